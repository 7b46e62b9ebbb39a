"""Framework adapters, imported as ``ckptrun.adapters.<name>``, found through a small registry.

A registry entry maps a name to a module path and is imported only when asked for (the way
fsspec registers its implementations), so ``import ckptrun`` never imports Lightning or
transformers.  Adding a framework is one new module plus one :func:`register` call (or one
line in ``_BUILTIN``).

Two kinds of adapters:

* *state adapters* (``deepspeed``, ``ddp``, ``fsdp``, ``dataloader``) rewrite entries of a
  ``Checkpointer`` state dict into objects that snapshot the right thing (a DDP wrapper's inner
  module; an FSDP2 model and its optimizers through ``torch.distributed.checkpoint.state_dict``;
  a torchdata ``StatefulDataLoader`` restored without drawing from the restored RNG).  ``Checkpointer`` applies
  them by itself; a state adapter module defines ``adapt(state, cache) -> dict``.
* *framework adapters* (``lightning``, ``transformers``) are callbacks the user adds to the
  framework's trainer; they build a ``Checkpointer`` themselves.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Dict, List

__all__ = ["register", "get", "names", "adapt_state"]

# name -> (module path, is a state adapter applied by Checkpointer)
_BUILTIN: Dict[str, tuple] = {
    # DeepSpeed first: its engine is an nn.Module that the DDP adapter must not take for a model
    "deepspeed": ("ckptrun.adapters.deepspeed", True),
    "ddp": ("ckptrun.adapters.ddp", True),
    "fsdp": ("ckptrun.adapters.fsdp", True),
    "dataloader": ("ckptrun.adapters.dataloader", True),
    "lightning": ("ckptrun.adapters.lightning", False),
    "transformers": ("ckptrun.adapters.transformers", False),
}
_registry: Dict[str, tuple] = dict(_BUILTIN)
_loaded: Dict[str, ModuleType] = {}


def register(name: str, module: str, state_adapter: bool = False, clobber: bool = False) -> None:
    """Register ``module`` (a dotted path, imported lazily) under ``name``.

    ``state_adapter=True``: ``Checkpointer`` calls its ``adapt(state, cache)`` on every state.
    """
    if name in _registry and not clobber and _registry[name][0] != module:
        raise ValueError(f"ckptrun adapter {name!r} is already registered as {_registry[name][0]}")
    _registry[name] = (module, state_adapter)
    _loaded.pop(name, None)


def get(name: str) -> ModuleType:
    """The adapter module registered as ``name`` (imported on first use)."""
    if name not in _registry:
        raise KeyError(f"no ckptrun adapter named {name!r}; known: {', '.join(names())}")
    mod = _loaded.get(name)
    if mod is None:
        mod = _loaded[name] = importlib.import_module(_registry[name][0])
    return mod


def names() -> List[str]:
    """Registered adapter names."""
    return sorted(_registry)


def adapt_state(state: Dict[str, Any], cache: Dict[Any, Any]) -> Dict[str, Any]:
    """The view of ``state`` that ``Checkpointer`` snapshots: every state adapter applied in
    registration order.  ``cache`` keeps adapter objects alive across calls (keyed by the
    adapters themselves), so the same model/optimizer gets the same wrapper every step."""
    view = state
    for name, (_, is_state) in list(_registry.items()):
        if is_state:
            view = get(name).adapt(view, cache)
    return view
