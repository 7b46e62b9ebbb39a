"""ckptrun.cli.args.parse: torchrun parity, ckptrun options, env defaults and up-front validation."""

from __future__ import annotations

import os
import re
import socket

import pytest

from ckptrun.cli.args import UsageError, parse


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    """Run in an empty directory with a train.py and no PET_/CKPTRUN_ variables."""
    for key in list(os.environ):
        if key.startswith(("PET_", "CKPTRUN_")) or key == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT":
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.setenv("CKPTRUN_RDZV_CHECK_TIMEOUT", "0.5")
    monkeypatch.setenv("CKPTRUN_SECRET", "a test job secret of enough bytes")  # several machines


def _error(argv):
    with pytest.raises(UsageError) as info:
        parse(argv)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def listener():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def test_defaults(tmp_path):
    cfg = parse(["train.py"])
    assert cfg.script == "train.py" and cfg.script_args == []
    assert (cfg.module, cfg.no_python, cfg.run_path, cfg.use_env) == (False, False, False, True)
    assert cfg.nproc_per_node == 1 and (cfg.min_nodes, cfg.max_nodes) == (1, 1)
    # static single node without a master port becomes c10d on a free port, like torchrun
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("c10d", "localhost:0")
    assert re.match(r"^\d{8}-\d{6}-[0-9a-f]{4}$", cfg.rdzv_id)
    # the default run dir is stable for the same job (the script and its arguments)
    assert re.match(r"^train-[0-9a-f]{10}$", os.path.basename(cfg.run_dir)), cfg.run_dir
    assert os.path.dirname(cfg.run_dir) == str(tmp_path / "ckptrun-runs")
    assert parse(["train.py"]).run_dir == cfg.run_dir
    assert parse(["train.py", "--lr", "1"]).run_dir != cfg.run_dir
    assert cfg.persist_to == os.path.join(cfg.run_dir, "checkpoints")
    assert (cfg.persist_every_steps, cfg.persist_every_seconds) == (None, 600.0)
    assert (cfg.keep, cfg.replicas, cfg.hang_timeout, cfg.resume_from) == (3, 2, None, None)
    assert cfg.max_restarts == 10 and cfg.monitor_interval == 0.1
    assert cfg.start_method == "spawn" and cfg.role == "default" and cfg.shutdown_timeout == 5.0
    assert (cfg.redirects, cfg.tee, cfg.local_ranks_filter, cfg.log_dir) == ("0", "0", None, None)
    assert cfg.master_port == 29500 and cfg.master_addr == "127.0.0.1"


def _older_torchrun_parser(monkeypatch, missing):
    """torchrun's parser as an older torch has it: without the options ``missing``."""
    import torch.distributed.run as trun

    real = trun.get_args_parser

    def older():
        parser = real()
        for action in [a for a in parser._actions if a.dest in missing]:
            parser._remove_action(action)
            for group in parser._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
            for flag in action.option_strings:
                parser._option_string_actions.pop(flag, None)
        return parser
    monkeypatch.setattr(trun, "get_args_parser", older)


LATER_FLAGS = ["shutdown_timeout", "signals_to_handle", "duplicate_stdout_filters",
               "duplicate_stderr_filters", "virtual_local_rank", "local_ranks_filter",
               "event_log_handler", "logs_specs"]


def test_a_torch_without_newer_torchrun_options_parses_the_same(monkeypatch):
    """torch 2.11's parser has no --shutdown-timeout (seen on a GPU machine: every ckptrun
    command failed with an AttributeError); ckptrun adds what an older torch lacks."""
    want = parse(["--shutdown-timeout", "7", "--local-ranks-filter", "0", "train.py"])
    plain = parse(["train.py"])
    _older_torchrun_parser(monkeypatch, LATER_FLAGS)
    got = parse(["--shutdown-timeout", "7", "--local-ranks-filter", "0", "train.py"])
    assert got.shutdown_timeout == want.shutdown_timeout == 7.0
    assert got.local_ranks_filter == want.local_ranks_filter
    older = parse(["train.py"])
    for name in ("shutdown_timeout", "signals_to_handle", "duplicate_stdout_filters",
                 "duplicate_stderr_filters", "virtual_local_rank", "event_log_handler"):
        assert getattr(older, name) == getattr(plain, name), name
    with pytest.raises(UsageError, match="numa"):  # torch's own feature: unknown without it
        _older_torchrun_parser(monkeypatch, LATER_FLAGS + ["numa_binding"])
        parse(["--numa-binding", "node", "train.py"])


def test_script_args_pass_through_untouched():
    args = ["--lr", "3", "--help", "status", "-m", "--nnodes", "4", "--", "--run-dir", "x"]
    cfg = parse(["--nproc-per-node", "2", "train.py", *args])
    assert cfg.script == "train.py" and cfg.script_args == args and cfg.nproc_per_node == 2
    assert cfg.min_nodes == 1 and not cfg.module


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node", "--nproc_per",
                                  "--nproc-per", "--nproc", "--nproc-per-node=", "--nproc="])
def test_both_spellings_and_prefixes(flag):
    argv = [flag + "3", "train.py"] if flag.endswith("=") else [flag, "3", "train.py"]
    assert parse(argv).nproc_per_node == 3


def test_other_spellings_and_prefixes(tmp_path):
    cfg = parse(["--max_restarts", "4", "--run_dir", "rd", "--persist_every", "7", "--stand",
                 "--hang", "9", "--monitor-i", "0.5", "train.py"])
    assert cfg.max_restarts == 4 and cfg.run_dir == str(tmp_path / "rd")
    assert cfg.persist_every_steps == 7 and cfg.standalone and cfg.hang_timeout == 9.0
    assert cfg.monitor_interval == 0.5
    assert "ambiguous" in _error(["--r", "x", "train.py"])


def test_pet_env_defaults(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    monkeypatch.setenv("PET_NNODES", "")  # empty: as if unset
    monkeypatch.setenv("PET_STANDALONE", "")  # Kubeflow sets it empty: false, no crash
    monkeypatch.setenv("PET_NO_PYTHON", "")
    cfg = parse(["train.py"])
    assert cfg.nproc_per_node == 2 and cfg.max_restarts == 5 and cfg.min_nodes == 1
    assert not cfg.standalone and not cfg.no_python
    assert parse(["--nproc-per-node", "4", "train.py"]).nproc_per_node == 4  # flag wins


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False),
                                            ("", False), ("False", False)])
def test_pet_standalone_values(monkeypatch, value, expected):
    monkeypatch.setenv("PET_STANDALONE", value)
    assert parse(["train.py"]).standalone is expected


def test_bad_pet_values(monkeypatch):
    monkeypatch.setenv("PET_STANDALONE", "maybe")
    assert "PET_STANDALONE" in _error(["train.py"])
    monkeypatch.delenv("PET_STANDALONE")
    monkeypatch.setenv("PET_MAX_RESTARTS", "many")
    assert "max-restarts" in _error(["train.py"])


def test_ckptrun_env_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTRUN_KEEP", "5")
    monkeypatch.setenv("CKPTRUN_REPLICAS", "3")
    monkeypatch.setenv("CKPTRUN_PERSIST_EVERY", "100")
    monkeypatch.setenv("CKPTRUN_HANG_TIMEOUT", "30")
    monkeypatch.setenv("CKPTRUN_RUN_DIR", str(tmp_path / "envrun"))
    monkeypatch.setenv("CKPTRUN_PERSIST_TO", "ckpts")
    cfg = parse(["train.py"])
    assert (cfg.keep, cfg.replicas, cfg.persist_every_steps, cfg.hang_timeout) == (5, 3, 100, 30.0)
    assert cfg.persist_every_seconds is None
    assert cfg.run_dir == str(tmp_path / "envrun") and cfg.persist_to == str(tmp_path / "ckpts")
    assert parse(["--keep", "1", "train.py"]).keep == 1  # flag wins
    monkeypatch.setenv("CKPTRUN_REPLICAS", "zero")
    assert "--replicas" in _error(["train.py"])


@pytest.mark.parametrize("text,steps,seconds", [("30s", None, 30.0), ("10m", None, 600.0),
                                                ("1h", None, 3600.0), ("250", 250, None),
                                                ("1.5m", None, 90.0)])
def test_persist_every(text, steps, seconds):
    cfg = parse(["--persist-every", text, "train.py"])
    assert (cfg.persist_every_steps, cfg.persist_every_seconds) == (steps, seconds)


@pytest.mark.parametrize("argv,needle", [
    (["--persist-every", "0"], "--persist-every"),
    (["--persist-every", "0s"], "--persist-every"),
    (["--persist-every", "-5"], "--persist-every"),
    (["--persist-every", "10x"], "--persist-every"),
    (["--hang-timeout", "0"], "--hang-timeout"),
    (["--hang-timeout", "-1"], "--hang-timeout"),
    (["--hang-timeout", "soon"], "--hang-timeout"),
    (["--hang-timeout", "nan"], "--hang-timeout"),
    (["--keep", "0"], "--keep"),
    (["--keep", "two"], "--keep"),
    (["--replicas", "0"], "--replicas"),
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--nproc-per-node", "-2"], "--nproc-per-node"),
    (["--nproc-per-node", "lots"], "--nproc-per-node"),
    (["--nnodes", "0"], "--nnodes"),
    (["--nnodes", "3:2"], "--nnodes"),
    (["--nnodes", "a"], "--nnodes"),
    (["--nnodes", "1:2:3"], "--nnodes"),
    (["--monitor-interval", "0"], "--monitor-interval"),
    (["--redirects", "9"], "--redirects"),
    (["--local-ranks-filter", "a,b"], "--local-ranks-filter"),
    (["--rdzv-conf", "novalue"], "--rdzv-conf"),
    (["--start-method", "thread"], "start-method"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "1"], "--node-rank"),
    (["--rdzv-backend", "c10d", "--nnodes", "2"], "--rdzv-endpoint"),
])
def test_bad_inputs_are_one_line_usage_errors(argv, needle):
    assert needle in _error(argv + ["train.py"])


def test_missing_script():
    assert "training script not found: nope.py" in _error(["nope.py"])
    assert "no training script" in _error([])
    assert "no training script" in _error(["--nproc-per-node", "2"])


def test_module_and_no_python(tmp_path):
    cfg = parse(["-m", "pkg.train", "--x", "1"])  # a module name is not checked on disk
    assert cfg.module and cfg.script == "pkg.train" and cfg.script_args == ["--x", "1"]
    cfg = parse(["--no-python", "echo", "hello"])  # found on PATH
    assert cfg.no_python and cfg.script == "echo" and cfg.script_args == ["hello"]
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    assert parse(["--no_python", "./run.sh"]).script == "./run.sh"
    assert "not found" in _error(["--no-python", "no-such-program-xyz"])
    assert "cannot be used together" in _error(["--no-python", "-m", "pkg"])
    assert parse(["--run-path", "train.py"]).run_path


def test_gpu_without_cuda():
    import torch

    if torch.cuda.is_available():
        assert parse(["--nproc-per-node", "gpu", "train.py"]).nproc_per_node >= 1
    else:
        assert "--nproc-per-node gpu" in _error(["--nproc-per-node", "gpu", "train.py"])
    assert parse(["--nproc-per-node", "cpu", "train.py"]).nproc_per_node >= 1
    assert parse(["--nproc-per-node", "auto", "train.py"]).nproc_per_node >= 1


def test_standalone_ignores_rdzv_options(tmp_path):
    cfg = parse(["--standalone", "--rdzv-backend", "static", "--rdzv-endpoint", "far:1", "train.py"])
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.standalone) == ("c10d", "localhost:0", True)


def test_rdzv_id_names_the_run(tmp_path):
    cfg = parse(["--rdzv-id", "job7", "train.py"])
    assert cfg.rdzv_id == "job7" and cfg.run_dir == str(tmp_path / "ckptrun-runs" / "job7")


def test_nnodes_range_and_conf():
    cfg = parse(["--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                 "--rdzv-conf", "join_timeout=5,last_call_timeout=1", "train.py"])
    assert (cfg.min_nodes, cfg.max_nodes) == (1, 3) and not cfg.nnodes_fixed
    assert cfg.rdzv_configs == {"join_timeout": "5", "last_call_timeout": "1"}
    assert cfg.rdzv_id == "none"  # multi-node: all nodes must agree, so no generated id


def test_static_multi_node_non_zero_rank():
    cfg = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.9.8.7",
                 "--master-port", "1234", "train.py"])
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("static", "10.9.8.7:1234")
    assert cfg.rdzv_configs == {"rank": 1} and cfg.node_rank == 1 and cfg.master_port == 1234


def test_master_port(listener):
    assert "--master-port" in _error(["--master-port", str(listener), "train.py"])
    port = _free_port()
    cfg = parse(["--master-port", str(port), "train.py"])  # given: stays static, like torchrun
    assert cfg.rdzv_backend == "static" and cfg.rdzv_endpoint == f"127.0.0.1:{port}"
    # another node's rank-0 port is not ours to check
    parse(["--nnodes", "2", "--node-rank", "1", "--master-port", str(listener), "train.py"])


def test_c10d_endpoint_checks(listener):
    base = ["--nnodes", "2", "--rdzv-backend", "c10d"]
    closed = _free_port()
    msg = _error(base + ["--rdzv-endpoint", f"127.0.0.1:{closed}", "--rdzv-conf", "is_host=0",
                         "train.py"])
    assert "unreachable" in msg
    assert "cannot resolve" in _error(base + ["--rdzv-endpoint", "no-such-host.invalid:29400",
                                              "train.py"])
    # reachable as a client
    parse(base + ["--rdzv-endpoint", f"127.0.0.1:{listener}", "--rdzv-conf", "is_host=false",
                  "train.py"])
    # we host it: a free port is fine, a port someone listens on too (torch joins as client)
    parse(base + ["--rdzv-endpoint", f"localhost:{closed}", "train.py"])
    parse(base + ["--rdzv-endpoint", f"localhost:{listener}", "train.py"])
    msg = _error(base + ["--rdzv-endpoint", f"localhost:{listener}", "--rdzv-conf", "is_host=1",
                         "train.py"])
    assert "in use" in msg


def test_persist_to(tmp_path):
    assert parse(["--persist-to", "ck", "train.py"]).persist_to == str(tmp_path / "ck")
    url = f"file://{tmp_path}/ck2"
    assert parse(["--persist-to", url, "train.py"]).persist_to == url
    (tmp_path / "afile").write_text("x")
    assert "--persist-to" in _error(["--persist-to", str(tmp_path / "afile" / "sub"), "train.py"])


def _durable_step(root, nbytes: int = 4096) -> None:
    import torch

    from ckptrun.tiers.durable import storage

    meta = {"format": 1, "step": 3, "rank": 0, "world_size": 1, "tree": None,
            "tensors": [{"path": "w", "dtype": "uint8", "shape": [nbytes], "offset": 0,
                         "nbytes": nbytes}]}
    storage.write_step(str(root), 3, {0: (meta, [torch.zeros(nbytes, dtype=torch.uint8)])}, 1)


def test_resume_from(tmp_path):
    assert "does not exist" in _error(["--resume-from", str(tmp_path / "none"), "train.py"])
    (tmp_path / "old").mkdir()
    assert "not a ckptrun checkpoint" in _error(["--resume-from", "old", "train.py"])
    _durable_step(tmp_path / "ck")
    assert parse(["--resume-from", "ck", "train.py"]).resume_from == str(tmp_path / "ck")
    assert parse(["--resume-from", "ck/step-3", "train.py"]).resume_from


def test_shm_too_small_for_the_known_state(tmp_path, monkeypatch):
    import os

    _durable_step(tmp_path / "ck", nbytes=1 << 20)
    real = os.statvfs

    class Tiny:  # a Docker-sized /dev/shm: 2 MiB free
        f_bavail, f_frsize = 512, 4096

    monkeypatch.setattr("ckptrun.cli.preflight.os.statvfs",
                        lambda p: Tiny() if p == "/dev/shm" else real(p))
    msg = _error(["--nproc-per-node", "2", "--resume-from", "ck", "train.py"])
    assert "/dev/shm has 2 MiB free" in msg and "shm-size" in msg
    monkeypatch.setattr("ckptrun.cli.preflight.os.statvfs", real)
    parse(["--nproc-per-node", "2", "--resume-from", "ck", "train.py"])


def test_shm_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("ckptrun.cli.preflight.SHM_DIR", str(tmp_path / "noshm"))
    assert "noshm" in _error(["train.py"])


def test_logs_and_shutdown(monkeypatch):
    cfg = parse(["-r", "3", "-t", "0:1,1:2", "--local-ranks-filter", "0,1", "--log-dir", "L",
                 "--shutdown-timeout", "3", "--role", "trainer", "--start-method", "fork",
                 "train.py"])
    assert (cfg.redirects, cfg.tee, cfg.local_ranks_filter) == ("3", "0:1,1:2", {0, 1})
    assert cfg.log_dir == "L" and cfg.shutdown_timeout == 3.0 and cfg.role == "trainer"
    assert cfg.start_method == "fork"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert parse(["train.py"]).shutdown_timeout == 7.0


def test_parse_creates_nothing_on_error(tmp_path):
    _error(["--keep", "0", "train.py"])
    assert not (tmp_path / "ckptrun-runs").exists()


def test_replication_rate(monkeypatch):
    assert parse(["train.py"]).replication_rate is None  # default: unpaced
    assert parse(["--replication-rate", "250", "train.py"]).replication_rate == 250e6
    assert parse(["--replication_rate", "0", "train.py"]).replication_rate is None
    monkeypatch.setenv("CKPTRUN_REPLICATION_RATE", "1.5")
    assert parse(["train.py"]).replication_rate == 1.5e6
    assert parse(["--replication-rate", "off", "train.py"]).replication_rate is None
    for bad in ("fast", "-3", "inf"):
        assert "--replication-rate" in _error(["--replication-rate", bad, "train.py"])


def test_default_run_dir_follows_the_scheduler_job_id(tmp_path, monkeypatch):
    """Slurm's job id (a requeued job keeps it) or torchelastic's run id name the default
    run dir, so that the same job started again finds its checkpoints; --rdzv-id wins."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert parse(["train.py"]).run_dir == str(tmp_path / "ckptrun-runs" / "slurm-4242")
    assert parse(["--rdzv-id", "exp/7", "train.py"]).run_dir == \
        str(tmp_path / "ckptrun-runs" / "exp_7")
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert parse(["train.py"]).run_dir == str(tmp_path / "ckptrun-runs" / "abc")


def test_standby(listener, monkeypatch):
    """--standby joins a job of several machines through a dynamic rendezvous; anything
    else is one line and exit 2 before anything starts."""
    job = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{listener}", "--rdzv-conf", "is_host=false"]
    assert parse(job + ["--standby", "train.py"]).standby
    assert not parse(job + ["train.py"]).standby
    monkeypatch.setenv("CKPTRUN_STANDBY", "1")
    assert parse(job + ["train.py"]).standby
    assert "several machines" in _error(["--standalone", "train.py"])
    assert "several machines" in _error(["--nnodes", "1", "train.py"])
    assert "c10d or etcd-v2" in _error(["--nnodes", "2", "--master-port", str(listener),
                                        "train.py"])
