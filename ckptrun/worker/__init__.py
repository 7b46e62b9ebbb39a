"""What runs inside the user's training process.

* :mod:`~ckptrun.worker.checkpointer` -- ``ckptrun.Checkpointer``: save, restore, close;
* :mod:`~ckptrun.worker.saving` -- the slot layout ``save()`` keeps, the background copy;
* :mod:`~ckptrun.worker.slotset` -- this rank's slot files, the shared-memory room check;
* :mod:`~ckptrun.worker.interval` -- which ``save()`` calls take a snapshot;
* :mod:`~ckptrun.worker.heartbeat` -- ``ckptrun.heartbeat()`` and the link to the control block;
* :mod:`~ckptrun.worker.standalone` -- persistence under plain ``python``/``torchrun``;
* :mod:`~ckptrun.worker.bootstrap` -- the worker process's entry: a warm interpreter that
  runs the user's script like ``python`` would;
* :mod:`~ckptrun.worker.prefault` -- a spare's pre-faulted heap;
* :mod:`~ckptrun.worker.clean_exit` -- a garbage collection at exit (gloo teardown).

The worker side talks to the agent only through :mod:`ckptrun.protocol` (environment, control
block, slot files) and writes :mod:`ckptrun.snapshot` slots; it never imports the agent, the
store access or the command line.  Of the tiers it uses only the durable format, to persist
on its own when no agent runs it.  This package's ``__init__`` imports nothing, so that
``import ckptrun`` stays light.
"""
