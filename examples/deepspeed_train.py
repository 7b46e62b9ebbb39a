"""A DeepSpeed ZeRO training loop (stages 0-3) protected by ckptrun: register the engine.

    pip install deepspeed
    ckptrun --standalone --nproc-per-node 2 examples/deepspeed_train.py --zero-stage 2
    ckptrun --standalone --nproc-per-node 2 examples/deepspeed_train.py --zero-stage 3 --crash-at 6

``Checkpointer({"engine": engine})``: each rank's snapshot is its own ZeRO partitions (fp32
master weights, optimizer moments, stage-3 parameter shards), the LR scheduler and the
engine's counters (``ckptrun.adapters.deepspeed``); a restore puts them back in place.
Gradient accumulation, dropout and gradient clipping as a real loop has them; runs on CPU
with gloo (the optimizer is PyTorch's AdamW, ``torch_adam``, so no DeepSpeed op is compiled).
``--crash-at N`` SIGKILLs rank 1 after optimizer step N in the first attempt; ``--out FILE``
writes the full fp32 weights (rank 0) to compare a run with a failure with one without.
"""

from __future__ import annotations

import argparse
import os
import signal

import deepspeed
import torch
import torch.nn as nn

import ckptrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--persistence-threshold", type=int, default=0,
                   help="stage 3 keeps parameters of fewer elements whole (DeepSpeed's "
                        "stage3_param_persistence_threshold; its own default is 1e5)")
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256),
                          nn.GELU(), nn.Linear(256, 8))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        # 0: stage 3 partitions every parameter (by default it keeps small ones whole)
        "zero_optimization": {"stage": args.zero_stage,
                              "stage3_param_persistence_threshold": args.persistence_threshold},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    torch.manual_seed(1 + rank)  # the dropout stream: captured in every snapshot
    ckpt = ckptrun.Checkpointer({"engine": engine})
    start = ckpt.restore()  # the optimizer step to go on from (0: a fresh start)
    for step in range(start, args.steps):
        for micro in range(args.accum):
            g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
            x = torch.randn(8, 64, generator=g)
            loss = nn.functional.mse_loss(engine(x), x[:, :8].sin())
            engine.backward(loss)
            engine.step()  # applies the update at the last micro-batch of the step
        ckpt.save(step + 1)
        if rank == 0 and (step + 1) % 4 == 0:
            print(f"[deepspeed] step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
        if (step + 1 == args.crash_at and rank == 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    if args.zero_stage == 3:
        from deepspeed.utils import safe_get_full_fp32_param
        weights = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    else:
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if args.out and rank == 0:
        torch.save(weights, args.out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
