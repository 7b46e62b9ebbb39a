"""DeepSpeed: a ``DeepSpeedEngine`` snapshots each rank's own ZeRO state, in place, no gathering.

``Checkpointer({"engine": engine, ...})`` with the engine ``deepspeed.initialize`` returned:
the Checkpointer applies this adapter by itself (like DDP's and FSDP2's), and the engine
entry becomes an :class:`EngineState` whose snapshot holds, per rank,

* ZeRO stages 1-3: the flat buffers the rank owns -- its partition of the fp32 master
  weights, the 16-bit (or, on CPU, fp32) working weights the model's parameters are views
  of (stages 1-2: every parameter; stage 3: this rank's partition of each, plus the
  parameters small enough to be kept whole, ``stage3_param_persistence_threshold``) -- and
  the inner optimizer's state of each master partition (Adam's moments and step), its
  hyper-parameters, the loss scaler;
* stage 0: the module's parameters and the engine's optimizer as PyTorch's own state dicts;
* always: the module's buffers, the LR scheduler, the engine's step counters.

Nothing is gathered: every rank copies its own bytes (the per-rank size of ZeRO), and a
restore copies them back into the same buffers, so the next step computes exactly what the
uninterrupted run computed.  DeepSpeed's own ``state_dict()`` is not used: it holds Python
objects (the loss scaler, parameter mappings) that no snapshot may pickle, and its
``load_state_dict`` takes every rank's state at once.

Limits (checked, or said where they cannot be): the same world size and ZeRO configuration
as the run that took the snapshot; no optimizer offload to NVMe; no 16-bit training without
ZeRO (stage 0's FP16/BF16 optimizer wrappers are refused at the first save); the durable copy is DCP of
these per-rank buffers (``torch.distributed.checkpoint`` reads it without ckptrun, but it
is not a model state dict: use DeepSpeed's ``zero_to_fp32`` on a DeepSpeed checkpoint for
that).  Registering the engine's optimizer or scheduler beside the engine is allowed; the
engine entry already holds them, so the optimizer entry is stored empty.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import torch

# ZeRO optimizers' flat buffers, by stage: the fp32 master partition first
_FP32_FLATS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_WORKING_FLATS = ("bit16_groups_flat", "fp16_partitioned_groups_flat")
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
_SCALAR = (bool, int, float, type(None))


def _engine_class() -> Optional[type]:
    if "deepspeed" not in sys.modules:  # never import DeepSpeed for a script without it
        return None
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        return None
    return DeepSpeedEngine


def adapt(state: Dict[str, Any], cache: Dict[Any, Any]) -> Dict[str, Any]:
    """``state`` with every ``DeepSpeedEngine`` replaced by its :class:`EngineState` (the
    same object every step) and that engine's own optimizer, where it is registered too,
    by an empty entry."""
    cls = _engine_class()
    if cls is None:
        return state
    engines = {k: v for k, v in state.items() if isinstance(v, cls)}
    if not engines:
        return state
    covered = {id(e.optimizer) for e in engines.values() if getattr(e, "optimizer", None)}
    out = {}
    for k, v in state.items():
        if k in engines:
            key = (EngineState, id(v))
            if key not in cache or cache[key].engine is not v:
                cache[key] = EngineState(v)
            out[k] = cache[key]
        elif id(v) in covered:
            out[k] = _HeldByEngine()
        else:
            out[k] = v
    return out


class _HeldByEngine:
    """The engine's optimizer, registered beside the engine: its state is the engine's."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        return None


class EngineState:
    """One ``DeepSpeedEngine``'s per-rank training state (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    # -- what a snapshot holds -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        e = self.engine
        opt = getattr(e, "optimizer", None)
        stage, world = _layout(e)
        sd: Dict[str, Any] = {
            "zero_stage": stage, "world_size": world,
            "counters": {c: int(getattr(e, c, 0) or 0) for c in _COUNTERS},
            "buffers": dict(e.module.named_buffers()),
        }
        sched = getattr(e, "lr_scheduler", None)
        if sched is not None and hasattr(sched, "state_dict"):
            sd["scheduler"] = sched.state_dict()
        fp32 = _flats(opt, _FP32_FLATS)
        if fp32 is None:  # stage 0: a PyTorch optimizer on the module's own parameters
            sd["module"] = {n: p for n, p in e.module.named_parameters()}
            if isinstance(opt, torch.optim.Optimizer):
                sd["optimizer"] = opt.state_dict()
            elif opt is not None:
                raise TypeError(f"ckptrun cannot snapshot DeepSpeed's {type(opt).__name__} "
                                "(ZeRO stage 0 with a 16-bit optimizer wrapper); use ZeRO "
                                "stage 1-3, or fp32 without ZeRO")
            return sd
        inner = opt.optimizer
        sd["fp32"] = list(fp32)
        sd["working"] = list(_flats(opt, _WORKING_FLATS) or [])
        # stage 3 keeps small parameters whole on every rank (beside their partition)
        sd["whole"] = [p.data for p in e.module.parameters()
                       if hasattr(p, "ds_tensor") and p.data.numel() > 0]
        sd["inner_state"] = [dict(inner.state.get(t, {})) for t in fp32]
        sd["inner_groups"] = [{k: v for k, v in g.items() if k != "params"}
                              for g in inner.param_groups]
        scaler = getattr(opt, "loss_scaler", None)
        sd["scaler"] = _scalars(scaler)
        sd["zero"] = {k: getattr(opt, k) for k in ("overflow", "dynamic_loss_scale")
                      if isinstance(getattr(opt, k, None), _SCALAR)}
        return sd

    # -- restore in place ----------------------------------------------------------------
    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        e = self.engine
        opt = getattr(e, "optimizer", None)
        stage, world = _layout(e)
        if int(sd.get("zero_stage", -1)) != stage or int(sd.get("world_size", -1)) != world:
            raise ValueError(f"this DeepSpeed snapshot was taken with ZeRO stage "
                             f"{sd.get('zero_stage')} on {sd.get('world_size')} ranks; this "
                             f"engine runs stage {stage} on {world}")
        for c, v in (sd.get("counters") or {}).items():
            setattr(e, c, int(v))
        _copy_named(dict(e.module.named_buffers()), sd.get("buffers") or {}, "buffer")
        sched = getattr(e, "lr_scheduler", None)
        if sched is not None and "scheduler" in sd:
            sched.load_state_dict(sd["scheduler"])
        if "module" in sd:  # stage 0
            with torch.no_grad():
                _copy_named(dict(e.module.named_parameters()), sd["module"], "parameter")
            if "optimizer" in sd and isinstance(opt, torch.optim.Optimizer):
                opt.load_state_dict(sd["optimizer"])
            return
        inner = opt.optimizer
        fp32 = list(_flats(opt, _FP32_FLATS) or [])
        with torch.no_grad():
            _copy_list(fp32, sd["fp32"], "fp32 master partition")
            _copy_list(list(_flats(opt, _WORKING_FLATS) or []), sd["working"], "working flat")
            whole = [p.data for p in e.module.parameters()
                     if hasattr(p, "ds_tensor") and p.data.numel() > 0]
            if whole:  # a fresh engine gathers them at its first forward, from the partitions
                _copy_list(whole, sd.get("whole") or [], "whole parameter")
        for t, saved in zip(fp32, sd["inner_state"]):
            live = inner.state.setdefault(t, {})
            for k, v in saved.items():
                if isinstance(v, torch.Tensor):
                    if isinstance(live.get(k), torch.Tensor) and live[k].shape == v.shape:
                        live[k].copy_(v)
                    else:  # a fresh process: the optimizer has not stepped yet
                        live[k] = v.detach().clone()
                else:
                    live[k] = v
        for g, saved in zip(inner.param_groups, sd["inner_groups"]):
            g.update(saved)
        scaler = getattr(opt, "loss_scaler", None)
        for k, v in (sd.get("scaler") or {}).items():
            setattr(scaler, k, v)
        for k, v in (sd.get("zero") or {}).items():
            setattr(opt, k, v)


def _layout(engine: Any) -> tuple:
    """(ZeRO stage, world size): what a snapshot must have been taken with to fit."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return int(engine.zero_optimization_stage()), int(world)


def _flats(opt: Any, names: tuple) -> Optional[List[torch.Tensor]]:
    for name in names:
        got = getattr(opt, name, None)
        if isinstance(got, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in got):
            return list(got)
    return None


def _scalars(obj: Any) -> Dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, _SCALAR)} if obj is not None \
        else {}


def _copy_list(live: List[torch.Tensor], saved: List[torch.Tensor], what: str) -> None:
    if len(live) != len(saved):
        raise ValueError(f"this DeepSpeed snapshot has {len(saved)} {what}s, the engine "
                         f"{len(live)}: another model or ZeRO configuration")
    for dst, src in zip(live, saved):
        if dst.shape != src.shape:
            raise ValueError(f"a {what} of shape {tuple(src.shape)} does not fit "
                             f"{tuple(dst.shape)}: another model or ZeRO configuration")
        dst.copy_(src)


def _copy_named(live: Dict[str, torch.Tensor], saved: Dict[str, torch.Tensor],
                what: str) -> None:
    missing = sorted(set(saved) ^ set(live))
    if missing:
        raise ValueError(f"this DeepSpeed snapshot's {what}s do not match the engine's: "
                         f"{', '.join(missing[:5])}")
    for name, src in saved.items():
        live[name].data.copy_(src)
