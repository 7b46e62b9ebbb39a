"""``--standby`` that is never needed: it waits without a rank and leaves when the job ends.

The takeover itself (a standby taking a lost machine's place, and more losses than standbys)
is in ``test_machine_loss.py``, with the other machine losses; this one times nothing, so it
runs beside other tests.
"""

from __future__ import annotations

import uuid

import pytest
from machines import (
    assert_bitwise_equal,
    finish,
    free_port,
    listening,
    machine,
    of,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("namespaces")]



def test_an_unneeded_standby_leaves_when_the_job_ends(tmp_path, references):
    """A standby of a job that loses no machine exits 0 when the job is over, and it never
    took a rank: the job's weights are those of a 2-machine run."""
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id]
    out = str(tmp_path / "final.pt")
    a = machine(tmp_path, "a", common, out, step_time="0.02")
    wait_until(lambda: listening(port), 60, "the store host", [a])
    s = machine(tmp_path, "s", common + ["--standby"], out, step_time="0.02")
    b = machine(tmp_path, "b", common, out, step_time="0.02")
    codes = finish([a, b, s], 180)
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in "abs"}
    assert codes == [0, 0, 0], logs
    assert "finished without needing this standby" in logs["s"], logs["s"]
    assert not of(s.run_dir, "start")
    assert sorted(of(m.run_dir, "start")[0]["node"] for m in (a, b)) == [0, 1]
    assert_bitwise_equal(out, references(2))
