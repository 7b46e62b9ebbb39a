"""The global RNG states (python, numpy, torch CPU and CUDA) as snapshot state: captured on
every ``save()``, applied on restore (see :mod:`ckptrun.snapshot.tree`)."""

from __future__ import annotations

import random
from typing import Any, Dict, Optional

import numpy as np
import torch


def capture_rng() -> Dict[str, Any]:
    """The global RNG states: python, numpy, torch CPU and (when initialised) every CUDA device."""
    rng: Dict[str, Any] = {
        # 625 ints as a tensor rather than JSON: keeps the meta (built on every save) small.
        "python": _py_rng_state(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = list(torch.cuda.get_rng_state_all())
    return rng


def _py_rng_state() -> Dict[str, Any]:
    version, internal, gauss = random.getstate()
    # np.fromiter: a third of torch.tensor(tuple)'s time for these 625 ints
    state = torch.from_numpy(np.fromiter(internal, dtype=np.int64, count=len(internal)))
    return {"version": version, "state": state, "gauss": gauss}


def restore_rng(rng: Dict[str, Any]) -> None:
    """Set the global RNGs from :func:`capture_rng`'s result (after a round trip)."""
    if "python" in rng:
        v = rng["python"]
        random.setstate((v["version"], tuple(int(x) for x in v["state"].tolist()), v["gauss"]))
    if "numpy" in rng:
        np.random.set_state(tuple(rng["numpy"]))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"].clone())
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.clone() for s in states])


class DeferredRNG:
    """The global RNG states as a state item whose restore is applied later, at a moment the
    caller picks (framework adapters: after the framework seeded its own workers/loaders)."""

    def __init__(self) -> None:
        self.pending: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.pending = sd

    def apply(self) -> None:
        """Restore the states loaded last, once."""
        if self.pending is not None:
            restore_rng(self.pending)
            self.pending = None
