"""The durable tier: ``<url>/step-<N>/`` in ``torch.distributed.checkpoint`` (DCP) format.

Layout of one persisted step (any fsspec URL: plain path, ``file://``, ``s3://``, ``memory://``)::

    step-<N>/__<node>_<k>.distcp   tensors, written by DCP's own storage writer (torch.save per tensor)
    step-<N>/.metadata             DCP's global metadata, so plain ``dcp.load`` reads the step
    step-<N>/ckptrun.json          our JSON index, written LAST: a step without it does not exist

DCP keys are ``rank<r>/<path>`` for tensors plus ``rank<r>/__ckptrun_meta__`` (a uint8 tensor
holding the snapshot's JSON meta), so the checkpoint is tensors only.  Reading back never
unpickles anything: ``ckptrun.json`` gives the file, offset and length of every tensor, each
byte range goes through ``torch.load(..., weights_only=True)`` and its xxh3 checksum is verified.

Writing is split so parts can come from several machines: every node calls :func:`write_parts`
for its own ranks (files prefixed ``__<node>_``) and returns a JSON-able part description; one
process calls :func:`finalize` with all parts to write ``.metadata`` and ``ckptrun.json``.
:func:`write_step` does both for the single-node case.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import re
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

Snapshot = Tuple[Dict[str, Any], List[torch.Tensor]]
PartInfo = Dict[str, Any]  # JSON-able: {"node", "step", "ranks": {r: {...}}, "bytes", "seconds"}

INDEX_NAME = "ckptrun.json"
META_KEY = "__ckptrun_meta__"
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")


class StorageError(Exception):
    """A durable-storage problem, with a one-line message fit for the command line."""


# --------------------------------------------------------------------------- paths


def _fs(url: str):
    """``(filesystem, path)`` for ``url``; local paths become absolute."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(str(url))
    except (ValueError, ImportError) as e:  # unknown protocol or its package missing
        raise StorageError(f"unsupported storage URL {url}: {_one_line(e)}") from e
    if _is_local(fs):
        path = os.path.abspath(path)
    return fs, path.rstrip("/") or "/"


def _is_local(fs) -> bool:
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return proto in ("file", "local")


def _unstrip(fs, path: str) -> str:
    return path if _is_local(fs) else fs.unstrip_protocol(path)


def step_url(url: str, step: int) -> str:
    """URL of the DCP directory of ``step`` under the persist root ``url``."""
    return f"{str(url).rstrip('/')}/step-{int(step)}"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


# --------------------------------------------------------------------------- tensors


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise StorageError(f"unknown dtype {name!r}")
    return dt


def checksum(t: torch.Tensor) -> str:
    """xxh3-64 (``protocol.new_checksum``) of a contiguous CPU tensor's bytes, as hex."""
    from ckptrun.protocol import new_checksum

    h = new_checksum()
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _storage_info(relative_path: str, offset: int, length: int):
    """DCP's per-item storage record.

    DCP has no public constructor for it: ``.metadata`` must hold ``_StorageInfo`` objects for
    ``FileSystemReader`` to find each tensor, so this is the one place we touch a private name.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def _writer(fs, path: str, threads: int):
    """DCP storage writer for a step directory.

    Local paths use ``FileSystemWriter`` (real fsync).  ``FsspecWriter`` falls back to a
    machine-wide ``os.sync()`` on streams without ``fileno`` (S3...), so sync is off there:
    object stores are durable once the upload completes.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    if _is_local(fs):
        return FileSystemWriter(path, sync_files=True, thread_count=threads, overwrite=True)
    # torch 2.13 does not re-export FsspecWriter from the package; its module is the only home
    # (dcp.save/load pick the same class themselves for URL checkpoint ids).
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(_unstrip(fs, path), sync_files=False, thread_count=threads, overwrite=True)


def _planner_class():
    from torch.distributed.checkpoint import DefaultSavePlanner

    class ChecksumPlanner(DefaultSavePlanner):
        """Hashes each tensor right before DCP writes it (in the writer's own threads)."""

        checksums: Dict[str, str]

        def resolve_data(self, write_item):
            obj = super().resolve_data(write_item)
            if isinstance(obj, torch.Tensor):
                self.checksums[write_item.index.fqn] = checksum(obj.contiguous())
            return obj

    return ChecksumPlanner


# --------------------------------------------------------------------------- writing


def write_parts(
    url: str, step: int, snapshots: Dict[int, Snapshot], node: int = 0, threads: int = 1
) -> PartInfo:
    """Write one node's ranks of ``step`` into ``<url>/step-<step>/`` as DCP data files.

    ``snapshots`` maps global rank -> ``(meta, tensors)``.  Returns a JSON-able part description
    for :func:`finalize`.  The step stays invisible (no ``ckptrun.json``) until finalized.
    """
    t0 = time.monotonic()
    fs, root = _fs(url)
    sdir = posixpath.join(root, f"step-{int(step)}")
    state: Dict[str, torch.Tensor] = {}
    described: Dict[str, Dict[str, Any]] = {}
    for rank, (meta, tensors) in sorted(snapshots.items()):
        descs = meta.get("tensors", [])
        if len(descs) != len(tensors):
            raise StorageError(f"rank {rank}: meta describes {len(descs)} tensors, got {len(tensors)}")
        for d, t in zip(descs, tensors):
            if d["path"] == META_KEY:
                raise StorageError(f"rank {rank}: tensor path {META_KEY!r} is reserved")
            key = f"rank{rank}/{d['path']}"
            state[key] = t.detach().cpu().contiguous()
            described[key] = {"path": d["path"]}
        raw = json.dumps(meta, separators=(",", ":")).encode()
        state[f"rank{rank}/{META_KEY}"] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    # A rewrite of the same step must never look complete half-way through.
    try:
        fs.rm(posixpath.join(sdir, INDEX_NAME))
    except (FileNotFoundError, OSError):
        pass
    planner = _planner_class()()
    planner.checksums = {}
    writer = _writer(fs, sdir, max(1, threads))
    planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
    # use_collectives=False + rank=node gives this node's files their own "__<node>_" prefix.
    writer.set_up_storage_writer(True, rank=int(node), use_collectives=False)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(plan)
    results = writer.write_data(plan, planner).wait()
    ranks: Dict[str, Dict[str, Any]] = {str(r): {"meta": None, "tensors": []} for r in snapshots}
    by_key = {r.index.fqn: r for r in results}
    total = 0
    for key, t in state.items():
        res = by_key[key]
        info = res.storage_data
        entry = {"key": key, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                 "nbytes": t.numel() * t.element_size(), "file": info.relative_path,
                 "offset": int(info.offset), "length": int(info.length),
                 "checksum": planner.checksums[key]}
        total += entry["length"]
        rank_s, _, path = key.partition("/")
        slot = ranks[rank_s[len("rank"):]]
        if path == META_KEY:
            slot["meta"] = entry
        else:
            entry["path"] = described[key]["path"]
            slot["tensors"].append(entry)
    return {"node": int(node), "step": int(step), "ranks": ranks, "bytes": total,
            "seconds": time.monotonic() - t0}


def finalize(url: str, step: int, parts: Sequence[PartInfo], world_size: int) -> Dict[str, Any]:
    """Make ``step`` visible: write DCP's ``.metadata`` then ``ckptrun.json`` (last).

    ``parts`` are the :func:`write_parts` results of every node; together they must cover
    ranks ``0..world_size-1`` exactly once.  Returns the index written to ``ckptrun.json``.
    """
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    import ckptrun

    ranks: Dict[str, Any] = {}
    for part in parts:
        if int(part["step"]) != int(step):
            raise StorageError(f"part of node {part['node']} is for step {part['step']}, not {step}")
        for r, entry in part["ranks"].items():
            if r in ranks:
                raise StorageError(f"rank {r} of step {step} written by two nodes")
            ranks[r] = entry
    missing = sorted(set(range(world_size)) - {int(r) for r in ranks})
    if missing:
        raise StorageError(f"step {step}: no data for ranks {missing}")
    sd_md, planner_data, results, files = {}, {}, [], {}
    for r in sorted(ranks, key=int):
        for e in [ranks[r]["meta"], *ranks[r]["tensors"]]:
            size = torch.Size(e["shape"])
            zero = torch.Size([0] * len(size))
            sd_md[e["key"]] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_dtype(e["dtype"])), size=size,
                chunks=[ChunkStorageMetadata(offsets=zero, sizes=size)])
            planner_data[e["key"]] = (e["key"],)
            results.append(WriteResult(index=MetadataIndex(e["key"], zero, 0),
                                       size_in_bytes=e["length"],
                                       storage_data=_storage_info(e["file"], e["offset"], e["length"])))
            files[e["file"]] = max(files.get(e["file"], 0), e["offset"] + e["length"])
    fs, root = _fs(url)
    sdir = posixpath.join(root, f"step-{int(step)}")
    writer = _writer(fs, sdir, 1)
    writer.set_up_storage_writer(True)  # collective layout: one global ".metadata"
    writer.finish(Metadata(state_dict_metadata=sd_md, planner_data=planner_data), [results])
    index = {
        "format": FORMAT, "step": int(step), "world_size": int(world_size), "time": time.time(),
        "ckptrun_version": ckptrun.__version__, "torch_version": torch.__version__,
        "bytes": sum(files.values()), "nodes": len(parts),
        "write_seconds": max((float(p.get("seconds", 0.0)) for p in parts), default=0.0),
        "files": files, "ranks": ranks,
    }
    _put_atomic(fs, posixpath.join(sdir, INDEX_NAME), json.dumps(index).encode())
    return index


def write_step(url: str, step: int, snapshots: Dict[int, Snapshot], world_size: int,
               threads: int = 1) -> Dict[str, Any]:
    """Single-node persist of ``step``: all ranks of the job in ``snapshots``.

    Returns ``{"bytes": written, "seconds": elapsed, "url": step URL}``.
    """
    t0 = time.monotonic()
    part = write_parts(url, step, snapshots, node=0, threads=threads)
    index = finalize(url, step, [part], world_size)
    return {"bytes": index["bytes"], "seconds": time.monotonic() - t0, "url": step_url(url, step)}


def _put_atomic(fs, path: str, data: bytes) -> None:
    """Local: tmp + fsync + rename.  Object stores: a single PUT is already atomic."""
    if not _is_local(fs):
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself must survive a power loss
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- reading


def read_index(url: str, step: int) -> Optional[Dict[str, Any]]:
    """``ckptrun.json`` of ``step`` (``None`` when the step is missing or incomplete)."""
    fs, root = _fs(url)
    path = posixpath.join(root, f"step-{int(step)}", INDEX_NAME)
    try:
        index = json.loads(fs.cat_file(path))
    except (FileNotFoundError, ValueError):
        return None
    except OSError as e:
        raise StorageError(f"cannot read {path}: {_one_line(e)}") from e
    ok = isinstance(index, dict) and index.get("format") == FORMAT and index.get("step") == step
    return index if ok else None


def read_rank(url: str, step: int, rank: int, verify: bool = True) -> Snapshot:
    """One rank's ``(meta, tensors)`` of a persisted step, checksums verified."""
    index = read_index(url, step)
    if index is None:
        raise StorageError(f"step {step} is not a complete checkpoint in {url}")
    entry = index["ranks"].get(str(rank))
    if entry is None:
        raise StorageError(f"step {step} in {url} has no rank {rank} (world size {index['world_size']})")
    fs, root = _fs(url)
    loaded = _read_entries(fs, posixpath.join(root, f"step-{int(step)}"),
                           [entry["meta"], *entry["tensors"]], verify)
    meta = json.loads(bytes(loaded[0].numpy()))
    return meta, loaded[1:]


def _read_entries(fs, sdir: str, entries: List[Dict[str, Any]], verify: bool) -> List[torch.Tensor]:
    out: List[Optional[torch.Tensor]] = [None] * len(entries)
    by_file: Dict[str, List[int]] = {}
    for i, e in enumerate(entries):
        by_file.setdefault(e["file"], []).append(i)
    for name, idxs in by_file.items():
        idxs.sort(key=lambda i: entries[i]["offset"])  # sequential reads hit the read-ahead cache
        path = posixpath.join(sdir, name)
        try:
            with fs.open(path, "rb") as f:
                for i in idxs:
                    e = entries[i]
                    f.seek(e["offset"])
                    buf = f.read(e["length"])
                    if len(buf) != e["length"]:
                        raise StorageError(f"{path}: truncated at {e['key']}")
                    try:
                        t = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
                    except (RuntimeError, ValueError, EOFError) as err:  # torn or foreign bytes
                        raise StorageError(f"{path}: corrupt entry {e['key']}: {_one_line(err)}") from err
                    if (not isinstance(t, torch.Tensor) or list(t.shape) != e["shape"]
                            or t.dtype != _dtype(e["dtype"])):
                        raise StorageError(f"{path}: {e['key']} does not match the index")
                    if verify and checksum(t) != e["checksum"]:
                        raise StorageError(f"{path}: checksum mismatch for {e['key']}")
                    out[i] = t
        except OSError as e:
            raise StorageError(f"cannot read {path}: {_one_line(e)}") from e
    return out  # type: ignore[return-value]


def list_steps(url: str) -> List[Dict[str, Any]]:
    """Complete persisted steps, oldest first: ``{step, url, bytes, time, world_size}``."""
    fs, root = _fs(url)
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False, refresh=True)]
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StorageError(f"cannot list {url}: {_one_line(e)}") from e
    steps = []
    for name in names:
        m = _STEP_RE.match(name)
        if not m:
            continue
        index = read_index(url, int(m.group(1)))
        if index is not None:
            steps.append({"step": index["step"], "url": step_url(url, index["step"]),
                          "bytes": index["bytes"], "time": index["time"],
                          "world_size": index["world_size"]})
    return sorted(steps, key=lambda s: s["step"])


def _step_dirs(fs, root: str) -> List[int]:
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False, refresh=True)]
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, names) if m)


def newest_step(url: str) -> Optional[int]:
    """Newest complete persisted step under ``url``, or ``None``."""
    steps = list_steps(url)
    return steps[-1]["step"] if steps else None


def prune(url: str, keep: int) -> List[int]:
    """Delete all but the ``keep`` newest complete steps (``keep <= 0``: keep all).

    Incomplete step directories older than the newest complete step are debris of an
    interrupted persist and go too; newer ones may be in flight and stay.  Returns the
    removed step numbers.
    """
    fs, root = _fs(url)
    complete = [s["step"] for s in list_steps(url)]
    if not complete:
        return []
    doomed = set(complete[:-keep] if keep > 0 else [])
    doomed |= {s for s in _step_dirs(fs, root) if s < complete[-1] and s not in complete}
    for s in sorted(doomed):
        sdir = posixpath.join(root, f"step-{s}")
        try:
            fs.rm(posixpath.join(sdir, INDEX_NAME))  # invisible first, then gone
        except (FileNotFoundError, OSError):
            pass
        fs.rm(sdir, recursive=True)
    return sorted(doomed)


# --------------------------------------------------------------------------- checks


def check_writable(url: str, timeout: float = 30.0) -> None:
    """Raise :class:`StorageError` (one line) unless ``url`` accepts and deletes a probe file."""
    error: List[BaseException] = []

    def probe() -> None:
        try:
            fs, root = _fs(url)
            fs.makedirs(root, exist_ok=True)
            path = posixpath.join(root, f".ckptrun-probe-{uuid.uuid4().hex[:12]}")
            fs.pipe_file(path, b"ckptrun")
            fs.rm(path)
        except BaseException as e:  # noqa: B036 -- reported to the caller below
            error.append(e)

    t = threading.Thread(target=probe, name="ckptrun-storage-probe", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise StorageError(f"persist target {url} did not answer within {timeout:.0f}s")
    if error:
        e = error[0]
        msg = str(e) if isinstance(e, StorageError) else _one_line(e)
        raise StorageError(f"persist target {url} is not writable: {msg}")


def resolve(url: str) -> Tuple[str, int]:
    """``(root, step)`` for a persist root (newest step) or a ``.../step-<N>`` URL."""
    base = str(url).rstrip("/")
    m = _STEP_RE.match(posixpath.basename(base))
    if m and read_index(posixpath.dirname(base) or ".", int(m.group(1))) is not None:
        return posixpath.dirname(base), int(m.group(1))
    step = newest_step(base)
    if step is None:
        raise StorageError(f"{url} holds no complete ckptrun checkpoint")
    return base, step


def is_checkpoint(url: str) -> bool:
    """True if ``url`` is a complete step directory or a root holding one."""
    try:
        resolve(url)
    except StorageError:
        return False
    return True


def load_torch_state(url: str, step: int, rank: int) -> Dict[str, Any]:
    """A rank's state for export: nested via ``snapshot.unflatten`` when available.

    Falls back to a flat ``{path: tensor}`` dict (plus ``"__ckptrun_meta__"`` JSON text is
    left out: everything returned is loadable with ``weights_only=True``).
    """
    meta, tensors = read_rank(url, step, rank)
    return state_from_snapshot(meta, tensors)


def state_from_snapshot(meta: Dict[str, Any], tensors: List[torch.Tensor]) -> Dict[str, Any]:
    """Nested state (``ckptrun.snapshot.unflatten``) or, without it, ``{path: tensor}``."""
    try:
        from ckptrun.snapshot import unflatten
    except ImportError:
        unflatten = None
    if unflatten is not None:
        return unflatten(meta["tree"], tensors)
    return {d["path"]: t for d, t in zip(meta["tensors"], tensors)}
