"""Shared test helpers: run the real ``ckptrun`` command and check for leftovers."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Callable, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def ckptrun_cmd(*args: str) -> List[str]:
    """The command line of ``ckptrun ARGS...`` in this interpreter."""
    return [sys.executable, "-m", "ckptrun.cli", *args]


def run_events(run_dir: str) -> List[dict]:
    """``<run_dir>/events.jsonl`` as a list of dicts."""
    try:
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def run_status(run_dir: str) -> dict:
    """``<run_dir>/status.json`` as a dict ({} when absent or unreadable)."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def file_tail(path: Optional[str], n: int = 4000) -> str:
    """The last ``n`` characters of a file ("" when there is none): a failed test's log."""
    try:
        with open(path or "", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def job_shm_files(run_dir: str) -> List[str]:
    """``/dev/shm/ckptrun-<token>-*`` files still present for the agents of ``run_dir``.

    Per job token (from the ``start`` events), not a global glob: other tests may run
    concurrently on the same machine.
    """
    tokens = {e.get("job_token") for e in run_events(run_dir) if e["event"] == "start"}
    return [p for t in tokens if t for p in glob.glob(f"/dev/shm/ckptrun-{t}-*")]


ENV_SHARED = "CKPTRUN_TEST_SHARED_DIR"


def shared_weights(tmp_path_factory, key: str, make: Callable[[pathlib.Path], str]) -> dict:
    """The weights in the file ``make(directory)`` writes -- made once per test session (per
    ``make test`` where it names :data:`ENV_SHARED`) and ``key``, by whichever xdist worker
    asks first, the other waiting for it.

    Why: the failure-free reference runs are module fixtures, and tests of one module run on
    both workers, so each worker ran every reference it needed -- the same CPU-seconds twice
    on a 2-core machine.  ``key`` must name everything the run depends on.
    """
    import torch

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's directory, above each worker's own
    root = base / "shared"
    # `make test` runs pytest three times (two at a time, paired, serial) over the same code:
    # it names one directory for all three, so that a reference made by one part serves the
    # next instead of being trained again
    if os.environ.get(ENV_SHARED):
        root = pathlib.Path(os.environ[ENV_SHARED])
    root.mkdir(exist_ok=True)
    d, done = root / key, root / f"{key}.done"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(d, ignore_errors=True)  # a worker's failed try
            d.mkdir()
            done.write_text(make(d))  # written only once the file is complete
    return torch.load(done.read_text(), weights_only=True)


@pytest.fixture
def ckptrun_run():
    """``ckptrun_run(*args, timeout=..., env=...)`` -> CompletedProcess (text output)."""

    def run(*args: str, timeout: float = 180, env=None, cwd=None):
        return subprocess.run(ckptrun_cmd(*args), capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=cwd)

    return run


# Modules whose tests time things or wait for timeouts that a second test running beside them
# would stretch (hang detection, replication pacing, the fault soak, the benchmarks):
# `make test` runs them alone, last.  Plain `pytest` runs everything one at a time.
# A test elsewhere that does so is marked ``serial`` itself.
SERIAL_MODULES = {
    "test_hang_progress", "test_agent_hang", "test_check_soak",
    "test_pacing", "test_snapshot_interval",
    "test_benchmarks_machines", "test_benchmarks_quick", "test_benchmarks_recovery",
    "test_storage_bench", "test_beat_windows",
}

# The multi-machine scenarios (machine loss, etcd, the Slurm cluster, the store under attack,
# replication) and the end-to-end recoveries: their timed checks (a link-detected loss within
# 2 s, a crash seen within 3 s) hold with a second test beside them (each runs ~1.6x longer:
# they are CPU-bound), so `make test` runs them two at a time, between the rest and the
# serial modules.
PAIRED_MODULES = {
    "test_machine_loss", "test_etcd_machine_loss", "test_slurm", "test_sec_store",
    "test_agent_multinode", "test_multinode_replication", "test_e2e_recovery",
}


# Modules whose tests share a failure-free reference run (:func:`shared_weights`), longest
# first: each runs on one xdist worker, one test after the other (`make test` passes
# ``--dist loadgroup``).  Spread over both workers, two tests asked for the same reference at
# once and one of the two cores waited for the other to train it (up to ~30 s each time).
GROUPED_MODULES = ("test_framework_gpt_scripts", "test_inplace", "test_preemption",
                   "test_adapters_frameworks", "test_vision_script")


def _schedule_key(item) -> tuple:
    """Longest work first, so that the end of a part is short tests on both workers rather
    than one long test on one while the other waits: the grouped modules, then the tests
    marked ``slow``, then the rest (collection order within each)."""
    stem = item.path.stem
    if stem in GROUPED_MODULES:
        return (0, GROUPED_MODULES.index(stem))
    return (1 if item.get_closest_marker("slow") is not None else 2, 0)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        compat = item.get_closest_marker("compat")
        if compat is not None:  # travels with the report, from an xdist worker too
            item.user_properties.append(("compat", compat.args[0]))
        if item.path.stem in GROUPED_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        if item.get_closest_marker("serial") is not None:
            continue  # marked in its module: it times something alone
        if item.path.stem in PAIRED_MODULES:
            item.add_marker(pytest.mark.paired)
        elif item.path.stem in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
    items.sort(key=_schedule_key)  # stable: collection order within a key


@pytest.fixture(autouse=True)
def _cold_restarts_unless_marked(request, monkeypatch):
    """Tests restart workers cold (``CKPTRUN_WARM_SPARES=0``) unless marked ``spares``.

    Why: a warm spare per local rank imports torch in the background after every start,
    several CPU-seconds each; on the 2-core CI machine that was a third of the suite's time.
    The warm path keeps its own coverage: the tests marked ``spares`` (recovery end to end,
    torchrun parity, orphans, the CI fault soak) run with the product's default.
    """
    if request.node.get_closest_marker("spares") is None:
        monkeypatch.setenv("CKPTRUN_WARM_SPARES", "0")


# One OpenMP thread a worker, as torchrun gives every worker of a multi-rank machine: the
# simulated machines run one rank each, which torch would give two intra-op threads on this
# 2-core machine, and four to eight such workers beside a second test spun on each other --
# a machine-loss test used 20% more CPU without it.  The launcher's own default is tested
# with the variable unset (tests/test_agent_env.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every job the tests start has a job secret, as a user's multi-machine job must; set for the
# whole session (module- and session-scoped fixtures start jobs before any function-scoped
# fixture runs).  The tests of a job without one remove it themselves.
os.environ.setdefault("CKPTRUN_SECRET", os.urandom(32).hex())


@pytest.fixture
def token():
    """A job token of this test's own: the shared-memory files named after it go with it."""
    import uuid

    tok = "test" + uuid.uuid4().hex[:8]
    yield tok
    for f in glob.glob(f"/dev/shm/ckptrun-{tok}*"):
        os.unlink(f)


# The modules that simulate machines (tests/machines.py) use these two with
# ``pytestmark = pytest.mark.usefixtures("namespaces")``.
@pytest.fixture(scope="module")
def namespaces():
    """Skips the module where private-memory machines cannot be simulated."""
    from machines import require_namespaces

    require_namespaces()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``references(world)``: the final weights of a failure-free run with ``world`` ranks
    (``machines.reference_weights``)."""
    from machines import reference_weights

    return reference_weights(tmp_path_factory)


# The compatibility report (docs/compat.md): where CKPTRUN_COMPAT_REPORT names a file, each
# pytest run adds the outcome of its ``compat``-marked tests under the running torch's version
# (`make test` runs pytest several times, on several torch releases: tests/compat_table.py
# turns the files into the table).
ENV_COMPAT_REPORT = "CKPTRUN_COMPAT_REPORT"
_compat_outcomes: dict = {}


def pytest_runtest_logreport(report) -> None:
    feature = dict(report.user_properties).get("compat")
    if not feature or not os.environ.get(ENV_COMPAT_REPORT):
        return
    tests = _compat_outcomes.setdefault(feature, {})
    if report.failed:
        tests[report.nodeid] = "failed"
    elif report.skipped and tests.get(report.nodeid) != "failed":
        tests[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        tests.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get(ENV_COMPAT_REPORT)
    if not path or hasattr(session.config, "workerinput") or not _compat_outcomes:
        return  # an xdist worker: its reports reach the controller, which writes
    import torch

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    if data.get("torch") != torch.__version__:
        data = {"torch": torch.__version__, "python": sys.version.split()[0], "features": {}}
    for feature, tests in _compat_outcomes.items():
        data["features"].setdefault(feature, {}).update(tests)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
