"""Attacks on the durable reader: a checkpoint directory someone else wrote or damaged.

Every index below is the attack: a traversal out of the step directory, fields of the wrong
type or out of bounds, JSON nested 100k deep, a blob that carries a pickle payload.  Each must
end in one StorageError line (exit 2 on the command line), never a traceback, never a byte
read from outside the checkpoint, never code run."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch
from test_storage_format import snapshots

from ckptrun.tiers.durable import storage
from ckptrun.tiers.durable.storage import StorageError

STEP = 7


def checkpoint(tmp_path) -> str:
    url = str(tmp_path / "ck")
    storage.write_step(url, STEP, snapshots(STEP), world_size=2)
    return url


def index_file(url: str) -> str:
    return os.path.join(url, f"step-{STEP}", storage.INDEX_NAME)


def rewrite_index(url: str, change) -> None:
    path = index_file(url)
    with open(path) as f:
        index = json.load(f)
    change(index)
    with open(path, "w") as f:
        json.dump(index, f)


def first_tensor(index: dict) -> dict:
    return index["ranks"]["0"]["tensors"][0]


def _set(field, value, of=first_tensor):
    return lambda index: of(index).__setitem__(field, value)


CRAFTED = {
    "a data file outside the step (traversal)": _set("file", "../../../../../../etc/passwd"),
    "an absolute data file": _set("file", "/etc/passwd"),
    "a data file the index does not list": _set("file", "__9_9.distcp"),
    "a negative offset": _set("offset", -5),
    "a length beyond the file": _set("length", 1 << 40),
    "a string offset": _set("offset", "0"),
    "a boolean length": _set("length", True),
    "a shape of strings": _set("shape", ["8", "16"]),
    "a shape too large for its bytes": _set("shape", [1 << 20, 1 << 20]),
    "an unknown dtype": _set("dtype", "__import__"),
    "a checksum that is not hex": _set("checksum", "'; rm -rf /"),
    "a negative rank": lambda i: i["ranks"].__setitem__("-1", i["ranks"].pop("1")),
    "a missing rank": lambda i: i["ranks"].pop("1"),
    "a world size as text": lambda i: i.__setitem__("world_size", "2"),
    "a world size of a billion": lambda i: i.__setitem__("world_size", 10**9),
    "files as a list": lambda i: i.__setitem__("files", ["__0_0.distcp"]),
    "a tensor list that is a dict": lambda i: i["ranks"]["0"].__setitem__("tensors", {}),
    "a meta entry of floats": _set("dtype", "float32", of=lambda i: i["ranks"]["0"]["meta"]),
    "another format": lambda i: i.__setitem__("format", 99),
}


@pytest.mark.parametrize("what", sorted(CRAFTED))
def test_a_crafted_index_is_one_line_refusal(tmp_path, what):
    url = checkpoint(tmp_path)
    rewrite_index(url, CRAFTED[what])
    with pytest.raises(StorageError) as err:
        for rank in range(2):
            storage.read_rank(url, STEP, rank)
    assert "\n" not in str(err.value), err.value
    # a damaged step is skipped by listings (an older one may do), not a crash
    assert [s["step"] for s in storage.list_steps(url)] == []


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe not json", b"null"])
def test_an_index_that_is_not_an_object_is_refused(tmp_path, raw):
    url = checkpoint(tmp_path)
    with open(index_file(url), "wb") as f:
        f.write(raw)
    with pytest.raises(StorageError, match="malformed"):
        storage.read_index(url, STEP)


def test_a_traversal_cannot_read_a_valid_blob_outside_the_checkpoint(tmp_path):
    """The outside file holds exactly what the index expects (shape, dtype, checksum): the
    old reader loaded it.  The name alone is refused now."""
    url = checkpoint(tmp_path)
    outside = torch.full((8, 16), 7.0)
    buf = io.BytesIO()
    torch.save(outside, buf)
    (tmp_path / "outside.distcp").write_bytes(buf.getvalue())

    def point_outside(index):
        e = first_tensor(index)
        e.update(file="../../outside.distcp", offset=0, length=len(buf.getvalue()),
                 checksum=storage.checksum(outside))
        index["files"]["../../outside.distcp"] = len(buf.getvalue())
    rewrite_index(url, point_outside)
    with pytest.raises(StorageError, match="not a DCP file name"):
        storage.read_rank(url, STEP, 0)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['CKPTRUN_TEST_MARK']}",))


def test_a_blob_with_a_pickle_payload_is_never_unpickled(tmp_path, monkeypatch):
    """A data file rewritten so that its blob's ``data.pkl`` runs a command when unpickled,
    its tensor bytes left right: the restore reads the bytes, and the command never runs."""
    url = checkpoint(tmp_path)
    mark = tmp_path / "pwned"
    monkeypatch.setenv("CKPTRUN_TEST_MARK", str(mark))
    index = json.load(open(index_file(url)))
    e = first_tensor(index)
    path = os.path.join(url, f"step-{STEP}", e["file"])
    data = bytearray(open(path, "rb").read())
    blob = bytes(data[e["offset"]:e["offset"] + e["length"]])
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        names = z.namelist()
        storage_name = next(n for n in names if n.split("/")[1:2] == ["data"])
    tensor_bytes = snapshots(STEP)[0][1][0].numpy().tobytes()
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as z:
        z.writestr(names[0].split("/")[0] + "/data.pkl", pickle.dumps(_Payload()))
        z.writestr(storage_name, tensor_bytes)
    evil_bytes = evil.getvalue()
    with open(path, "ab") as f:  # appended: the index now points at the evil blob
        f.write(evil_bytes)
    e.update(offset=len(data), length=len(evil_bytes))
    index["files"][e["file"]] = len(data) + len(evil_bytes)
    with open(index_file(url), "w") as f:
        json.dump(index, f)
    meta, tensors = storage.read_rank(url, STEP, 0)
    assert torch.equal(tensors[0], snapshots(STEP)[0][1][0])
    assert not mark.exists(), "the pickle in the blob was run"


def test_the_restore_command_says_one_line_and_exits_2(tmp_path):
    url = checkpoint(tmp_path)
    rewrite_index(url, CRAFTED["a data file outside the step (traversal)"])
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "restore", "--from",
                           os.path.join(url, f"step-{STEP}"), "--to", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "malformed" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
