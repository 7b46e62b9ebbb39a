"""``ckptrun.Checkpointer``: snapshot the training state at every step, restore it exactly.

Under the ckptrun agent (``CKPTRUN_CONTROL`` set) snapshots go into the rank's
shared-memory slot files, which survive a worker crash; ``restore()`` loads the step the
agent chose (``CKPTRUN_RESTORE``).  Under plain ``python``/``torchrun`` the same script
keeps its snapshot in-process (double-buffered anonymous memory, same slot layout) and
persists only when a durable URL is given (``persist_to=`` or ``CKPTRUN_PERSIST_TO``).

Overlap: ``save()`` copies the small, mutable-anytime items (RNG, plain data, buffers)
synchronously and leaves parameters and optimizer state -- which only change inside
``optimizer.step()`` -- to a background thread (``copy_`` and xxh3 both release the GIL).
A step pre-hook on every optimizer in the state waits for that copy, so no parameter
changes under it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ckptrun import snapshot as S
from ckptrun.protocol import (
    DEFAULT_NUM_SLOTS,
    ENV_CONTROL,
    ENV_MAX_STATE_BYTES,
    ENV_NUM_SLOTS,
    ENV_PERSIST_TO,
    ENV_RESTORE,
    ENV_SLOT_PREFIX,
    Fatal,
    Phase,
    SlotState,
)
from ckptrun.protocol.check import OLD_VALUES_ENTRY, VALUES_ENTRY
from ckptrun.snapshot.slots import (
    CopyPlan,
    SlotWrite,
    clone_fast,
    copy_into,
    read_slot,
    slot_size,
    verify_slot,
)
from ckptrun.worker import prefault
from ckptrun.worker.check_probe import CheckProbe
from ckptrun.worker.clean_exit import collect_at_exit
from ckptrun.worker.heartbeat import raise_if_recovering, worker_link
from ckptrun.worker.interval import SnapshotInterval
from ckptrun.worker.saving import Copier, Layout
from ckptrun.worker.slotset import ShmTooSmall, SlotSet
from ckptrun.worker.snapshot_cost import TOO_COSTLY, SnapshotCost
from ckptrun.worker.stale import StaleNumbers
from ckptrun.worker.standalone import StandalonePersister

RNG_KEY = "rng"
VALUES_KEY = VALUES_ENTRY  # what the script gave to save(step, **values)
# every open Checkpointer of this process: an in-process recovery abandons them
_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def abandon_all() -> None:
    """In-process recovery: let each open Checkpointer finish the copy under way and stop
    (no final snapshot, no persist -- the attempt they belong to is over)."""
    for ck in list(_live):
        ck._abandon()


class RestoreFailed(RuntimeError):
    """``restore()`` found the state but a registered object refused it (its message names
    the entry, the rank and why); under the launcher the job stops instead of restarting
    into the same refusal -- unless the failure was one a fresh process may not meet again
    (:func:`_passing`)."""


def _passing(exc: BaseException) -> bool:
    """Whether a failed load may go through in a restarted process: a collective or the
    network failed (a peer gone during the load: torch.distributed's errors, or gloo's plain
    RuntimeErrors about connections), or memory or the device ran out -- anywhere in the
    exception's chain of causes."""
    from ckptrun.worker.collectives import from_communication

    seen: set = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if from_communication(exc) or isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
            return True
        if "cuda" in str(exc).lower() or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Checkpointer:
    """Per-iteration snapshots of ``state`` into the memory tier (see DESIGN §2).

    ``state`` maps names to objects with ``state_dict()``/``load_state_dict()`` (models,
    optimizers, schedulers, stateful loaders), tensors, numpy arrays and plain data; plain
    entries are replaced in the dict on restore, objects and tensors are loaded in place.
    """

    def __init__(self, state: Dict[str, Any], *, persist_to: Optional[str] = None,
                 overlap: bool = True, capture_rng: bool = True,
                 persist_every: Optional[int] = None, verify_restore: bool = True,
                 every: Any = None, overhead_budget: Any = None) -> None:
        if not isinstance(state, dict):
            raise TypeError("ckptrun.Checkpointer expects a dict of name -> state")
        self.state = state
        self.overlap = overlap
        self.capture_rng = capture_rng
        self.verify_restore = verify_restore
        agent_target = os.environ.get(ENV_PERSIST_TO) if os.environ.get(ENV_CONTROL) else None
        if agent_target is not None and ((persist_to and persist_to != agent_target)
                                         or persist_every is not None):
            # the agent persists under the launcher; said rather than ignored in silence
            if os.environ.get("RANK", "0") == "0":
                print(f"ckptrun: Checkpointer(persist_to=, persist_every=) apply without the "
                      f"ckptrun launcher; this job persists to {agent_target} as "
                      f"--persist-to/--persist-every say", file=sys.stderr, flush=True)
            persist_to = agent_target
        self.persist_to = persist_to or os.environ.get(ENV_PERSIST_TO) or None
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._rng_key = RNG_KEY if RNG_KEY not in state else "__ckptrun_rng__"
        self._values_key = VALUES_KEY if VALUES_KEY not in state else OLD_VALUES_ENTRY
        #: the values of the last ``save(step, **values)``, or the restored ones
        self.values: Dict[str, Any] = {}
        self._stale = StaleNumbers(state)
        self._check = CheckProbe.from_env(self.rank)  # under ``ckptrun check`` only
        self._link = worker_link() if os.environ.get(ENV_CONTROL) else None
        if self._link is not None:
            num = int(os.environ.get(ENV_NUM_SLOTS, str(DEFAULT_NUM_SLOTS)))
            self._slots = SlotSet(os.environ[ENV_SLOT_PREFIX], num, keep=2,
                                  max_bytes=int(os.environ.get(ENV_MAX_STATE_BYTES, "0") or 0),
                                  rank=self.rank)
        else:  # in-process: newest commit + one being written (+ one a persist may hold)
            self._slots = SlotSet(None, 3 if self.persist_to else 2, keep=1, rank=self.rank)
        self._persist = None
        if self._link is None and self.persist_to:
            self._persist = StandalonePersister(self.persist_to, persist_every, self.rank,
                                                self.world_size)
        self._copier = Copier()
        collect_at_exit()  # the job's DDP/FSDP process groups go before shutdown, not in it
        self._pending: Optional[threading.Event] = None  # set when the background copy is done
        self._pending_error: Optional[BaseException] = None
        # set when the background copy no longer reads the state (see _await_release)
        self._released: Optional[threading.Event] = None
        self._hooked: Dict[int, Any] = {}
        self._stream = None
        self.saves, self.skipped_saves, self.last_block_s = 0, 0, 0.0
        self.last_copy_s = 0.0  # background copy + checksum of the last save
        self.last_hash_s = 0.0  # the checksum's share of it
        self._closed = False
        self._adapters: Dict[Any, Any] = {}  # adapter objects (DDP unwrap, FSDP2 wrappers)
        self._layout: Optional[Layout] = None
        # every= N | "auto" (default CKPTRUN_SNAPSHOT_EVERY, else 1: every step, DESIGN)
        self._interval = SnapshotInterval(every, overhead_budget, self.world_size)
        self._cost = SnapshotCost()  # what the snapshots block the loop (said if too much)
        self._cost_said = False
        self._aside_s = 0.0  # what the last save() spent on persisting and ckptrun check
        self._last_step: Optional[int] = None  # the last step given to save() ...
        self._last_snap: Optional[int] = None  # ... and the last one snapshotted
        self._shown_every = 1 if self._interval.mode == "1" else 0  # reported to the agent
        self._stepped = False
        for opt in S.find_optimizers(self._view()):
            self._hook(opt)
        _live.add(self)
        # dropped without close(): the copy thread ends with it (the slots' own finalizer
        # unregisters their CUDA memory)
        weakref.finalize(self, self._copier.stop).atexit = False

    # ------------------------------------------------------------------ public API

    def save(self, step: int, **values: Any) -> bool:
        """Snapshot the state as ``step``: the state after ``step`` steps of training, an
        integer >= 1 (``restore()`` returns it; 0 means "nothing restored").  Returns False
        when the save was skipped (no free slot, or not a step of the snapshot interval; it
        is a heartbeat all the same).

        ``values``: what the loop rebinds or prefetches and the next step uses -- numbers
        (``best_val_loss=best``), the batch fetched ahead (``batch=(X, Y)``), any state value
        -- snapshotted with this step; after a restore they are in :attr:`values` (and
        :meth:`get`).  Give them at every save: each snapshot holds the values given to it.

        Returns as soon as the synchronous part is copied; parameters and optimizer state
        may still be copying (the next ``optimizer.step()`` waits for them; state on the
        GPU only until it is copied off the GPU, the checksum of the host copy goes on
        beside the step and the next ``save()`` waits for it).
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"ckptrun: save(step): step must be an int, got {step!r}")
        if step < 1:
            raise ValueError(f"ckptrun: save({step}): steps start at 1 -- save(n) records the "
                             "state after n steps, and restore() returns 0 for 'nothing "
                             "restored'; in a loop over range(start, total) call "
                             "save(step + 1)")
        t0 = time.monotonic()
        if self._link is not None:
            raise_if_recovering(self._link)  # a rank elsewhere failed (@ckptrun.resilient)
        self.values = values
        if not self._stepped:  # the first step this process made: the end of a recovery
            self._stepped = True
            self._ctl("first_step_at", time.monotonic())
        iv = self._interval
        due = iv.due(step)
        self._last_step = step
        if iv.every != self._shown_every:  # interval mode: the agent shows and logs it
            self._shown_every = iv.every
            self._ctl("snapshot_every", iv.every)
            self._ctl("snapshot_overhead", iv.overhead or 0.0)
        if not due:
            # the previous snapshot's checksum may still run (state on the GPU): it is that
            # snapshot's cost, and "auto" reads the time after this call as a plain step
            self.wait()
            self._cost.blocked(time.monotonic() - t0)
            self._set_phase(Phase.RUNNING, step)
            return False
        self._last_snap = step
        self._stale.saved(step)
        took = self._snapshot(step)
        now = time.monotonic()
        self._cost.blocked(now - t0 - self._aside_s)
        self._aside_s = 0.0
        if self._slots.complete():
            self._cost.snapshot_done(now)
            self._judge_cost()
        else:  # the first saves wait for slots being allocated: once per job, not a cost
            self._cost.restart()
        return took

    def _judge_cost(self) -> None:
        """Show what a fixed interval's snapshots cost (``ckptrun status``); say it once where
        they make the loop at least twice as slow -- silence would leave a user with a job
        many times slower than under torchrun and no reason given."""
        cost = self._cost
        if self._interval.mode == "auto" or not cost.window_ends():
            return
        share = cost.share()
        self._ctl("snapshot_overhead", min(share, 1e6))
        if share >= TOO_COSTLY and not self._cost_said and self.rank == 0:
            self._cost_said = True
            blocked, training = cost.mean_ms()
            print(f"ckptrun: snapshots every {self._interval.every} step(s) block the "
                  f"training loop {blocked:.0f} ms each against {training:.0f} ms of "
                  f"training ({1 + share:.1f}x the time without them); --snapshot-every "
                  "auto (Checkpointer(every='auto') without the launcher) snapshots every "
                  "k steps within a 3% budget", file=sys.stderr, flush=True)

    def get(self, name: str, default: Any = None) -> Any:
        """A value given to ``save(step, name=...)``: after ``restore()``, the restored one;
        ``default`` when there is none (a fresh start)."""
        return self.values.get(name, default)

    @property
    def every(self) -> int:
        """The current snapshot interval in steps (1 = every step; changes under "auto")."""
        return self._interval.every

    @property
    def snapshot_overhead(self) -> Optional[float]:
        """Under ``every="auto"``: the measured share of training time that snapshots at
        the current interval cost (None until measured)."""
        return self._interval.overhead

    def _snapshot(self, step: int) -> bool:
        t0 = time.perf_counter()
        self.wait()
        prefault.release()  # a restarted worker's start-up is over (no-op otherwise)
        self._set_phase(Phase.SAVING, step)
        try:
            fl = S.flatten_state(self._full_state())
        except S.Unsnapshottable:
            self._ctl("fatal", Fatal.CONFIG)  # a restart would fail the same way: the job stops
            raise
        for opt in fl.optimizers:
            self._hook(opt)
        tensors = [t for _, t in fl.items]
        gpu = next((t.device.index for t in tensors if t.is_cuda), None)  # None: no CUDA
        self._slots.use_device(gpu)
        lay = self._layout_of(fl, self.overlap and bool(fl.optimizers))
        mj = S.meta_json(step, self.rank, self.world_size, fl.tree, lay.tensors_json)
        k = self._slots.choose(self._pin())
        if k is None:
            self.skipped_saves += 1
            self._ctl("skipped_saves", self.skipped_saves)
            self._set_phase(Phase.RUNNING)
            return False
        try:
            mm = self._slots.ensure(k, slot_size(len(mj), lay.data_len), len(mj), lay.data_len)
        except ShmTooSmall:
            self._ctl("fatal", Fatal.CONFIG)  # a restart cannot fix this: the agent stops the job
            raise
        job = SlotWrite(mm, mj, tensors, lay.offsets, lay.data_len, step, self.rank,
                        self.world_size)
        job.begin()
        stream = self._copy_stream(gpu)
        if stream is not None:  # copies must see the kernels that produced the tensors
            stream.wait_stream(torch.cuda.current_stream(gpu))
        job.copy(lay.sync, stream)
        if lay.deferred:
            plan = lay.plan
            if plan is None or not plan.still_valid(tensors):
                plan = lay.plan = CopyPlan(tensors, lay.offsets, lay.deferred, lay.sync_end)
            self._released = threading.Event()
            self._pending = self._copier.submit(self._finish, job, k, plan, stream,
                                                self._released)
        else:
            self._finish(job, k, None, stream)
        self.last_block_s = time.perf_counter() - t0
        self._ctl("save_block_s", self.last_block_s)
        aside = time.monotonic()  # a durable write and ckptrun check's probe: not snapshots
        if self._persist is not None and self._persist.collective and self._persist.due(step):
            self.wait()  # a collective write: every rank is here at the same step
            self._persist.write(self._committed(k, step), step)
        if self._check is not None:
            self.wait()
            got = self._committed(k, step)
            if got is not None:
                self._check.committed(step, *got)
        self._aside_s += time.monotonic() - aside
        return True

    def restore(self) -> int:
        """Load the newest step every rank can restore; 0 = nothing (state untouched)."""
        self.wait()
        t0 = time.perf_counter()
        if self._link is not None:
            plan = json.loads(os.environ.get(ENV_RESTORE) or '{"step": 0}')
            step = int(plan.get("step", 0))
            if step <= 0:
                self._ctl("restored_step", 0)
                # a beat: the loop starts now, and a hang before its first save (a deadlock
                # in the first step, a data-loader worker that never answers) is caught
                # like one after it -- unwatched, such a job sat silent until its
                # collectives timed out
                self._set_phase(Phase.RUNNING)
                return 0
            self._set_phase(Phase.RESTORING, step)
            k = self._slots.find(step)
            if k is None:
                raise RuntimeError(f"ckptrun: rank {self.rank} has no committed slot for step "
                                   f"{step} that the agent asked to restore")
            # "verified": the agent hashed this slot with every writer gone: no second pass
            self._load_slot(k, verify=self.verify_restore and not plan.get("verified"))
        else:
            step = self._restore_standalone()
            if step <= 0:
                return 0
        dt = time.perf_counter() - t0
        prefault.release()  # the state is rebuilt: glibc trims again (no-op if not a spare)
        self._ctl("restored_step", step)
        self._ctl("restore_s", dt)
        self._set_phase(Phase.RUNNING, step)
        self._interval.restart()
        self._cost.restart()
        return step

    def _await_release(self) -> None:
        """Before ``optimizer.step()`` changes the state: wait until the background copy no
        longer reads it.  For state on the GPU that is when the copies off the GPU are done
        -- the checksum of the host copy goes on beside the step (the next ``save()``
        waits for it); for CPU state it is the whole write (copies and checksum are
        interleaved, cache-hot)."""
        released = self._released
        if released is not None:
            t0 = time.monotonic()
            released.wait()
            self._cost.blocked(time.monotonic() - t0)
            self._released = None

    def wait(self) -> None:
        """Wait for the background copy of the previous save (no-op when none runs)."""
        done = self._pending
        if done is not None:
            done.wait()
            self._pending = None
        err, self._pending_error = self._pending_error, None
        if err is not None:  # a failed snapshot must not stop training: report, go on
            print(f"ckptrun: snapshot failed and was dropped: {err!r}", file=sys.stderr)

    def close(self) -> None:
        """Wait for the last snapshot (and persist it when a durable URL is set)."""
        if self._closed:
            return
        if self._last_step is not None and self._last_step != self._last_snap:
            self._snapshot(self._last_step)  # interval mode: the final step, in memory too
        self.wait()
        if self._persist is not None:
            self._persist.join()
            k = self._slots.newest()
            step = self._slots.header(k).step if k is not None else -1
            # The final step (ranks saved the same steps, so they agree on this collectively).
            if step > 0 and step != self._persist.persisted_step:
                self._persist.write(self._committed(k, step), step)
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self._copier.stop()
        self._slots.stop_allocating()
        self._slots.unpin()  # no more writes: the CUDA registrations go now, not at collection
        self._closed = True
        _live.discard(self)

    def _abandon(self) -> None:
        """Stop without a final snapshot: the copy under way completes (or is dropped if
        it fails), the optimizer hooks go, the copy thread ends."""
        if self._closed:
            return
        try:
            self.wait()
        except Exception as exc:  # a copy that failed is not a reason to stay down
            print(f"ckptrun: the last snapshot copy failed: {exc!r}", file=sys.stderr)
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self._copier.stop()
        self._slots.hand_back()  # the next attempt's Checkpointer maps the same slots
        self._closed = True
        _live.discard(self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _view(self) -> Dict[str, Any]:
        """The state as snapshotted: framework wrappers adapted (``ckptrun.adapters``)."""
        from ckptrun.adapters import adapt_state

        return adapt_state(self.state, self._adapters)

    def _full_state(self, values: bool = True) -> Dict[str, Any]:
        """The snapshotted tree: the adapted state, the RNG states and (``values``) what the
        last ``save()`` was given."""
        full = dict(self._view())
        if self.capture_rng:
            full[self._rng_key] = S.capture_rng()
        if values and self.values:
            full[self._values_key] = self.values
        return full

    def _finish(self, job: SlotWrite, k: int, deferred: Optional[CopyPlan], stream: Any,
                released: Optional[threading.Event] = None) -> None:
        try:
            if deferred is not None:
                job.copy(deferred, stream, released)
            h = job.commit()
        except BaseException as e:  # the slot stays WRITING: ignored by every reader
            self._pending_error = e
            self._ctl("phase", Phase.RUNNING)
            return
        finally:
            if released is not None:
                released.set()
        self.saves += 1
        self.last_copy_s = job.copy_s
        self.last_hash_s = job.hash_s
        if self._link is not None:
            for name, value in (("committed_step", h.step), ("committed_slot", k),
                                ("saves", self.saves), ("save_copy_s", job.copy_s),
                                ("state_bytes", h.data_len)):
                self._ctl(name, value)
        self._ctl("phase", Phase.RUNNING)
        p = self._persist
        if p is not None and not p.collective and p.due(h.step):
            # Its own thread: a slow store must not hold up the next optimizer step.  The
            # slot stays pinned (skipped by the writer) until the write is done.
            p.start_background(k, lambda slot: self._committed(slot, h.step))

    def _layout_of(self, fl: S.Flattened, background: bool) -> Layout:
        """The slot layout of ``fl``: the previous save's while the state has the same
        tensors (paths, dtypes, shapes) split the same way, else a new one."""
        key = ([(p, t.dtype, t.shape) for p, t in fl.items], fl.deferrable, fl.shards, background)
        lay = self._layout
        if lay is None or lay.key != key:
            lay = self._layout = Layout(key, fl, background)
        return lay

    def _committed(self, k: Optional[int], step: int) -> Optional[Tuple[dict, list]]:
        """``(meta, views)`` of slot ``k`` if it holds a committed ``step``, else None."""
        if k is None:
            return None
        h = self._slots.header(k)
        if h.state != SlotState.COMMITTED or h.step != step:
            return None
        return tuple(read_slot(self._slots.mms[k])[1:])

    def _restore_standalone(self) -> int:
        k = self._slots.newest()
        if k is not None:
            return self._load_slot(k, self.verify_restore)
        step = self._persist.newest() if self._persist is not None else None
        if not step:
            return 0
        self._set_phase(Phase.RESTORING, step)
        meta, tensors = self._persist.read(step)
        self._load(meta, tensors)
        return int(step)

    def _load_slot(self, k: int, verify: bool) -> int:
        mm = self._slots.mms[k]
        h, meta, views = read_slot(mm)
        if verify and not verify_slot(mm, h):
            raise RuntimeError(f"ckptrun: rank {self.rank}: slot {k} (step {h.step}) fails its "
                               "checksum; refusing to restore from it")
        # Nothing may keep pointing into the slot (optimizer.load_state_dict keeps the tensors
        # it is given; the next save() rewrites slots).  Where the live state already has a
        # tensor of the same path/shape/dtype, copy straight into it: module.load_state_dict
        # then copies each tensor onto itself (a no-op) and no fresh memory is touched;
        # otherwise (e.g. optimizer state in a fresh process) take a private copy.
        # Numpy-backed entries are left out: their memory may be read-only (np.frombuffer);
        # load_into assigns those arrays itself.
        # (not the values of the last save(): those are handed back as fresh objects, the
        # script may still hold the ones it gave)
        fl = S.flatten_state(self._full_state(values=False))
        live = {p: t for p, t in fl.items if p in fl.tensor_paths}
        tensors = []
        for d, v in zip(meta["tensors"], views):
            cur = live.get(d["path"])
            if cur is not None and cur.dtype == v.dtype and cur.shape == v.shape \
                    and not _overlaps(cur, mm):
                with torch.no_grad():
                    tensors.append(copy_into(cur, v))
            else:
                tensors.append(clone_fast(v))
        del views
        self._load(meta, tensors)
        return h.step

    def _load(self, meta: Dict[str, Any], tensors: List[torch.Tensor]) -> None:
        restored = S.unflatten(meta["tree"], tensors)
        self.values = restored.pop(self._values_key, None) or {}
        rng = restored.pop(self._rng_key, None) if self.capture_rng else None
        if not self.capture_rng:
            restored.pop(self._rng_key, None)
        view = self._view()
        target = dict(view)
        # the restored tensors that were DTensor shards or lived on a device: the objects
        # holding them are given them back in those types (snapshot.loading)
        needs_live = {id(t) for d, t in zip(meta["tensors"], tensors)
                      if "global_shape" in d or d.get("device")}
        try:
            S.load_into(target, restored, needs_live)
        except S.LoadFailed as exc:
            if not _passing(exc.cause):  # the same state would fail the same way
                self._ctl("fatal", Fatal.RESTORE)
            raise RestoreFailed(f"ckptrun: rank {self.rank}: {exc}") from None
        for k, v in target.items():  # plain entries are replaced in the script's own dict
            # (entries an adapter added to the view, e.g. DDP's bucket layouts, are not the
            # script's: they stay out of its dict)
            if k not in view or (k in self.state and view[k] is self.state[k]):
                self.state[k] = v
        if rng is not None:
            S.restore_rng(rng)

    def _hook(self, opt: torch.optim.Optimizer) -> None:
        if id(opt) not in self._hooked:
            me = weakref.ref(self)  # the optimizer must not keep a dropped Checkpointer

            def before_step(*_: Any) -> None:
                ck = me()
                if ck is not None:
                    ck._await_release()
            self._hooked[id(opt)] = opt.register_step_pre_hook(before_step)

    def _copy_stream(self, gpu: Optional[int]) -> Any:
        """The side stream for copies off the GPU (None: no state on a GPU)."""
        if gpu is None:
            return None
        # on the state's GPU, not the current one: a script may keep its model on cuda:N
        # without torch.cuda.set_device, and a stream of another device would not order
        # the copies after the kernels that wrote the tensors
        if self._stream is None or self._stream.device.index != gpu:
            self._stream = torch.cuda.Stream(device=gpu)
        return self._stream

    def _pin(self) -> int:
        if self._link is None:
            return self._persist.pinned if self._persist is not None else -1
        block, local_rank = self._link
        return block.get(local_rank, "pin")

    def _ctl(self, name: str, value: Any) -> None:
        if self._link is not None:
            block, local_rank = self._link
            block.set(local_rank, name, value)

    def _set_phase(self, phase: int, step: Optional[int] = None) -> None:
        if self._link is not None:
            block, local_rank = self._link
            block.beat(local_rank, step=step, phase=phase)


def _overlaps(t: torch.Tensor, mm: Any) -> bool:
    """Whether ``t`` lives inside the slot map ``mm`` (never restore into the slot itself)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    return base <= t.data_ptr() < base + len(mm)
