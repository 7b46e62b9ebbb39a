"""Worker output: ckptrun's default (rank-prefixed console + per-rank files in the run dir)
and torchrun's --log-dir/--redirects/--tee/--local-ranks-filter meaning."""

from __future__ import annotations

import glob
import os

from conftest import SCRIPTS

DUMP = os.path.join(SCRIPTS, "agent_envdump.py")


def test_default_prefixed_console_and_files(tmp_path, ckptrun_run):
    run_dir = str(tmp_path / "run")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--run-dir", run_dir, DUMP, "x")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[rank0]: ARGV " in p.stdout and "[rank1]: ARGV " in p.stdout
    for lr in (0, 1):
        log = open(os.path.join(run_dir, "logs", "attempt_0", str(lr), "stdout.log")).read()
        assert log.startswith("ENVDUMP ") and "ARGV " in log  # files hold the raw output
        mode = os.stat(os.path.join(run_dir, "logs", "attempt_0", str(lr), "stdout.log")).st_mode
        assert mode & 0o777 == 0o600


def test_lines_already_labelled_are_not_labelled_twice(tmp_path, ckptrun_run):
    """torch labels a distributed worker's uncaught traceback ``[rank<N>]: `` itself."""
    script = tmp_path / "labels.py"
    script.write_text('import os\nr = os.environ["RANK"]\n'
                      'print(f"[rank{r}]: Traceback (labelled by torch)")\nprint("plain")\n')
    p = ckptrun_run("--standalone", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "r"),
                    str(script))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["[rank0]: Traceback (labelled by torch)", "[rank0]: plain"]


def test_torchrun_tee_and_filter(tmp_path, ckptrun_run):
    log_dir = str(tmp_path / "logs")
    p = ckptrun_run("--standalone", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "r"),
                    "--log-dir", log_dir, "--tee", "3", "--local-ranks-filter", "1", DUMP)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[default1]:ARGV " in p.stdout  # torchrun's tee header
    assert "[default0]:" not in p.stdout  # filtered out of the console...
    files = sorted(glob.glob(os.path.join(log_dir, "*_*", "attempt_0", "*", "stdout.log")))
    assert len(files) == 2  # ...but both ranks are in torchrun's log layout
    assert all("ARGV " in open(f).read() for f in files)


def test_torchrun_redirect_only_to_files(tmp_path, ckptrun_run):
    log_dir = str(tmp_path / "logs")
    p = ckptrun_run("--standalone", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "r"),
                    "--log-dir", log_dir, "--redirects", "3", DUMP)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ARGV" not in p.stdout
    files = glob.glob(os.path.join(log_dir, "*_*", "attempt_0", "0", "stdout.log"))
    assert files and "ARGV " in open(files[0]).read()
