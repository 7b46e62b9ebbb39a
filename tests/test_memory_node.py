"""NodeMemory: steps, verification, the restore decision, safe reads, materialisation, cleanup."""

from __future__ import annotations

import glob
import os
import uuid

import pytest
import torch

from ckptrun import snapshot as S
from ckptrun.protocol import (
    ControlBlock,
    SlotHeader,
    SlotState,
    control_path,
    open_shm_file,
    set_slot_state,
)
from ckptrun.tiers.memory.node import NodeMemory, SlotChanged


@pytest.fixture
def mem():
    token = f"t{uuid.uuid4().hex[:10]}"
    m = NodeMemory(token, num_slots=3)
    yield m
    m.cleanup()
    assert not glob.glob(f"/dev/shm/ckptrun-{token}-*")


def snap(step: int, rank: int = 0, n: int = 1000):
    g = torch.Generator().manual_seed(step * 10 + rank)
    state = {"w": torch.randn(n, generator=g), "b": torch.randn(3, 3, generator=g).bfloat16(),
             "step": step}
    tree, items = S.flatten(state)
    meta = S.make_meta(step, rank, 2, tree, items, [0] * len(items))  # write_slot lays out
    return meta, [t for _, t in items]


def slot_mm(mem, rank, step):
    k = mem.steps(rank)[step]
    return open_shm_file(f"{mem.slot_prefix(rank)}{k}")


def test_steps_verify_and_common_step(mem):
    for s in (3, 4, 5):
        mem.write(0, *snap(s, 0), step=s)
    for s in (2, 3, 4):
        mem.write(1, *snap(s, 1), step=s)
    assert sorted(mem.steps(0)) == [3, 4, 5] and sorted(mem.steps(1)) == [2, 3, 4]
    assert mem.verify(0, 5) and mem.verify(1, 2) and not mem.verify(1, 5)
    assert mem.common_step([0, 1]) == 4
    assert mem.common_step([0]) == 5
    assert mem.common_step([]) is None
    assert len(mem.slot_paths(0)) == 3 and mem.total_bytes() > 6 * 4000


def test_flipped_byte_fails_verify_and_is_skipped(mem):
    for s in (3, 4):
        for r in (0, 1):
            mem.write(r, *snap(s, r), step=s)
    assert mem.common_step([0, 1]) == 4
    mm = slot_mm(mem, 1, 4)
    h = SlotHeader.unpack_from(mm)
    mm[h.data_offset + 1234] ^= 0x10  # one bit of one tensor of rank 1, step 4
    mm.close()
    assert not mem.verify(1, 4)
    assert mem.verify(0, 4) and mem.verify(1, 3)
    assert mem.common_step([0, 1]) == 3  # the corrupt copy is skipped, never used

    mm = slot_mm(mem, 0, 3)  # a corrupt meta is caught too
    mm[4096 + 5] ^= 1
    mm.close()
    assert not mem.verify(0, 3)
    assert mem.common_step([0, 1]) is None


def test_torn_write_is_ignored(mem):
    mem.write(0, *snap(1), step=1)
    mem.write(0, *snap(2), step=2)
    k = mem.steps(0)[2]
    mm = open_shm_file(f"{mem.slot_prefix(0)}{k}")
    h = SlotHeader.unpack_from(mm)
    set_slot_state(mm, SlotState.WRITING, 2, h.seq + 1)  # a worker died mid-copy
    mm.close()
    assert sorted(mem.steps(0)) == [1]
    assert mem.common_step([0]) == 1
    with pytest.raises(KeyError):
        mem.read(0, 2)


def test_discard_newer(mem):
    for s in (5, 6, 7):
        mem.write(0, *snap(s), step=s)
    mem.discard_newer([0], 5)
    assert sorted(mem.steps(0)) == [5]
    assert mem.common_step([0]) == 5


def test_read_copies_out_and_pins(mem):
    token_ctl = control_path(mem.job_token)
    block = ControlBlock(token_ctl, nranks=1, create=True)
    meta, tensors = snap(9)
    mem.write(0, meta, tensors, step=9)
    seen = []

    class Spy:
        def set(self, lr, name, value):
            seen.append((lr, name, value))
            block.set(lr, name, value)

    meta2, got = mem.read(0, 9, pin=(Spy(), 0))
    assert seen == [(0, "pin", mem.steps(0)[9]), (0, "pin", -1)]
    assert block.get(0, "pin") == -1
    assert meta2["step"] == 9 and [d["path"] for d in meta2["tensors"]] == ["w", "b"]
    for a, b in zip(tensors, got):
        assert torch.equal(a, b)
    assert S.unflatten(meta2["tree"], got)["step"] == 9
    # the copy is private: rewriting the slot does not change it
    mm = slot_mm(mem, 0, 9)
    h = SlotHeader.unpack_from(mm)
    mm[h.data_offset:h.data_offset + 64] = bytes(64)
    mm.close()
    assert torch.equal(got[0], tensors[0])
    block.close()


def test_read_detects_a_slot_rewritten_under_it(mem):
    mem.write(0, *snap(4), step=4)
    with pytest.raises(SlotChanged):
        with mem.pinned(0, 4) as (meta, views):
            assert meta["step"] == 4 and views[0].numel() == 1000
            mm = slot_mm(mem, 0, 4)
            h = SlotHeader.unpack_from(mm)
            set_slot_state(mm, SlotState.WRITING, 4, h.seq + 1)  # the worker started a write
            set_slot_state(mm, SlotState.COMMITTED, 4)
            mm.close()


def test_write_grows_a_small_slot_and_round_trips(mem):
    mem.write(0, *snap(1, n=10), step=1)
    meta, tensors = snap(2, n=200_000)
    for _ in range(2):
        mem.write(0, *snap(3, n=10), step=3)
    k = mem.write(0, meta, tensors, step=2)
    assert mem.steps(0)[2] == k and mem.verify(0, 2)
    m2, got = mem.read(0, 2)
    assert torch.equal(got[0], tensors[0]) and m2["rank"] == 0
    assert os.path.getsize(f"{mem.slot_prefix(0)}{k}") >= 800_000


def test_read_common_for_the_persister(mem):
    assert mem.read_common(0) is None and mem.ranks() == []
    for s in (3, 4):
        mem.write(0, *snap(s, 0), step=s)
        mem.write(1, *snap(s, 1), step=s)
    mem.write(0, *snap(5, 0), step=5)
    assert mem.ranks() == [0, 1]
    assert mem.read_common(5) is None  # cheap "nothing new" answer
    step, snaps = mem.read_common(2)
    assert step == 4 and sorted(snaps) == [0, 1]
    for r in (0, 1):
        meta, tensors = snaps[r]
        want = snap(4, r)[1]
        assert meta["step"] == 4 and all(torch.equal(a, b) for a, b in zip(want, tensors))


def test_holding_gives_verified_views_of_every_rank_without_copying(mem):
    """The final persist's reader: the slots themselves, checked against their checksums
    and pinned while held; a flipped byte is refused, never handed to the writer."""
    block = ControlBlock(control_path(mem.job_token), nranks=2, create=True)
    mem.attach_control(block, [0, 1])
    for s in (3, 4):
        for r in (0, 1):
            mem.write(r, *snap(s, r), step=s)
    with mem.holding([0, 1], 4) as snaps:
        assert sorted(snaps) == [0, 1]
        assert [block.get(lr, "pin") for lr in (0, 1)] == [mem.steps(r)[4] for r in (0, 1)]
        for r in (0, 1):
            meta, views = snaps[r]
            assert meta["step"] == 4
            assert all(torch.equal(a, b) for a, b in zip(snap(4, r)[1], views))
        mm = slot_mm(mem, 1, 4)  # the views are the slot's memory, not a copy
        h = SlotHeader.unpack_from(mm)
        before = views[0].clone()
        mm[h.data_offset] ^= 0xFF
        assert not torch.equal(before, views[0])
        mm[h.data_offset] ^= 0xFF
        mm.close()
    assert [block.get(lr, "pin") for lr in (0, 1)] == [-1, -1]
    with pytest.raises(KeyError):
        with mem.holding([0, 1], 9):
            pass
    mm = slot_mm(mem, 1, 4)
    h = SlotHeader.unpack_from(mm)
    mm[h.data_offset + 1234] ^= 0x10
    mm.close()
    with pytest.raises(SlotChanged):
        with mem.holding([0, 1], 4):
            pass
    block.close()


def test_meta_checksum_matches_the_slot(mem):
    from ckptrun.snapshot.slots import meta_checksum

    mem.write(0, *snap(7), step=7)
    meta, tensors = mem.read(0, 7)
    h = mem.headers(0)[mem.steps(0)[7]]
    assert meta_checksum(meta, tensors) == h.checksum
    tensors[0][3] += 1
    assert meta_checksum(meta, tensors) != h.checksum


def test_attached_control_pins_reads(mem):
    block = ControlBlock(control_path(mem.job_token), nranks=1, create=True)
    mem.attach_control(block, [5])
    mem.write(5, *snap(2, 5), step=2)
    pins = []
    real = block.set
    block.set = lambda lr, name, v: (pins.append((lr, name, v)), real(lr, name, v))
    mem.read(5, 2)
    assert pins == [(0, "pin", mem.steps(5)[2]), (0, "pin", -1)]
    block.close()


def test_hold_pins_the_slot_and_readers_take_turns(mem):
    """``hold`` (the replication rounds' copy) pins the slot like ``read`` (the persister's):
    the worker's slot choice skips it, and the two agent threads never hold the rank's one
    ``pin`` field at the same time (one would unpin the other's slot)."""
    import threading

    from ckptrun.worker.slotset import SlotSet

    block = ControlBlock(control_path(mem.job_token), nranks=1, create=True)
    mem.attach_control(block, [0])
    for s in (1, 2):
        mem.write(0, *snap(s), step=s)
    k = mem.steps(0)[1]
    with mem.hold(0, 1) as path:
        assert path == f"{mem.slot_prefix(0)}{k}" and block.get(0, "pin") == k
        mem.write(0, *snap(3), step=3)  # into the free slot; step 1 is now the oldest
        writer = SlotSet(mem.slot_prefix(0), 3, keep=2)
        assert writer.choose(block.get(0, "pin")) is None  # pinned: the save is skipped
        done = threading.Event()
        reader = threading.Thread(target=lambda: (mem.read(0, 2), done.set()))
        reader.start()
        assert not done.wait(0.3)  # the persister's read waits for the pin
        assert block.get(0, "pin") == k
    reader.join(5)
    assert done.is_set() and block.get(0, "pin") == -1
    with mem.hold(0, 1) as path:  # step 1 is still committed (the save was skipped)
        assert path is not None
    with mem.hold(0, 99) as path:
        assert path is None and block.get(0, "pin") == -1
    writer.close()
    block.close()
