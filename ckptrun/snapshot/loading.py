"""Loading restored state into the live objects, in the types their ``state_dict()`` gave.

:func:`load_into` puts what :func:`~ckptrun.snapshot.tree.unflatten` rebuilt into the
registered objects: ``load_state_dict``, ``set_state``, dataclass fields, tensors in place.

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

import dataclasses
from typing import Any, Dict, Optional, Set

import numpy as np
import torch

from ckptrun.snapshot.tree import GENERATOR_KEY, dataclass_fields, is_dtensor


class LoadFailed(Exception):
    """A registered entry refused its restored value (its ``load_state_dict`` or the type
    match before it raised): ``entry`` is its path in the state, ``into`` what was loading,
    ``cause`` the exception."""

    def __init__(self, entry: str, into: str, cause: BaseException) -> None:
        super().__init__(f"cannot load the restored {entry!r} into {into}: "
                         f"{type(cause).__name__}: {_one_line(str(cause))}".rstrip(": "))
        self.entry, self.into, self.cause = entry, into, cause


def _one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line, its middle left out past ``limit`` characters: torch's load
    errors say what failed on the first line ("Error(s) in loading state_dict for X") and why
    on the last ("got mixed torch.Tensor and DTensor")."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else f"{flat[:limit // 3]} ... {flat[-(2 * limit) // 3:]}"


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


def load_into(target: Dict[Any, Any], restored: Dict[Any, Any],
              needs_live: Optional[Set[int]] = None, path: str = "") -> None:
    """Load ``restored`` (from :func:`unflatten`) into the live ``target`` state in place.

    Objects get ``load_state_dict`` -- with what their ``state_dict()`` gave: where the
    restored value holds a tensor of ``needs_live`` (ids of tensors that were DTensor shards
    or lived on a device), the object's live ``state_dict()`` is asked and those tensors take
    its types and devices (:func:`as_live`); generators ``set_state``; a
    dataclass instance its fields (each loaded the same way); tensors are overwritten in place
    when shape and dtype match (a DTensor's local shard, for a DTensor) -- the script keeps
    its references; nested dicts are updated recursively; anything else replaces the entry.
    """
    for k, new in restored.items():
        cur = target.get(k, None) if isinstance(target, dict) else None
        where = f"{path}/{k}" if path else str(k)
        if cur is not None and hasattr(cur, "load_state_dict") and not isinstance(cur, torch.Tensor) \
                and hasattr(cur, "state_dict"):
            # (the FSDP2 adapter's wrappers put shards into the live DTensors themselves)
            try:
                if needs_live and holds_any(new, needs_live) \
                        and not getattr(cur, "ckptrun_loads_shards", False):
                    new = as_live(new, cur.state_dict(), where)
                cur.load_state_dict(new)
            except LoadFailed:
                raise
            except Exception as exc:
                raise LoadFailed(where, f"{type(cur).__qualname__}.load_state_dict",
                                 exc) from exc
        elif isinstance(cur, torch.Generator) and isinstance(new, dict) and GENERATOR_KEY in new:
            cur.set_state(new[GENERATOR_KEY])
        elif dataclasses.is_dataclass(cur) and not isinstance(cur, type) \
                and isinstance(new, dict):
            fields = dataclass_fields(cur)
            load_into(fields, {n: v for n, v in new.items() if n in fields}, needs_live, where)
            for name in new:
                if name in fields:  # (object's own setattr: frozen ones are restored too)
                    object.__setattr__(cur, name, fields[name])
        elif is_dtensor(cur) and isinstance(new, torch.Tensor) \
                and cur.to_local().shape == new.shape and cur.dtype == new.dtype:
            with torch.no_grad():  # a DTensor registered as such: its shard, in place
                local = cur.to_local()
                if local.data_ptr() != new.data_ptr():
                    local.copy_(new)
        elif isinstance(cur, torch.Tensor) and isinstance(new, torch.Tensor) \
                and cur.shape == new.shape and cur.dtype == new.dtype:
            with torch.no_grad():
                cur.copy_(new)
        elif isinstance(cur, np.ndarray) and isinstance(new, np.ndarray) \
                and cur.shape == new.shape and cur.dtype == new.dtype and cur.flags.writeable:
            cur[...] = new
        elif type(cur) is dict and type(new) is dict:
            load_into(cur, new, needs_live, where)
            for extra in [e for e in cur if e not in new]:
                del cur[extra]
        else:
            target[k] = new
