"""The durable tier: ``<url>/step-<N>/`` in ``torch.distributed.checkpoint`` (DCP) format.

A step directory (any fsspec URL) holds ``__<node>_<k>.distcp`` (tensors, written by DCP's own
storage writer), DCP's ``.metadata`` (so plain ``dcp.load`` reads it without ckptrun) and
``ckptrun.json``, our JSON index, written LAST: a step without it does not exist.  DCP keys
are ``rank<r>/<path>`` plus ``rank<r>/__ckptrun_meta__`` (uint8 tensor of the snapshot's JSON
meta): tensors only.  Reading back never unpickles: the index (checked field by field,
:mod:`.index`) gives each tensor's file, offset, length, shape and dtype; the tensor's bytes
are found inside its ``torch.save`` blob by the zip headers alone
(:mod:`ckptrun.torchcompat.save_format`) and their
xxh3 checksum is verified.  Writing is split for multi-node jobs: each node calls
:func:`write_parts` (its own ``__<node>_`` files, returns JSON-able :data:`PartInfo`), one
process calls :func:`finalize`; :func:`write_step` does both on a single node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# DCP (and with it DTensor, ~700 modules) is imported where a step is written, not here: an
# agent starts without it, and torch's rendezvous walks every loaded module at each event
from ckptrun.protocol.untrusted import UntrustedFile, open_regular, read_regular
from ckptrun.tiers.durable.index import FORMAT, IndexProblem, check_index
from ckptrun.torchcompat import dcp as dcp_internals
from ckptrun.torchcompat.save_format import BlobError, tensor_from_blob

Snapshot = Tuple[Dict[str, Any], List[torch.Tensor]]
PartInfo = Dict[str, Any]  # JSON-able: {"node", "step", "ranks": {r: {...}}, "bytes", "seconds"}

log = logging.getLogger(__name__)

INDEX_NAME = "ckptrun.json"
INDEX_MAX_BYTES = 256 << 20  # ~1M tensor entries; a larger "index" is not one ckptrun wrote
META_KEY = "__ckptrun_meta__"
_STEP_RE = re.compile(r"^step-(\d+)$")


class StorageError(Exception):
    """A durable-storage problem, with a one-line message fit for the command line."""


def warm_up() -> None:
    """Import what writing a step needs (DCP), ahead of the first persist: imported then, it
    cost that persist a second or two under load, and the steps it was to catch went by."""
    from torch.distributed.checkpoint import FileSystemWriter  # noqa: F401

    from ckptrun.snapshot import shards  # noqa: F401


def _fs(url: str):
    """``(filesystem, path)`` for ``url``; local paths become absolute."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(str(url))
    except (ValueError, ImportError) as e:  # unknown protocol or its package missing
        raise StorageError(f"unsupported storage URL {url}: {_one_line(e)}") from e
    path = os.path.abspath(path) if _is_local(fs) else path
    return fs, path.rstrip("/") or "/"


def _is_local(fs) -> bool:
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return proto in ("file", "local")


def step_url(url: str, step: int) -> str:
    """URL of the DCP directory of ``step`` under the persist root ``url``."""
    return f"{str(url).rstrip('/')}/step-{int(step)}"


def _step_dir(url: str, step: Optional[int]):
    """``(fs, directory)``: ``url/step-<step>``, or ``url`` itself when ``step`` is None."""
    fs, root = _fs(url)
    return fs, root if step is None else posixpath.join(root, f"step-{int(step)}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


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


def _writer(fs, path: str, threads: int):
    """DCP writer: local ``FileSystemWriter`` (real fsync) or ``FsspecWriter`` without sync
    (it would fall back to a machine-wide ``os.sync()``; an object store is durable on upload)."""
    from torch.distributed.checkpoint import FileSystemWriter

    dcp_internals.quiet_typed_storage_warning()
    if _is_local(fs):
        return FileSystemWriter(path, sync_files=True, thread_count=threads, overwrite=True)
    return dcp_internals.fsspec_writer_class()(fs.unstrip_protocol(path), sync_files=False, thread_count=threads, overwrite=True)


def write_parts(url: str, step: int, snapshots: Dict[int, Snapshot], node: int = 0,
                threads: int = 1, standalone: bool = False) -> PartInfo:
    """Write one node's ranks (``{rank: (meta, tensors)}``) of ``step`` as DCP data files into
    ``<url>/step-<step>/`` (``standalone``: into ``url`` itself, for exports).  Returns the
    JSON-able part for :func:`finalize`; the step stays invisible until finalized.

    Byte-identical tensors of ranks written here are stored once (:func:`shards.plan_chunks`)."""
    from ckptrun.snapshot import shards

    t0 = time.monotonic()
    fs, sdir = _step_dir(url, None if standalone else step)
    try:  # DTensor shards go under one global key at their offsets
        chunks, plan = shards.plan_chunks(snapshots, checksum, META_KEY)
    except ValueError as e:
        raise StorageError(str(e)) from e
    _rm_quiet(fs, posixpath.join(sdir, INDEX_NAME))  # a rewrite never looks complete midway
    # nor to plain DCP (and DCP's writer warns of every directory it finds a .metadata in)
    _rm_quiet(fs, posixpath.join(sdir, ".metadata"))
    planner, writer = shards.ChunkPlanner(chunks), _writer(fs, sdir, max(1, threads))
    planner.set_up_planner(None, storage_meta=None, is_coordinator=True)
    # this node's files get their own "__<node>_" prefix, without collectives
    writer.set_up_storage_writer(True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    dcp_plan = planner.finish_plan(dcp_internals.node_plan(writer, local, int(node)))
    # xxh3 guards the bytes; torch.save's CRC32 pass is redundant (1.5x slower; load skips it).
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        results = writer.write_data(dcp_plan, planner).wait()
    finally:
        torch.serialization.set_crc32_options(crc)
    by_key = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for r in results}
    ranks: Dict[str, Dict[str, Any]] = {str(r): {"meta": None, "tensors": []} for r in snapshots}
    total = 0
    for rank_s, entry, where in plan:
        if isinstance(where, int):  # alias of an earlier entry: same bytes
            src = plan[where][1]
            entry.update({k: src[k] for k in ("file", "offset", "length")}, alias=src["key"])
        elif where is None:
            entry.update(file=None, offset=0, length=0)
        else:
            info = by_key[where]
            entry.update(file=info.relative_path, offset=int(info.offset), length=int(info.length))
            total += entry["length"]
        path = entry["key"].partition("/")[2] if not entry.get("global_shape") else None
        if path == META_KEY:
            ranks[rank_s]["meta"] = entry
        else:
            ranks[rank_s]["tensors"].append(entry)
    return {"node": int(node), "step": int(step), "ranks": ranks, "bytes": total,
            "seconds": time.monotonic() - t0}


def finalize(url: str, step: int, parts: Sequence[PartInfo], world_size: int,
             standalone: bool = False) -> Dict[str, Any]:
    """Make ``step`` visible: DCP's ``.metadata``, then ``ckptrun.json`` (returned) last.
    ``parts`` (every node's :func:`write_parts`) must cover ranks ``0..world_size-1`` once."""
    import ckptrun
    from ckptrun.snapshot import shards

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
    metadata, results, files = shards.dcp_metadata(ranks, _dtype, dcp_internals.storage_info)
    fs, sdir = _step_dir(url, None if standalone else step)
    writer = _writer(fs, sdir, 1)
    writer.set_up_storage_writer(True)  # collective layout: one global ".metadata"
    writer.finish(metadata, [results])
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
               threads: int = 1, standalone: bool = False) -> Dict[str, Any]:
    """Single-node persist of all ranks of ``step``; returns ``{bytes, seconds, url}``."""
    t0 = time.monotonic()
    part = write_parts(url, step, snapshots, node=0, threads=threads, standalone=standalone)
    index = finalize(url, step, [part], world_size, standalone=standalone)
    return {"bytes": index["bytes"], "seconds": time.monotonic() - t0,
            "url": str(url) if standalone else step_url(url, step)}


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


def _rm_quiet(fs, path: str) -> None:
    with contextlib.suppress(OSError):  # FileNotFoundError included
        fs.rm(path)


def read_index(url: str, step: Optional[int]) -> Optional[Dict[str, Any]]:
    """``ckptrun.json`` of ``step``, ``None`` if there is none (``step=None``: ``url`` is the
    step directory itself, any step accepted).  One that is there but malformed -- not JSON,
    a field of the wrong type or out of bounds, a data file outside the directory -- raises
    :class:`StorageError` saying what is wrong: such a step is damaged, not absent."""
    if absent_locally(url):
        return None
    fs, sdir = _step_dir(url, step)
    path = posixpath.join(sdir, INDEX_NAME)
    try:
        raw = _read_small(fs, path, INDEX_MAX_BYTES)
    except FileNotFoundError:
        return None
    except UntrustedFile as e:
        raise StorageError(str(e)) from e
    except OSError as e:
        raise StorageError(f"cannot read {path}: {_one_line(e)}") from e
    try:
        return check_index(json.loads(raw), step)
    except (ValueError, RecursionError) as e:  # IndexProblem, JSONDecodeError, deep nesting
        what = str(e) if isinstance(e, IndexProblem) else f"not JSON ({_one_line(e)})"
        raise StorageError(f"{path} is malformed: {what}") from e


def _read_small(fs, path: str, max_bytes: int) -> bytes:
    """A file of at most ``max_bytes`` that someone else may have planted: locally a regular
    file opened without following a symlink or blocking on a FIFO
    (:mod:`ckptrun.protocol.untrusted`); elsewhere a file by the store's own listing."""
    if _is_local(fs):
        return read_regular(path, max_bytes)
    info = fs.info(path)  # FileNotFoundError where there is none
    if info.get("type") != "file":
        raise UntrustedFile(f"{path} is not a file")
    if int(info.get("size") or 0) > max_bytes:
        raise UntrustedFile(f"{path} is {info.get('size')} bytes, more than {max_bytes}")
    return fs.cat_file(path)


def _open_data(fs, path: str):
    """``(file, size)`` of a step's data file, opened as :func:`_read_small` opens."""
    if _is_local(fs):
        fd, size = open_regular(path)
        return os.fdopen(fd, "rb"), size
    info = fs.info(path)
    if info.get("type") != "file":
        raise UntrustedFile(f"{path} is not a file")
    return fs.open(path, "rb"), int(info.get("size") or 0)


def read_rank(url: str, step: Optional[int], rank: int, verify: bool = True,
              world_size: Optional[int] = None) -> Snapshot:
    """One rank's ``(meta, tensors)``, checksums verified (``step=None``: ``url`` is the step dir).
    Another ``world_size`` than the saved one reshards DTensor shards (:mod:`ckptrun.snapshot.shards`);
    the rest (RNG, plain data) comes from saved rank ``rank % saved world size``."""
    index = read_index(url, step)
    if index is None:
        raise StorageError(f"step {step} is not a complete checkpoint in {url}")
    saved = int(index["world_size"])
    reshard = world_size is not None and int(world_size) != saved
    src = rank % saved if reshard else rank
    entry = index["ranks"].get(str(src))
    if entry is None:
        raise StorageError(f"step {step} in {url} has no rank {rank} (world size {saved})")
    fs, sdir = _step_dir(url, step)
    plain = [e for e in entry["tensors"] if not (reshard and "global_shape" in e)]
    loaded = iter(_read_entries(fs, sdir, [entry["meta"], *plain], verify))
    meta = _meta(bytes(next(loaded).numpy()), len(entry["tensors"]), f"{sdir} rank {src}")
    if not reshard:
        tensors = list(loaded)
        _check_tree(meta, tensors, f"{sdir} rank {src}")
        return meta, tensors
    from ckptrun.snapshot import shards

    everyone = [e for r in index["ranks"].values() for e in r["tensors"] if "global_shape" in e]
    try:
        return meta, shards.reshard(meta, entry["tensors"], everyone, loaded, rank, int(world_size),
                                    lambda x: _read_entries(fs, sdir, [x], verify)[0])
    except ValueError as err:
        raise StorageError(str(err)) from err


def _meta(raw: bytes, count: int, where: str) -> Dict[str, Any]:
    """A rank's snapshot meta (JSON) from storage, its shape checked before anyone walks it."""
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise StorageError(f"{where}: the snapshot meta is not JSON ({_one_line(e)})") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), list) \
            or len(meta["tensors"]) != count \
            or not all(isinstance(d, dict) and isinstance(d.get("path"), str) for d in meta["tensors"]):
        raise StorageError(f"{where}: the snapshot meta does not describe its {count} tensors")
    return meta


def _check_tree(meta: Dict[str, Any], tensors: List[torch.Tensor], where: str) -> None:
    """Rebuild the state once here: a skeleton that does not fit its tensors fails now, with
    one line, rather than in the worker's ``restore()``."""
    from ckptrun.snapshot import unflatten

    try:
        unflatten(meta.get("tree"), tensors)
    except Exception as e:  # noqa: BLE001 -- any way a crafted skeleton breaks is "malformed"
        raise StorageError(f"{where}: the snapshot skeleton is malformed ({_one_line(e)})") from e


def _read_entries(fs, sdir: str, entries: List[Dict[str, Any]], verify: bool) -> List[torch.Tensor]:
    out: List[Optional[torch.Tensor]] = [None] * len(entries)
    by_file: Dict[str, List[int]] = {}
    for i, e in enumerate(entries):
        if e["file"] is None:  # an empty shard: nothing was stored
            out[i] = torch.empty(e["shape"], dtype=_dtype(e["dtype"]))
            continue
        by_file.setdefault(e["file"], []).append(i)
    for name, idxs in by_file.items():
        idxs.sort(key=lambda i: entries[i]["offset"])  # sequential reads hit the read-ahead cache
        path = posixpath.join(sdir, name)  # a checked DCP file name: stays inside sdir
        try:
            f, size = _open_data(fs, path)
            with f:
                for i in idxs:
                    e = entries[i]
                    if e["offset"] + e["length"] > size:  # before allocating what it claims
                        raise StorageError(f"{path}: truncated at {e['key']}")
                    f.seek(e["offset"])
                    buf = _read_exactly(f, e["length"])
                    if buf is None:
                        raise StorageError(f"{path}: truncated at {e['key']}")
                    try:
                        t = tensor_from_blob(buf, e["shape"], _dtype(e["dtype"]))
                    except BlobError as err:  # torn or foreign bytes
                        raise StorageError(f"{path}: corrupt entry {e['key']}: {err}") from err
                    if verify and checksum(t) != e["checksum"]:
                        raise StorageError(f"{path}: checksum mismatch for {e['key']}")
                    out[i] = t
        except UntrustedFile as e:
            raise StorageError(str(e)) from e
        except OSError as e:
            raise StorageError(f"cannot read {path}: {_one_line(e)}") from e
    return out  # type: ignore[return-value]


def _read_exactly(f, n: int) -> Optional[bytearray]:
    """``n`` bytes from ``f`` into a fresh buffer (the tensor will live in it), or None if the
    file ends first."""
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            return None
        got += k
    return buf


def list_steps(url: str) -> List[Dict[str, Any]]:
    """Complete persisted steps, oldest first: ``{step, url, bytes, time, world_size}``."""
    steps = []
    for s in _step_dirs(url):
        try:
            index = read_index(url, s)
        except StorageError as e:  # a damaged step is skipped: the older ones may do
            log.warning("durable step %s skipped: %s", s, e)
            continue
        if index is not None:
            steps.append({"step": index["step"], "url": step_url(url, index["step"]),
                          "bytes": index["bytes"], "time": index["time"],
                          "world_size": index["world_size"]})
    return sorted(steps, key=lambda s: s["step"])


def absent_locally(url: str) -> bool:
    """``url`` is a plain local path that does not exist (a new job's checkpoint directory):
    nothing to list, and no reason to import fsspec (~0.16 s of every start-up) to see it."""
    return "://" not in str(url) and not os.path.exists(str(url))


def _step_dirs(url: str) -> List[int]:
    if absent_locally(url):
        return []
    fs, root = _fs(url)  # all step-<N> directories, complete or not
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False, refresh=True)]
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StorageError(f"cannot list {url}: {_one_line(e)}") from e
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, names) if m)


def newest_step(url: str) -> Optional[int]:
    """Newest complete persisted step under ``url``, or ``None``."""
    return max((s["step"] for s in list_steps(url)), default=None)


def prune(url: str, keep: int) -> List[int]:
    """Delete all but the ``keep`` newest complete steps (``keep <= 0``: keep all); returns them.
    Incomplete step dirs older than the newest complete one are debris of an interrupted
    persist and go too; newer ones may be in flight and stay."""
    fs, root = _fs(url)
    complete = [s["step"] for s in list_steps(url)]
    if not complete:
        return []
    doomed = set(complete[:-keep] if keep > 0 else [])
    doomed |= {s for s in _step_dirs(url) if s < complete[-1] and s not in complete}
    for s in sorted(doomed):
        sdir = posixpath.join(root, f"step-{s}")
        _rm_quiet(fs, posixpath.join(sdir, INDEX_NAME))  # invisible first, then gone
        fs.rm(sdir, recursive=True)
    return sorted(doomed)


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
    t.join(timeout)  # an unreachable endpoint may retry for minutes: don't wait for it
    if t.is_alive():
        raise StorageError(f"persist target {url} did not answer within {timeout:.0f}s")
    if error:
        msg = str(error[0]) if isinstance(error[0], StorageError) else _one_line(error[0])
        raise StorageError(f"persist target {url} is not writable: {msg}")


def resolve(url: str) -> Tuple[str, int]:
    """``(step dir URL, step)`` for a step dir/export or a persist root (its newest step);
    read it with ``read_rank(dir_url, None, rank)``."""
    base = str(url).rstrip("/")
    index = read_index(base, None)
    if index is not None:
        return base, int(index["step"])
    step = newest_step(base)
    if step is None:
        raise StorageError(f"{url} holds no complete ckptrun checkpoint")
    return step_url(base, step), step


def is_checkpoint(url: str) -> bool:
    """True if ``url`` is a complete step directory or a root holding one."""
    with contextlib.suppress(StorageError):
        return bool(resolve(url))
    return False


def load_torch_state(url: str, step: Optional[int], rank: int) -> Any:
    """A rank's nested state (``snapshot.unflatten``); may hold numpy/plain data (RNG states)."""
    from ckptrun.snapshot import unflatten

    meta, tensors = read_rank(url, step, rank)
    return unflatten(meta["tree"], tensors)
