"""One tensor out of a ``torch.save`` blob in a DCP data file, without unpickling it.

DCP writes each tensor as a ``torch.save`` zip archive: ``<name>/data.pkl`` (a pickle that
says how to rebuild the tensor) and ``<name>/data/0`` (its storage's raw bytes, stored
uncompressed).  The index (``ckptrun.json``) already says the tensor's shape and dtype, so the
pickle is never needed: the storage bytes are located from the zip's own headers and viewed
as that shape and dtype.  Nothing read from storage goes through an unpickler, not even
``torch.load(weights_only=True)``'s restricted one, and a crafted blob can at worst be
refused (its checksum is verified by the caller).
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from typing import List

import torch

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # zip local file header, 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


class BlobError(ValueError):
    """The bytes are not a ``torch.save`` archive of one tensor of the expected size."""


def tensor_from_blob(buf: bytearray, shape: List[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape``/``dtype`` whose storage is the one record ``*/data/<k>`` of the
    ``torch.save`` archive in ``buf``; it shares ``buf``'s memory (no copy) where aligned."""
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * size
    try:
        with zipfile.ZipFile(_View(buf)) as z:
            records = [i for i in z.infolist() if _is_storage(i.filename)]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise BlobError(f"not a torch.save archive ({e})") from e
    if not records:
        if nbytes == 0:  # an empty tensor may be saved without a storage record
            return torch.empty(shape, dtype=dtype)
        raise BlobError("the archive holds no tensor data")
    if len(records) != 1:
        raise BlobError(f"the archive holds {len(records)} storages, not one")
    info = records[0]
    if info.compress_type != zipfile.ZIP_STORED:
        raise BlobError("the tensor data is compressed (torch.save never does that)")
    if info.file_size < nbytes:
        raise BlobError(f"the tensor data is {info.file_size} bytes, {nbytes} expected")
    start = _data_start(buf, info)
    if start + nbytes > len(buf):
        raise BlobError("the tensor data runs past the end of the blob")
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start) if nbytes \
        else torch.empty(0, dtype=torch.uint8)
    if start % size:  # a view to a wider dtype needs an aligned offset: copy instead
        flat = flat.clone()
    return flat.view(dtype).reshape(shape)


class _View(io.RawIOBase):
    """A read-only file over ``buf`` (``io.BytesIO`` would copy a blob of a gigabyte)."""

    def __init__(self, buf: bytearray) -> None:
        self._mv, self._pos = memoryview(buf), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        chunk = self._mv[self._pos:self._pos + len(b)]
        b[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _is_storage(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 3 and parts[1] == "data" and parts[2].isdigit()


def _data_start(buf: bytearray, info: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes begin: after its local header, whose name and extra
    field lengths can differ from the central directory's."""
    at = info.header_offset
    if at < 0 or at + _LOCAL_HEADER.size > len(buf):
        raise BlobError("a zip header points outside the blob")
    fields = _LOCAL_HEADER.unpack_from(buf, at)
    if fields[0] != _LOCAL_MAGIC:
        raise BlobError("a zip local header is damaged")
    name_len, extra_len = fields[-2], fields[-1]
    return at + _LOCAL_HEADER.size + name_len + extra_len
