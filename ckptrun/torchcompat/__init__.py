"""The one seam between ckptrun and torch's internals.

Every use of a private torch name, every patch of torch behaviour and every read of a format
torch does not document lives in this package, one module per torch area:

- :mod:`.process_groups` -- c10d: watching group creation, aborting NCCL, the table of
  groups, the groups torch keeps as default arguments;
- :mod:`.ddp` -- DDP's reducer: its bucket layout, rebuilding it in a saved layout;
- :mod:`.dcp` -- ``torch.distributed.checkpoint``: the storage writers and DCP's
  per-item storage record;
- :mod:`.dtensor` -- where a DTensor's local shard sits in the global tensor;
- :mod:`.save_format` -- the zip layout of ``torch.save``, read without unpickling;
- :mod:`.etcd_store` -- how torch's ``EtcdStore`` encodes keys and values;
- :mod:`.warm_up` and :mod:`.numa` -- a private import paid ahead, torch's NUMA binding.

Each function says which torch releases it was checked on (``CHECKED``: the floor, the
release the main test suite pins, the newest at the time).  Where the running torch lacks
what a function needs it returns ``None``/``False`` or raises :class:`Unsupported` with one
line naming the torch that has it; the caller degrades or refuses -- never a traceback.
``tests/test_torch_seam.py`` fails when product code outside this package names a private
torch attribute.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

#: the lowest torch ckptrun supports: the first release whose FSDP2 (the public
#: ``torch.distributed.fsdp.fully_shard``, 2.6) also runs on the CPU -- 2.6's fails in its own
#: all-gather there ("'Stream' object has no attribute 'record_event'"), so on a CPU-only
#: machine 2.6 cannot be proven -- with DCP's ``state_dict`` API as documented today
FLOOR: Tuple[int, int] = (2, 7)

#: the releases every function of this package was run on (``make test``'s compatibility part)
CHECKED = ("2.7.0", "2.13.0", "2.15.0")


class Unsupported(RuntimeError):
    """This torch lacks what a feature needs; the message is one line naming the torch that
    has it."""


def floor_problem() -> Optional[str]:
    """One line saying why the installed torch is outside ckptrun's range, or None.  Read
    from the installed package's metadata: ``ckptrun status`` and the checks before a job
    starts do not pay for ``import torch``."""
    from importlib import metadata

    try:
        installed = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return f"torch is not installed (ckptrun needs torch>={FLOOR[0]}.{FLOOR[1]})"
    m = re.match(r"(\d+)\.(\d+)", installed)
    if m and (int(m.group(1)), int(m.group(2))) < FLOOR:
        return (f"ckptrun needs torch>={FLOOR[0]}.{FLOOR[1]}; this environment has torch "
                f"{installed} (pip install 'torch>={FLOOR[0]}.{FLOOR[1]}')")
    return None


def torch_version() -> Tuple[int, int]:
    """The running torch's ``(major, minor)``."""
    import torch

    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def at_least(major: int, minor: int) -> bool:
    """Whether the running torch is ``major.minor`` or newer."""
    return torch_version() >= (major, minor)
