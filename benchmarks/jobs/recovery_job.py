"""Benchmark training job: deterministic DDP (gloo) with a configurable amount of state.

The same script runs under ``ckptrun`` and ``torchrun`` and checkpoints in one of four ways
(``--ckpt``): ``ckptrun`` (``Checkpointer.save`` every step), ``torchsave`` (one
``torch.save`` file per rank every ``--save-every`` steps, the newest complete step is
loaded at start), ``dcp`` (``torch.distributed.checkpoint.save`` every ``--save-every``
steps, newest loaded at start), ``floor`` (the least a snapshot every step costs:
:class:`FloorCopy`, no checkpoint kept) and ``none``.

The state is a small MLP + AdamW plus a ``blob`` tensor that pads the state to
``--state-mb`` MiB per rank (think optimizer state or embeddings that change a little every
step); the blob is identical on every rank, as replicated DDP state is.

Every rank logs JSON lines to ``<log-dir>/rank<R>-attempt<A>.jsonl`` with wall-clock
``time.time()``: ``start``, ``restored`` (step), ``step`` (after each completed step),
``kill``/``hang`` (just before the injected failure).  The harness
(``benchmarks/recovery.py``) computes recovery times and steps lost from these files.

Failures are injected only in the first attempt, on rank ``--fail-rank``, *inside* step
``K + 1`` (after its forward pass): step ``K`` is the last one completed.  ``--fail-file``
lets the harness choose the moment (once the launcher is in its steady state).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, TextIO

import torch
import torch.distributed as dist
import torch.nn as nn


class StepLog:
    """Append-only JSON lines with wall-clock times, flushed per line (survives SIGKILL)."""

    def __init__(self, log_dir: str, rank: int, attempt: int) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self._f: TextIO = open(os.path.join(log_dir, f"rank{rank}-attempt{attempt}.jsonl"), "a")

    def write(self, event: str, **fields: Any) -> None:
        self._f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        self._f.flush()


class FloorCopy:
    """The work a snapshot at every step cannot avoid, and nothing else: every state tensor
    copied into a pre-faulted buffer and hashed with xxh3 in 8 MiB chunks (each right
    after its copy, as ckptrun's slot writer does), on a thread that overlaps the next
    forward and backward; the next ``optimizer.step()`` waits for it.  No slot files, no
    agent, no metadata: what ckptrun costs beyond this is its own overhead."""

    CHUNK = 8 << 20

    def __init__(self, tensors: List[torch.Tensor]) -> None:
        self.src = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
        self.dst = torch.zeros(sum(s.numel() for s in self.src), dtype=torch.uint8)
        self.thread: Optional[threading.Thread] = None

    def _copy(self) -> None:
        import xxhash

        digest, off = xxhash.xxh3_64(), 0
        for src in self.src:
            for a in range(0, src.numel(), self.CHUNK):
                piece = self.dst[off + a:off + min(src.numel(), a + self.CHUNK)]
                piece.copy_(src[a:a + self.CHUNK])
                digest.update(piece.numpy())
            off += src.numel()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer,
                  blob: torch.Tensor) -> List[torch.Tensor]:
    """Every tensor a snapshot of ``{"model", "optim", "blob"}`` holds."""
    out = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    out += [t for st in optim.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return out + [blob]


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    layers: list = []
    width = 32
    for _ in range(args.layers):
        layers += [nn.Linear(width, args.hidden), nn.ReLU()]
        width = args.hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def batch(step: int, rank: int, size: int) -> tuple:
    """Data that depends only on (step, rank): exact resume needs no loader state."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def blob_numel(args: argparse.Namespace, model: nn.Module) -> int:
    """Floats to add so that model + AdamW state (3 copies of the weights) reach the size."""
    params = sum(p.numel() for p in model.parameters())
    return max(1024, (args.state_mb << 20) // 4 - 3 * params)


def touch_blob(blob: torch.Tensor, step: int) -> None:
    """A small, deterministic change per step (the blob must change for saves to matter)."""
    i = (step * 4096) % max(1, blob.numel() - 4096)
    blob[i : i + 4096] += 1.0


# ---------------------------------------------------------------- baseline checkpointing

def torchsave_restore(root: str, rank: int, world: int, state: Dict[str, Any]) -> int:
    """Load the newest step whose files exist for every rank; 0 if none."""
    steps = sorted((int(os.path.basename(d).split("-")[1]) for d in glob.glob(f"{root}/step-*")),
                   reverse=True)
    for step in steps:
        if all(os.path.exists(f"{root}/step-{step}/rank{r}.pt") for r in range(world)):
            got = torch.load(f"{root}/step-{step}/rank{rank}.pt", weights_only=True)
            state["model"].load_state_dict(got["model"])
            state["optim"].load_state_dict(got["optim"])
            state["blob"].copy_(got["blob"])
            return step
    return 0


def torchsave_save(root: str, rank: int, step: int, state: Dict[str, Any]) -> None:
    """One file per rank, written then renamed (a half-written file is never loaded)."""
    d = f"{root}/step-{step}"
    os.makedirs(d, exist_ok=True)
    tmp = f"{d}/rank{rank}.pt.tmp"
    torch.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict(),
                "blob": state["blob"]}, tmp)
    os.replace(tmp, f"{d}/rank{rank}.pt")


def dcp_state(ddp: nn.Module, optim: torch.optim.Optimizer, blob: torch.Tensor) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(ddp, optim)
    return {"model": msd, "optim": osd, "blob": blob}


def dcp_restore(root: str, ddp: nn.Module, optim: torch.optim.Optimizer,
                blob: torch.Tensor) -> int:
    """Load the newest complete DCP step (``.metadata`` is written last); 0 if none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    steps = sorted((int(os.path.basename(os.path.dirname(m)).split("-")[1])
                    for m in glob.glob(f"{root}/step-*/.metadata")), reverse=True)
    if not steps:
        return 0
    state = dcp_state(ddp, optim, blob)
    dcp.load(state, checkpoint_id=f"{root}/step-{steps[0]}")
    set_state_dict(ddp, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return steps[0]


# ---------------------------------------------------------------- main loop

def wipe_machine_memory() -> int:
    """Make every snapshot this machine's agent holds unusable (its workers' slots and the
    peer copies it keeps): invert a page in the middle of the data, so checksums fail.
    Stands for a machine whose memory is gone; only other machines' copies are left."""
    from ckptrun import protocol as P

    prefix = os.environ[P.ENV_SLOT_PREFIX]  # <shm>/ckptrun-<token>-r<rank>-s
    n = 0
    for path in glob.glob(prefix[: prefix.rindex("-r")] + "-*"):
        if path.endswith("-control"):
            continue
        mm = P.open_shm_file(path)
        try:
            h = P.SlotHeader.unpack_from(mm)
            if h.state == P.SlotState.COMMITTED and h.data_len >= 2 * P.PAGE:
                mid = h.data_offset + (h.data_len // 2 // P.PAGE) * P.PAGE
                mm[mid : mid + P.PAGE] = bytes(b ^ 0xFF for b in mm[mid : mid + P.PAGE])
                n += 1
        finally:
            mm.close()
    return n


def due(args: argparse.Namespace, at: int, step: int, running_s: float) -> bool:
    """Fail at ``at``, or later once ``--fail-after-s`` of training passed, at the same
    position in the ``--save-every`` cycle (so the baselines' loss is comparable)."""
    if at < 0 or step < at or running_s < args.fail_after_s:
        return False
    if args.fail_file and not os.path.exists(args.fail_file):
        return False  # the harness says when the launcher is in steady state
    return step == at or (step - at) % args.save_every == 0


def inject(args: argparse.Namespace, log: StepLog, step: int, rank: int, attempt: int,
           running_s: float) -> None:
    """Kill or stop this rank during step ``step + 1`` (first attempt only)."""
    if attempt != 0 or rank != args.fail_rank:
        return
    if due(args, args.kill_at, step, running_s):
        if args.wipe:
            log.write("wiped", files=wipe_machine_memory())
        log.write("kill", step=step)
        os.kill(os.getpid(), signal.SIGKILL)
    if due(args, args.hang_at, step, running_s):
        log.write("hang", step=step)
        os.kill(os.getpid(), signal.SIGSTOP)


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", choices=["ckptrun", "torchsave", "dcp", "floor", "none"],
                   default="ckptrun")
    p.add_argument("--state-mb", type=int, default=64, help="state per rank, MiB")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--steps-after-restore", type=int, default=5)
    p.add_argument("--save-every", type=int, default=10, help="torchsave/dcp interval")
    p.add_argument("--ckpt-dir", default="", help="torchsave/dcp directory")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--fail-after-s", type=float, default=0.0,
                   help="train at least this long before failing (a launcher's warm-up done)")
    p.add_argument("--fail-file", default="", help="fail only once this file exists")
    p.add_argument("--wipe", action="store_true",
                   help="with --kill-at: first wipe this machine's snapshots (ckptrun)")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--alternate", type=int, default=0,
                   help="ckptrun: blocks of this many steps without, then with save()")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--in-place", action="store_true",
                   help="run the training under @ckptrun.resilient (in-process recovery)")
    p.add_argument("--setup-s", type=float, default=0.0,
                   help="the process's own start-up before training, outside the training "
                        "function (a tokenizer, a dataset index: what a GPT script loads)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--compile-kept", action="store_true",
                   help="build and torch.compile the model once per process, outside the "
                        "training function: a survivor recovering in place keeps it")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="pad every step to at least this many seconds with a sleep after "
                        "save() (a GPU-bound step: the CPU waits, the snapshot copy overlaps)")
    return p.parse_args(argv)


_KEPT: Optional[nn.Module] = None  # --compile-kept: the process's one compiled model


def compiled_frames() -> int:
    """Python frames torch.compile has compiled in this process so far (0 without dynamo).
    Frames, not graphs: a compiled DDP module breaks into frames that hold no graph of
    their own, and tracing them is still most of its compile time."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def main(argv: Optional[list] = None) -> None:
    global _KEPT
    args = parse(argv)
    if args.setup_s > 0:  # once per process: a survivor recovering in place keeps it
        time.sleep(args.setup_s)
    if args.compile_kept:  # the compiled code lives as long as the process
        _KEPT = torch.compile(build(args))
    if args.in_place:
        import ckptrun

        ckptrun.resilient(train)(args)
    else:
        train(args)


def train(args: argparse.Namespace) -> None:
    """One attempt's training (what ``--in-place`` wraps in ``@ckptrun.resilient``)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = StepLog(args.log_dir, rank, attempt)
    log.write("start", ckpt=args.ckpt)
    frames0 = compiled_frames()  # a survivor's count so far: what it compiles again is new
    dist.init_process_group("gloo")
    model = build(args) if _KEPT is None else _KEPT
    ddp = nn.parallel.DistributedDataParallel(model)
    if args.compile:  # compiled at the first step: a restarted process pays it again
        ddp = torch.compile(ddp)
    optim = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    blob = torch.zeros(blob_numel(args, model))
    torch.manual_seed(1 + rank)
    state = {"model": model, "optim": optim, "blob": blob}

    t0 = time.perf_counter()
    ckpt = None
    if args.ckpt == "ckptrun":
        import ckptrun

        ckpt = ckptrun.Checkpointer(state)
        start = ckpt.restore()
    elif args.ckpt == "torchsave":
        start = torchsave_restore(args.ckpt_dir, rank, world, state)
    elif args.ckpt == "dcp":
        start = dcp_restore(args.ckpt_dir, ddp, optim, blob)
    else:
        start = 0
    log.write("restored", step=start, seconds=time.perf_counter() - t0)

    begun = time.monotonic()
    floor: Optional[FloorCopy] = None  # --ckpt floor: made at the first save (AdamW's state)
    step, end = start, args.steps
    if attempt == 0 and max(args.kill_at, args.hang_at) >= 0:
        end = 1 << 30  # the failure ends the first attempt (the harness has a timeout)
    elif attempt > 0:
        end = start + args.steps_after_restore  # every rank restored the same step
    while step < end:
        t_step = time.perf_counter()
        x, y = batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(ddp(x), y)
        inject(args, log, step, rank, attempt, time.monotonic() - begun)  # ``step`` is done
        optim.zero_grad()
        loss.backward()
        t_opt = time.perf_counter()
        if floor is not None:
            floor.wait()  # as ckptrun's hook makes optimizer.step() wait for its copy
        optim.step()  # under ckptrun this waits for the previous step's background copy
        t_save = time.perf_counter()
        touch_blob(blob, step)
        n = step + 1
        saving = args.alternate <= 0 or (step // args.alternate) % 2 == 1
        if ckpt is not None and saving:
            ckpt.save(n)
        elif args.ckpt == "floor" and saving:
            floor = floor or FloorCopy(state_tensors(model, optim, blob))
            floor.start()
        elif args.ckpt == "torchsave" and n % args.save_every == 0:
            torchsave_save(args.ckpt_dir, rank, n, state)
        elif args.ckpt == "dcp" and n % args.save_every == 0:
            import torch.distributed.checkpoint as dcp

            dcp.save(dcp_state(ddp, optim, blob), checkpoint_id=f"{args.ckpt_dir}/step-{n}")
        t_done = time.perf_counter()
        if args.step_time > 0:
            time.sleep(max(0.0, args.step_time - (t_done - t_step)))
        log.write("step", step=n, opt_s=t_save - t_opt, save_s=t_done - t_save,
                  saving=saving, **({"compiled": compiled_frames() - frames0}
                                    if n == start + 1 else {}))
        step = n
    if ckpt is not None:
        ckpt.close()
    if floor is not None:
        floor.wait()
    dist.barrier()  # gloo teardown while a peer is still sending aborts (seen without ckptrun)
    dist.destroy_process_group()
    log.write("done")


if __name__ == "__main__":
    main()
