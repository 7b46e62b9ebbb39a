"""c10d internals: group creation, NCCL abort, the table of groups, pinned default groups.

Checked on torch 2.7.0, 2.13.0 and 2.15.0 (:data:`ckptrun.torchcompat.CHECKED`).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, List, TypeVar

T = TypeVar("T")


def watch_group_creation(before: Callable[[], T], after: Callable[[T, str], None]) -> bool:
    """Call ``before()`` as each process group starts being created and ``after(token,
    backend)`` once it is (or failed), ``token`` being what ``before`` returned; False where
    this torch offers no place to watch (the caller then does without).

    There is no public hook for group creation; ``c10d._new_process_group_helper`` is what
    ``init_process_group`` and ``new_group`` both go through (2.7 .. 2.15).  Its backend is
    read by parameter name, not position: the positions moved between releases.
    """
    try:
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return False
    inner = getattr(c10d, "_new_process_group_helper", None)
    if inner is None:
        return False
    try:
        signature = inspect.signature(inner)
    except (TypeError, ValueError):
        signature = None

    def backend_of(args: tuple, kwargs: dict) -> str:
        if signature is not None:
            try:
                return str(signature.bind_partial(*args, **kwargs).arguments.get("backend", ""))
            except TypeError:
                pass
        return str(kwargs.get("backend", ""))

    def helper(*args: Any, **kwargs: Any) -> Any:
        token = before()
        try:
            return inner(*args, **kwargs)
        finally:
            after(token, backend_of(args, kwargs).lower())

    helper.__wrapped__ = inner  # type: ignore[attr-defined]
    c10d._new_process_group_helper = helper
    return True


def abort_nccl() -> None:
    """Abort every NCCL communicator of this process (``c10d._abort_process_group``, made
    for this; 2.7 .. 2.15).  Raises what torch raises, or :class:`Unsupported`."""
    import torch.distributed.distributed_c10d as c10d

    from ckptrun.torchcompat import Unsupported

    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        raise Unsupported("this torch cannot abort NCCL communicators")
    abort()


def all_groups() -> List[object]:
    """Every process group of this process ([] without any, or on a torch that keeps them
    elsewhere): torch's own table, ``c10d._world.pg_map`` (2.7 .. 2.15)."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return list(c10d._world.pg_map)
    except Exception:  # noqa: BLE001
        return []


# modules whose functions take ``group=group.WORLD`` as a default argument: evaluated once,
# at import -- and torch imports them with ``torch._dynamo`` (DDP's constructor, the first
# optimizer step) or the user's script does, often after the first attempt's
# ``init_process_group``.  (Found by grepping torch 2.7 .. 2.15 for ``= group.WORLD``.)
GROUP_DEFAULT_MODULES = ("torch.distributed.nn.functional",
                         "torch.distributed.fsdp.sharded_grad_scaler",
                         "torch.distributed.optim.zero_redundancy_optimizer")


def unpin_default_groups() -> int:
    """Replace the destroyed groups that functions (and classes' methods) of
    :data:`GROUP_DEFAULT_MODULES` keep as default arguments with ``None`` -- which they take
    as "the default group", now the next attempt's; returns how many functions changed.

    Why: ``torch.distributed.nn.functional.all_gather(t)`` and the rest of torch's
    differentiable collectives, or a ``ShardedGradScaler()``, would otherwise keep using the
    first attempt's group after an in-place recovery -- the collectives raised "not
    initialized in the world group map" on every survivor -- and keep it alive: its
    connections, its store client and its threads (on a GPU, the aborted communicator) for
    the life of the process.  A patch of torch's functions' ``__defaults__``: torch has no
    way to say "the default group, whichever it is now" but ``None``.
    """
    modules = [sys.modules[m] for m in GROUP_DEFAULT_MODULES if m in sys.modules]
    if not modules:  # none imported: nothing can hold a group (and no torch import here)
        return 0
    from torch.distributed import ProcessGroup

    def unpin(fn: object) -> int:
        changed = 0
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d  # type: ignore[attr-defined]
                                    for d in defaults)
            changed = 1
        kw = getattr(fn, "__kwdefaults__", None)
        if kw and any(isinstance(d, ProcessGroup) for d in kw.values()):
            fn.__kwdefaults__ = {k: None if isinstance(d, ProcessGroup) else d  # type: ignore[attr-defined]
                                 for k, d in kw.items()}
            changed = 1
        return changed

    n = 0
    for module in modules:
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                n += sum(unpin(m) for m in vars(obj).values())
            else:
                n += unpin(obj)
    return n
