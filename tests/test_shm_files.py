"""Shared-memory files as ckptrun allocates them (``ckptrun.protocol.shm``): private, with
every page given its memory up front (never a sparse file that SIGBUSes mid-copy when
/dev/shm fills), and a file that does not fit refused at once and removed."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import uuid

import pytest

from ckptrun.protocol import create_shm_file
from ckptrun.worker.slotset import ENV_AHEAD, SlotSet

MiB = 1 << 20


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture
def shm_name():
    prefix = f"/dev/shm/ckptrun-test{uuid.uuid4().hex[:8]}-"
    yield prefix
    for name in os.listdir("/dev/shm"):
        if f"/dev/shm/{name}".startswith(prefix):
            os.unlink(f"/dev/shm/{name}")


def test_a_new_file_is_private_zeroed_and_every_page_allocated(shm_name):
    path = shm_name + "a"
    mm = create_shm_file(path, 32 * MiB + 4096)
    try:
        st = os.stat(path)
        assert st.st_size == len(mm) == 32 * MiB + 4096
        assert st.st_mode & 0o777 == 0o600
        assert allocated(path) >= st.st_size  # not sparse: tmpfs holds every page now
        assert mm[:4096] == bytes(4096) and mm[-4096:] == bytes(4096)
    finally:
        mm.close()


def test_a_slot_grown_in_place_has_its_new_pages_allocated(shm_name, monkeypatch):
    monkeypatch.setenv(ENV_AHEAD, "0")
    slots = SlotSet(shm_name + "r0-s", num_slots=3, keep=2)
    try:
        slots.ensure(0, 4 * MiB, meta_len=100, data_len=4 * MiB)
        grown = slots.ensure(0, 24 * MiB, meta_len=100, data_len=24 * MiB)
        path = shm_name + "r0-s0"
        assert len(grown) >= 24 * MiB and allocated(path) >= os.stat(path).st_size
    finally:
        slots.close()


def test_a_file_that_does_not_fit_is_refused_and_removed(tmp_path):
    """In a 4 MiB tmpfs (a mount namespace of its own): ENOSPC at creation, no file left."""
    from machines import UNSHARE, require_namespaces

    require_namespaces()
    code = (
        "import errno, os, sys\n"
        "from ckptrun.protocol import create_shm_file\n"
        f"p = {str(tmp_path / 'small' / 'f')!r}\n"
        "try:\n"
        "    create_shm_file(p, 16 << 20)\n"
        "except OSError as e:\n"
        "    print('errno', e.errno, 'left', os.path.exists(p))\n"
    )
    (tmp_path / "small").mkdir()
    r = subprocess.run(
        [UNSHARE, "-m", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size=4m tmpfs {tmp_path / "small"} && exec "$@"', "x",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["errno", str(errno.ENOSPC), "left", "False"], r.stdout
