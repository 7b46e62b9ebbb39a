"""A user's script (test job): a char-level GPT-2 trained with the HF Trainer the way people
write it -- a tiny config (no download), a map-style dataset of dicts, loader workers that
persist and prefetch, gradient accumulation, a cosine schedule with warm-up, evaluation every
10 steps (its loader's workers persist too), fp32 on CPU.

``--crash-at K`` SIGKILLs rank 1 at the end of step K, after ckptrun's snapshot of it (first
attempt only); ``--in-place`` runs the training under ``@ckptrun.resilient``; ``--out F``:
final weights."""

import argparse
import os
import signal

import torch
from char_corpus import BLOCK, Chunks, chars, data, n
from ckptrun.adapters.transformers import CkptrunCallback
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import ckptrun


class LMChunks(Chunks):
    """The corpus's chunks as the Trainer wants them: input ids, labels (shifted inside)."""

    def __getitem__(self, i):
        s = self.d[i * BLOCK:(i + 1) * BLOCK]
        return {"input_ids": s, "labels": s.clone()}


class Crash(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at and os.environ.get("RANK") == "1" \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def train(a):
    cfg = GPT2Config(vocab_size=len(chars), n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=a.output_dir, use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        per_device_train_batch_size=8, per_device_eval_batch_size=8,
        gradient_accumulation_steps=2, num_train_epochs=a.epochs, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.1, max_grad_norm=1.0,
        eval_strategy="steps", eval_steps=10, logging_steps=5, save_strategy="no",
        dataloader_num_workers=2, dataloader_persistent_workers=True,
        dataloader_prefetch_factor=4, seed=1337, report_to=[], disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=LMChunks(data[:n]),
                      eval_dataset=LMChunks(data[n:], limit=24),
                      callbacks=[CkptrunCallback(), Crash(a.crash_at)])
    trainer.train()
    if a.out and trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, a.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--output-dir", default="hf-out")
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--in-place", action="store_true")
    a = p.parse_args()
    (ckptrun.resilient(train) if a.in_place else train)(a)
