"""Example (and adapter test job) -- HF Trainer job for the adapter tests: a small MLP (no download), synthetic data, dropout,
AdamW + linear schedule, 2 epochs, CPU/gloo; ``--deepspeed-stage N`` trains it through
DeepSpeed ZeRO stage N (the Trainer's own optimizer).  ``--crash-at K`` SIGKILLs rank 1 at step K in
the first attempt (``--in-place``: the training runs under ``@ckptrun.resilient`` and rank 0
recovers in its own process); ``--out F`` writes the final weights (rank 0)."""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn as nn
from ckptrun.adapters.transformers import CkptrunCallback
from transformers import Trainer, TrainerCallback, TrainingArguments

import ckptrun


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Crash(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at and int(os.environ.get("RANK", "0")) == 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--run-dir", default="/tmp/ckptrun-hf")
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--no-ckpt", action="store_true")
    p.add_argument("--deepspeed-stage", type=int, default=-1,
                   help="train through DeepSpeed ZeRO with this stage (1-3)")
    p.add_argument("--in-place", action="store_true",
                   help="@ckptrun.resilient: a rank that did not fail recovers in its process")
    a = p.parse_args()
    (ckptrun.resilient(train) if a.in_place else train)(a)


def train(a: argparse.Namespace) -> None:
    """One training: TrainingArguments (they form the process group), Trainer, train()."""
    ds = None
    if a.deepspeed_stage >= 0:  # the Trainer's own AdamW, handed to DeepSpeed's ZeRO
        ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": a.deepspeed_stage,
                                    "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    ddp = "gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None  # accelerate: 1 process
    args = TrainingArguments(output_dir=a.run_dir, use_cpu=True, ddp_backend=ddp,
                             per_device_train_batch_size=4, num_train_epochs=a.epochs,
                             learning_rate=1e-2, warmup_steps=2, save_strategy="no",
                             logging_steps=5, report_to=[], seed=1, dataloader_num_workers=0,
                             disable_tqdm=True, deepspeed=ds)
    callbacks = [] if a.no_ckpt else [CkptrunCallback()]
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Data(48),
                      callbacks=[*callbacks, Crash(a.crash_at)])
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if a.deepspeed_stage == 3:  # partitioned parameters: gather the full fp32 weights
        from deepspeed.utils import safe_get_full_fp32_param
        weights = {n: safe_get_full_fp32_param(p).clone()
                   for n, p in trainer.model.named_parameters()}
    if a.out and trainer.args.process_index == 0:
        torch.save(weights, a.out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # gloo teardown can abort when one rank exits first
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
