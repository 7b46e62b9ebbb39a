"""The ``ckptrun`` entry point: dispatch, pass-through, help/version, exit codes, no tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from ckptrun import cli


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith(("PET_", "CKPTRUN_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


@pytest.fixture
def fake_agent(monkeypatch):
    """Replace ckptrun.agent.supervisor with a stub that records the config and returns ``code``."""
    calls = []
    mod = types.ModuleType("ckptrun.agent.supervisor")
    mod.code = 0

    def run_agent(cfg, user_umask=None):
        calls.append(cfg)
        return mod.code

    mod.run_agent = run_agent
    monkeypatch.setitem(sys.modules, "ckptrun.agent.supervisor", mod)
    return mod, calls


def _main(argv):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code


def _ckptrun(args, cwd, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "CKPTRUN_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "ckptrun.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_default_subcommand_is_run(workdir, fake_agent):
    mod, calls = fake_agent
    assert _main(["--nproc_per_node", "2", "train.py", "--lr", "3", "--help", "status"]) == 0
    assert calls[0].nproc_per_node == 2
    assert calls[0].script == "train.py" and calls[0].script_args == ["--lr", "3", "--help", "status"]


@pytest.mark.parametrize("code", [0, 1])
def test_exit_code_is_the_agents(workdir, fake_agent, code):
    mod, calls = fake_agent
    mod.code = code
    assert _main(["train.py"]) == code


def test_run_subcommand_for_scripts_named_like_subcommands(workdir, fake_agent):
    mod, calls = fake_agent
    (workdir / "status").write_text("print('a script called status')\n")
    assert _main(["run", "status", "--json"]) == 0
    assert calls[-1].script == "status" and calls[-1].script_args == ["--json"]
    assert _main(["--nproc-per-node", "1", "status", "-m"]) == 0  # options first: still run
    assert calls[-1].script == "status" and calls[-1].script_args == ["-m"]
    assert _main(["run", "-m", "pkg.mod", "--help"]) == 0
    assert calls[-1].module and calls[-1].script_args == ["--help"]


def test_usage_error_in_process(workdir, fake_agent, capsys):
    mod, calls = fake_agent
    assert _main(["--keep", "0", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptrun: error: ") and err.count("\n") == 1 and not calls


@pytest.mark.parametrize("args,env", [
    (["--nproc-per-node", "0", "train.py"], {}),
    (["--bogus-flag", "train.py"], {}),
    (["missing.py"], {}),
    (["--persist-every", "soon", "train.py"], {}),
    (["train.py"], {"PET_STANDALONE": "maybe"}),
    ([], {}),
])
def test_usage_errors_exit_2_one_line_no_traceback(workdir, args, env):
    proc = _ckptrun(args, workdir, env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ckptrun: error: ") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_empty_pet_standalone_is_accepted(workdir, fake_agent, monkeypatch):
    mod, calls = fake_agent
    monkeypatch.setenv("PET_STANDALONE", "")
    assert _main(["train.py"]) == 0 and calls[-1].standalone is False


def test_help_lists_torchrun_and_ckptrun_options(workdir):
    proc = _ckptrun(["--help"], workdir)
    assert proc.returncode == 0
    for opt in ("--nproc-per-node", "--rdzv-endpoint", "--standalone", "--max-restarts",
                "--no-python", "--signals-to-handle", "--run-dir", "--persist-to",
                "--persist-every", "--keep", "--replicas", "--hang-timeout", "--resume-from"):
        assert opt in proc.stdout, opt
    assert "status" in proc.stdout and "restore" in proc.stdout


def test_version(workdir):
    from ckptrun import __version__

    for mod in ("ckptrun", "ckptrun.cli"):
        proc = subprocess.run([sys.executable, "-m", mod, "--version"], cwd=workdir,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and __version__ in proc.stdout


def test_status_without_run(workdir):
    proc = _ckptrun(["status"], workdir)
    assert proc.returncode == 2 and proc.stderr.startswith("ckptrun: error: ")
    assert "Traceback" not in proc.stderr


def test_restore_dispatch(workdir, capsys):
    assert _main(["restore", "--help"]) == 0
    assert "--rollback" in capsys.readouterr().out


def test_check_help_names_the_subcommand(capsys):
    assert _main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ckptrun check ") and "--fail-at S" in out
