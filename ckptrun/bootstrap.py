"""Worker entry point: pay ``import torch`` before the worker is needed, then run the script.

The agent starts ``python -u -m ckptrun.bootstrap --go-fd N``.  This process imports torch
and warms the optimizer machinery (the first optimizer constructor costs about as much as
the import), then blocks on the inherited pipe ``N`` for one JSON "go" message::

    {"env": {...}, "argv": [...], "kind": "script"|"module", "target": ..., "cwd": ..., "nice": n}

and then behaves like ``python script.py args`` / ``python -m module args``: same
``os.environ``, ``sys.argv``, ``sys.path[0]``, ``__main__``, exit status and traceback.
On a first start the message follows immediately; a warm spare waits (possibly minutes)
until a restart needs it.  End of file without a message means "not needed": exit 0.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback

_PR_SET_PDEATHSIG = 1


def _read_go(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _warm_up(go_fd: int) -> None:
    """Import torch and, for a spare, run the code paths every training script hits first.

    A cold start (the "go" message is already waiting) skips the optimizer warm-up: the
    script pays for what it uses, exactly as under torchrun, no more.
    """
    import gc
    import select

    import torch
    import torch.distributed  # noqa: F401  (process groups, DDP)
    import torch.nn  # noqa: F401

    if select.select([go_fd], [], [], 0)[0]:
        gc.freeze()  # see below; without the full collection, which costs ~0.15 s
        return
    p = torch.nn.Parameter(torch.zeros(4))
    for opt_cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = opt_cls([p], lr=0.1)
        p.grad = torch.ones(4)
        opt.step()
        opt.zero_grad()
    # Everything torch allocated at import lives until exit: move it out of the collector's
    # sight.  Every later GC pass is cheaper, and the final collection at interpreter exit
    # drops from ~1 s to ~0.2 s here -- exit time that a hang detector would see as silence.
    gc.collect()
    gc.freeze()


def _apply_env(env: dict, nice: int) -> None:
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        # a niced spare becomes a full-priority worker (lowering needs privilege).  Linux
        # nice values are per thread: the threads torch started during warm-up count too.
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                pass


def _register_stack_dump(path: str):
    """SIGUSR1 -> all threads' stacks into ``path`` (works for a SIGSTOPped worker on SIGCONT)."""
    try:
        f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
    except OSError:
        return None
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    return f


def _user_traceback(tb):
    """Drop the bootstrap's and runpy's frames, as plain ``python`` shows only the script's."""
    import runpy

    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) in skip
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


def _run(go: dict) -> None:
    import runpy

    argv = list(go["argv"])
    os.chdir(go["cwd"])
    if go["kind"] == "module":
        sys.path[0] = os.getcwd()  # what ``python -m`` puts first
        sys.argv = ["-m", *argv[1:]]  # runpy replaces argv[0] with the module's file
        runpy.run_module(go["target"], run_name="__main__", alter_sys=True)
    else:
        script = go["target"]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        sys.argv = argv
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    args = sys.argv[1:]
    go_fd = int(args[args.index("--go-fd") + 1])
    if "--nice" in args:
        os.nice(int(args[args.index("--nice") + 1]))
    _warm_up(go_fd)
    raw = _read_go(go_fd)
    if not raw:
        sys.exit(0)  # a spare that was not needed
    import json

    go = json.loads(raw)
    _apply_env(go["env"], go.get("nice", 0))
    stacks = os.environ.get("CKPTRUN_STACKS_FILE")
    if stacks:
        _register_stack_dump(stacks)
    del raw, args
    try:
        _run(go)
    except SystemExit:
        _mark_done()
        raise
    except BaseException as exc:  # like the interpreter: hook (traceback), then exit 1
        tb = _user_traceback(exc.__traceback__)
        exc.__traceback__ = tb  # the default hook prints the exception's own traceback
        sys.excepthook(type(exc), exc, tb)
        _mark_done()
        if isinstance(exc, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)
    _mark_done()


def _mark_done() -> None:
    """The script is over: interpreter shutdown is not a hang (phase DONE is never timed out)."""
    if "ckptrun.heartbeat" not in sys.modules:
        return  # never linked to the control block: not watched for hangs anyway
    try:
        from ckptrun.heartbeat import heartbeat
        from ckptrun.protocol import Phase

        heartbeat(phase=Phase.DONE)
    except Exception:
        pass


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # the bootstrap itself failed (not the user's script)
        traceback.print_exc()
        sys.exit(1)
