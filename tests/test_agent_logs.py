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


def _pumped(prefix: bytes, text: bytes) -> bytes:
    """What the console shows of ``text`` written by a worker through a Pump."""
    import io

    from ckptrun.agent.logs import Pump

    r, w = os.pipe()
    console = io.BytesIO()
    console.close = lambda: None  # read after the pump is done
    pump = Pump(r, None, console, prefix)
    pump.start()
    for i in range(0, len(text), 7):  # in pieces, as a pipe delivers them
        os.write(w, text[i:i + 7])
    os.close(w)
    pump.join(10)
    return console.getvalue()


TRACEBACK = (b"Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
             b"    cfg['lr']\nKeyError: 'lr'\n\nDuring handling of the above exception, "
             b"another exception occurred:\n\nTraceback (most recent call last):\n"
             b"  File \"train.py\", line 5, in <module>\n    raise ValueError(\"no lr\")\n"
             b"ValueError: no lr\n")


def test_a_traceback_a_restarted_rank_repeats_is_shown_once():
    """A crash that repeats after a restart: the first attempt's traceback in full, later
    ones as one line each; another rank's, or a different one, in full."""
    first = _pumped(b"[rank5]: ", b"starting\n" + TRACEBACK + b"after\n")
    assert first == b"".join(b"[rank5]: " + ln + b"\n"
                             for ln in (b"starting\n" + TRACEBACK + b"after").split(b"\n"))
    again = _pumped(b"[rank5]: ", b"starting\n" + TRACEBACK)
    assert again == (b"[rank5]: starting\n[rank5]: (the same traceback as before: "
                     b"KeyError: 'lr')\n[rank5]: \n[rank5]: During handling of the above "
                     b"exception, another exception occurred:\n[rank5]: \n"
                     b"[rank5]: (the same traceback as before: ValueError: no lr)\n")
    assert _pumped(b"[rank6]: ", TRACEBACK).count(b"Traceback") == 2  # another rank
    other = TRACEBACK.replace(b"no lr", b"no lr either")
    assert _pumped(b"[rank5]: ", other).count(b"Traceback") == 1  # its second one differs
    unfinished = _pumped(b"[rank7]: ", b"Traceback (most recent call last):\n  File \"x\"")
    assert unfinished == b"[rank7]: Traceback (most recent call last):\n[rank7]:   File \"x\"\n"
