"""Hugging Face ``Trainer``: per-step memory snapshots and exact resume from one callback.

    Trainer(..., callbacks=[ckptrun.adapters.transformers.CkptrunCallback()])

Captured at every ``every_n_steps``-th optimizer step (``on_step_end``): the model (unwrapped:
the same keys with or without DDP; under a DeepSpeed config the engine instead, whose ZeRO
state ``ckptrun.adapters.deepspeed`` captures), the optimizer (accelerate's wrapper unwrapped), the LR
scheduler, ``TrainerState`` (global step, epoch, log history, callback states, ...), the RNG
states of python/numpy/torch/CUDA, and the data position (batches consumed).

Restored at ``on_train_begin`` from the step ckptrun chose (memory, or storage when
``persist_to`` is set and nothing is in memory).  The consumed batches are skipped through the
prepared data loader's public ``skip_batches`` (accelerate's ``DataLoaderShard``, what
``skip_first_batches`` uses for HF's own resume), whole epochs included; the RNG is set again
after the resumed epoch's iterator was created, exactly where HF's own resume does it.

An evaluation during training leaves the global RNG where the step before it left it (set
back at ``on_evaluate``).  An evaluation may draw from it -- a new eval loader iterator draws
its workers' seed, and with persistent workers only the first evaluation of a process makes
one -- and a resumed run neither repeats the evaluations before the snapshot nor the one of
the snapshot's own step (taken at ``on_step_end``, before it), so without this the training's
dropout after a resume would follow another stream than the failure-free run's.

Not captured: the Trainer's private logging accumulators (the first loss logged after a
resume averages only the steps since the resume).  ``state.epoch`` (a float for logs) is
corrected for the batches skipped in the resumed epoch, which HF counts from the resume point.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any, Dict, Optional

from transformers import TrainerCallback

import ckptrun
from ckptrun import snapshot as S


class _TrainerStateDict:
    """``TrainerState`` as plain data (its own JSON form), loaded back field by field into the
    live object the Trainer holds."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Dict[str, Any]:
        # The JSON form HF itself writes (trainer_state.json): plain data only.
        return json.loads(json.dumps(dataclasses.asdict(self.state)))

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        for k, v in sd.items():
            setattr(self.state, k, v)


def _deepspeed_engine(model: Any) -> Any:
    """The ``DeepSpeedEngine`` that trains ``model`` (a Trainer run with a DeepSpeed
    config), or None.  The callback gets the model, not the engine: the engine is found
    among the live objects, once, at the start of training."""
    if "deepspeed" not in sys.modules or model is None:
        return None
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine

    for obj in gc.get_objects():
        if issubclass(type(obj), DeepSpeedEngine) and getattr(obj, "module", None) is model:
            return obj
    return None


def _hf_trainer_log() -> logging.Logger:
    return logging.getLogger("transformers.trainer")


class _NoSampleWarning(logging.Filter):
    """Drops HF's "not a single sample in your epoch_iterator, stopping training" for an
    epoch skipped whole on resume: training goes on (``on_epoch_end``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("There seems not to be a single sample")


_NO_SAMPLE = _NoSampleWarning()


class CkptrunCallback(TrainerCallback):
    """Snapshot the training state every ``every_n_steps`` optimizer steps; restore it at
    train start.  ``persist_to``/``persist_every`` are passed to ``ckptrun.Checkpointer``
    (used without the ckptrun agent; under the agent, ``ckptrun --persist-to`` decides)."""

    def __init__(self, every_n_steps: int = 1, persist_to: Optional[str] = None,
                 persist_every: Optional[int] = None) -> None:
        self.every_n_steps = max(1, int(every_n_steps))
        self.persist_to = persist_to
        self.persist_every = persist_every
        self.ckpt: Optional[ckptrun.Checkpointer] = None
        self.restored_step = 0
        self._rng = S.DeferredRNG()
        self._loader: Any = None
        self._skip = 0  # batches still to skip (over epochs) after a restore
        self._epoch = -1
        self._rng_after_step: Optional[Dict[str, Any]] = None  # what an evaluation gets back

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        engine = _deepspeed_engine(model)
        # under a DeepSpeed config the Trainer's model is the engine's module and its optimizer
        # the engine's ZeRO optimizer: the engine holds their state (ckptrun.adapters.deepspeed)
        tree: Dict[str, Any] = ({"engine": engine} if engine is not None
                                else {"model": model, "optim": opt})
        tree.update(trainer_state=_TrainerStateDict(state), rng=self._rng)
        if lr_scheduler is not None:
            tree["sched"] = lr_scheduler
        self.ckpt = ckptrun.Checkpointer(tree, capture_rng=False, persist_to=self.persist_to,
                                         persist_every=self.persist_every)
        self._loader = train_dataloader
        self._epoch = -1
        self._rng_after_step = S.capture_rng()  # eval_on_start evaluates before any step
        self.restored_step = self.ckpt.restore()
        if self.restored_step:
            self._skip = int(state.global_step) * int(args.gradient_accumulation_steps)
            if not hasattr(train_dataloader, "skip_batches"):
                print("ckptrun: the train dataloader has no skip_batches; the data position is "
                      "not restored", file=sys.stderr)
                self._skip = 0

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch += 1
        if self._loader is None or not hasattr(self._loader, "skip_batches"):
            self._rng.apply()
            return
        per_epoch = len(self._loader)
        n = min(self._skip, per_epoch)
        self._loader.skip_batches = n
        self._skip -= n
        if n and n >= per_epoch:  # HF warns that it stops (it does not: on_epoch_end)
            _hf_trainer_log().addFilter(_NO_SAMPLE)
            if getattr(args, "process_index", 0) == 0:
                print(f"ckptrun: epoch {self._epoch} was trained before the snapshot: "
                      "skipped", file=sys.stderr, flush=True)
        if n == 0:  # resuming at an epoch boundary: the RNG goes before the iterator
            self._rng.apply()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._rng.apply()  # after the resumed epoch's iterator fetched its first batch

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        n = self._skipped_now()
        if n:  # HF counts the resumed epoch's batches from the resume point
            state.epoch = min(float(int(state.epoch) + 1),
                              state.epoch + n / len(self._loader))
        self._rng_after_step = S.capture_rng()
        if self.ckpt is not None and state.global_step % self.every_n_steps == 0:
            self.ckpt.save(int(state.global_step))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is not None and self._rng_after_step is not None:  # during training only
            S.restore_rng(self._rng_after_step)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._loader is not None and self._skipped_now() >= len(self._loader):
            # An epoch consumed before the snapshot yields no batch; HF then stops training
            # ("not a single sample"): this one was skipped on purpose, go on.
            if state.max_steps <= 0 or state.global_step < state.max_steps:
                control.should_training_stop = False
        if self._loader is not None and hasattr(self._loader, "skip_batches"):
            self._loader.skip_batches = 0
        _hf_trainer_log().removeFilter(_NO_SAMPLE)

    def _skipped_now(self) -> int:
        """Batches of the current epoch skipped on resume (the loader's, until its end)."""
        return int(getattr(self._loader, "skip_batches", 0) or 0) if self._loader is not None \
            else 0

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
        self._rng_after_step = None
