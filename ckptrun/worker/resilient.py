"""``@ckptrun.resilient``: in-process recovery -- a surviving rank is not restarted.

Decorate the function that sets up the process group and the model and runs the loop::

    @ckptrun.resilient
    def train(args):
        dist.init_process_group("gloo")
        model = DDP(build_model()); ...
        ckpt = ckptrun.Checkpointer({...})
        for step in range(ckpt.restore(), args.steps):
            ...
            ckpt.save(step + 1)

When a rank elsewhere fails, the agent asks this one to recover (``ckptrun.protocol.recovery``):
its blocked collectives are broken (``ckptrun.worker.collectives``), the exception that
comes out of them -- or :class:`RecoveryRequested`, raised by the next ``save()`` or
``heartbeat()`` -- unwinds the function, the process groups are destroyed, and once the
failed ranks have been replaced the function is called again with the next attempt's
environment.  Its ``init_process_group`` joins the new group, ``restore()`` returns the
newest step every rank holds, and training goes on.  The process keeps its interpreter,
imports, compiled code, CUDA context and anything built outside the function.

An exception that is not caused by a failure elsewhere (the agent asks for no recovery in
the few seconds after it) leaves the function as it would without the decorator: this
rank fails and is replaced.  Under plain ``python`` or ``torchrun`` the decorator only
calls the function.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
from typing import Any, Callable, Optional, TypeVar

from ckptrun.protocol.env import ENV_HOT_SPARE
from ckptrun.protocol.recovery import message_path, read_message
from ckptrun.worker.collectives import (
    CollectiveBreaker,
    destroy_groups,
    forget_framework_groups,
    from_communication,
    release_retired,
)
from ckptrun.worker.heartbeat import RecoveryRequested, recovery_target, worker_link

F = TypeVar("F", bound=Callable[..., Any])

WATCH_S = 0.02  # how often the watcher thread reads the agent's request (a dead peer's
# collectives raise by themselves: this only bounds how long a rank that waits for a live one,
# or computes, goes on)
POLL_S = 0.005  # how often an unwound rank looks for the request or the go
# how long an exception out of the function waits for the agent's request: a collective
# broken by a dead peer raises before the agent has seen the death (a few ms locally; a
# remote node's failure reaches this agent through the store)
COMM_ERROR_WAIT_S = 10.0
OTHER_ERROR_WAIT_S = 0.25
GO_TIMEOUT_S = 900.0  # the agent replaces a worker that it gave up on; this is a last stop
PARK_POLL_S = 0.01  # a hot spare waits for hours: a read of two fields every 10 ms

_breaker = CollectiveBreaker()

__all__ = ["RecoveryRequested", "resilient"]


def resilient(fn: Optional[F] = None) -> Any:
    """Run ``fn`` so that a failure elsewhere in the job recovers this process in place
    (see the module docstring); ``@ckptrun.resilient`` and ``@ckptrun.resilient()``."""
    if fn is None:
        return resilient

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        link = worker_link()
        if link is None:  # plain python / torchrun: nothing to recover with
            return fn(*args, **kwargs)
        if os.environ.get(ENV_HOT_SPARE):  # --hot-spares: wait here to take a failed rank
            link = _park(link)
        if _group_exists():
            # a group made outside cannot be re-formed by calling the function again: this
            # rank restarts as without the decorator (rather than go on with a broken group)
            print("ckptrun: @ckptrun.resilient: the process group was created before "
                  f"{getattr(fn, '__name__', 'the function')}() was called; in-process "
                  "recovery needs init_process_group() inside it -- this rank restarts as "
                  "usual after a failure", file=sys.stderr, flush=True)
            return fn(*args, **kwargs)
        return _run(fn, args, kwargs, link)

    return wrapper


def _group_exists() -> bool:
    if "torch" not in sys.modules:
        return False
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


NCCL_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def _nccl_errors_raise() -> None:
    """Have NCCL's watchdog abort a failed communicator and let the error reach the
    function (2, "clean up only") instead of tearing the process down.

    ckptrun and torchrun set 1 ("tear down"), torch's default is 3 ("skip clean-up"): under
    either, a survivor whose peer died is killed by its own watchdog -- racing the
    in-place recovery it opted into.  ``ProcessGroupNCCL`` reads the variable when it is
    made, by the ``init_process_group`` inside the function; 0 (no handling) is left alone.
    """
    if os.environ.get(NCCL_ERRORS, "3") != "0":
        os.environ[NCCL_ERRORS] = "2"


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _run(fn: Callable[..., Any], args: tuple, kwargs: dict, link) -> Any:
    block, local_rank = link
    _breaker.install()
    while True:
        _nccl_errors_raise()  # the attempt's environment may have set it back
        attempt = _attempt()
        # what exists before the function (imports, the script's start-up) outlives every
        # attempt: out of the collector's sight, a recovery's collection only walks what the
        # failed attempt built (~10 ms instead of ~0.3 s with torch.compile's modules loaded)
        gc.freeze()
        block.set(local_rank, "resilient", attempt + 1)
        watcher = _Watcher(block, local_rank)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            target = watcher.wait_for_request(exc)
            watcher.stop()
            if target is None:  # this rank's own failure: it leaves as without us
                block.set(local_rank, "resilient", 0)
                # its peers wait in a collective for it: they learn now, not at its exit
                _breaker.break_all()
                raise
            what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            # while the frames still hold them: a Checkpointer collected with its frame
            # would not hand its slot maps to the next attempt's
            _abandon_checkpointers()
            del exc  # its traceback holds the function's frames: the model, DDP, the group
        else:
            watcher.stop()
            block.set(local_rank, "resilient", 0)
            return result
        env = _unwind_and_wait(block, local_rank, target)
        if env is None:
            block.set(local_rank, "resilient", 0)
            raise RuntimeError(f"ckptrun: no usable recovery message for attempt {target} "
                               f"(unwound after {what})")
        _apply(env)
        print(f"ckptrun: rank {os.environ.get('RANK', '?')}: recovering in place into attempt "
              f"{_attempt()} (unwound on {what[:120]})", file=sys.stderr, flush=True)


def _unwind_and_wait(block, local_rank: int, target: int) -> Optional[dict]:
    """Leave nothing of the failed attempt running, tell the agent, wait for its go; the
    message's environment updates (None: none usable)."""
    _abandon_checkpointers()  # (any made after the request was read)
    _breaker.break_all()  # a group created after the request was read
    destroy_groups()
    forget_framework_groups()
    _breaker.forget()
    block.set(local_rank, "unwound", target)
    # the failed attempt's DDP reducers (a reference cycle), groups and loaders go now --
    # on a GPU before the next attempt allocates -- while the agent decides the restore and
    # the replacement starts
    gc.collect()
    release_retired()  # the groups themselves: last, on a thread of their own
    # the state the function rebuilds lands in fresh pages: fault them in while the
    # replacement starts (``prefault``: what a warm spare does; undone by ``restore()``)
    from ckptrun.worker import prefault

    prefault.reserve(block.get(local_rank, "state_bytes"),
                     stop=lambda: block.get(local_rank, "recover_go") >= target)
    run_dir = os.environ.get("CKPTRUN_RUN_DIR", "")
    deadline = time.monotonic() + GO_TIMEOUT_S
    while time.monotonic() < deadline:
        go = block.get(local_rank, "recover_go")
        if go >= target:
            return read_message(message_path(run_dir, go, local_rank), go)
        later = block.get(local_rank, "recover")
        if later > target:  # another failure before the go: that attempt, same process
            target = later
            block.set(local_rank, "unwound", target)
        time.sleep(POLL_S)
    return None


def _abandon_checkpointers() -> None:
    """The open Checkpointers stop: their last copy finishes first (the slot the restore
    reads is whole) and their slot maps wait for the next attempt."""
    from ckptrun.worker.checkpointer import abandon_all

    abandon_all()


def _apply(env: dict) -> None:
    """Take a hand-over message's variables (an empty value unsets one) and dump stacks
    into the new attempt's file from now on."""
    for key, value in env.items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    stacks = env.get("CKPTRUN_STACKS_FILE")
    if stacks:
        from ckptrun.worker.bootstrap import register_stack_dump

        register_stack_dump(stacks)


def _park(link):
    """A hot spare at its function's entry: say so, wait for a rank (the agent writes the
    message for this record and ``recover_go``), take its variables, link to its record."""
    from ckptrun.worker import prefault

    block, record = link
    block.set(record, "resilient", 1)  # at the entry, ready
    run_dir = os.environ.get("CKPTRUN_RUN_DIR", "")
    rank_record = int(os.environ.get("CKPTRUN_LOCAL_RANK") or 0)
    reserved = False
    while True:
        go = block.get(record, "recover_go")
        if go > 0:
            break
        if not reserved:  # once the rank's state size is known: as a warm spare does
            size = block.get(rank_record, "state_bytes")
            if size > 0:
                prefault.reserve(size, stop=lambda: block.get(record, "recover_go") > 0)
                reserved = True
        time.sleep(PARK_POLL_S)
    env = read_message(message_path(run_dir, go, record), go, promote=True)
    if env is None or not env.get("CKPTRUN_LOCAL_RANK"):
        raise SystemExit(f"ckptrun: hot spare: no usable message for attempt {go}")
    _apply(env)
    new = worker_link()  # the rank's own record from now on
    if new is None:
        raise SystemExit("ckptrun: hot spare: no control block after the hand-over")
    print(f"ckptrun: rank {os.environ.get('RANK', '?')}: a hot spare takes the rank in attempt "
          f"{go}", file=sys.stderr, flush=True)
    return new


class _Watcher:
    """A thread that reads the agent's request; on one, it breaks the collectives so that
    the function unwinds wherever it waits."""

    def __init__(self, block, local_rank: int):
        self.block, self.local_rank = block, local_rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckptrun-recovery",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_S):
            if recovery_target(self.block, self.local_rank) is not None:
                _breaker.break_all()
                return

    def wait_for_request(self, exc: BaseException) -> Optional[int]:
        """The attempt to recover into, when ``exc`` came from a failure elsewhere; None
        when the agent asks for none in time."""
        if isinstance(exc, RecoveryRequested):
            return exc.attempt
        wait = COMM_ERROR_WAIT_S if from_communication(exc) else OTHER_ERROR_WAIT_S
        deadline = time.monotonic() + wait
        while True:
            target = recovery_target(self.block, self.local_rank)
            if target is not None:
                return target
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def stop(self) -> None:
        self._stop.set()


