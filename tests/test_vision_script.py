"""A user's image-classification script (tests/scripts/vision_style.py: BatchNorm, dropout,
an EMA model, ``OneCycleLR``, a ``DistributedSampler`` told the epoch, a torchdata
``StatefulDataLoader`` whose workers augment from their own RNG) whose failure is one of its
*data-loader workers*: stopped, so rank 1 waits for its batch for ever while rank 0 waits in
the next all-reduce -- the hang is rank 1's (its stopped child), and rank 0 recovers in its
own process; or killed, so rank 1 raises on its next batch.  Both end bitwise equal to the
failure-free run.  Without ``ckptrun.adapters.dataloader`` the restored loop's new iterator
drew from the restored RNG and dropout ran one position off: the weights differed."""

from __future__ import annotations

import json
import os

import pytest
import torch
from adapter_util import assert_bitwise, ckptrun_job, of
from conftest import shared_weights

pytest.importorskip("torchdata")
pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "vision_style.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    def make(tmp) -> str:
        assert not of(ckptrun_job(str(tmp / "run"), SCRIPT, "--out", str(tmp / "out.pt")),
                      "restart")
        return str(tmp / "out.pt")
    return shared_weights(tmp_path_factory, "vision", make)


@pytest.mark.parametrize("failure,in_place", [("--stop-worker-at", True),
                                              ("--kill-worker-at", False)])
def test_a_data_worker_failure_recovers_bitwise(tmp_path, reference, failure, in_place):
    evts = ckptrun_job(str(tmp_path / "run"), SCRIPT, "--out", str(tmp_path / "out.pt"),
                       failure, "10", *(["--in-place"] if in_place else []),
                       launcher=["--hang-timeout", "3"])
    hangs = of(evts, "hang_detected")
    if failure == "--stop-worker-at":
        assert [(e["rank"], e["why"], e["child"]) for e in hangs] == \
            [(1, "child_stopped", "a fork of the rank: a data-loader worker, say")], hangs
    else:
        assert not hangs and [e["rank"] for e in of(evts, "worker_failed")] == [1], evts
    assert [r.get("in_place") for r in of(evts, "restart")] == [[0] if in_place else None]
    restored = of(evts, "restored")
    # a stopped worker: rank 1 trains on with the batches already fetched (2 per worker)
    # until it needs one of the stopped worker's
    last = 16 if failure == "--stop-worker-at" else 10
    assert restored and restored[0]["tier"] == "memory" and 9 <= restored[0]["step"] <= last
    assert_bitwise(reference, torch.load(tmp_path / "out.pt", weights_only=True))


def test_a_loader_built_outside_the_function_recovers_in_place_bitwise(tmp_path, reference):
    """A ``StatefulDataLoader`` with persistent workers made once per process, outside
    ``@ckptrun.resilient`` (passed in, as docs/inplace.md allows for start-up worth keeping):
    rank 1 is killed mid-epoch; rank 0 recovers in its own process, ``restore()`` puts the
    loader it kept back to the restored step, and the run ends bitwise equal.  (torchdata
    starts the loader's workers again when its state is loaded -- that is how their RNG
    states go back -- so the workers themselves are new.)"""
    pids = tmp_path / "pids.jsonl"
    evts = ckptrun_job(str(tmp_path / "run"), SCRIPT, "--out", str(tmp_path / "out.pt"),
                       "--crash-at", "10", "--in-place", "--loader-outside",
                       "--pids", str(pids))
    assert [r.get("in_place") for r in of(evts, "restart")] == [[0]], evts
    seen = {d["attempt"]: d for d in map(json.loads, pids.read_text().splitlines())}
    assert sorted(seen) == ["0", "1"] and seen["0"]["pid"] == seen["1"]["pid"], seen
    assert_bitwise(reference, torch.load(tmp_path / "out.pt", weights_only=True))
