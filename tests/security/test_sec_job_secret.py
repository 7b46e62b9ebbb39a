"""The job secret never travels through the rendezvous store: several machines refuse to
start without one (unless ``--insecure``), a secret file others can read or swap is refused,
the workers never see it, and a key derived for another job is refused by the replica server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SCRIPTS

from ckptrun.cli.args import UsageError, parse
from ckptrun.protocol.job_secret import job_key
from ckptrun.tiers.peer.copies import PeerStore
from ckptrun.tiers.peer.server import ReplicaServer, holdings
from ckptrun.tiers.peer.wire import AuthError

# several machines (the endpoint is taken for another machine's: see _several_machines)
TWO = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999",
       "--rdzv-id", "j1"]
# several agents on this machine alone (torch's own launcher tests start them so)
LOCAL_TWO = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29999",
             "--rdzv-id", "j1"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.delenv("CKPTRUN_SECRET", raising=False)
    monkeypatch.setenv("CKPTRUN_RDZV_CHECK_TIMEOUT", "0.2")


@pytest.fixture(autouse=True)
def _several_machines(request, monkeypatch):
    """The tests of a job on several machines run on this one, whose loopback endpoint would
    give its agents the user's own secret (``LOCAL_TWO``): the endpoint is taken for another
    machine's instead -- no test here may reach out to a real other address."""
    if "loopback" not in request.node.name:
        monkeypatch.setattr("ckptrun.cli.args._loopback", lambda endpoint: False)


def _refusal(argv) -> str:
    with pytest.raises(UsageError) as err:
        parse(argv)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_several_machines_without_a_secret_are_refused():
    msg = _refusal([*TWO, "train.py"])
    assert "CKPTRUN_SECRET" in msg and "--secret-file" in msg and "--insecure" in msg


def test_insecure_accepts_the_risk_and_says_so(capsys):
    cfg = parse([*TWO, "--insecure", "train.py"])
    assert cfg.secret is None and cfg.insecure
    assert "--insecure" in capsys.readouterr().err


def test_agents_on_loopback_share_the_users_own_secret(tmp_path, monkeypatch):
    """No secret given, every agent on this machine: the user's 0600 file, made once and the
    same for each agent; a file there that is not the user's alone is refused, not used."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    first = parse([*LOCAL_TWO, "train.py"]).secret
    second = parse([*LOCAL_TWO, "train.py"]).secret
    path = tmp_path / "home" / ".cache" / "ckptrun" / "local-secret"
    assert first and first == second == path.read_bytes().strip()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    path.chmod(0o644)
    msg = _refusal([*LOCAL_TWO, "train.py"])
    assert "chmod 600" in msg and "CKPTRUN_SECRET" in msg


def test_one_machine_needs_no_secret():
    assert parse(["--standalone", "train.py"]).secret is None


def test_the_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("CKPTRUN_SECRET", "x" * 40)
    assert parse([*TWO, "train.py"]).secret == b"x" * 40
    monkeypatch.setenv("CKPTRUN_SECRET", "short")
    assert "at least 16" in _refusal([*TWO, "train.py"])


def test_a_secret_file_must_be_the_users_alone(tmp_path):
    f = tmp_path / "job.secret"
    f.write_text(os.urandom(32).hex() + "\n")
    os.chmod(f, 0o644)
    assert "chmod 600" in _refusal([*TWO, "--secret-file", str(f), "train.py"])
    os.chmod(f, 0o600)
    assert parse([*TWO, "--secret-file", str(f), "train.py"]).secret == f.read_text().strip().encode()
    link = tmp_path / "link.secret"  # as Kubernetes mounts a Secret's key: followed
    link.symlink_to(f)
    assert parse([*TWO, "--secret-file", str(link), "train.py"]).secret == f.read_text().strip().encode()
    assert "does not exist" in _refusal([*TWO, "--secret-file", str(tmp_path / "nope"), "train.py"])
    if os.geteuid() == 0:
        os.lchown(link, 65534, 65534)  # a link someone else could point elsewhere
        assert "symlink of another user" in _refusal([*TWO, "--secret-file", str(link), "train.py"])
        os.chown(f, 65534, 65534)
        assert "another user" in _refusal([*TWO, "--secret-file", str(f), "train.py"])


def test_the_workers_never_see_the_secret(tmp_path):
    env = dict(os.environ, CKPTRUN_SECRET="a secret the script must not see!")
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone",
                           "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                           os.path.join(SCRIPTS, "agent_envdump.py")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dump = next(json.loads(line.split("ENVDUMP ", 1)[1]) for line in proc.stdout.splitlines()
                if "ENVDUMP " in line)
    assert "CKPTRUN_SECRET" not in dump
    assert not any("a secret the script" in v for v in dump.values())


def test_the_reaper_never_sees_the_secret(tmp_path):
    """The agent's helper processes run without it: the worker reads the environment of
    its agent's reaper (a child of the same agent) while the job runs."""
    script = tmp_path / "reaper_env.py"
    script.write_text(
        "import os, psutil\n"
        "agent = psutil.Process(os.getppid())\n"
        "reapers = [p for p in agent.children()\n"
        "           if 'ckptrun.agent.reaper' in ' '.join(p.cmdline())]\n"
        "env = open(f'/proc/{reapers[0].pid}/environ', 'rb').read()\n"
        "print('REAPERS', len(reapers), 'SECRET' if b'CKPTRUN_SECRET' in env else 'CLEAN',\n"
        "      flush=True)\n")
    env = dict(os.environ, CKPTRUN_SECRET="a secret the reaper must not see!")
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone",
                           "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                           str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REAPERS 1 CLEAN" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_key_for_another_job_is_refused(tmp_path):
    secret = os.urandom(32)
    refused = []
    srv = ReplicaServer("127.0.0.1", job_key(secret, "job-a"), PeerStore(f"sec{os.getpid()}"),
                        on_refused=refused.append)
    try:
        assert holdings(srv.address, job_key(secret, "job-a"), "n1") == {}
        with pytest.raises((AuthError, ConnectionError)):
            holdings(srv.address, job_key(secret, "job-b"), "n1")  # same secret, other job
        with pytest.raises((AuthError, ConnectionError)):
            holdings(srv.address, secret, "n1")  # the raw secret is not the key either
    finally:
        srv.stop()
    assert refused  # (reported at most every few seconds: a flood is not a line each)
