"""torchdata's ``StatefulDataLoader``: a restore must not draw from the restored RNG.

Creating a data-loader iterator draws from torch's global RNG (or the loader's
``generator``): the base seed of its workers (``torch.empty((), dtype=torch.int64)
.random_()``), in every loader, with or without workers.  An uninterrupted run draws it when
an epoch begins -- before every snapshot of that epoch, so each snapshot's RNG state is the
state *after* that draw.  A restored process creates the iterator once more after ``restore()`` (its ``for batch in
loader`` begins again), so it draws a second time from the RNG ckptrun has just restored:
dropout, noise and every later draw in the main process run one stream position off, and
the job is not exact any more (``ckptrun check`` reports ``rng`` differing at the first
step after the restore).  The loader's own state does not need the draw: it keeps the base
seed (and its sampler's generator) and puts them back itself.

So a registered ``StatefulDataLoader`` (or a subclass, such as torchtitan's) is snapshotted
through :class:`RngNeutralLoader`, whose ``load_state_dict`` arranges for the loader's next
iterator -- created when the loop asks for it, after its ``sampler.set_epoch(epoch)`` -- to
leave torch's RNG (and the loader's own ``generator``, if it has one) as it found them, so
the draw counts as the one made before the snapshot.  Creating the iterator at restore time
instead would run before the loop's ``set_epoch`` and shuffle the epoch as epoch 0.
Top-level entries only; a loader nested deeper is restored as before.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional

import torch


def _loader_class() -> Optional[type]:
    """``StatefulDataLoader`` if the script imported torchdata (never imported here: a job
    without it must not pay for the import at every save)."""
    mod = sys.modules.get("torchdata.stateful_dataloader")
    return getattr(mod, "StatefulDataLoader", None) if mod is not None else None


class RngNeutralLoader:
    """The snapshot view of a ``StatefulDataLoader``: its own state; restoring it makes the
    loader's next iterator draw nothing from the RNGs (see the module docstring for why)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> Dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        if state and "_get_iterator" not in vars(self.loader):
            self.loader._get_iterator = _once_without_draws(self.loader)


def _once_without_draws(loader: Any) -> Callable[[], Any]:
    """A one-shot ``_get_iterator`` for ``loader`` (an instance attribute over the class's
    method, the one ``__iter__`` and ``state_dict`` call) that puts the RNG states back after
    the iterator is made, then removes itself."""
    made = type(loader)._get_iterator

    def get_iterator() -> Any:
        vars(loader).pop("_get_iterator", None)
        own = loader.generator
        before = (torch.get_rng_state(), own.get_state() if own is not None else None)
        try:
            return made(loader)
        finally:
            torch.set_rng_state(before[0])
            if own is not None:
                own.set_state(before[1])
    return get_iterator


def adapt(state: Dict[str, Any], cache: Dict[Any, Any]) -> Dict[str, Any]:
    """``state`` with every top-level ``StatefulDataLoader`` seen through
    :class:`RngNeutralLoader` (the same keys and values are snapshotted)."""
    cls = _loader_class()
    if cls is None:
        return state
    out = None
    for k, v in state.items():
        if isinstance(v, cls):
            out = dict(state) if out is None else out
            out[k] = RngNeutralLoader(v)
    return state if out is None else out
