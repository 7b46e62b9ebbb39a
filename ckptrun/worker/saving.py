"""Two pieces of :meth:`ckptrun.Checkpointer.save`: the slot layout it keeps from one step to
the next, and the long-lived thread that runs the background copies."""

from __future__ import annotations

import queue
import threading
from typing import Any, Optional

from ckptrun import snapshot as S
from ckptrun.snapshot.copyplan import CopyPlan
from ckptrun.snapshot.slots import layout, meta_bytes


class Layout:
    """Where each tensor of a flattened state goes in a slot, and the JSON of the meta's
    tensor entries -- all a function of the tensors' paths, dtypes and shapes and of which
    are copied in the background, so ``save()`` computes it once and keeps it until these
    change (new parameters, optimizer state created by the first step, a load_state_dict
    that brings other shapes).  The sync part is laid out (and hashed) first."""

    def __init__(self, key: Any, fl: S.Flattened, background: bool) -> None:
        self.key = key
        nbytes = [t.numel() * t.element_size() for _, t in fl.items]
        self.deferred = [i for i, d in enumerate(fl.deferrable) if d and background and nbytes[i]]
        dset = set(self.deferred)
        self.sync = [i for i in range(len(nbytes)) if i not in dset]
        self.offsets, self.data_len = layout(nbytes, self.sync + self.deferred)
        self.tensors_json = meta_bytes(S.tensor_entries(fl.items, self.offsets, fl.shards))
        # where the sync part ends: the background copy goes on from there
        self.sync_end = max((self.offsets[i] + nbytes[i] for i in self.sync if nbytes[i]),
                            default=0)
        self.plan: Optional[CopyPlan] = None  # of the background copy, kept while valid


class Copier:
    """One long-lived background copy thread (starting a thread per save cost ~1 ms here)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Any, *args: Any) -> threading.Event:
        done = threading.Event()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ckptrun-snapshot", daemon=True)
            self._thread.start()
        self._q.put((fn, args, done))
        return done

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args, done = item
            try:
                fn(*args)
            finally:
                done.set()
                # not kept while waiting for the next: they hold the Checkpointer, whose
                # collection unregisters its slots' CUDA memory
                item = fn = args = done = None

    def stop(self) -> None:
        """End the thread and wait for it: a daemon thread still alive when the interpreter
        finalizes is stopped wherever it is, and inside torch's C++ that aborts the process
        ("terminate called without an active exception")."""
        if self._thread is not None:
            self._q.put(None)
            if self._thread is not threading.current_thread():  # (a collection on it)
                self._thread.join(timeout=10.0)
            self._thread = None
