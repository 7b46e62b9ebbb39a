"""The agent's view of its node's memory tier: which steps each rank holds, verification,
the restore decision, safe reads of live slots, materialising copies, cleanup.

The agent never writes a slot while its worker runs, except ``pin`` in the control block;
it reads headers, verifies checksums and copies data out seqlock-style (``state``/``step``/
``seq`` unchanged after the copy, else the copy is thrown away).
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import re
import threading
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ckptrun.protocol import (
    DEFAULT_NUM_SLOTS,
    SHM_DIR,
    SHM_PREFIX,
    ControlBlock,
    ShmMaps,
    SlotHeader,
    SlotState,
    create_shm_file,
    open_shm_file,
    rank_slot_prefix,
    set_slot_state,
    slot_path,
)
from ckptrun.snapshot.slots import (
    meta_bytes,
    meta_checksum,
    read_slot,
    slot_size,
    verify_slot,
    write_slot,
)

Snapshot = Tuple[dict, List[torch.Tensor]]
PinRef = Tuple[ControlBlock, int]  # (control block, local rank) whose ``pin`` to set


class SlotChanged(RuntimeError):
    """The slot was rewritten while it was being read; the copy must not be used."""


class NodeMemory:
    """Slots of every rank on this node for the job ``job_token``."""

    def __init__(self, job_token: str, num_slots: int = DEFAULT_NUM_SLOTS) -> None:
        self.job_token = job_token
        self.num_slots = num_slots
        self._control: Optional[ControlBlock] = None
        self._local_of: Dict[int, int] = {}
        self._maps = ShmMaps()  # populated read-only maps: verifying costs no page fault
        self._warmed = 0.0
        # a rank has one ``pin`` field: readers in the agent's threads (the persister, the
        # replication rounds) take turns holding it
        self._pin_locks: Dict[int, threading.Lock] = {}

    def attach_control(self, block: ControlBlock, ranks: Sequence[int]) -> None:
        """Let reads pin slots through ``block``, whose record ``i`` is ``ranks[i]``'s (this
        node's global ranks in local-rank order)."""
        self._control = block
        self._local_of = {r: lr for lr, r in enumerate(ranks)}

    def ranks(self) -> List[int]:
        """Global ranks that have slot files on this node."""
        pat = re.compile(re.escape(f"{SHM_PREFIX}{self.job_token}-r") + r"(\d+)-s\d+$")
        found = {int(m.group(1)) for m in (pat.match(os.path.basename(p))
                                             for p in self._job_files()) if m}
        return sorted(found)

    # ------------------------------------------------------------------ naming

    def slot_prefix(self, rank: int) -> str:
        """The ``CKPTRUN_SLOT_PREFIX`` of global rank ``rank`` on this node."""
        return rank_slot_prefix(self.job_token, rank)

    def slot_paths(self, rank: int) -> List[str]:
        """Existing slot files of ``rank``."""
        paths = [slot_path(self.slot_prefix(rank), k) for k in range(self.num_slots)]
        return [p for p in paths if os.path.exists(p)]

    def total_bytes(self) -> int:
        """Bytes of shared memory this job's files occupy on this node."""
        total = 0
        for p in self._job_files():
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(p).st_size
        return total

    # ------------------------------------------------------------------ headers

    def _open(self, rank: int, k: int, write: bool = False) -> Optional[mmap.mmap]:
        try:
            return open_shm_file(slot_path(self.slot_prefix(rank), k), write=write)
        except (FileNotFoundError, ValueError):  # missing, or empty (mmap of length 0)
            return None

    def headers(self, rank: int) -> Dict[int, SlotHeader]:
        """Header of every existing slot of ``rank`` (slot index -> header)."""
        out = {}
        for k in range(self.num_slots):
            mm = self._open(rank, k)
            if mm is not None:
                out[k] = SlotHeader.unpack_from(mm)
                mm.close()
        return out

    def steps(self, rank: int) -> Dict[int, int]:
        """Committed steps of ``rank`` (step -> slot), from headers only (no checksum)."""
        out: Dict[int, int] = {}
        hs = self.headers(rank)
        for k, h in sorted(hs.items(), key=lambda kv: kv[1].commit_time):
            if h.state == SlotState.COMMITTED:
                out[h.step] = k  # the later commit wins if a step was written twice
        return out

    # ------------------------------------------------------------------ verification

    def verify(self, rank: int, step: int) -> bool:
        """True when ``rank`` holds ``step`` committed and its checksum matches."""
        k = self.steps(rank).get(step)
        return k is not None and self._verify_slot(rank, k, step)

    def verify_all(self, ranks: Sequence[int], step: int) -> bool:
        """:meth:`verify` for every rank in ``ranks``, in parallel (xxh3 releases the GIL)."""
        ranks = list(ranks)
        if len(ranks) <= 1:
            return all(self.verify(r, step) for r in ranks)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(len(ranks), os.cpu_count() or 1)) as pool:
            return all(pool.map(lambda r: self.verify(r, step), ranks))

    def warm(self, ranks: Sequence[int], every_s: float = 1.0) -> None:
        """Keep every slot file of ``ranks`` mapped and pre-faulted (new or resized files
        are mapped when this is called; a ``stat`` per slot otherwise, at most once per
        ``every_s``), so that verifying on the restart path reads without page faults."""
        now = time.monotonic()
        if now - self._warmed < every_s:
            return
        self._warmed = now
        for r in ranks:
            for k in range(self.num_slots):
                self._maps.get(slot_path(self.slot_prefix(r), k))

    def _verify_slot(self, rank: int, k: int, step: int) -> bool:
        mm = self._maps.get(slot_path(self.slot_prefix(rank), k))
        if mm is None:
            return False
        h = SlotHeader.unpack_from(mm)
        if h.state != SlotState.COMMITTED or h.step != step:
            return False
        # Hashed on every query, never cached: memory can rot after a first check
        # (~20 ms per 256 MiB from a warm map, and only on the restart path).
        return verify_slot(mm, h)

    def common_step(self, ranks: Sequence[int]) -> Optional[int]:
        """Newest step committed and verified on every rank in ``ranks`` (None if none).

        A copy that fails its checksum is skipped, never used (Megatron-LM #5281).
        """
        ranks = list(ranks)
        if not ranks:
            return None
        per_rank = [self.steps(r) for r in ranks]
        common = set(per_rank[0])
        for st in per_rank[1:]:
            common &= set(st)
        for step in sorted(common, reverse=True):
            if step <= 0:
                continue
            if all(self._verify_slot(r, st[step], step) for r, st in zip(ranks, per_rank)):
                return step
        return None

    def discard_newer(self, ranks: Sequence[int], step: int) -> None:
        """Mark every slot of ``ranks`` holding a step newer than ``step`` EMPTY (and torn
        WRITING slots too), so an abandoned timeline is never restored.  Workers must be
        stopped."""
        for r in ranks:
            for k in range(self.num_slots):
                mm = self._open(r, k, write=True)
                if mm is None:
                    continue
                h = SlotHeader.unpack_from(mm)
                newer = h.state == SlotState.COMMITTED and h.step > step
                if newer or h.state == SlotState.WRITING:
                    set_slot_state(mm, SlotState.EMPTY, -1, h.seq + 1)
                mm.close()

    # ------------------------------------------------------------------ reading and writing

    @contextlib.contextmanager
    def pinned(self, rank: int, step: int, pin: Optional[PinRef] = None
               ) -> Iterator[Tuple[dict, List[torch.Tensor]]]:
        """Hold ``(meta, tensor views)`` of ``rank``'s ``step`` without copying.

        With ``pin`` the worker will not choose this slot while it is held.  On exit the
        header is checked again and :class:`SlotChanged` raised if the slot was rewritten:
        whatever was done with the views (sent, written) must then be discarded.
        """
        k = self.steps(rank).get(step)
        if k is None:
            raise KeyError(f"rank {rank} has no committed step {step} in memory")
        with self._pinning(pin, k):
            yield from self._views(rank, k, step)

    @contextlib.contextmanager
    def hold(self, rank: int, step: int) -> Iterator[Optional[str]]:
        """The path of the slot holding ``rank``'s committed ``step`` (None: not held), which
        the worker does not choose for a save while it is held (with this node's control
        block attached).  The worker may have chosen it just before: verify what is read."""
        k = self.steps(rank).get(step)
        if k is None:
            yield None
            return
        with self._pinning(self._pin_ref(rank), k):
            yield slot_path(self.slot_prefix(rank), k)

    def _pin_ref(self, rank: int) -> Optional[PinRef]:
        if self._control is None or rank not in self._local_of:
            return None
        return self._control, self._local_of[rank]

    @contextlib.contextmanager
    def _pinning(self, pin: Optional[PinRef], k: int) -> Iterator[None]:
        if pin is None:
            yield
            return
        with self._pin_locks.setdefault(pin[1], threading.Lock()):
            pin[0].set(pin[1], "pin", k)
            try:
                yield
            finally:
                pin[0].set(pin[1], "pin", -1)

    def _views(self, rank: int, k: int, step: int) -> Iterator[Snapshot]:
        mm = self._open(rank, k)
        try:
            if mm is None:
                raise KeyError(f"slot {k} of rank {rank} disappeared")
            h = SlotHeader.unpack_from(mm)
            if h.state != SlotState.COMMITTED or h.step != step:
                raise SlotChanged(f"slot {k} of rank {rank} no longer holds step {step}")
            h, meta, views = read_slot(mm)
            if h.step != step:
                raise SlotChanged(f"slot {k} of rank {rank} no longer holds step {step}")
            yield meta, views
            del views
            after = SlotHeader.unpack_from(mm)
            if (after.state, after.step, after.seq) != (h.state, h.step, h.seq):
                raise SlotChanged(f"slot {k} of rank {rank} was rewritten while being read")
        finally:
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()  # views handed out keep the map alive until they go

    def read(self, rank: int, step: int, pin: Optional[PinRef] = None) -> Snapshot:
        """A private copy of ``rank``'s ``step`` (for persistence or export).

        Raises :class:`SlotChanged` if the slot was rewritten during the copy, ``KeyError``
        if the step is not held.
        """
        pin = pin or self._pin_ref(rank)
        with self.pinned(rank, step, pin) as (meta, views):
            tensors = [v.clone() for v in views]
        return meta, tensors

    def newest_committed(self, ranks: Sequence[int]) -> Optional[int]:
        """Newest step every one of ``ranks`` has committed (headers only: cheap to poll;
        nothing is verified -- :meth:`common_step` does that)."""
        per_rank = [set(self.steps(r)) for r in ranks]
        common = set.intersection(*per_rank) if per_rank else set()
        return max(common) if common else None

    def read_common(self, min_step: int = 0, ranks: Optional[Sequence[int]] = None
                    ) -> Optional[Tuple[int, Dict[int, Snapshot]]]:
        """The persister's reader: ``(step, {rank: (meta, tensors)})`` for the newest step all
        ``ranks`` (default: every rank with slots here) committed, if ``>= min_step``.

        Cheap when there is nothing new (headers only).  The tensors are private copies whose
        checksum was verified after copying, so a long durable write never holds a slot.
        Raises :class:`SlotChanged` if a slot was rewritten during the copy (retry later).
        """
        ranks = self.ranks() if ranks is None else list(ranks)
        if not ranks:
            return None
        step = self.newest_committed(ranks)
        if step is None or step < min_step:
            return None
        out: Dict[int, Snapshot] = {}
        for r in ranks:
            meta, tensors = self.read(r, step)
            if meta_checksum(meta, tensors) != self._header_checksum(r, step):
                raise SlotChanged(f"rank {r} step {step}: copy does not match its checksum")
            out[r] = (meta, tensors)
        return step, out

    @contextlib.contextmanager
    def holding(self, ranks: Sequence[int], step: int) -> Iterator[Dict[int, Snapshot]]:
        """``{rank: (meta, tensor views)}`` of ``step`` on every rank in ``ranks``, checksums
        verified, without copying: for a reader while the workers are stopped (the final
        persist), where :meth:`read_common`'s private copies would only add fresh pages to
        fault in (~1.5-3 GB/s) and the state's size again in memory.  The slots are pinned
        while held.  Raises ``KeyError`` (a step not held), :class:`SlotChanged` (a copy not
        matching its checksum, or rewritten while held)."""
        with contextlib.ExitStack() as stack:
            out: Dict[int, Snapshot] = {}
            for r in ranks:
                meta, views = stack.enter_context(self.pinned(r, step, self._pin_ref(r)))
                if meta_checksum(meta, views) != self._header_checksum(r, step):
                    raise SlotChanged(f"rank {r} step {step}: slot does not match its checksum")
                out[r] = (meta, views)
            yield out

    def _header_checksum(self, rank: int, step: int) -> Optional[int]:
        k = self.steps(rank).get(step)
        return None if k is None else self.headers(rank)[k].checksum

    def write(self, rank: int, meta: dict, tensors: List[torch.Tensor], step: int) -> int:
        """Materialise a snapshot (from a peer or storage) into a slot of ``rank``; returns
        the slot.  Only while the rank's worker is stopped.  Never overwrites the newest
        other commit when another slot is free."""
        hs = self.headers(rank)
        done = sorted((h.step, h.commit_time, k) for k, h in hs.items()
                      if h.state == SlotState.COMMITTED)
        same = [k for s, _, k in done if s == step]
        free = [k for k in range(self.num_slots) if k not in {k2 for _, _, k2 in done}]
        k = same[0] if same else free[0] if free else done[0][2]
        m = dict(meta, step=step, rank=rank)
        nbytes = sum(t.numel() * t.element_size() + 64 for t in tensors)
        need = slot_size(len(meta_bytes(m)) + 4096, nbytes)
        path = slot_path(self.slot_prefix(rank), k)
        mm = self._open(rank, k, write=True)
        if mm is not None and len(mm) < need:
            mm.close()
            mm = None
        if mm is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # too small (or empty): workers are stopped, replace it
            mm = create_shm_file(path, need + need // 10)
        try:
            write_slot(mm, m, tensors, step=step, rank=rank,
                       world_size=meta.get("world_size", 0))
        finally:
            mm.close()
        return k

    # ------------------------------------------------------------------ cleanup

    def _job_files(self) -> List[str]:
        return glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{glob.escape(self.job_token)}-*"))

    def cleanup(self) -> None:
        """Unlink every ``/dev/shm/ckptrun-<token>-*`` file of this job (control block too)."""
        self._maps.drop()
        for p in self._job_files():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
