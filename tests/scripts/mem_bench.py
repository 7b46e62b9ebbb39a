"""Ad-hoc memory-tier measurement (not a test): save() blocking time vs a plain copy_ of the
same bytes, snapshot copy bandwidth vs memcpy, restore time -- under a simulated agent
environment (shared-memory slot files), for ~``--mib`` MiB of model + Adam state.

    python tests/scripts/mem_bench.py --mib 256
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
import uuid

import torch


def timed(fn, n=5):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from ckptrun.protocol import ControlBlock, control_path
    from ckptrun.tiers.memory.node import NodeMemory

    token = f"bench{uuid.uuid4().hex[:8]}"
    mem = NodeMemory(token)
    block = ControlBlock(control_path(token), nranks=1, create=True)
    os.environ.update({"CKPTRUN_CONTROL": control_path(token), "CKPTRUN_SLOT_PREFIX":
                       mem.slot_prefix(0), "CKPTRUN_NUM_SLOTS": "3", "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    try:
        import ckptrun

        # params + exp_avg + exp_avg_sq = 3 x params
        per = args.mib * (1 << 20) // 3 // 4 // 8  # floats per layer, 8 layers
        side = int(per ** 0.5)
        model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(8)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())

        src = torch.cat([p.detach().reshape(-1) for p in model.parameters()] * 3).view(torch.uint8)
        dst = torch.empty_like(src)
        dst.fill_(1)  # touched: no first-touch cost in the baseline either
        copy_s = timed(lambda: dst.copy_(src), args.reps)
        memcpy_s = timed(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel()),
                         args.reps)

        results = {}
        for overlap in (True, False):
            ck = ckptrun.Checkpointer({"model": model, "optim": opt}, overlap=overlap)
            ck.save(1)  # allocation (pre-faulted) happens here
            ck.wait()
            blocks, copies, hashes = [], [], []
            for s in range(2, 2 + args.reps):
                ck.wait()  # as in a loop whose compute outlasts the copy
                t0 = time.perf_counter()
                ck.save(s)
                blocks.append(time.perf_counter() - t0)
                ck.wait()
                copies.append(ck.last_copy_s)
                hashes.append(ck.last_hash_s)
            restore_s = []
            for _ in range(3):
                os.environ["CKPTRUN_RESTORE"] = json.dumps({"step": 1 + args.reps, "tier": "memory"})
                t0 = time.perf_counter()
                ck.restore()
                restore_s.append(time.perf_counter() - t0)
            ck.close()
            # as in a restarted worker: fresh model, optimizer without state (first touch)
            fresh = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False)
                                          for _ in range(8)])
            fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-4)
            ck2 = ckptrun.Checkpointer({"model": fresh, "optim": fresh_opt})
            t0 = time.perf_counter()
            ck2.restore()
            fresh_s = time.perf_counter() - t0
            assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
            ck2.close()
            del fresh, fresh_opt, ck2
            results[overlap] = (statistics.median(blocks), statistics.median(copies),
                                statistics.median(hashes), statistics.median(restore_s), fresh_s)
        gb = state_bytes / 1e9
        print(f"state {state_bytes / 2**20:.0f} MiB ({len(list(model.parameters()))} params + Adam)")
        print(f"plain copy_     {copy_s * 1e3:8.1f} ms  {gb / copy_s:6.1f} GB/s")
        print(f"memcpy (1 thr)  {memcpy_s * 1e3:8.1f} ms  {gb / memcpy_s:6.1f} GB/s")
        for overlap, (b, c, h, r, f) in results.items():
            print(f"overlap={overlap!s:5}  save() blocks {b * 1e3:6.2f} ms "
                  f"({100 * b / copy_s:5.1f}% of copy_); background copy+xxh3 {c * 1e3:6.1f} ms "
                  f"= {gb / c:4.1f} GB/s; copy alone {(c - h) * 1e3:6.1f} ms = "
                  f"{gb / (c - h):4.1f} GB/s ({100 * memcpy_s / (c - h):4.0f}% of memcpy); "
                  f"restore: in-process {r * 1e3:6.1f} ms, fresh model+optimizer {f * 1e3:6.1f} ms")
    finally:
        block.close()
        mem.cleanup()


if __name__ == "__main__":
    main()
