"""Imports a warm spare pays before it is given a rank's work.

Checked on torch 2.7.0, 2.13.0 and 2.15.0.
"""

from __future__ import annotations


def import_compiler_stack() -> None:
    """Import ``torch._dynamo`` now: DDP's first constructor imports it (~2.7 s on the
    build machine), as do ``torch.compile`` and the first optimizer step.  No public module
    pulls it in whole; a torch where it fails to import is left to fail in the script, as it
    would under torchrun."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
