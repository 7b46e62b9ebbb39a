"""Worker entry point: pay ``import torch`` before the worker is needed, then run the script.

The agent starts ``python -u -m ckptrun.worker.bootstrap --go-fd N``.  This process imports torch
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
from typing import Optional, Tuple

from ckptrun.protocol.priority import renice

_PR_SET_PDEATHSIG = 1
SLOT_POLL_S = 1.0  # a waiting spare looks for new or grown slot files this often


def _wait_for_go(fd: int, slots: Optional[Tuple[str, int]]) -> None:
    """Block until the "go" message (or EOF) is readable.  A spare given its future rank's
    slot files (``--slots PREFIX N``) maps them meanwhile, and again when one is replaced
    or grows: the worker it becomes adopts the maps instead of pre-faulting them itself;
    and it faults in heap memory for the state the worker will rebuild (``prefault``)."""
    import select

    if slots is None:
        select.select([fd], [], [])
        return
    from ckptrun.worker import prefault
    from ckptrun.worker.slotset import premap_slots, premapped_state_bytes

    reserved = 0
    while True:
        premap_slots(*slots)
        if not reserved:  # once the rank's state size is known (its first snapshot)
            reserved = prefault.reserve(premapped_state_bytes())
        if select.select([fd], [], [], SLOT_POLL_S)[0]:
            return


def _read_go(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _warm_up(go_fd: int, force: bool = False) -> None:
    """Import torch and, for a spare, run the code paths every training script hits first.

    A cold start (the "go" message is already waiting) skips the optimizer warm-up: the
    script pays for what it uses, exactly as under torchrun, no more.  ``force``: a hot
    spare (its "go" is waiting too, but it has time before it is needed).
    """
    import gc
    import select

    if not force and select.select([go_fd], [], [], 0)[0]:
        # A cold start imports nothing: the script meets a fresh interpreter, as under
        # ``python script.py`` -- environment it sets before ``import torch`` (thread
        # counts, allocator settings) applies, and a module it shadows is its own.
        return
    import torch
    import torch.distributed  # noqa: F401  (process groups, DDP)
    import torch.nn  # noqa: F401

    from ckptrun.torchcompat.warm_up import import_compiler_stack

    import_compiler_stack()  # what DDP's first constructor imports (~2.7 s here)

    p = torch.nn.Parameter(torch.zeros(4))
    for opt_cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = opt_cls([p], lr=0.1)
        p.grad = torch.ones(4)
        opt.step()
        opt.zero_grad()
    # and what a script restoring with ckptrun imports next (~40 ms at start-up otherwise);
    # a spare that cannot must still serve (the script meets the same error itself)
    try:
        import ckptrun.worker.checkpointer  # noqa: F401
        from ckptrun.adapters import adapt_state

        adapt_state({}, {})  # imports the state adapters Checkpointer applies (DDP, FSDP2)
    except Exception:
        pass
    # Everything torch allocated at import lives until exit: move it out of the collector's
    # sight.  Every later GC pass is cheaper, and the final collection at interpreter exit
    # drops from ~1 s to ~0.2 s here -- exit time that a hang detector would see as silence.
    gc.collect()
    gc.freeze()


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _apply_env(env: dict, nice: int) -> None:
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        renice(os.getpid(), nice)  # a niced spare becomes a full-priority worker


def _follow_thread_env(torch) -> None:  # type: ignore[no-untyped-def]
    """A warm spare imported torch before the script ran; under ``python script.py`` a
    thread count the script puts in ``os.environ`` before its own ``import torch`` applies.
    So until the script imports torch, such an assignment sets torch's thread count too
    (``os.environ[...] = ...`` goes through ``os.putenv``); after it, nothing changes, as
    under python."""
    import builtins

    real_putenv, real_import = os.putenv, builtins.__import__

    def putenv(key, value):  # type: ignore[no-untyped-def]
        real_putenv(key, value)
        name = key.decode() if isinstance(key, bytes) else key
        text = value.decode() if isinstance(value, bytes) else value
        if name in THREAD_VARS and text.strip().isdigit() and int(text) > 0:
            torch.set_num_threads(int(text))

    def watching_import(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "torch" or name.startswith("torch."):  # the script's own import
            os.putenv, builtins.__import__ = real_putenv, real_import
        return real_import(name, *args, **kwargs)

    os.putenv, builtins.__import__ = putenv, watching_import


def register_stack_dump(path: str):
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
    sys.path.insert(0, "")  # sys.path[0]: set below, as ``python`` sets it
    if go["kind"] == "module":
        sys.path[0] = os.getcwd()  # what ``python -m`` puts first
        sys.argv = ["-m", *argv[1:]]  # runpy replaces argv[0] with the module's file
        runpy.run_module(go["target"], run_name="__main__", alter_sys=True)
    else:
        # ``python x.py``'s __file__ is absolute (3.9+): joined to the cwd, not normalised
        target = go["target"]
        script = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        sys.argv = argv
        if os.path.isfile(script) and not _is_zip(script):
            _run_file(script)
        else:  # a directory or zip archive with __main__.py
            runpy.run_path(script, run_name="__main__")


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def _run_file(script: str) -> None:
    """Run ``script`` as ``python script.py`` does: a fresh ``__main__`` module whose
    ``__file__`` is the absolute path, ``sys.argv[0]`` left as typed (``runpy.run_path``
    would replace it with the path it was given)."""
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __builtins__=builtins, __spec__=None,
                         __loader__=SourceFileLoader("__main__", script), __package__=None)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _set_title(go: dict) -> None:
    """``ps``/``pgrep -f train.py`` show the user's command, as for torchrun's workers."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    argv = list(go["argv"])
    head = ["-m", go["target"]] if go["kind"] == "module" else [argv[0]]
    setproctitle(" ".join([sys.executable, "-u", *head, *argv[1:]]))


def main() -> None:
    # ``python -m`` put the current directory first on sys.path; what the bootstrap imports
    # must not come from there (a ``typing_extensions.py`` beside the script would shadow
    # the real one for torch).  The script's own sys.path[0] is set in :func:`_run`.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    args = sys.argv[1:]
    go_fd = int(args[args.index("--go-fd") + 1])
    if "--nice" in args:
        os.nice(int(args[args.index("--nice") + 1]))
    slots = None
    if "--slots" in args:
        i = args.index("--slots")
        slots = (args[i + 1], int(args[i + 2]))
    _warm_up(go_fd, force="--warm" in args)
    _wait_for_go(go_fd, slots)
    raw = _read_go(go_fd)
    if not raw:
        sys.exit(0)  # a spare that was not needed
    import json

    go = json.loads(raw)
    if slots is not None:  # keep only the maps of the slots this worker will use
        from ckptrun.worker.slotset import drop_premapped

        drop_premapped(go["env"].get("CKPTRUN_SLOT_PREFIX") or None)
    _set_title(go)  # before the environment is replaced: setproctitle needs the original
    _apply_env(go["env"], go.get("nice", 0))
    stacks = os.environ.get("CKPTRUN_STACKS_FILE")
    if stacks:
        register_stack_dump(stacks)
    del raw, args
    from ckptrun.worker.clean_exit import collect_at_exit

    collect_at_exit()  # DDP/FSDP process groups go before shutdown, not in it
    if "torch" in sys.modules:  # a warm spare: last, nothing of ours imports torch after it
        _follow_thread_env(sys.modules["torch"])
    try:
        _run(go)
    except SystemExit as exc:
        _mark_done(ok=exc.code in (None, 0))
        raise
    except BaseException as exc:  # like the interpreter: hook (traceback), then exit 1
        tb = _user_traceback(exc.__traceback__)
        exc.__traceback__ = tb  # the default hook prints the exception's own traceback
        sys.excepthook(type(exc), exc, tb)
        _mark_raised()
        _mark_done(ok=False)
        if isinstance(exc, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)
    _mark_done(ok=True)


def _mark_raised() -> None:
    """The traceback is out: the agent may count this failure before the teardown ends."""
    if "ckptrun.worker.heartbeat" not in sys.modules:
        return
    try:
        from ckptrun.worker.heartbeat import worker_link

        link = worker_link()
        if link is not None:
            link[0].set(link[1], "raised", 1)
    except Exception:
        pass


def _mark_done(ok: bool) -> None:
    """The script is over: interpreter shutdown is not a hang (phase DONE is never timed out);
    ``ok``: it succeeded, so its last snapshot may be persisted during the teardown."""
    if "ckptrun.worker.heartbeat" not in sys.modules:
        return  # never linked to the control block: not watched for hangs anyway
    try:
        from ckptrun.protocol import Phase
        from ckptrun.worker.heartbeat import heartbeat, worker_link

        link = worker_link()
        if ok and link is not None:
            link[0].set(link[1], "ended_ok", 1)  # before DONE: the agent reads both
        heartbeat(phase=Phase.DONE)
        from ckptrun.worker.progress import sampler

        if sampler() is not None:  # DONE is not watched: end the thread before teardown
            sampler().stop()
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
