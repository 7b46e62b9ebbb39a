#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a GPU and no network (PyTorch already there):
# the CUDA tests (tests/test_cuda.py) and the CUDA benchmark section (benchmarks/cuda.py).
#
#   benchmarks/cuda_check.sh [OUT_DIR]      (wheels for missing dependencies in .whl/)
#
# Writes OUT_DIR/cuda.json (the section's rows) and OUT_DIR/log.  CUDA_PARTS (default all:
# copy,save,process,recovery) picks the benchmark's parts.
set -u
out=${1:-${OUT:-/tmp/ckptrun-cuda}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# ckptrun itself: an editable install where setuptools allows it, else the tree on the path
# (adapters/ is imported as ckptrun.adapters: a link stands in for the install's mapping)
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>/dev/null; then
    [ -e ckptrun/adapters ] || ln -s ../adapters ckptrun/adapters
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, ckptrun; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py 2>&1
    # NCCL with a real peer failure needs two ranks; with one GPU they share it, which NCCL
    # may refuse: try two ranks on GPU 0 first, and only where that works run an in-place
    # job with rank 1 SIGKILLed
    echo "== NCCL, two ranks on GPU 0"
    cat >/tmp/nccl_pair.py <<'PY'
import os, sys, tempfile, traceback
import torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, path):
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2)
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        print(f"rank {rank}: all_reduce gave {x[0].item()}", flush=True)
    except Exception as exc:
        print(f"rank {rank}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}", flush=True)
        os._exit(1)

if __name__ == "__main__":
    mp.spawn(run, args=(tempfile.mktemp(),), nprocs=2)
PY
    if timeout 60 python3 /tmp/nccl_pair.py; then
        rm -rf /tmp/nccl-run
        timeout 90 python3 -m ckptrun.cli --standalone --nproc-per-node 2 --max-restarts 1 \
            --run-dir /tmp/nccl-run examples/train.py --device cuda --backend nccl --width 256 \
            --steps 16 --in-place --crash-at 6 --crash-rank 1 2>&1 | tail -25
        echo "rc=${PIPESTATUS[0]}"
        grep -h '"restart"\|"restored"\|"recovered"' /tmp/nccl-run/events.jsonl 2>/dev/null
        cp /tmp/nccl-run/events.jsonl "$out/nccl-events.jsonl" 2>/dev/null
    fi
    timeout 170 python3 -m benchmarks --only cuda --sizes 256M,1G --reps 3 \
        --cuda-parts "${CUDA_PARTS:-copy,save,process,recovery}" --out "$out/cuda.json" 2>&1
} | tee "$out/log"
