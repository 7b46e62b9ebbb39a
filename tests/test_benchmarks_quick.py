"""Smoke test of the benchmark harness at a tiny size: sections present, numbers positive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_benchmark_run(tmp_path):
    out = tmp_path / "bench.json"
    doc = tmp_path / "perf.md"
    from benchmarks.report import BEGIN, END

    doc.write_text(f"# perf\n\nintro\n\n{BEGIN}\nSTALE-GENERATED-TEXT\n{END}\n\noutro\n")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--sizes", "8M", "--reps", "1", "--out", str(out),
         "--tmpdir", str(tmp_path), "--no-print", "--update-doc", str(doc),
         # the sections that launch jobs take minutes: tests/test_benchmarks_recovery.py
         "--only", "limits,stall,replication,quoted,goodput", "--replication-size", "4M"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["sizes"] == [8 << 20]
    sections = res["sections"]
    assert {"limits", "stall", "goodput", "replication", "quoted"} <= set(sections)
    for name, sec in sections.items():
        assert "error" not in sec, (name, sec.get("error"))
        assert sec["rows"], name

    cases = {r["case"]: r for r in sections["limits"]["rows"]}
    for case in ("memcpy", "shm copy (pre-faulted)", "shm first touch", "loopback TCP",
                 "disk write+fsync", "fsspec write"):
        row = cases[case]
        assert row["bytes"] == 8 << 20
        assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
        assert row["gb_per_s"] > 0 and row["vs_memcpy"] > 0
    assert cases["memcpy"]["vs_memcpy"] == 1.0
    assert cases["cold torch import"]["median_s"] > 0

    methods = {r["method"]: r for r in sections["stall"]["rows"]}
    for method in ("plain copy_", "torch.save+fsync", "DCP save", "DCP async_save"):
        assert methods[method]["median_s"] > 0
    assert methods["DCP async_save"]["total_median_s"] > 0
    assert "ckptrun save()" in methods

    goodput = [r for r in sections["goodput"]["rows"] if r["inputs"].startswith("measured")]
    assert len({r["inputs"] for r in goodput}) == 2
    assert [r["machines"] for r in goodput][:1] == [16]
    for r in goodput:
        assert 0 <= r["ckptrun_ratio"] <= 1 and 0 <= r["storage_ratio"] <= 1
        assert r["failures_per_day"] > 0
    assert res["meta"]["goodput_inputs"]["state_bytes"] == 8 << 20

    rep = {r["case"]: r for r in sections["replication"]["rows"]}
    assert rep["raw loopback TCP"]["vs_tcp"] == 1.0 and rep["push"]["gb_per_s"] > 0
    assert rep["push"]["bytes"] == 4 << 20 and 0 < rep["push paced (1 GB/s)"]["vs_rate"] <= 1.5
    assert rep["push"]["met"] in ("yes", "no")
    assert all("not measured" in r["source"] for r in sections["quoted"]["rows"])

    text = doc.read_text()
    assert text.startswith("# perf\n\nintro") and text.rstrip().endswith("outro")
    assert "STALE-GENERATED-TEXT" not in text and "Limits of this machine" in text and "| memcpy |" in text
