"""FSDP2 / DTensor: sharded model and optimizer state through
``torch.distributed.checkpoint.state_dict`` (``get_*_state_dict`` / ``set_*_state_dict``).

``Checkpointer({"model": fsdp_model, "optim": opt})`` just works: any module with DTensor
parameters (``fully_shard``, tensor parallel) is snapshotted as its *sharded* state dict, and
an optimizer over its parameters as the matching FQN-keyed optimizer state dict.  Each rank
copies only its own shards (the snapshot carries each DTensor's local shard plus its global
shape, offset and placements); restoring from memory at the same world size copies them back
into the live shards.  The durable copy writes DTensors as sharded DCP entries, so
``dcp.load`` -- or ``Checkpointer.restore()`` at another world size -- reshards them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ckptrun.snapshot import dtensor_class, is_dtensor


def _dcp_sd():
    from torch.distributed.checkpoint import state_dict as dsd

    return dsd


def is_sharded_module(x: Any) -> bool:
    """A module whose parameters include DTensors (FSDP2, tensor parallel)."""
    cls = dtensor_class()  # looked up once: this runs on every save()
    return cls is not None and isinstance(x, torch.nn.Module) \
        and any(isinstance(p, cls) for p in x.parameters())


class ShardedModel:
    """A sharded module's state as ``get_model_state_dict`` gives it (DTensor values)."""

    ckptrun_loads_shards = True  # load_state_dict takes local shards (_into_live)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> Dict[str, Any]:
        return _dcp_sd().get_model_state_dict(self.model)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        live = self.state_dict()
        _dcp_sd().set_model_state_dict(self.model, _into_live(sd, live, "model"))


class ShardedOptimizer:
    """An optimizer of a sharded module, FQN-keyed (``get_optimizer_state_dict``)."""

    ckptrun_loads_shards = True  # load_state_dict takes local shards (_into_live)

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model = model
        self.optim = optim
        self.ckptrun_optimizers = [optim]  # Checkpointer hooks its step (overlapped copy)

    def state_dict(self) -> Dict[str, Any]:
        return _dcp_sd().get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        live = self.state_dict()  # creates the state of a fresh optimizer (zero-lr step)
        _dcp_sd().set_optimizer_state_dict(self.model, self.optim, _into_live(sd, live, "optim"))


def _into_live(new: Any, live: Any, path: str) -> Any:
    """``new`` with every local shard put into the matching live DTensor (in place), so that
    ``set_*_state_dict`` receives DTensors with the live mesh and placements."""
    if is_dtensor(live) and isinstance(new, torch.Tensor) and not is_dtensor(new):
        local = live.to_local()
        if local.shape != new.shape:
            raise RuntimeError(f"ckptrun: shard of {path} has shape {tuple(new.shape)}, the live "
                               f"shard {tuple(local.shape)} (different world size or sharding?)")
        if local.data_ptr() != new.data_ptr():
            with torch.no_grad():
                local.copy_(new)
        return live
    if isinstance(new, dict) and isinstance(live, dict):
        return {k: _into_live(v, live.get(k), f"{path}/{k}") for k, v in new.items()}
    if isinstance(new, list) and isinstance(live, list) and len(new) == len(live):
        return [_into_live(v, lv, f"{path}/{i}") for i, (v, lv) in enumerate(zip(new, live))]
    return new


def _owner(optim: torch.optim.Optimizer, models: List[torch.nn.Module]) -> Optional[torch.nn.Module]:
    params = {id(p) for g in optim.param_groups for p in g["params"]}
    for m in models:
        if params and params <= {id(p) for p in m.parameters()}:
            return m
    return None


def adapt(state: Dict[str, Any], cache: Dict[Any, Any]) -> Dict[str, Any]:
    """``state`` with sharded modules and their optimizers wrapped (top level)."""
    if not any(is_sharded_module(v) for v in state.values()):
        return state
    models = [v for v in state.values() if is_sharded_module(v)]
    out = dict(state)
    for k, v in state.items():
        key: Any = None
        if is_sharded_module(v):
            key = ("fsdp-model", id(v))
            if key not in cache:
                cache[key] = ShardedModel(v)
        elif isinstance(v, torch.optim.Optimizer):
            owner = _owner(v, models)
            if owner is None:
                continue
            key = ("fsdp-optim", id(v), id(owner))
            if key not in cache:
                cache[key] = ShardedOptimizer(owner, v)
        if key is not None:
            out[k] = cache[key]
    return out
