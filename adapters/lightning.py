"""PyTorch Lightning: per-batch memory snapshots and exact resume from one callback.

    L.Trainer(..., strategy="ddp", callbacks=[ckptrun.adapters.lightning.CkptrunCallback()])

Captured after every ``every_n_steps``-th optimizer step, at the start of the next batch
(when the step, the LR schedulers and the loop counters of the previous batch are all done):
the LightningModule's state dict, every optimizer and LR scheduler, the fit loop's state
(epoch/batch/optimizer progress counters, stateful loader states), the state of stateful
callbacks, the precision plugin (grad scaler), the global RNG states, and the data position
(epoch and batches consumed).

Restored at ``on_fit_start`` (after the strategy set up model and optimizers, before the fit
loop starts).  The consumed batches of the resumed epoch are skipped at the sampler level,
before the first batch is fetched (the loader's batch sampler reads its sampler through a
skip-once wrapper for that epoch; a loader with workers has its iterator made again, as its
workers were given indices when Lightning made it); the RNG is set at the first batch start, after the
loader's iterator exists -- the same point where it was captured.

A validation during the fit leaves the global RNG as the training batch before it left it
(captured at ``on_train_batch_end``, set back at ``on_validation_end``).  A validation may draw from it --
a new val loader iterator draws its workers' seed, and with persistent workers only the first
validation of a process makes one; a resumed fit makes it at another validation than the
failure-free fit did (it skips the sanity check) -- so without this the training's dropout
after a resume would follow another stream.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Dict, Iterator, Optional

from ckptrun.adapters import ddp
from lightning.pytorch.callbacks import Callback

import ckptrun
from ckptrun import snapshot as S


class _SkipOnce:
    """A sampler that drops its first ``n`` indices once (the batches consumed before the
    snapshot), then behaves like ``inner``; ``len`` stays the inner one (Lightning counts
    batches by the restored progress)."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner = inner
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        n, self.n = self.n, 0
        return itertools.islice(iter(self.inner), n, None)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)


class _FitState:
    """Everything of a Lightning fit that a resume needs, as nested state dicts."""

    def __init__(self, trainer: Any, module: Any, data: Dict[str, int]) -> None:
        self.trainer = trainer
        self.module = module
        self.data = data

    @property
    def ckptrun_optimizers(self) -> list:
        return list(self.trainer.optimizers)  # Checkpointer hooks their step (overlapped copy)

    def _callbacks(self) -> Dict[str, Any]:
        return {cb.state_key: cb for cb in self.trainer.callbacks
                if not isinstance(cb, CkptrunCallback) and cb.state_dict()}

    def state_dict(self) -> Dict[str, Any]:
        t = self.trainer
        return {
            "model": self.module.state_dict(),
            "optimizers": [t.strategy.optimizer_state(o) for o in t.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs],
            "loops": t.fit_loop.state_dict(),
            "callbacks": {k: cb.state_dict() for k, cb in self._callbacks().items()},
            "precision": t.precision_plugin.state_dict(),
            "data": dict(self.data),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        t = self.trainer
        self.module.load_state_dict(sd["model"])
        for opt, osd in zip(t.optimizers, sd["optimizers"]):
            opt.load_state_dict(osd)
        for cfg, ssd in zip(t.lr_scheduler_configs, sd["schedulers"]):
            cfg.scheduler.load_state_dict(ssd)
        t.fit_loop.load_state_dict(sd["loops"])
        live = self._callbacks()
        for k, csd in sd["callbacks"].items():
            if k in live:
                live[k].load_state_dict(csd)
        t.precision_plugin.load_state_dict(sd["precision"])
        self.data.update(sd["data"])



class CkptrunCallback(Callback):
    """Snapshot the fit every ``every_n_steps`` optimizer steps; restore it at fit start.
    ``persist_to``/``persist_every`` go to ``ckptrun.Checkpointer`` (without the agent)."""

    def __init__(self, every_n_steps: int = 1, persist_to: Optional[str] = None,
                 persist_every: Optional[int] = None) -> None:
        self.every_n_steps = max(1, int(every_n_steps))
        self.persist_to = persist_to
        self.persist_every = persist_every
        self.ckpt: Optional[ckptrun.Checkpointer] = None
        self.restored_step = 0
        self._data = {"epoch": 0, "batches": 0}
        self._rng = S.DeferredRNG()
        self._last = -1
        self._skip: Optional[tuple] = None  # (batch sampler, original sampler) while skipping
        self._rng_before_val: Optional[Dict[str, Any]] = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        state: Dict[str, Any] = {"fit": _FitState(trainer, pl_module, self._data),
                                 "rng": self._rng}
        if ddp.distributed():
            # the strategy's DDP wraps the module: its bucket layout makes the first step
            # after a restore sum the gradients as the run it replaces did (3+ ranks)
            state[ddp.LAYOUT_KEY] = ddp.BucketLayouts({"model": pl_module})
        self.ckpt = ckptrun.Checkpointer(state, capture_rng=False, persist_to=self.persist_to,
                                         persist_every=self.persist_every)
        self.restored_step = self.ckpt.restore()
        self._last = trainer.global_step if self.restored_step else -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.restored_step:
            return
        n = self._data["batches"]
        bs = getattr(trainer.train_dataloader, "batch_sampler", None)
        if n > 0:
            if bs is None or not hasattr(bs, "sampler") or not hasattr(bs, "batch_size"):
                print("ckptrun: the train dataloader has no batch sampler; the data position is "
                      "not restored (the epoch restarts from its first batch)", file=sys.stderr)
                return
            self._skip = (bs, bs.sampler)
            bs.sampler = _SkipOnce(bs.sampler, n * bs.batch_size)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if getattr(trainer.train_dataloader, "num_workers", 0) and fetcher is not None:
            # Lightning made the epoch's iterator before this hook (FitLoop.setup_data), and a
            # loader with workers takes its first batches' indices from the sampler as its
            # iterator is made: in the order of the sampler's epoch then (Lightning sets the
            # resumed one after this hook), without the skip.  Made again, it reads them in
            # the resumed epoch's order through the skipping sampler (persistent workers drop
            # what they had fetched).
            sampler = getattr(bs, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(int(self._data["epoch"]))
            iter(fetcher)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._skip is not None:  # the resumed epoch's iterator has taken what it skips
            bs, inner = self._skip
            bs.sampler, self._skip = inner, None
        self._rng.apply()
        step = trainer.global_step
        if self.ckpt is not None and step > 0 and step != self._last and step % self.every_n_steps == 0:
            self._data.update(epoch=trainer.current_epoch, batches=batch_idx)
            self.ckpt.save(step)
            self._last = step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # before a validation's loader makes its iterator (on_validation_start comes after)
        if self.ckpt is not None and getattr(trainer, "enable_validation", True):
            self._rng_before_val = S.capture_rng()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._rng_before_val is not None:
            S.restore_rng(self._rng_before_val)
            self._rng_before_val = None

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
