"""How a slot write moves tensors: :class:`CopyPlan` (see :class:`ckptrun.snapshot.slots.SlotWrite`)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

CHUNK = 8 << 20  # copy granularity; each chunk is hashed right after it is copied (cache-hot)

_CAT, _MEMMOVE, _OTHER = 0, 1, 2


class CopyPlan:
    """How :meth:`SlotWrite.copy` moves tensors ``indices`` (offset order) into a slot whose
    write is at ``start``: runs of small contiguous CPU tensors as one ``torch.cat`` of their
    byte views (zero padding included) into the slot, then one checksum update -- two calls
    that release the GIL, where a copy per tensor took several per tensor, each a hand-over
    of the GIL between the background copy and the training thread; large tensors in
    ``CHUNK`` pieces, each hashed right after it is copied (cache-hot); anything else (not
    contiguous, on the GPU) with ``copy_``.

    A plan holds views of the tensors' memory: :meth:`still_valid` says whether it may be
    used again for another write of the same tensors (same storage, still contiguous).
    """

    def __init__(self, tensors: List[torch.Tensor], offsets: List[int],
                 indices: Sequence[int], start: int) -> None:
        self.start = start
        self.threads = torch.get_num_threads()
        # torch.cat runs a plain serial copy loop with one intra-op thread; with more, it
        # would start a parallel region from the copying thread (see copy_into).
        batching = self.threads == 1
        idx = sorted(indices, key=lambda i: offsets[i])
        self.gpu = [i for i in idx if tensors[i].device.type != "cpu" and _nbytes(tensors[i])]
        self.ops: List[Tuple[int, int, Any]] = []
        self.ptrs: List[Tuple[int, int, bool]] = []  # (index, data_ptr, cpu and contiguous)
        batch: List[torch.Tensor] = []
        bstart = pos = start  # where the batch starts; where the last tensor ends
        for i in idx:
            t, o = tensors[i], offsets[i]
            n = _nbytes(t)
            if n == 0:
                continue
            cpu = _raw(t)
            self.ptrs.append((i, t.data_ptr(), cpu))
            flat = _bytes_view(t) if batching and cpu and n < CHUNK else None
            if flat is not None:
                if batch and o + n - bstart > CHUNK:
                    self.ops.append((_CAT, pos, batch))
                    batch = []
                if not batch:
                    bstart = pos
                if o > pos:
                    batch.append(_zeros(o - pos))
                batch.append(flat)
            else:
                if batch:
                    self.ops.append((_CAT, pos, batch))
                    batch = []
                self.ops.append((_MEMMOVE if cpu else _OTHER, i, n))
            pos = o + n
        if batch:
            self.ops.append((_CAT, pos, batch))

    def still_valid(self, tensors: List[torch.Tensor]) -> bool:
        """Whether this plan copies ``tensors`` correctly: each is still at the same address,
        on the CPU and contiguous where it was (dtypes and shapes are the caller's key)."""
        if torch.get_num_threads() != self.threads:
            return False
        for i, ptr, cpu in self.ptrs:
            t = tensors[i]
            if t.data_ptr() != ptr or _raw(t) != cpu:
                return False
        return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values as they are: a contiguous CPU tensor without a
    pending conjugation or negation (those go through ``copy_``, which applies them)."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


_ZEROS = torch.zeros(64, dtype=torch.uint8)


def _zeros(n: int) -> torch.Tensor:
    """``n`` zero bytes (the padding in a batch: below 64 between adjacent tensors)."""
    return _ZEROS[:n] if n <= len(_ZEROS) else torch.zeros(n, dtype=torch.uint8)


def _bytes_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A contiguous CPU tensor's bytes as a flat uint8 view, or None where torch has none."""
    try:
        return t.detach().reshape(-1).view(torch.uint8)
    except RuntimeError:
        return None
