"""Durable persistence for a ``Checkpointer`` running without the agent (plain ``python`` or
``torchrun``), through the durable tier's :mod:`ckptrun.tiers.durable.storage`.

One process: the in-process snapshot is written by a background thread while the slot is
pinned.  Several ranks (``torchrun``): every rank writes its own part
(``storage.write_parts(node=rank)``), the part descriptions are all-gathered as JSON bytes
over the default process group (no pickle), rank 0 finalizes, and a barrier follows -- this
is a collective, so it runs on the main thread at a step every rank reaches (or ``close()``).
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

Snapshot = Tuple[Dict[str, Any], List[torch.Tensor]]


def _storage():
    try:
        from ckptrun.tiers.durable import storage
    except ImportError:
        return None
    return storage


class StandalonePersister:
    """Persists in-process snapshots to ``url`` every ``every`` steps and at ``close()``."""

    def __init__(self, url: str, every: Optional[int], rank: int, world_size: int) -> None:
        self.url = url
        self.every = every
        self.rank = rank
        self.world_size = world_size
        self.persisted_step = -1
        self.pinned = -1  # in-process slot a background write is reading
        self._thread: Optional[threading.Thread] = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step != self.persisted_step

    @property
    def collective(self) -> bool:
        return self.world_size > 1

    def start_background(self, k: int, read: Callable[[int], Snapshot]) -> None:
        """Single process: write slot ``k`` in a thread (slot pinned meanwhile)."""
        if self.pinned >= 0:
            return  # the previous write is still running: skip, the next one catches up
        self.pinned = k
        self._thread = threading.Thread(target=self._write_pinned, args=(k, read),
                                        name="ckptrun-persist", daemon=True)
        self._thread.start()

    def _write_pinned(self, k: int, read: Callable[[int], Snapshot]) -> None:
        try:
            snap = read(k)
            self.write(snap, int(snap[0]["step"]))
        finally:
            self.pinned = -1

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def write(self, snap: Optional[Snapshot], step: int) -> bool:
        """Persist one snapshot (collectively when ``world_size > 1``: every rank must call
        this for the same ``step``, with ``snap`` None if it has no snapshot); never raises."""
        storage = _storage()
        if storage is None:
            print("ckptrun: persist_to is set but ckptrun.tiers.durable.storage is unavailable", file=sys.stderr)
            return False
        try:
            if not self.collective:
                if snap is None:
                    raise RuntimeError("no committed snapshot")
                storage.write_step(self.url, step, {self.rank: snap}, self.world_size)
            else:
                self._write_collective(storage, step, snap)
        except Exception as e:  # Megatron-LM #1435: a failed write must not kill training
            print(f"ckptrun: persisting step {step} to {self.url} failed: {e}", file=sys.stderr)
            return False
        self.persisted_step = step
        return True

    def _write_collective(self, storage, step: int, snap: Optional[Snapshot]) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("persisting from several ranks without the ckptrun agent needs "
                               "torch.distributed initialised (to agree on the step)")
        part: Optional[Dict[str, Any]] = None
        error = ""
        try:
            if snap is None:
                raise RuntimeError(f"rank {self.rank} has no committed snapshot of step {step}")
            part = storage.write_parts(self.url, step, {self.rank: snap}, node=self.rank)
        except Exception as e:  # every rank must still join the gather below
            error = str(e) or type(e).__name__
        parts = _all_gather_json({"part": part, "error": error})
        failed = [p["error"] for p in parts if p["error"] or p["part"] is None]
        if not failed and self.rank == 0:
            storage.finalize(self.url, step, [p["part"] for p in parts], self.world_size)
        dist.barrier()
        if failed:
            raise RuntimeError(f"a rank failed to write its part: {failed[0]}")

    def newest(self) -> Optional[int]:
        storage = _storage()
        return None if storage is None else storage.newest_step(self.url)

    def read(self, step: int) -> Optional[Snapshot]:
        storage = _storage()
        # A different world size than the saved one reshards DTensor state (FSDP2).
        return None if storage is None else storage.read_rank(self.url, step, self.rank,
                                                              world_size=self.world_size)


def _all_gather_json(obj: Any) -> List[Any]:
    """all_gather of a JSON-able object as bytes tensors (no pickle: not all_gather_object)."""
    import torch.distributed as dist

    dev = torch.device("cpu")
    if dist.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(dev)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    top = int(max(s.item() for s in sizes))
    padded = torch.zeros(top, dtype=torch.uint8, device=dev)
    padded[:data.numel()] = data
    bufs = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(bufs, padded)
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)]
