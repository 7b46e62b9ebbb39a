"""Slot file I/O: layout, the chunked copy-and-checksum writer, validated reads, verification.

A slot (see :mod:`ckptrun.protocol`) is a 4 KiB binary header, the meta JSON at offset
``SLOT_HEADER_SIZE`` and, from the page-aligned ``data_offset`` on, the tensors' raw bytes,
each at a 64-byte aligned ``offset`` relative to ``data_offset``.  Padding between tensors is
zeroed, so the checksum -- xxh3_64 over the meta JSON bytes, then data bytes
``[0, data_len)`` -- is a single pass over two contiguous ranges that anyone (agent, peer,
durable tier) can recompute.  Works on any writable buffer with the ``mmap`` interface:
shared-memory slot files and the anonymous maps of the in-process mode alike.
"""

from __future__ import annotations

import ctypes
import json
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ckptrun.protocol import (
    SLOT_HEADER_SIZE,
    SlotHeader,
    SlotState,
    data_offset_for,
    new_checksum,
    set_slot_state,
)
from ckptrun.snapshot.copyplan import _CAT, _MEMMOVE, CHUNK, CopyPlan, _nbytes  # noqa: F401

ALIGN = 64  # tensor start alignment: a cache line, and any dtype's element size

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
                 "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
                 "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
}


def dtype_name(dt: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the names stored in meta)."""
    return str(dt).split(".", 1)[1]


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ``ValueError`` for anything unknown."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"ckptrun: unknown tensor dtype {name!r} in snapshot") from None


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def layout(nbytes: Sequence[int], order: Optional[Sequence[int]] = None) -> Tuple[List[int], int]:
    """Offsets (indexed like ``nbytes``) for tensors placed in ``order``; and the data length."""
    offsets = [0] * len(nbytes)
    pos = 0
    for i in (range(len(nbytes)) if order is None else order):
        pos = _round_up(pos, ALIGN)
        offsets[i] = pos
        pos += nbytes[i]
    return offsets, pos


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def meta_bytes(meta: Any) -> bytes:
    """The canonical JSON encoding of ``meta`` (the bytes that are stored and checksummed)."""
    return _JSON.encode(meta).encode()


def slot_size(meta_len: int, data_len: int) -> int:
    """Bytes a slot needs for a meta of ``meta_len`` bytes and ``data_len`` data bytes."""
    return data_offset_for(meta_len) + data_len


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``, as one plain ``memmove`` when both are contiguous CPU tensors.

    ctypes drops the GIL for the call, and a single-threaded memcpy avoids torch's intra-op
    parallel region, which on an oversubscribed machine (training threads + this copy) ran
    ~8x slower than memcpy when issued per chunk from the main thread.
    """
    n = dst.numel() * dst.element_size()
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()):
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return dst
    return dst.copy_(src)


def clone_fast(src: torch.Tensor) -> torch.Tensor:
    """A private contiguous copy of ``src`` (see :func:`copy_into`)."""
    return copy_into(torch.empty(src.shape, dtype=src.dtype, device=src.device), src)


class SlotWrite:
    """One write into a slot: ``begin`` -> ``copy`` (in offset order, may be split across
    calls and threads) -> ``commit``.  The slot reads WRITING from ``begin`` until ``commit``
    flips it, so a crash at any point leaves a slot that every reader ignores."""

    def __init__(self, mm, meta_json: bytes, tensors: List[torch.Tensor], offsets: List[int],
                 data_len: int, step: int, rank: int, world_size: int) -> None:
        self.mm = mm
        self.meta_json = meta_json
        self.tensors = tensors
        self.offsets = offsets
        self.data_len = data_len
        self.header = SlotHeader(
            state=SlotState.WRITING, step=step, meta_len=len(meta_json), data_len=data_len,
            data_offset=data_offset_for(len(meta_json)), capacity=len(mm), rank=rank,
            world_size=world_size)
        if slot_size(len(meta_json), data_len) > len(mm):
            raise ValueError(f"ckptrun: slot of {len(mm)} bytes too small for "
                             f"{slot_size(len(meta_json), data_len)} bytes of snapshot")
        self._hash = new_checksum()
        self._pos = 0  # data bytes written and hashed so far (copies go in offset order)
        self._data = None
        self.copy_s = 0.0  # wall time in copy(), checksum included
        self.hash_s = 0.0  # of which hashing

    def begin(self) -> None:
        """Mark the slot WRITING (new seq), store the meta JSON and start the checksum."""
        old = SlotHeader.unpack_from(self.mm)
        self.header.seq = old.seq + 1
        self.header.pack_into(self.mm)  # state WRITING from here on
        m = self.header.meta_len
        self.mm[SLOT_HEADER_SIZE:SLOT_HEADER_SIZE + m] = self.meta_json
        self._hash.update(self.meta_json)
        if self.data_len:
            self._data = torch.frombuffer(self.mm, dtype=torch.uint8, count=self.data_len,
                                          offset=self.header.data_offset)

    def copy(self, indices: Any, stream: Any = None, released: Any = None) -> None:
        """Copy (and checksum) the tensors ``indices``, which must continue the offset order;
        ``indices`` may be a :class:`CopyPlan` of them made for the current position.

        CUDA tensors are copied with ``non_blocking`` on ``stream`` (the slot memory is
        pinned by the caller); CPU tensors beside them (AdamW's step counts) are copied
        meanwhile, and everything is hashed once the copies completed.  ``released`` (an
        event) is set as soon as no tensor is read any more: with tensors on the GPU before
        the checksum -- the training loop may change them while the host copy is hashed.
        """
        t0 = time.perf_counter()
        plan = indices if isinstance(indices, CopyPlan) else \
            CopyPlan(self.tensors, self.offsets, indices, self._pos)
        if plan.start != self._pos:
            raise ValueError(f"ckptrun: copy plan starts at {plan.start}, the write is at "
                             f"{self._pos}")
        copied = False
        if plan.gpu:
            try:
                with torch.cuda.stream(stream) if stream is not None else _null():
                    for i in plan.gpu:
                        self._typed_dst(i).copy_(self.tensors[i], non_blocking=True)
                self._copy_cpu_sources(plan)
            finally:  # no copy may still be in flight once the state is released
                (stream or torch.cuda.current_stream(
                    self.tensors[plan.gpu[0]].device)).synchronize()
            copied = True
            if released is not None:
                released.set()
        for kind, a, b in plan.ops:
            if kind == _CAT:  # b: byte views and zero padding that fill [self._pos, a)
                if not copied:
                    torch.cat(b, out=self._data[self._pos:a])
                self._hash_to(a)
                continue
            t, o = self.tensors[a], self.offsets[a]
            self._pad_to(o)
            if kind == _MEMMOVE and not copied:
                dst, src = self._data.data_ptr() + o, t.data_ptr()
                for x in range(0, b, CHUNK):
                    y = min(b, x + CHUNK)
                    ctypes.memmove(dst + x, src + x, y - x)  # GIL released, no intra-op pool
                    self._hash_to(o + y)  # still cache-hot
            else:
                if t.device.type == "cpu" and not copied:
                    self._typed_dst(a).copy_(t)
                self._hash_to(o + b)
        if released is not None:
            released.set()
        self.copy_s += time.perf_counter() - t0

    def _copy_cpu_sources(self, plan: CopyPlan) -> None:
        """The CPU tensors of ``plan`` into their places, not hashed yet (the copy loop
        hashes them in offset order, with the GPU tensors' host copies)."""
        pos = self._pos
        for kind, a, b in plan.ops:
            if kind == _CAT:  # fills [pos, a), its zero padding included
                torch.cat(b, out=self._data[pos:a])
                pos = a
                continue
            t, o = self.tensors[a], self.offsets[a]
            if kind == _MEMMOVE:
                ctypes.memmove(self._data.data_ptr() + o, t.data_ptr(), b)
            elif t.device.type == "cpu":
                self._typed_dst(a).copy_(t)
            pos = o + b

    def _hash_to(self, end: int) -> None:
        """Hash the data bytes ``[self._pos, end)``, just written."""
        th = time.perf_counter()
        for a in range(self._pos, end, CHUNK):
            self._hash.update(self._data[a:min(end, a + CHUNK)].numpy())
        self._pos = end
        self.hash_s += time.perf_counter() - th

    def commit(self) -> SlotHeader:
        """Finish the checksum and flip the header to COMMITTED (the commit point)."""
        self._pad_to(self.data_len)
        self.header.checksum = self._hash.intdigest()
        self.header.commit_time = time.time()
        self.header.pack_into(self.mm)  # all fields, still WRITING ...
        set_slot_state(self.mm, SlotState.COMMITTED, self.header.step)  # ... then the flip
        self.header.state = SlotState.COMMITTED
        self._data = None
        return self.header

    def _typed_dst(self, i: int) -> torch.Tensor:
        t = self.tensors[i]
        o = self.offsets[i]
        raw = self._data[o:o + _nbytes(t)]
        return (raw if t.dtype == torch.uint8 else raw.view(t.dtype)).view(t.shape)

    def _pad_to(self, pos: int) -> None:
        if pos > self._pos:
            self._data[self._pos:pos].zero_()
            self._hash_to(pos)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def write_slot(mm, meta: Dict[str, Any], tensors: List[torch.Tensor], *,
               step: Optional[int] = None, rank: Optional[int] = None,
               world_size: Optional[int] = None) -> SlotHeader:
    """Write a whole snapshot into the slot ``mm`` and commit it; returns the header.

    The tensor offsets of ``meta`` are recomputed for this slot (a copy of ``meta`` is
    stored); ``step``/``rank``/``world_size`` default to the values in ``meta``.  Used to
    materialise peer or durable copies into slot files.
    """
    if len(tensors) != len(meta["tensors"]):
        raise ValueError(f"ckptrun: meta describes {len(meta['tensors'])} tensors, "
                         f"got {len(tensors)}")
    tensors = [t.detach().contiguous() for t in tensors]
    offsets, data_len = layout([t.numel() * t.element_size() for t in tensors])
    meta = dict(meta)
    meta["tensors"] = [dict(d, offset=o, dtype=dtype_name(t.dtype), shape=list(t.shape),
                            nbytes=t.numel() * t.element_size())
                       for d, t, o in zip(meta["tensors"], tensors, offsets)]
    step = meta["step"] if step is None else step
    meta["step"] = step
    job = SlotWrite(mm, meta_bytes(meta), tensors, offsets, data_len, step,
                    meta.get("rank", -1) if rank is None else rank,
                    meta.get("world_size", 0) if world_size is None else world_size)
    job.begin()
    job.copy(range(len(tensors)))
    return job.commit()


def read_header(mm) -> SlotHeader:
    return SlotHeader.unpack_from(mm)


def read_slot(mm) -> Tuple[SlotHeader, Dict[str, Any], List[torch.Tensor]]:
    """Parse a COMMITTED slot: ``(header, meta, tensors)`` with tensors as views of ``mm``.

    Raises ``ValueError`` for a slot that is not committed or whose layout is inconsistent.
    The views alias the slot: clone them before the slot can be rewritten.
    """
    h = SlotHeader.unpack_from(mm)
    if h.state != SlotState.COMMITTED:
        raise ValueError(f"ckptrun: slot is not committed (state {h.state})")
    if h.data_offset < SLOT_HEADER_SIZE + h.meta_len or h.data_offset + h.data_len > len(mm):
        raise ValueError("ckptrun: slot header describes more bytes than the slot holds")
    meta = json.loads(bytes(mm[SLOT_HEADER_SIZE:SLOT_HEADER_SIZE + h.meta_len]))
    if meta.get("step") != h.step:
        raise ValueError(f"ckptrun: slot meta step {meta.get('step')} != header step {h.step}")
    views: List[torch.Tensor] = []
    for d in meta["tensors"]:
        dt = dtype_from_name(d["dtype"])
        shape = list(d["shape"])
        numel = 1
        for s in shape:
            numel *= s
        nb = numel * torch.empty((), dtype=dt).element_size()
        if nb != d["nbytes"] or d["offset"] < 0 or d["offset"] + nb > h.data_len:
            raise ValueError(f"ckptrun: inconsistent tensor entry {d['path']!r} in slot")
        if nb == 0:
            views.append(torch.empty(shape, dtype=dt))
            continue
        with warnings.catch_warnings():  # readers map slots read-only on purpose
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=nb,
                                   offset=h.data_offset + d["offset"])
        views.append((raw if dt == torch.uint8 else raw.view(dt)).view(shape))
    return h, meta, views


def slot_checksum(mm, header: Optional[SlotHeader] = None) -> int:
    """xxh3_64 of the slot's meta JSON bytes then its data bytes (what ``checksum`` holds)."""
    h = header or SlotHeader.unpack_from(mm)
    x = new_checksum()
    with memoryview(mm) as mv:
        with mv[SLOT_HEADER_SIZE:SLOT_HEADER_SIZE + h.meta_len] as part:
            x.update(part)
        with mv[h.data_offset:h.data_offset + h.data_len] as part:
            x.update(part)
    return x.intdigest()


def meta_checksum(meta: Dict[str, Any], tensors: List[torch.Tensor]) -> int:
    """The slot checksum of a copied-out snapshot: ``meta`` (as stored, offsets included) and
    its tensors placed at their offsets with zero padding -- without building the slot."""
    x = new_checksum()
    x.update(meta_bytes(meta))
    pos = 0
    for d, t in sorted(zip(meta["tensors"], tensors), key=lambda dt: dt[0]["offset"]):
        if d["offset"] > pos:
            x.update(bytes(d["offset"] - pos))
        n = d["nbytes"]
        if n:
            x.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        pos = d["offset"] + n
    return x.intdigest()


def verify_slot(mm, header: Optional[SlotHeader] = None) -> bool:
    """True when the slot is COMMITTED, in bounds, and its checksum matches, unchanged meanwhile."""
    h = header or SlotHeader.unpack_from(mm)
    if h.state != SlotState.COMMITTED or h.data_offset + h.data_len > len(mm) \
            or h.data_offset < SLOT_HEADER_SIZE + h.meta_len:
        return False
    ok = slot_checksum(mm, h) == h.checksum
    after = SlotHeader.unpack_from(mm)
    return ok and (after.state, after.step, after.seq) == (h.state, h.step, h.seq)
