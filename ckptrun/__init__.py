"""ckptrun: a drop-in ``torchrun`` that keeps an in-memory checkpoint of every iteration.

Worker-side API (see DESIGN §2)::

    import ckptrun
    ckpt = ckptrun.Checkpointer({"model": model, "optim": optimizer})
    start = ckpt.restore()
    for step in range(start, total):
        train_one_step()
        ckpt.save(step + 1)
    ckpt.close()

``@ckptrun.resilient`` on the function that builds the model and runs the loop: after a
failure elsewhere the surviving ranks recover in place instead of restarting.

Names are imported lazily so that ``ckptrun status`` does not pay for ``import torch``.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Checkpointer", "RecoveryRequested", "heartbeat", "resilient", "__version__"]

# Imported eagerly (it needs only the stdlib) so that the name ``ckptrun.heartbeat`` is the
# function even after something imports the submodule of the same name.
from ckptrun.worker.heartbeat import RecoveryRequested, heartbeat  # noqa: E402
from ckptrun.worker.resilient import resilient  # noqa: E402  (stdlib only until it runs)


def __getattr__(name: str):
    if name == "Checkpointer":
        from ckptrun.worker.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'ckptrun' has no attribute {name!r}")
