"""The demo job (examples/train.py) plus test-only failure injection.

``--corrupt-at N``: after step N (first attempt, the crash rank) flip one byte in the data of
every committed slot of this rank, then SIGKILL -- no memory copy of this rank verifies, so the
restore must come from storage (or a peer).  ``--wipe-at N``: the same for every snapshot file
of this machine's agent (its workers' slots and the copies it keeps): the machine's memory is
gone, only other machines' copies are left.  ``--kill-agent-at N``: SIGKILL the agent (the parent process)
after step N.  ``--fast-after-file PATH``: once PATH exists, the steps take no ``--step-time``
(a multi-machine test has seen what it waited for; the weights do not depend on the sleep).
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import train  # noqa: E402  (examples/train.py)

from ckptrun.protocol import ENV_SLOT_PREFIX, SlotHeader, SlotState, open_shm_file  # noqa: E402


def _await_commit(step: int, timeout_s: float = 10.0) -> None:
    """Until this rank's save of ``step`` is committed: its copy runs in the background, and
    a slot committed after the corruption would be a good copy the test did not intend."""
    prefix, deadline = os.environ[ENV_SLOT_PREFIX], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in glob.glob(prefix + "*"):
            h = _header(path)
            if h is not None and h.state == SlotState.COMMITTED and h.step >= step:
                return
        time.sleep(0.005)


def _header(path: str):
    try:
        mm = open_shm_file(path, write=False)
    except (OSError, ValueError):  # gone, or still being created (sized 0)
        return None
    try:
        return SlotHeader.unpack_from(mm)
    finally:
        mm.close()


def corrupt_own_slots(step: int, machine: bool = False) -> int:
    _await_commit(step)
    n = 0
    prefix = os.environ[ENV_SLOT_PREFIX]
    if machine:  # /dev/shm/ckptrun-<token>-r<rank>-s -> every file of the agent's token
        prefix = prefix[: prefix.rindex("-r")] + "-"
    for path in glob.glob(prefix + "*"):
        if path.endswith("-control"):
            continue
        try:
            mm = open_shm_file(path)
        except ValueError:  # a slot still being created (sized 0): holds nothing
            continue
        h = SlotHeader.unpack_from(mm)
        if h.state == SlotState.COMMITTED and h.data_len:
            pos = h.data_offset + h.data_len // 2
            mm[pos] = mm[pos] ^ 0xFF
            n += 1
        mm.close()
    return n


def main() -> None:
    argv = sys.argv[1:]
    extra = {"--corrupt-at": -1, "--kill-agent-at": -1, "--wipe-at": -1}
    fast_after = ""
    for flag in [*extra, "--fast-after-file"]:
        if flag in argv:
            i = argv.index(flag)
            if flag in extra:
                extra[flag] = int(argv[i + 1])
            else:
                fast_after = argv[i + 1]
            del argv[i : i + 2]
    sys.argv = [sys.argv[0], *argv]
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    original = train.inject_failure

    def inject(args, step: int, rank: int) -> None:
        if fast_after and args.step_time and os.path.exists(fast_after):
            args.step_time = 0.0
        original(args, step, rank)
        if not first_attempt or rank != args.crash_rank:
            return
        if step == extra["--corrupt-at"]:
            print(f"[test] rank {rank}: corrupted {corrupt_own_slots(step)} slots", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == extra["--wipe-at"]:
            print(f"[test] rank {rank}: wiped {corrupt_own_slots(step, True)} snapshots", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == extra["--kill-agent-at"]:
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(60)  # the agent's death must take this worker with it

    train.inject_failure = inject
    train.main()


if __name__ == "__main__":
    main()
