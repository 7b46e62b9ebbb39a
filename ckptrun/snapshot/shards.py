"""Sharded (DTensor) entries of the durable tier: DCP write plan, chunk layout, resharding.

A snapshot tensor whose description carries ``global_shape``/``global_offset`` (a DTensor's
local shard, see :func:`ckptrun.snapshot.tree._enc_dtensor`) is written under one *global* DCP key
-- the snapshot path with ``/`` turned into ``.``, which is the key ``dcp.load`` derives from
``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)}`` -- as a chunk
at its offset, so plain ``dcp.load`` reshards it.  ckptrun itself reads it back at another
world size with :func:`reshard_desc` + :func:`assemble`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

ChunkKey = Tuple[str, Tuple[int, ...]]  # (DCP key, chunk offsets)


def is_sharded(desc: Dict[str, Any]) -> bool:
    """Whether a snapshot tensor description is a DTensor shard."""
    return "global_shape" in desc


def dcp_key(path: str) -> str:
    """Global DCP key of a sharded snapshot path (``model/0.weight`` -> ``model.0.weight``)."""
    return path.replace("/", ".")


class ChunkPlanner(DefaultSavePlanner):
    """A save planner for given ``(key, offsets, global size, tensor)`` chunks: plain tensors
    (offsets all zero, size = their shape) and shards (their offsets in the global tensor)."""

    def __init__(self, chunks: Sequence[Tuple[str, Tuple[int, ...], List[int], torch.Tensor]]) -> None:
        super().__init__()
        self._items: List[WriteItem] = []
        self._data: Dict[ChunkKey, torch.Tensor] = {}
        for key, offsets, size, t in chunks:
            off = torch.Size(offsets)
            whole = list(t.shape) == list(size) and not any(offsets)
            self._items.append(WriteItem(
                index=MetadataIndex(key, off),
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                    properties=TensorProperties(dtype=t.dtype), size=torch.Size(size))))
            self._data[(key, tuple(offsets))] = t

    def set_up_planner(self, state_dict: Any = None, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._data[(index.fqn, tuple(index.offset or ()))]


def local_chunk(desc: Dict[str, Any], rank: int, world_size: int) -> Tuple[List[int], List[int]]:
    """``(offsets, shape)`` of ``rank``'s shard of a sharded tensor when the job runs with
    ``world_size`` ranks on a 1-D mesh (FSDP2's layout: ``torch.chunk`` along the dim)."""
    shape = list(desc["global_shape"])
    offsets = [0] * len(shape)
    if len(desc.get("mesh_shape", [1])) != 1:
        raise ValueError(f"resharding {desc['path']}: only 1-D device meshes are supported")
    for p in desc["placements"]:
        if p == "R":
            continue
        d = int(p[1:])
        n = shape[d]
        c = math.ceil(n / world_size) if n else 0
        start = min(rank * c, n)
        offsets[d], shape[d] = start, min(start + c, n) - start
    return offsets, shape


def assemble(offsets: List[int], shape: List[int], dtype: torch.dtype,
             sources: List[Dict[str, Any]], read: Callable[[Dict[str, Any]], torch.Tensor],
             name: str) -> torch.Tensor:
    """The region ``offsets``/``shape`` of a global tensor from stored chunks (index entries
    with ``chunk_offset`` and ``shape``); ``read(entry)`` loads one chunk.  Every element must
    be covered, or ``ValueError``."""
    out = torch.empty(shape, dtype=dtype)
    covered = 0
    seen = set()
    for e in sources:
        c_off, c_shape = list(e["chunk_offset"]), list(e["shape"])
        if tuple(c_off) in seen or not math.prod(c_shape):
            continue
        lo = [max(a, b) for a, b in zip(offsets, c_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, c_off, c_shape)]
        if any(h <= low for low, h in zip(lo, hi)) and shape:
            continue
        seen.add(tuple(c_off))
        chunk = read(e)
        src, dst = chunk, out
        for d, (low, h) in enumerate(zip(lo, hi)):
            src = src.narrow(d, low - c_off[d], h - low)
            dst = dst.narrow(d, low - offsets[d], h - low)
        dst.copy_(src)
        covered += src.numel()
    if covered != out.numel():
        raise ValueError(f"{name}: the stored chunks cover {covered} of {out.numel()} elements")
    return out


def plan_chunks(snapshots: Dict[int, Tuple[Dict[str, Any], List[torch.Tensor]]],
                checksum: Callable[[torch.Tensor], str], meta_key: str
                ) -> Tuple[List[Tuple[str, Tuple[int, ...], List[int], torch.Tensor]], List[Any]]:
    """What a node writes for ``{rank: (meta, tensors)}``: the DCP chunks, and per stored
    entry ``(rank, index entry, where)`` -- ``where`` is the chunk key, the plan index of a
    byte-identical earlier entry (stored once: replicated DDP state, replicated shards) or
    None (an empty shard).  The meta JSON travels as a uint8 tensor under ``meta_key``."""
    chunks: List[Tuple[str, Tuple[int, ...], List[int], torch.Tensor]] = []
    plan: List[Tuple[str, Dict[str, Any], Any]] = []  # (rank, entry, chunk key or alias index)
    first: Dict[Any, Tuple[int, torch.Tensor, str]] = {}  # path/chunk -> (plan index, tensor, sum)
    for rank, (meta, tensors) in sorted(snapshots.items()):
        descs = meta.get("tensors", [])
        if len(descs) != len(tensors):
            raise ValueError(f"rank {rank}: meta describes {len(descs)} tensors, got {len(tensors)}")
        raw = json.dumps(meta, separators=(",", ":")).encode()
        items = [({"path": meta_key}, torch.frombuffer(bytearray(raw), dtype=torch.uint8))]
        for d, t in zip(descs, tensors):
            if d["path"] == meta_key:
                raise ValueError(f"rank {rank}: tensor path {meta_key!r} is reserved")
            items.append((d, t.detach().cpu().contiguous()))
        for d, t in items:
            entry: Dict[str, Any] = {"dtype": str(t.dtype).replace("torch.", ""),
                                     "shape": list(t.shape), "nbytes": t.numel() * t.element_size(),
                                     "checksum": checksum(t)}
            if d["path"] != meta_key:
                entry["path"] = d["path"]
            if is_sharded(d):
                off = tuple(int(o) for o in d["global_offset"])
                entry.update(key=dcp_key(d["path"]), chunk_offset=list(off),
                             global_shape=list(d["global_shape"]))
                same = (entry["key"], off)
            else:
                entry["key"] = f"rank{rank}/{d['path']}"
                same = ("", d["path"]) if d["path"] != meta_key else None
            prev = first.get(same) if same is not None else None
            if prev is not None and prev[2] == entry["checksum"] and prev[1].dtype == t.dtype \
                    and prev[1].shape == t.shape and torch.equal(prev[1], t):
                plan.append((str(rank), entry, prev[0]))  # stored once: an alias
                continue
            if same is not None and same[0] and prev is not None:
                raise ValueError(f"ranks disagree on chunk {same} of {entry['key']}")
            if same is not None and prev is None:
                first[same] = (len(plan), t, entry["checksum"])
            if is_sharded(d) and t.numel() == 0:
                plan.append((str(rank), entry, None))  # an empty shard: nothing to store
                continue
            key = (entry["key"], tuple(entry.get("chunk_offset", [0] * t.dim())))
            chunks.append((key[0], key[1], entry.get("global_shape", list(t.shape)), t))
            plan.append((str(rank), entry, key))
    return chunks, plan


def reshard(meta: Dict[str, Any], entries: List[Dict[str, Any]], everyone: List[Dict[str, Any]],
            plain: Iterator[torch.Tensor], rank: int, world_size: int,
            read: Callable[[Dict[str, Any]], torch.Tensor]) -> List[torch.Tensor]:
    """The tensors of ``meta`` (a saved rank's, index ``entries``) for ``rank`` of
    ``world_size``: unsharded ones from ``plain`` in order, shards cut from ``everyone``'s
    stored chunks (``read`` loads one).  Updates the shard descriptions in ``meta``."""
    tensors = []
    for d, e in zip(meta["tensors"], entries):
        if "global_shape" not in e:
            tensors.append(next(plain))
            continue
        offsets, shape = local_chunk(d, rank, world_size)
        t = assemble(offsets, shape, getattr(torch, e["dtype"]),
                     [x for x in everyone if x["key"] == e["key"]], read, e["key"])
        d.update(shape=shape, global_offset=offsets, nbytes=t.numel() * t.element_size(),
                 mesh_shape=[world_size])
        tensors.append(t)
    meta.update(rank=rank, world_size=world_size)
    return tensors


def dcp_metadata(ranks: Dict[str, Any], dtype: Callable[[str], torch.dtype],
                 storage_info: Callable[[str, int, int], Any]) -> Tuple[Any, List[Any], Dict[str, int]]:
    """DCP's ``Metadata``, the write results and ``{file: size}`` for the index entries of
    every rank (``finalize``): one chunk per (key, offset), aliases as keys of their own
    pointing at the same bytes, empty shards left out."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.storage import WriteResult

    sd_md, planner_data, results, files, done = {}, {}, [], {}, set()
    for r in sorted(ranks, key=int):
        for e in [ranks[r]["meta"], *ranks[r]["tensors"]]:
            size = torch.Size(e.get("global_shape", e["shape"]))
            off = torch.Size(e.get("chunk_offset", [0] * len(size)))
            if (e["key"], off) in done or e["file"] is None:
                continue  # a chunk another rank already stored (replicated) or an empty shard
            done.add((e["key"], off))
            tmd = sd_md.setdefault(e["key"], md.TensorStorageMetadata(
                properties=md.TensorProperties(dtype=dtype(e["dtype"])), size=size, chunks=[]))
            tmd.chunks.append(md.ChunkStorageMetadata(offsets=off, sizes=torch.Size(e["shape"])))
            planner_data[e["key"]] = (e["key"],)
            results.append(WriteResult(index=md.MetadataIndex(e["key"], off, 0),
                                       size_in_bytes=e["length"],
                                       storage_data=storage_info(e["file"], e["offset"], e["length"])))
            files[e["file"]] = max(files.get(e["file"], 0), e["offset"] + e["length"])
    return md.Metadata(state_dict_metadata=sd_md, planner_data=planner_data), results, files


def whole_tensors(snapshots: Dict[int, Tuple[Dict[str, Any], List[torch.Tensor]]]
                  ) -> List[torch.Tensor]:
    """The lowest rank's tensors of ``{rank: (meta, tensors)}`` with every DTensor shard
    replaced by its whole tensor, assembled from the shards of all ranks (replicated chunks
    are read once); unsharded tensors are the same objects.  ``ValueError`` if the ranks'
    shards do not cover a tensor."""
    pieces: Dict[str, List[Dict[str, Any]]] = {}
    for meta, tensors in snapshots.values():
        for d, t in zip(meta["tensors"], tensors):
            if is_sharded(d):
                pieces.setdefault(d["path"], []).append(
                    {"chunk_offset": list(d["global_offset"]), "shape": list(t.shape), "t": t})
    meta, tensors = snapshots[min(snapshots)]
    out = []
    for d, t in zip(meta["tensors"], tensors):
        if not is_sharded(d):
            out.append(t)
            continue
        shape = list(d["global_shape"])
        out.append(assemble([0] * len(shape), shape, t.dtype, pieces[d["path"]],
                            lambda e: e["t"], d["path"]))
    return out
