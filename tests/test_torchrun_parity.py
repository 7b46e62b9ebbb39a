"""torchrun parity: the scenarios of PyTorch's own launcher tests, in our words, run
against both launchers -- what the script sees, ``--run-path``, ``--virtual-local-rank``,
the log line template and duplicate filters, the failure summary of a ``@record`` entry
point, options from ``PET_*`` variables, ``--nproc-per-node cpu``, an elastic ``--nnodes
MIN:MAX`` job that starts with the nodes it has -- and the torchrun options ckptrun cannot
apply, refused with one line."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from ckptrun.torchcompat.numa import modes as numa_modes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "scripts", "parity_probe.py")
BIN = os.path.dirname(sys.executable)
LAUNCHERS = ["torchrun", "ckptrun"]


def with_flag(flag: str) -> list:
    """The launchers that know ``flag``: torchrun of an older torch lacks some of its newer
    options, which ckptrun takes on every torch (ckptrun/cli/args.py); there the test
    checks ckptrun against what newer torchrun does."""
    import torch.distributed.run as trun

    known = {o for a in trun.get_args_parser()._actions for o in a.option_strings}
    return LAUNCHERS if flag in known else ["ckptrun"]

pytestmark = pytest.mark.compat("torchrun parity: the same command, the same worker view")


def launch(launcher: str, tmp_path, *args: str, env=None, cwd=None, timeout=120,
           standalone=True):
    """The installed console script, as a user types it (``python -m`` would put the
    current directory first on the launcher's own sys.path)."""
    os.makedirs(tmp_path, exist_ok=True)
    cmd = [os.path.join(BIN, launcher)] + (["--standalone"] if standalone else [])
    if launcher == "ckptrun":
        cmd += ["--run-dir", str(tmp_path / "run")]
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or str(tmp_path))


def probes(out: str) -> dict:
    got = {}
    for line in out.splitlines():
        if "PROBE " in line:
            rec = json.loads(line.split("PROBE ", 1)[1])
            got[rec["rank"]] = rec
    return got


@pytest.mark.slow
def test_the_script_sees_what_python_script_py_shows(tmp_path):
    """From a directory holding a module that shadows one torch needs: the launchers import
    nothing from it; ``__file__`` is absolute, ``sys.argv[0]`` as typed, ``sys.path[0]`` the
    script's directory, torch not imported before the script (its thread count set before
    ``import torch`` applies), and ``pgrep -f`` finds the worker by the script's name."""
    work, scripts = tmp_path / "work", tmp_path / "scripts"
    work.mkdir()
    scripts.mkdir()
    shutil.copy(PROBE, scripts / "probe.py")
    (work / "typing_extensions.py").write_text("raise ImportError('the shadowing module')\n")
    seen = {}
    for launcher in LAUNCHERS:
        proc = launch(launcher, tmp_path / launcher, "--nproc-per-node", "2",
                      "../scripts/probe.py", "--mode", "show", cwd=str(work))
        assert proc.returncode == 0, (launcher, proc.stderr[-3000:])
        seen[launcher] = probes(proc.stdout)
    assert seen["ckptrun"] == seen["torchrun"], seen
    for rec in seen["ckptrun"].values():
        assert rec["file"] == os.path.join(str(work), "../scripts/probe.py"), rec  # as python
        assert rec["argv"][0] == "../scripts/probe.py" and rec["path0"] == str(scripts), rec
        assert not rec["torch_preloaded"] and rec["threads"] == 1 and rec["pgrep_finds_me"]


@pytest.mark.slow
@pytest.mark.spares
def test_a_restarted_worker_still_takes_the_thread_count_set_before_import_torch(tmp_path):
    """ckptrun restarts a worker in a warm spare that imported torch already; the
    OMP_NUM_THREADS the script sets before its own ``import torch`` applies all the same."""
    for launcher in LAUNCHERS:
        proc = launch(launcher, tmp_path / launcher, "--nproc-per-node", "2",
                      "--max-restarts", "1", PROBE, "--mode", "restart",
                      env={"CKPTRUN_SPARE_DELAY": "0.5"})
        assert proc.returncode == 0, (launcher, proc.stderr[-3000:])
        got = probes(proc.stdout)
        assert {r["attempt"] for r in got.values()} == {"1"}, got
        assert all(r["threads"] == 1 for r in got.values()), (launcher, got)
        if launcher == "ckptrun":  # the restart was a warm spare's: torch came first
            assert all(r["torch_preloaded"] for r in got.values()), got


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_run_path_overrides_no_python(tmp_path, launcher):
    proc = launch(launcher, tmp_path, "--nproc-per-node", "1", "--run-path", "--no-python",
                  PROBE, "--mode", "show")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert probes(proc.stdout)[0]["argv"][1:] == ["--mode", "show"]


@pytest.mark.slow
def test_virtual_local_rank_gives_each_worker_its_gpu_as_device_0(tmp_path):
    seen = {"torchrun": {0: ("0", "5"), 1: ("0", "7")}}  # what a torchrun with the flag shows
    for launcher in with_flag("--virtual-local-rank"):
        proc = launch(launcher, tmp_path / launcher, "--nproc-per-node", "2",
                      "--virtual-local-rank", PROBE, "--mode", "show",
                      env={"CUDA_VISIBLE_DEVICES": "5,7"})
        assert proc.returncode == 0, (launcher, proc.stderr[-3000:])
        seen[launcher] = {r: (p["local_rank"], p["cuda_visible"])
                          for r, p in probes(proc.stdout).items()}
    assert seen["ckptrun"] == seen["torchrun"] == {0: ("0", "5"), 1: ("0", "7")}, seen


@pytest.mark.slow
def test_line_prefix_template_and_duplicate_filters(tmp_path):
    """``--tee 3`` lines carry TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE's header; lines holding a
    filter word are also in ``<log dir>/<run>/attempt_0/filtered_stdout.log``, all ranks."""
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}:${rank}:${local_rank}>"}
    for launcher in with_flag("--duplicate-stdout-filters"):
        logs = tmp_path / launcher / "logs"
        proc = launch(launcher, tmp_path / launcher, "--nproc-per-node", "2", "--log-dir",
                      str(logs), "--tee", "3", "--duplicate-stdout-filters", "needle", PROBE,
                      "--mode", "lines", env=env)
        assert proc.returncode == 0, (launcher, proc.stderr[-3000:])
        for rank in (0, 1):
            assert f"<default:{rank}:{rank}>rank {rank} says hay" in proc.stdout, proc.stdout
        (filtered,) = glob.glob(str(logs / "*" / "attempt_0" / "filtered_stdout.log"))
        text = open(filtered).read()
        # torchrun's tail threads write each rank's line into the shared file without a lock, so
        # its two lines sometimes land on one; ckptrun's lines are whole and must stay so
        lines = (re.findall(r"<default:\d:\d>rank \d says needle", text)
                 if launcher == "torchrun" else text.splitlines())
        assert sorted(lines) == [f"<default:{r}:{r}>rank {r} says needle" for r in (0, 1)], (
            launcher, text)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failed_job_ends_with_torchruns_failure_summary(tmp_path, launcher):
    proc = launch(launcher, tmp_path, "--nproc-per-node", "2", "--max-restarts", "0", PROBE,
                  "--mode", "fail")
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    for text in ("parity_probe.py FAILED", "Root Cause (first observed failure):",
                 "rank      : 1 (local_rank: 1)", "ValueError: parity probe failed on purpose"):
        assert text in err, (launcher, text, err[-3000:])
    root = err.split("Root Cause (first observed failure):", 1)[1]
    assert "error_file: <N/A>" not in root  # @record wrote it, and it was read


@pytest.mark.parametrize("args,message", [
    (["--logs-specs", "mine"], "--logs-specs mine: ckptrun writes the worker logs itself"),
    (["--numa-binding", "node"], "--numa-binding node binds each worker to the CPUs near "
                                 "its GPU (GPU index = local rank); this machine has no CUDA"
     if numa_modes() else "--numa-binding node: this torch has no torch.numa.binding "
                          "(torch >= 2.9 has)"),
    (["--event-log-handler", "nowhere"], "--event-log-handler 'nowhere' is not a registered"),
])
def test_options_that_cannot_apply_are_refused_in_one_line(tmp_path, args, message):
    proc = launch("ckptrun", tmp_path, "--nproc-per-node", "1", *args, PROBE, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptrun: error: "), proc.stderr
    assert message in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_warnings_for_options_standalone_overrides_and_events_to_a_torch_handler(tmp_path):
    proc = launch("ckptrun", tmp_path, "--nproc-per-node", "1", "--rdzv-endpoint",
                  "10.0.0.1:29400", "--replicas", "5", "--event-log-handler", "console",
                  PROBE, "--mode", "show")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("ckptrun: warning: --standalone runs its own store on this machine: "
            "--rdzv-endpoint 10.0.0.1:29400 is not used") in proc.stderr
    assert "ckptrun: warning: --replicas 5: this job runs on one machine" in proc.stderr
    names = [json.loads(line)["name"] for line in proc.stderr.splitlines()
             if line.startswith('{"name": "ckptrun.')]
    assert names[0] == "ckptrun.start" and names[-1] == "ckptrun.finished", proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("nproc", ["cpu", "auto"])
def test_options_from_pet_variables_and_one_worker_per_cpu(tmp_path, nproc):
    """No launcher options but the script: ``PET_NPROC_PER_NODE=cpu`` (one worker per CPU,
    as ``--nproc-per-node cpu``; ``auto`` means the same on a machine without GPUs) and
    ``PET_MAX_RESTARTS`` come from the environment."""
    seen = {}
    env = {"PET_NPROC_PER_NODE": nproc, "PET_MAX_RESTARTS": "0", "PET_STANDALONE": "1"}
    for launcher in LAUNCHERS:
        proc = launch(launcher, tmp_path / launcher, PROBE, "--mode", "show", env=env,
                      standalone=False)
        assert proc.returncode == 0, (launcher, proc.stderr[-3000:])
        seen[launcher] = {r: (p["world_size"], p["local_world_size"])
                          for r, p in probes(proc.stdout).items()}
    n = os.cpu_count()
    assert seen["ckptrun"] == seen["torchrun"] == {r: (str(n), str(n)) for r in range(n)}, seen


@pytest.mark.slow
def test_an_elastic_job_starts_with_the_nodes_it_has(tmp_path):
    """``--nnodes 1:2`` with a c10d rendezvous and one machine: after the last call it
    starts with one node, as torchrun does; the script sees one node's world."""
    seen = {}
    for launcher in LAUNCHERS:
        with socket.socket() as s:  # a free port for this launcher's store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = launch(launcher, tmp_path / launcher, "--nnodes", "1:2", "--nproc-per-node",
                      "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                      "--rdzv-id", f"elastic-{launcher}", "--rdzv-conf", "last_call_timeout=1",
                      PROBE, "--mode", "show", standalone=False, timeout=180)
        assert proc.returncode == 0, (launcher, proc.stderr[-3000:])
        seen[launcher] = {r: (p["world_size"], p["group_world_size"])
                          for r, p in probes(proc.stdout).items()}
    assert seen["ckptrun"] == seen["torchrun"] == {0: ("2", "1"), 1: ("2", "1")}, seen


@pytest.mark.slow
def test_two_agents_on_loopback_start_without_a_secret(tmp_path):
    """torch's ``test_launch_elastic_multiple_agents``: two launchers of one user on one
    machine, ``--nnodes 1:2`` on a loopback endpoint, nothing else set.  torchrun needs no
    secret, and neither does ckptrun: its agents share one of the user's own (a 0600 file in
    the user's cache)."""
    env = {k: v for k, v in os.environ.items() if k != "CKPTRUN_SECRET"}
    env["HOME"] = str(tmp_path / "home")
    seen = {}
    for launcher in LAUNCHERS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for node in range(2):
            cmd = [os.path.join(BIN, launcher)]
            if launcher == "ckptrun":
                cmd += ["--run-dir", str(tmp_path / f"run{node}")]
            cmd += ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"two-{launcher}",
                    PROBE, "--mode", "show"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env, cwd=str(tmp_path)))
        outs = [p.communicate(timeout=180) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, (launcher, err[-3000:])
        got = {}
        for out, _ in outs:
            got.update({r: (p["world_size"], p["group_world_size"])
                        for r, p in probes(out).items()})
        seen[launcher] = got
    assert seen["ckptrun"] == seen["torchrun"] == {0: ("2", "2"), 1: ("2", "2")}, seen
    secret = tmp_path / "home" / ".cache" / "ckptrun" / "local-secret"
    assert oct(os.stat(secret).st_mode & 0o777) == "0o600"
    # (a non-loopback endpoint still needs a secret: tests/security/test_sec_job_secret.py)


@pytest.mark.slow
def test_a_launcher_run_in_process_with_a_text_only_stdout(tmp_path):
    """torch's launcher tests call the launcher's ``main()`` in their own process, whose
    ``sys.stdout`` may be an ``io.StringIO`` (no ``.buffer``): the workers' lines reach it."""
    code = (
        "import io, json, sys\n"
        "out = io.StringIO(); sys.stdout = out\n"
        "from ckptrun.cli import main\n"
        "try:\n"
        f"    main(['--standalone', '--nproc-per-node', '2', '--run-dir', {str(tmp_path / 'run')!r},\n"
        f"          {PROBE!r}, '--mode', 'show'])\n"
        "    code = 0\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "sys.__stdout__.write(json.dumps({'code': code, 'out': out.getvalue()}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["code"] == 0, proc.stderr[-3000:]
    assert set(probes(got["out"])) == {0, 1}, got["out"][-2000:]
    assert "AttributeError" not in proc.stderr, proc.stderr[-3000:]
