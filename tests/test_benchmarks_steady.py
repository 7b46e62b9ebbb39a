"""The steady-state benchmark's arithmetic (``benchmarks/steady_state.py``), without a launch:
the model is as large as asked, and the rows' ratios come from the slopes and block pairs."""

from __future__ import annotations

import pytest

from benchmarks.steady_state import LAYERS, SIZES, _rows, hidden_for


@pytest.mark.parametrize("size", list(SIZES))
def test_the_model_and_adamw_take_the_size_asked(size):
    h = hidden_for(SIZES[size])
    params = 32 * h + h + (LAYERS - 1) * (h * h + h) + h + 1  # recovery_job's MLP
    assert abs(12 * params - SIZES[size]) / SIZES[size] < 0.30  # the square layers dominate


def test_rows_take_the_ratio_from_slopes_and_from_block_pairs():
    samples = {
        "torchrun, no checkpointing": [{"step_s": 1.0, "fixed_s": 4.0, "pairs": [],
                                        "opt_ms": 1.0, "save_ms": 0.0}],
        "torchrun, copy+hash every step (the floor)": [{"step_s": 1.08, "fixed_s": 4.0,
                                                        "pairs": [], "opt_ms": 2.0,
                                                        "save_ms": 0.0}],
        "ckptrun, save() every step": [{"step_s": 1.1, "fixed_s": 5.0, "pairs": [],
                                        "opt_ms": 2.0, "save_ms": 1.0}],
        "ckptrun, save() on/off in blocks": [{"step_s": 1.05, "fixed_s": 5.0,
                                              "pairs": [0.02, 0.04, 0.03], "opt_ms": 2.0,
                                              "save_ms": 1.0}, {"error": "rc=1"}],
    }
    rows = {r["case"]: r for r in _rows("256M", 2364, 24, samples)}
    assert rows["torchrun, no checkpointing"]["ratio"] == 1.0
    assert rows["ckptrun, save() every step"]["ratio"] == pytest.approx(1.1)
    assert rows["ckptrun, save() every step"]["met"] == "no"
    assert rows["ckptrun, save() every step"]["vs_floor"] == pytest.approx(1.1 / 1.08)
    floor = rows["torchrun, copy+hash every step (the floor)"]
    assert floor["ratio"] == pytest.approx(1.08) and "met" not in floor
    blocks = rows["ckptrun, save() on/off in blocks"]
    assert blocks["ratio"] == pytest.approx(1 / 0.97) and blocks["met"] == "yes"
    assert blocks["reps"] == 1 and "1 run(s) failed" in blocks["note"]


def test_the_fixed_cost_is_split_into_its_phases():
    """launch → first step, the warm-up steps beyond the slope, last step → exit and the
    final persist, from one launch's step logs and events (clock: the launch's time.time())."""
    from benchmarks.jobrun import Outcome
    from benchmarks.steady_state import SKIP, _phases

    t0 = 1000.0
    steps = [{"event": "step", "time": t0 + 3.0 + i * 0.5 + (1.0 if i >= 1 else 0.0)}
             for i in range(SKIP + 4)]  # the second step took 1 s more (a first save)
    out = Outcome(0, 12.0, {(0, 0): steps}, [{"event": "persisted", "seconds": 0.7}], [],
                  False, "", started_at=t0)
    got = _phases(out, 0.5)
    assert got["first_s"] == pytest.approx(3.0)
    assert got["warmup_s"] == pytest.approx(1.0)
    assert got["end_s"] == pytest.approx(12.0 - (3.0 + (SKIP + 3) * 0.5 + 1.0))
    assert got["persist_s"] == pytest.approx(0.7)
    assert _phases(Outcome(0, 1.0, {}, [], [], False, ""), 0.5) == {}
