"""Workers get exactly torchrun's environment (plus CKPTRUN_*), for scripts, -m and --no-python."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SCRIPTS, ckptrun_cmd

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
# differ by construction: ports, ids, error-file path (torchrun: a temp dir), ckptrun's own
IGNORED = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def dumps(out: str) -> dict:
    """{rank: (env, argv)} from the ENVDUMP/ARGV records of every worker.

    Records are found anywhere in the output, not per line: under torchrun the workers
    share the launcher's stdout unbuffered (``python -u``), so one worker's line and the
    other's newline can interleave."""
    decoder = json.JSONDecoder()
    envs, argvs = {}, []
    for tag, sink in (("ENVDUMP ", None), ("ARGV ", argvs)):
        pos = out.find(tag)
        while pos >= 0:
            obj, end = decoder.raw_decode(out, pos + len(tag))
            if sink is None:
                envs[int(obj["RANK"])] = obj
            else:
                sink.append(obj)
            pos = out.find(tag, end)
    return {r: (e, argvs) for r, e in envs.items()}


def launch(cmd, cwd) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CKPTRUN_", "PET_", "TORCHELASTIC_", "OMP_NUM_THREADS"))}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=cwd, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return dumps(p.stdout)


# the launch form and the number of ranks set different variables: each form at 2 ranks,
# and one rank once (the cross product ran twice the jobs for nothing either one adds)
@pytest.mark.parametrize("nproc,form", [(1, "script"), (2, "script"), (2, "module"),
                                        (2, "no-python")])
def test_worker_env_matches_torchrun(tmp_path, form, nproc):
    script = os.path.join(SCRIPTS, "agent_envdump.py")
    target = {"script": [script], "module": ["-m", "agent_envdump"],
              "no-python": ["--no-python", sys.executable, script]}[form]
    common = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "3"]
    ref = launch([TORCHRUN, *common, *target, "a", "--b=1"], SCRIPTS)
    ours = launch(ckptrun_cmd(*common, "--run-dir", str(tmp_path / "run"), *target, "a",
                              "--b=1"), SCRIPTS)
    assert sorted(ref) == sorted(ours) == list(range(nproc))
    for rank in ref:
        ref_env, ref_argv = ref[rank]
        env, argv = ours[rank]
        ckpt = {k for k in env if k.startswith("CKPTRUN_")}
        assert {"CKPTRUN_CONTROL", "CKPTRUN_RESTORE", "CKPTRUN_SLOT_PREFIX"} <= ckpt
        skip = IGNORED | ckpt
        assert {k: v for k, v in env.items() if k not in skip} == {
            k: v for k, v in ref_env.items() if k not in skip}
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{env['LOCAL_RANK']}/error.json")
        assert sorted(argv) == sorted(ref_argv)
    if nproc == 2:
        assert ours[0][0]["OMP_NUM_THREADS"] == "1"


def test_ddp_garbage_is_collected_before_interpreter_shutdown(tmp_path):
    """DDP holds its process group in a reference cycle: left to the collector's pass at
    interpreter shutdown, gloo tears down there and sometimes aborts the worker after the
    last step (a needless restart).  Workers collect it at exit, before the shutdown."""
    probe = tmp_path / "probe"
    cmd = ckptrun_cmd("--standalone", "--nproc-per-node", "1", "--run-dir",
                      str(tmp_path / "run"), os.path.join(SCRIPTS, "ddp_exit_probe.py"),
                      str(probe))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert probe.read_text() == "collected"


@pytest.mark.parametrize("checkpointer", [False, True])
def test_under_plain_torchrun_a_checkpointer_collects_before_shutdown(tmp_path, checkpointer):
    """The same under plain torchrun (no bootstrap): a script that creates a Checkpointer
    gets its garbage collected before interpreter shutdown; one that does not shows what
    torch does by default (the module is freed in the teardown, or never)."""
    probe = tmp_path / "probe"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTRUN_", "TORCHELASTIC_"))}
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "1",
           os.path.join(SCRIPTS, "ddp_exit_probe.py"), str(probe),
           *(["--checkpointer"] if checkpointer else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    seen = probe.read_text() if probe.exists() else "never"  # shutdown may never free it
    assert (seen == "collected") == checkpointer, seen
