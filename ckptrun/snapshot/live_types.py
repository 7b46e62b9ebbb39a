"""Restored values in the types the live objects gave: DTensors, and tensors on their devices.

A snapshot keeps a DTensor as its local shard (plus its layout) and every tensor's bytes in CPU
memory.  An object's ``load_state_dict`` often needs back exactly what its ``state_dict()``
gave: a framework wrapper over ``get_model_state_dict``/``get_optimizer_state_dict``
(torchtitan's ``ModelWrapper`` and ``OptimizersContainer``) hands the values on to
``set_*_state_dict``, which refuses a plain tensor where the live parameter is a DTensor
("got mixed torch.Tensor and DTensor").  So before such an object is loaded, its live
``state_dict()`` is asked once and every restored tensor at a path where the live value is a
DTensor becomes a DTensor with the live mesh, placements, global shape and stride (its local
shard being the restored one), and every tensor where the live one sits on another device is
moved there.  Only objects whose restored values need it are asked (:func:`holds_any`).
"""

from __future__ import annotations

from typing import Any, Set

import torch

from ckptrun.snapshot.tree import is_dtensor


class LiveMismatch(ValueError):
    """A restored value cannot take the live value's type (another shard shape: the job was
    sharded differently).  The message names the path."""


def holds_any(x: Any, ids: Set[int]) -> bool:
    """Whether the restored value ``x`` holds a tensor whose ``id`` is in ``ids``."""
    if isinstance(x, torch.Tensor):
        return id(x) in ids
    if isinstance(x, dict):
        return any(holds_any(v, ids) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(holds_any(v, ids) for v in x)
    return False


def as_live(new: Any, live: Any, path: str = "") -> Any:
    """``new`` (restored: plain CPU tensors, dicts, lists) with each tensor given the type and
    device of the value at the same place in ``live`` (what the object's ``state_dict()``
    returns now); places ``live`` lacks keep the restored value."""
    if isinstance(new, torch.Tensor):
        if is_dtensor(live):
            return _as_dtensor(new, live, path)
        if isinstance(live, torch.Tensor) and not is_dtensor(new) and live.device != new.device:
            return new.to(live.device)
        return new
    if isinstance(new, dict) and isinstance(live, dict):
        return {k: as_live(v, live[k], f"{path}/{k}") if k in live else v
                for k, v in new.items()}
    if isinstance(new, (list, tuple)) and isinstance(live, (list, tuple)) \
            and len(new) == len(live):
        out = [as_live(v, lv, f"{path}/{i}") for i, (v, lv) in enumerate(zip(new, live))]
        return out if isinstance(new, list) else tuple(out)
    return new


def _as_dtensor(local: torch.Tensor, live: Any, path: str) -> Any:
    """The DTensor laid out as ``live`` whose local shard is ``local`` (public
    ``DTensor.from_local``: no collective, no copy where the device matches)."""
    want = tuple(live.to_local().shape)
    if tuple(local.shape) != want:
        raise LiveMismatch(f"{path or '<root>'}: the restored shard has shape "
                           f"{tuple(local.shape)}, this rank's live shard {want} (sharded "
                           "differently from the run that saved it?)")
    if local.device != live.device:
        local = local.to(live.device)
    return type(live).from_local(local, live.device_mesh, live.placements, run_check=False,
                                 shape=live.shape, stride=live.stride())
