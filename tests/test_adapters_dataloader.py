"""A registered torchdata ``StatefulDataLoader`` resumes exactly, and so does every later
draw from the global RNG: the restored loop's new iterator must not draw from the RNG state
ckptrun has just restored (``ckptrun.adapters.dataloader``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import ckptrun

stateful = pytest.importorskip("torchdata.stateful_dataloader")

EPOCHS, BATCHES = 3, 5  # 20 samples in batches of 4


def make_loader(workers: int, sampler: str) -> stateful.StatefulDataLoader:
    """``shuffle``: torchdata's own sampler; ``set_epoch``: a ``DistributedSampler`` that the
    loop tells the epoch before iterating, as DDP scripts do."""
    data = TensorDataset(torch.arange(40, dtype=torch.float32).view(20, 2))
    dist_sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1) \
        if sampler == "set_epoch" else None
    return stateful.StatefulDataLoader(data, batch_size=4, shuffle=dist_sampler is None,
                                       sampler=dist_sampler, num_workers=workers,
                                       persistent_workers=workers > 0)


def train(ck: ckptrun.Checkpointer, loader, epoch: int, step: int, save_until: int) -> list:
    """The loop: per step its batch and a draw from torch's RNG (a dropout mask, say)."""
    seen = []
    while epoch < EPOCHS:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for (x,) in loader:
            step += 1
            seen.append((step, x.sum().item(), torch.rand(()).item()))
            if step <= save_until:
                ck.save(step, epoch=epoch)
        epoch += 1
    return seen


@pytest.mark.parametrize("sampler", ["shuffle", "set_epoch"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("at", [7, 10], ids=["mid-epoch", "epoch-end"])
def test_a_restored_loader_and_the_rng_continue_as_without_the_restore(workers, at, sampler):
    torch.manual_seed(0)
    loader = make_loader(workers, sampler)
    with ckptrun.Checkpointer({"data": loader}) as ck:
        # the failure-free run; snapshots stop at `at`, the run goes on to its end
        want = train(ck, loader, 0, 0, at)
        ck.wait()
        assert len(want) == EPOCHS * BATCHES
        torch.rand(5)  # the crashed timeline drew more; the restore must undo it all
        assert ck.restore() == at
        got = train(ck, loader, ck.get("epoch"), at, 0)
    assert got == want[at:]


class PackedStream(torch.utils.data.IterableDataset):
    """Pre-training data the way torchtitan reads it: an endless stream of documents of
    varying length, packed into fixed-length sequences through a token buffer; the position
    (documents read, tokens left over) is the dataset's own state, kept per loader worker."""

    def __init__(self, seq_len: int = 8) -> None:
        self.seq_len, self.sample_idx, self.buffer = seq_len, 0, []

    def document(self, i: int) -> list:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 1000, (int(torch.randint(3, 20, (), generator=g)),),
                             generator=g).tolist()

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        shard, shards = (info.id, info.num_workers) if info else (0, 1)
        while True:
            i = self.sample_idx * shards + shard
            self.sample_idx += 1
            self.buffer += self.document(i)
            while len(self.buffer) >= self.seq_len + 1:
                seq, self.buffer = self.buffer[:self.seq_len + 1], self.buffer[self.seq_len:]
                yield torch.tensor(seq)

    def state_dict(self) -> dict:
        return {"sample_idx": self.sample_idx, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.sample_idx, self.buffer = state["sample_idx"], list(state["buffer"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_token_stream_resumes_where_it_was(workers):
    torch.manual_seed(0)
    loader = stateful.StatefulDataLoader(PackedStream(), batch_size=4, num_workers=workers)

    def run(ck, step: int, until: int, save_until: int) -> list:
        seen = []
        for x in loader:
            step += 1
            seen.append((step, x.tolist(), torch.rand(()).item()))
            if step <= save_until:
                ck.save(step)
            if step == until:
                return seen
        raise AssertionError("the stream ended")

    with ckptrun.Checkpointer({"data": loader}) as ck:
        want = run(ck, 0, 20, 9)
        ck.wait()
        assert ck.restore() == 9
        got = run(ck, 9, 20, 0)
    assert got == want[9:]
