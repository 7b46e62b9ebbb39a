"""DDP / plain PyTorch: a ``DistributedDataParallel`` wrapper snapshots as its inner module.

``Checkpointer({"model": ddp_model})`` and ``Checkpointer({"model": ddp_model.module})``
store the same keys (no ``module.`` prefix), so a snapshot taken with one restores into the
other, or into a model without DDP at all.  ``torch.compile``'s wrapper (``_orig_mod``) is
unwrapped the same way.

Replicated state (every data-parallel rank holds identical model and optimizer state) is
stored once in the durable copy: :func:`ckptrun.tiers.durable.storage.write_parts` compares the ranks it
writes byte for byte and keeps one copy of each identical tensor (per-rank RNG and data
state differ, so they stay per rank); both DCP keys point at the same bytes.  Memory slots
stay per rank: a rank's restore must never depend on another rank's process.

:func:`make_exact` keeps a resumed DDP run *bitwise* equal to an uninterrupted one at any
world size (see its docstring); ckptrun does not need it to restore.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist


def unwrap(module: Any) -> Any:
    """The module whose ``state_dict`` is the model's: DDP and ``torch.compile`` unwrapped."""
    for _ in range(8):  # DDP(compile(model)) and the like
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif isinstance(module, torch.nn.Module) and hasattr(module, "_orig_mod") \
                and type(module).__name__ == "OptimizedModule":
            module = module._orig_mod
        else:
            return module
    return module


def adapt(state: Dict[str, Any], cache: Dict[Any, Any]) -> Dict[str, Any]:
    """``state`` with DDP/compiled wrappers replaced by their inner modules (top level)."""
    out = None
    for k, v in state.items():
        if isinstance(v, torch.nn.Module):
            inner = unwrap(v)
            if inner is not v:
                out = dict(state) if out is None else out
                out[k] = inner
    return state if out is None else out


# no annotations: DDP rejects a hook whose annotations are not its own types, and under
# ``from __future__ import annotations`` every annotation is a string
def exact_allreduce_hook(group, bucket):  # type: ignore[no-untyped-def]
    """A DDP comm hook that all-reduces every gradient of the bucket on its own (in
    ``group``, the hook's state; None: the default group), then averages.

    DDP regroups the gradients of its buckets (in execution order) after the first
    iteration of every process -- so also after a restore.  With more than two ranks the
    float sums of one all-reduce of a whole bucket depend on where each value sits in the
    bucket (ring all-reduce starts each chunk's sum at a different rank), and the first
    steps after a restore would differ from the uninterrupted run in the last bit.  A
    gradient reduced on its own always sits at offset 0.  The price is one collective per
    parameter instead of one per bucket (all in flight at once)."""
    buf, off, works = bucket.buffer(), 0, []
    for p in bucket.parameters():
        works.append(dist.all_reduce(buf[off:off + p.numel()], group=group, async_op=True))
        off += p.numel()
    size = dist.get_world_size(group)

    def average(done: torch.futures.Future) -> torch.Tensor:
        # a callback that does not read the result drops its error: a dead peer's failed
        # all-reduce then let this rank go on training alone, on partial sums
        for fut in done.value():
            fut.value()
        return buf.div_(size)
    return torch.futures.collect_all([w.get_future() for w in works]).then(average)


def make_exact(model: torch.nn.parallel.DistributedDataParallel,
               group: Optional[Any] = None) -> torch.nn.parallel.DistributedDataParallel:
    """Register :func:`exact_allreduce_hook` on ``model`` (before its first step) and
    return it: ``ddp = make_exact(DistributedDataParallel(model))``."""
    model.register_comm_hook(group, exact_allreduce_hook)
    return model
