"""The CUDA paths, on a machine with a GPU (skipped elsewhere, CI included).

* a job whose state lives on the GPU is snapshotted through the pinned slots (device -> host
  copies on a side stream), SIGKILLed, restored from memory onto the GPU, and ends bitwise
  equal to the failure-free run;
* ``@ckptrun.resilient`` on the GPU: the survivor keeps its process (and its CUDA context)
  and the run is still bitwise;
* an NCCL communicator is aborted and a new one formed in the same process -- what a
  survivor's in-place recovery does to an NCCL group (``ckptrun.worker.collectives``).

Two ranks share one GPU in these jobs (one GPU is what a test machine has), so their group is
gloo, which reduces CUDA tensors; NCCL refuses two ranks on one device, so its abort is
exercised with a group of one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import ckptrun_cmd, run_events

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
STEPS = 16


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _pids(output: str) -> dict:
    """rank -> {attempt: the pid it ran in}, from examples/train.py's start line."""
    got: dict = {}
    for rank, attempt, pid in re.findall(r"\[demo\] rank (\d+): attempt (\d+) in pid (\d+)",
                                         output):
        got.setdefault(int(rank), {})[int(attempt)] = int(pid)
    return got


def _job(tmp_path, name: str, *args: str) -> tuple:
    run_dir, out = tmp_path / name, tmp_path / f"{name}.pt"
    proc = subprocess.run(
        ckptrun_cmd("--standalone", "--nproc-per-node", "2", "--hang-timeout", "10",
                    "--run-dir", str(run_dir), TRAIN, "--device", "cuda", "--width", "256",
                    "--ballast-mib", "64", "--steps", str(STEPS), "--out", str(out), *args),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, run_events(str(run_dir)), torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _job(tmp_path_factory.mktemp("ref"), "ref")[2]


def test_a_gpu_job_killed_mid_run_restores_from_memory_bitwise(tmp_path, reference):
    _, evts, weights = _job(tmp_path, "job", "--crash-at", "6")
    restored = [e for e in evts if e["event"] == "restored"]
    assert restored and restored[0]["tier"] == "memory" and restored[0]["step"] >= 5, restored
    assert _equal(weights, reference), "a restore onto the GPU changed the result"


def test_gpu_survivors_recover_in_their_own_process(tmp_path, reference):
    proc, evts, weights = _job(tmp_path, "job", "--in-place", "--crash-at", "6",
                               "--crash-rank", "1")
    restarts = [e for e in evts if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["in_place"] == [0], restarts
    pids = _pids(proc.stdout + proc.stderr)
    assert pids[0][0] == pids[0][1] and pids[1][0] != pids[1][1], pids
    assert _equal(weights, reference), "in-place recovery on the GPU changed the result"


def test_a_failed_slot_registration_is_not_the_scripts_next_cuda_error(capfd):
    """A failed cudaHostRegister leaves its error for torch's next kernel-launch check,
    which reported it as the script's ("resource already mapped" out of a backward())."""
    from ckptrun.worker import pinning
    from ckptrun.worker.slotset import SlotSet

    x = torch.ones(4, device="cuda")
    slots = SlotSet(None, 2, 1)
    mm = slots.ensure(0, 8 << 20, 0, 4 << 20)
    assert slots._pinned[0] is not None, "a slot of a process that uses CUDA is pinned"
    view = torch.frombuffer(mm, dtype=torch.uint8)
    assert not pinning.register(view, 0)  # registered already: the runtime refuses
    assert float((x * 2).sum()) == 8.0  # a kernel launch after the failure
    assert "failed (cudaError" in capfd.readouterr().err
    del view
    slots.close()


def test_the_optimizer_step_waits_only_for_the_copies_off_the_gpu(monkeypatch):
    """The checksum of the host copy runs beside the next step (made slow here); the step
    changes the weights meanwhile and the snapshot still holds the saved step's."""
    import ckptrun
    from ckptrun.snapshot import slots as slots_mod

    real = slots_mod.SlotWrite._hash_to

    def slow(self, end):
        time.sleep(0.05)
        real(self, end)
    monkeypatch.setattr(slots_mod.SlotWrite, "_hash_to", slow)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        model(torch.ones(8, 1024, device="cuda")).square().sum().backward()
        opt.step()
        torch.cuda.synchronize()
    ckpt = ckptrun.Checkpointer({"model": model, "optim": opt})
    step()
    ckpt.save(1)
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    step()  # its optimizer.step() waited for the copies only: the checksum is still running
    assert ckpt._pending is not None and not ckpt._pending.is_set()
    assert not torch.equal(model.weight.detach().cpu(), saved["weight"])
    ckpt.wait()
    assert ckpt.restore() == 1
    assert all(torch.equal(v.detach().cpu(), saved[k]) for k, v in model.state_dict().items())
    ckpt.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_state_on_another_gpu_than_the_current_one_is_copied_on_its_own_stream():
    """A script may keep its model on cuda:1 without torch.cuda.set_device: the copies off
    the GPU must be ordered after that device's kernels, on a stream of that device."""
    import ckptrun

    assert torch.cuda.current_device() == 0
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).to("cuda:1")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = ckptrun.Checkpointer({"model": model, "optim": opt})
    for step in (1, 2):
        opt.zero_grad()
        model(torch.ones(8, 1024, device="cuda:1")).square().sum().backward()
        opt.step()  # no synchronize: the copies must wait for these kernels themselves
        ckpt.save(step)
    ckpt.wait()
    assert ckpt._stream.device == torch.device("cuda:1")
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    assert ckpt.restore() == 2
    assert all(torch.equal(v.detach().cpu(), saved[k]) for k, v in model.state_dict().items())
    ckpt.close()


def test_checkpointers_dropped_or_closed_leave_no_registered_memory_behind(monkeypatch, capfd):
    """A slot map unmapped while registered stays registered in the driver: the next map at
    its address failed to register (cudaError 712) and the copies into it failed at the
    script's next kernel ("resource already mapped"), seen when a benchmark dropped one
    Checkpointer and made another."""
    import gc

    import ckptrun
    from ckptrun.worker import pinning

    monkeypatch.setattr(pinning, "_warned", False)
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for round_ in range(4):
        ckpt = ckptrun.Checkpointer({"model": model, "optim": opt})
        for step in range(3):
            opt.zero_grad()
            model(torch.ones(64, 2048, device="cuda")).square().mean().backward()
            opt.step()
            ckpt.save(step + 1)
        ckpt.wait()
        assert all(v is not None for v in ckpt._slots._pinned), round_
        if round_ % 2:
            ckpt.close()
        del ckpt
        gc.collect()
    torch.cuda.synchronize()
    assert "failed (cudaError" not in capfd.readouterr().err


def test_an_nccl_communicator_is_aborted_and_formed_again_in_the_same_process(tmp_path):
    probe = os.path.join(ROOT, "tests", "scripts", "nccl_reform_probe.py")
    proc = subprocess.run([sys.executable, probe, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["installed"] and got["sum_0"] == got["sum_1"] == 1.0, got
    assert got["destroyed_0"] and got["destroyed_1"], got
    assert "aborting the NCCL communicators failed" not in proc.stderr, proc.stderr[-2000:]
    assert got["cuda_after"] == 16.0, got  # the process's CUDA context survived the abort
    print(json.dumps(got))
