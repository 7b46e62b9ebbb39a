"""Shared memory is private to the user: a file planted under a name ckptrun uses -- a
symlink, another user's file, one that others may read or write -- is refused, never opened
for a snapshot or a restore."""

from __future__ import annotations

import os

import pytest

from ckptrun.protocol import ControlBlock, ShmMaps, open_private, open_shm_file


@pytest.fixture
def shm(tmp_path):
    d = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    made = []

    def path(name: str) -> str:
        p = os.path.join(d, f"ckptrun-test-{os.getpid()}-{name}")
        made.append(p)
        return p

    yield path
    for p in made:
        if os.path.lexists(p):
            os.unlink(p)


def test_a_planted_symlink_is_not_followed(shm, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 512)
    link = shm("slot")
    os.symlink(victim, link)
    with pytest.raises(OSError):
        open_shm_file(link)
    with pytest.raises(OSError):
        ControlBlock(link)
    assert ShmMaps().get(link) is None
    assert victim.read_bytes() == b"precious" * 512


@pytest.mark.parametrize("mode", [0o666, 0o644, 0o660])
def test_a_file_others_can_read_or_write_is_refused(shm, mode):
    p = shm(f"open{mode:o}")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(p, mode)
    with pytest.raises(PermissionError, match="not a private file of this user"):
        open_shm_file(p)
    assert ShmMaps().get(p) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_private_file_is_refused(shm):
    p = shm("theirs")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(p, 0o600)
    os.chown(p, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match="owner 65534"):
        open_private(p, os.O_RDONLY)


def test_a_hard_link_to_a_private_file_is_refused(shm):
    p, alias = shm("mine"), shm("alias")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(p, 0o600)
    open_shm_file(p).close()  # our own private file: fine
    os.link(p, alias)
    with pytest.raises(PermissionError, match="links 2"):
        open_shm_file(alias)
