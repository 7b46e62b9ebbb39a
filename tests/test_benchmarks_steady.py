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
