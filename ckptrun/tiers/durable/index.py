"""``ckptrun.json`` checked before anything uses it.

A checkpoint directory may have been written by someone else, truncated, or crafted.  Every
field the reader uses is type-checked and bounded here, and every data file it names must be
a plain DCP file name inside the step directory, so that a bad index ends in one
:class:`IndexProblem` line -- never a traceback, a read outside the checkpoint, or a
gigabyte allocated because a length said so.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional

import torch

FORMAT = 1
MAX_WORLD = 1 << 20  # ranks
MAX_DIMS = 64
MAX_BYTES = 1 << 44  # 16 TiB: any one claimed size above this is not a real checkpoint
# DCP's own file names (``__<rank>_<k>.distcp``): no separator, no "..", nothing absolute
DATA_FILE = re.compile(r"^__\d{1,7}_\d{1,7}\.distcp$")
CHECKSUM = re.compile(r"^[0-9a-f]{1,64}$")


class IndexProblem(ValueError):
    """What is wrong with an index, as one line."""


def check_index(index: Any, step: Optional[int]) -> Dict[str, Any]:
    """``index`` itself when every field is well-formed (``step``: the step it must be for,
    None for any); raises :class:`IndexProblem` naming the first field that is not."""
    if not isinstance(index, dict):
        raise IndexProblem("the index is not a JSON object")
    if index.get("format") != FORMAT:
        raise IndexProblem(f"unknown index format {index.get('format')!r} (expected {FORMAT})")
    at = _int(index, "step", 0, 1 << 62)
    if step is not None and at != step:
        raise IndexProblem(f"the index is for step {at}, not {step}")
    world = _int(index, "world_size", 1, MAX_WORLD)
    _int(index, "bytes", 0, MAX_BYTES)
    if not isinstance(index.get("time"), (int, float)) or isinstance(index.get("time"), bool):
        raise IndexProblem("field 'time' is not a number")
    files = index.get("files")
    if not isinstance(files, dict):
        raise IndexProblem("field 'files' is not an object")
    for name, size in files.items():
        if not DATA_FILE.match(name):
            raise IndexProblem(f"data file name {name[:80]!r} is not a DCP file name")
        if not _is_int(size) or not 0 <= size <= MAX_BYTES:
            raise IndexProblem(f"size of {name} is not a byte count")
    ranks = index.get("ranks")
    if not isinstance(ranks, dict) or set(ranks) != {str(r) for r in range(world)}:
        raise IndexProblem(f"field 'ranks' does not hold exactly ranks 0..{world - 1}")
    for r, entry in ranks.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("tensors"), list):
            raise IndexProblem(f"rank {r}: no list of tensors")
        meta = entry.get("meta")
        _entry(meta, files, f"rank {r} meta")
        if meta["dtype"] != "uint8" or len(meta["shape"]) != 1 or meta["file"] is None:
            raise IndexProblem(f"rank {r}: the meta entry is not a byte string")
        for i, e in enumerate(entry["tensors"]):
            _entry(e, files, f"rank {r} tensor {i}")
    return index


def _entry(e: Any, files: Dict[str, int], where: str) -> None:
    if not isinstance(e, dict):
        raise IndexProblem(f"{where}: not an object")
    if not isinstance(e.get("key"), str):
        raise IndexProblem(f"{where}: no key")
    if not isinstance(e.get("dtype"), str) or not isinstance(
            getattr(torch, e["dtype"], None), torch.dtype):
        raise IndexProblem(f"{where}: unknown dtype {str(e.get('dtype'))[:40]!r}")
    shape = e.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS \
            or not all(_is_int(n) and 0 <= n <= MAX_BYTES for n in shape):
        raise IndexProblem(f"{where}: shape is not a list of sizes")
    for field in ("global_shape", "chunk_offset"):
        if field in e and (not isinstance(e[field], list) or len(e[field]) != len(shape)
                           or not all(_is_int(n) and 0 <= n <= MAX_BYTES for n in e[field])):
            raise IndexProblem(f"{where}: {field} does not match the shape")
    if not isinstance(e.get("checksum"), str) or not CHECKSUM.match(e["checksum"]):
        raise IndexProblem(f"{where}: checksum is not a hex digest")
    nbytes = math.prod(shape) * torch.empty((), dtype=getattr(torch, e["dtype"])).element_size()
    name = e.get("file")
    if name is None:
        if nbytes:
            raise IndexProblem(f"{where}: {nbytes} bytes with no data file")
        return
    if name not in files:
        raise IndexProblem(f"{where}: data file {str(name)[:80]!r} is not one of the step's files")
    offset, length = _int(e, "offset", 0, MAX_BYTES, where), _int(e, "length", 0, MAX_BYTES, where)
    if length < nbytes:
        raise IndexProblem(f"{where}: {length} bytes cannot hold a tensor of {nbytes}")
    if offset + length > files[name]:
        raise IndexProblem(f"{where}: bytes {offset}..{offset + length} lie past the end of {name}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: Dict[str, Any], field: str, lo: int, hi: int, where: str = "") -> int:
    v = d.get(field)
    if not _is_int(v) or not lo <= v <= hi:
        raise IndexProblem(f"{where + ': ' if where else ''}field {field!r} is not an integer in {lo}..{hi}")
    return v
