"""DDP internals: the reducer's bucket layout, and building the reducer in a saved layout.

What :mod:`ckptrun.adapters.ddp` needs for an exact first iteration after a restore (its
docstring says why).  Checked on torch 2.7.0, 2.13.0 and 2.15.0; every function returns
``None``/``False`` where a torch's internals differ, and the adapter falls back to a comm hook.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import torch

# one rebuild at a time: it answers DDP's bucket-assignment call by swapping a module global
_REBUILD_LOCK = threading.Lock()


def compiled_inner(module: Any) -> Optional[torch.nn.Module]:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, else None."""
    if type(module).__name__ == "OptimizedModule" and isinstance(module, torch.nn.Module):
        return getattr(module, "_orig_mod", None)
    return None


def logging_data(ddp: torch.nn.parallel.DistributedDataParallel) -> Optional[Dict[str, Any]]:
    """DDP's own logging data (``has_rebuilt_buckets``, ``rebuilt_per_bucket_param_indices``);
    None on a torch without it."""
    try:
        return dict(ddp._get_ddp_logging_data())
    except Exception:  # noqa: BLE001
        return None


def has_regrouped(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP has regrouped its buckets in this process (after its first iteration)."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def regroup_now(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Regroup DDP's buckets now if it has not yet (after its first backward; DDP itself
    would at the next forward, with the same result); whether it has regrouped by now."""
    try:
        if ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True  # what DDP's forward records when it regroups
    except Exception:  # noqa: BLE001
        return False
    return has_regrouped(ddp)


def grad_buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> Optional[List[Any]]:
    """The reducer's buckets in index order (each with ``parameters()``); None on a torch
    without them."""
    try:
        return sorted(ddp.reducer._get_zeros_like_grad_buckets(), key=lambda b: b.index())
    except Exception:  # noqa: BLE001
        return None


def has_comm_hook(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether a comm hook is registered on ``ddp`` (it then reduces by its own rules)."""
    return bool(getattr(ddp, "_comm_hooks", None))


def rebuild_reducer(ddp: torch.nn.parallel.DistributedDataParallel, params: List[torch.Tensor],
                    buckets: List[List[int]]) -> bool:
    """Build ``ddp``'s reducer again with ``buckets`` (indices into ``params``, in reduction
    order) before its first iteration; False, and ``ddp`` untouched, where that cannot be done
    on this torch or for this DDP (mixed precision, the Python reducer, delayed all-reduce,
    or parameters that are not ``params`` in that order).

    DDP's own ``_ddp_init_helper`` (what its unpickling runs) builds the reducer; the bucket
    assignment it asks ``dist._compute_bucket_assignment_by_size`` for is answered with
    ``buckets``.  The old reducer's autograd hooks go with it (its destructor removes them).
    """
    import torch.distributed as dist

    try:
        if has_regrouped(ddp):
            return False  # trained already in this process: its layout is DDP's own
        if getattr(ddp, "mixed_precision", None) is not None \
                or getattr(ddp, "_use_python_reducer", False) \
                or getattr(ddp, "_delay_all_reduce_all_params", False):
            return False
        parameters, expect_sparse = ddp._build_params_for_reducer()
        if [id(p) for p in parameters] != [id(p) for p in params]:
            return False
        names = ddp._build_debug_param_to_name_mapping(parameters)
        original = dist._compute_bucket_assignment_by_size
    except Exception:  # noqa: BLE001  (another torch's internals)
        return False
    cap = int(getattr(ddp, "bucket_bytes_cap", 25 * 1024 * 1024))
    # DDP reverses the assignment it is given (reduction starts with the last parameters)
    assignment = ([list(b) for b in reversed(buckets)], [cap] * len(buckets))
    old = (ddp.reducer, ddp.logger)
    with _REBUILD_LOCK:
        dist._compute_bucket_assignment_by_size = lambda *a, **k: assignment
        try:
            ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
            if ddp.static_graph:
                ddp.reducer._set_static_graph()
                ddp.logger._set_static_graph()
        except Exception as exc:  # noqa: BLE001
            ddp.reducer, ddp.logger = old
            raise RebuildFailed(str(exc)) from exc
        finally:
            dist._compute_bucket_assignment_by_size = original
    return True


class RebuildFailed(RuntimeError):
    """DDP's reducer could not be built again (the old one is back in place)."""
