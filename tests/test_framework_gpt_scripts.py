"""Users' scripts, not ours: a char-level GPT trained with the HF Trainer and Lightning the
way people write them (tests/scripts/gpt_*.py: loader workers that persist and
prefetch, gradient accumulation, clipping, cosine warm-up schedules, evaluation during
training -- on the main process only, or every 10 steps with its own persistent workers), and
a Llama trained the way torchtitan's trainer does it (tests/scripts/titan_style.py: blocks
``torch.compile``d and sharded with FSDP2, a torchdata ``StatefulDataLoader`` with workers,
a train-state object), at 3 ranks.  Rank 1 is SIGKILLed and the final weights must be
bitwise equal to the failure-free run's, with every rank restarted or with the survivors in
their processes.

The failure points are the ones that broke exactness before (each case fails without its
fix): a restore at an evaluation's step and evaluations whose loader makes its iterator (a
draw from the global RNG) in one process and not in the other; a Lightning loader with
workers, whose iterator Lightning makes before the callback can skip the consumed batches or
set the resumed epoch; DDP's bucket layout behind Lightning's module wrapper (3 ranks sum
differently in another layout)."""

from __future__ import annotations

import os

import pytest
import torch
from adapter_util import assert_bitwise, ckptrun_job, of
from conftest import shared_weights

pytestmark = pytest.mark.slow

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
JOBS = {"transformers": ("gpt_hf_trainer.py", "transformers"),
        "lightning": ("gpt_lightning.py", "lightning"),
        "torchtitan-style": ("titan_style.py", "torchdata")}


def _job(tmp, name: str, *args: str) -> list:
    script, module = JOBS[name]
    pytest.importorskip(module)
    extra = ["--output-dir", str(tmp / "hf-out")] if name == "transformers" else []
    return ckptrun_job(str(tmp / "run"), os.path.join(HERE, script), "--out",
                       str(tmp / "out.pt"), *extra, *args, nproc=3)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """name -> the failure-free run's final weights (one run per framework)."""
    def make(name: str, tmp) -> str:
        assert not of(_job(tmp, name), "restart")
        return str(tmp / "out.pt")

    return lambda name: shared_weights(tmp_path_factory, f"gpt-{name}",
                                       lambda tmp: make(name, tmp))


@pytest.mark.parametrize("name,crash_at,in_place", [
    # restored at step 10 or 11: the resumed run's first evaluation is step 20's (the
    # snapshot of step 10 is taken before its evaluation), where its eval loader's persistent
    # workers make their iterator -- the failure-free run made it at step 10
    ("transformers", 11, False),
    ("transformers", 19, True),  # the first step of the second epoch
    ("lightning", 19, False),  # the first batch of the second epoch
    ("lightning", 21, True),  # mid second epoch, a validation after the restore
    # restored at 7-9, around the end of the loader's first epoch (8 batches a rank); the
    # survivors keep their compiled blocks
    ("torchtitan-style", 9, True),
], ids=lambda v: str(v))
def test_a_users_gpt_script_resumes_bitwise(tmp_path, references, name, crash_at, in_place):
    evts = _job(tmp_path, name, "--crash-at", str(crash_at), *(["--in-place"] if in_place else []))
    restarts = of(evts, "restart")
    assert [r.get("in_place") for r in restarts] == [[0, 2] if in_place else None], restarts
    restored = of(evts, "restored")
    assert restored and restored[0]["tier"] == "memory" \
        and crash_at - 2 <= restored[0]["step"] <= crash_at, restored
    want, got = dict(references(name)), torch.load(tmp_path / "out.pt", weights_only=True)
    if "frames" in got:  # frames torch.compile compiled in rank 0's last training call
        assert want.pop("frames") > 0 and got.pop("frames") == 0, "a survivor compiled again"
        assert want.pop("losses") == got.pop("losses")
    assert_bitwise(want, got)
