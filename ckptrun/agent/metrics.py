"""``--metrics-port``: one agent's metrics in Prometheus text format, for the cluster's monitoring.

Served by ``prometheus_client`` (imported only when the option is given) on the address of
``--metrics-addr`` (loopback unless told otherwise: the numbers name steps, hosts and
sizes of someone's job).  Every agent serves its own machine: Prometheus scrapes each node,
as it scrapes each node's exporter.

Two sources, both already the agent's record of the job, so the metrics cannot disagree
with ``events.jsonl`` and ``status.json``:
  * its events (:meth:`AgentMetrics.event`, called by the event log for every record):
    failures, restarts by cause, restores by tier, recoveries and their downtime, persists;
  * its status (:meth:`AgentMetrics.status`, each time ``status.json`` is written): the
    workers' steps and snapshot timings, the newest step of each tier, replication rounds,
    bytes and lag.

A scrape reads the newest of both under a lock; nothing is computed on the training path.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ckptrun.protocol.gate import Gate

# upper bounds (s) of the downtime histogram: from a warm in-memory restore to a slow
# machine replacement
DOWNTIME_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PHASES = ("detect_s", "stop_s", "start_s", "restore_s", "first_step_s")


def available() -> bool:
    """Whether ``prometheus_client`` can be imported (a declared dependency; checked before
    anything starts so that a broken install is one usage line)."""
    import importlib.util

    return importlib.util.find_spec("prometheus_client") is not None


class AgentMetrics:
    """A ``prometheus_client`` collector of one agent's job (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: Dict[str, Any] = {}
        self._started: Optional[float] = None
        self._failures: Dict[str, int] = {}  # worker_failed / hang_detected by reason
        self._restarts: Dict[str, int] = {}  # by cause
        self._cause: Optional[str] = None  # of the failure the next restart answers
        self._restores: Dict[str, List[float]] = {}  # tier -> seconds of each
        self._downtimes: List[float] = []
        self._phases: Dict[str, float] = {}
        self._persists: List[Tuple[int, float]] = []  # (bytes, seconds)
        self._persist_failures = 0
        self._machines_lost = 0
        self._store_forged = 0
        self._steps_lost = 0  # steps of training given up by restarts from step 0

    # -- feeding ------------------------------------------------------------------------
    def event(self, record: Dict[str, Any]) -> None:
        """One event as written to ``events.jsonl``."""
        name = record.get("event")
        with self._lock:
            if name == "start" and self._started is None:
                self._started = float(record.get("time", time.time()))
            elif name == "worker_failed":
                reason = "signal" if "signal" in record else "exit"
                self._failures[reason] = self._failures.get(reason, 0) + 1
                self._cause = self._cause or f"worker_{reason}"
            elif name == "hang_detected":
                self._failures["hang"] = self._failures.get("hang", 0) + 1
                self._cause = self._cause or "hang"
            elif name == "node_lost":
                self._machines_lost += 1
                self._cause = self._cause or "machine_lost"
            elif name == "restart":
                # no failure seen here: another machine's failure restarted the job
                cause = self._cause or "remote_failure"
                self._restarts[cause] = self._restarts.get(cause, 0) + 1
                self._cause = None
            elif name == "restored":
                tier = str(record.get("tier") or "memory")
                self._restores.setdefault(tier, []).append(_num(record.get("seconds")))
            elif name == "recovered":
                self._downtimes.append(_num(record.get("downtime_s")))
                phases = record.get("phases")
                if isinstance(phases, dict):
                    self._phases = {p: _num(phases.get(p)) for p in PHASES}
            elif name == "persisted":
                self._persists.append((int(_num(record.get("bytes"))),
                                       _num(record.get("seconds"))))
            elif name == "persist_failed":
                self._persist_failures += 1
            elif name == "store_forged":
                self._store_forged += 1
            elif name == "progress_lost":
                self._steps_lost += int(_num(record.get("step")))

    def status(self, status: Dict[str, Any]) -> None:
        """The agent's newest ``status.json`` object."""
        with self._lock:
            self._status = status

    # -- scraping -----------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        """The metric families of a scrape (``prometheus_client``'s collector protocol)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            SummaryMetricFamily,
        )
        with self._lock:
            st = dict(self._status)
            failures, restarts = dict(self._failures), dict(self._restarts)
            restores = {k: list(v) for k, v in self._restores.items()}
            downtimes, phases = list(self._downtimes), dict(self._phases)
            persists, started = list(self._persists), self._started
            counts = (self._persist_failures, self._machines_lost, self._store_forged,
                      self._steps_lost)

        info = GaugeMetricFamily("ckptrun_info", "The job this agent runs (value 1).",
                                 labels=["run_id", "node", "state"])
        info.add_metric([str(st.get("run_id", "")), str(st.get("node", "")),
                         str(st.get("state", "starting"))], 1)
        yield info
        yield GaugeMetricFamily("ckptrun_attempt", "The attempt the job is in (0: never "
                                "restarted).", value=_num(st.get("attempt", 0)))

        c = CounterMetricFamily("ckptrun_worker_failures", "Workers of this machine that "
                                "failed, by reason (exit, signal, hang).", labels=["reason"])
        for reason in ("exit", "signal", "hang"):
            c.add_metric([reason], failures.get(reason, 0))
        yield c
        c = CounterMetricFamily("ckptrun_restarts", "Restarts of the job seen by this agent, by "
                                "cause (worker_exit, worker_signal, hang, machine_lost, "
                                "remote_failure: another machine's).", labels=["cause"])
        for cause in ("worker_exit", "worker_signal", "hang", "machine_lost", "remote_failure"):
            c.add_metric([cause], restarts.get(cause, 0))
        yield c
        yield CounterMetricFamily("ckptrun_machines_lost", "Machines this agent saw lost.",
                                  value=counts[1])

        s = SummaryMetricFamily("ckptrun_restore_seconds", "Restores of this machine's "
                                "ranks and the time each took, by tier.", labels=["tier"])
        for tier in ("memory", "peer", "storage"):
            got = restores.get(tier, [])
            s.add_metric([tier], count_value=len(got), sum_value=sum(got))
        yield s
        h = HistogramMetricFamily("ckptrun_recovery_downtime_seconds", "Recoveries: from the "
                                  "failure until every rank completed its first step after "
                                  "the restore.")
        h.add_metric([], _buckets(downtimes), sum_value=sum(downtimes))
        yield h
        g = GaugeMetricFamily("ckptrun_last_recovery_phase_seconds", "Where the last "
                              "recovery's downtime went (detect, stop, start, restore, "
                              "first_step: the script's own start-up).", labels=["phase"])
        for p in PHASES:
            if p in phases:
                g.add_metric([p[:-2]], phases[p])
        yield g

        workers = [w for w in st.get("workers") or [] if isinstance(w, dict)]
        for name, key, text in (
                ("ckptrun_step", "step", "The newest step each rank reported."),
                ("ckptrun_snapshot_block_seconds", "save_block_s",
                 "How long the last save() blocked the training loop."),
                ("ckptrun_snapshot_copy_seconds", "save_copy_s",
                 "How long the last snapshot's copy into memory took."),
                ("ckptrun_snapshot_bytes", "state_bytes", "The size of one snapshot.")):
            g = GaugeMetricFamily(name, text, labels=["rank"])
            for w in workers:
                if isinstance(w.get(key), (int, float)):
                    g.add_metric([str(w.get("rank"))], w[key])
            yield g
        c = CounterMetricFamily("ckptrun_snapshots", "Snapshots taken in memory since each "
                                "rank's process started.", labels=["rank"])
        for w in workers:
            if isinstance(w.get("saves"), int):
                c.add_metric([str(w.get("rank"))], w["saves"])
        yield c

        ck = st.get("checkpoint") or {}
        g = GaugeMetricFamily("ckptrun_checkpoint_step", "The newest step held by each tier "
                              "(memory: every rank of this machine; peer: its copies "
                              "elsewhere; storage: persisted).", labels=["tier"])
        for tier, key in (("memory", "memory_step"), ("peer", "peer_step"),
                          ("storage", "persisted_step")):
            if isinstance(ck.get(key), int):
                g.add_metric([tier], ck[key])
        yield g
        s = SummaryMetricFamily("ckptrun_persist_seconds", "Steps persisted to durable "
                                "storage and the time each took.")
        s.add_metric([], count_value=len(persists), sum_value=sum(t for _, t in persists))
        yield s
        yield CounterMetricFamily("ckptrun_persisted_bytes", "Bytes persisted to durable "
                                  "storage.", value=sum(b for b, _ in persists))
        yield CounterMetricFamily("ckptrun_persist_failures", "Persists that failed.",
                                  value=counts[0])
        for name, key, text, kind in (
                ("ckptrun_replication_rounds", "replication_rounds",
                 "Replication rounds this machine completed.", CounterMetricFamily),
                ("ckptrun_replicated_bytes", "replicated_bytes",
                 "Bytes this machine pushed to its peers.", CounterMetricFamily),
                ("ckptrun_replication_round_seconds", "replication_round_s",
                 "How long the last replication round took.", GaugeMetricFamily),
                ("ckptrun_replication_lag_steps", "replication_lag_steps",
                 "Steps the peers' copies trail this machine's newest snapshot.",
                 GaugeMetricFamily)):
            if isinstance(ck.get(key), (int, float)):
                yield kind(name, text, value=ck[key])
        yield CounterMetricFamily("ckptrun_store_forged", "Rendezvous-store values refused "
                                  "for a wrong MAC (someone else wrote them).", value=counts[2])
        yield CounterMetricFamily("ckptrun_steps_lost", "Steps this machine's ranks had reached "
                                  "when a restart found nothing to restore and started them "
                                  "over from step 0.", value=counts[3])

        if started is not None:
            elapsed = max(0.0, time.time() - started)
            down = sum(downtimes)
            yield GaugeMetricFamily("ckptrun_elapsed_seconds", "Wall time since the job "
                                    "started on this machine.", value=elapsed)
            yield GaugeMetricFamily("ckptrun_effective_training_seconds", "Wall time since "
                                    "the start less the downtime of its recoveries.",
                                    value=max(0.0, elapsed - down))


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else 0.0


def _buckets(values: List[float]) -> List[Tuple[str, int]]:
    """Cumulative histogram buckets, +Inf last."""
    out = [(str(b), sum(1 for v in values if v <= b)) for b in DOWNTIME_BUCKETS]
    return out + [("+Inf", len(values))]


class MetricsServer:
    """The HTTP endpoint of one :class:`AgentMetrics` (``prometheus_client``'s server)."""

    def __init__(self, metrics: AgentMetrics, port: int, addr: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics)
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        self._gate = _gate_requests(self._server)
        host, real_port = self._server.server_address[:2]
        self.url = f"http://{_url_host(host)}:{real_port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._gate.close()


def _gate_requests(server: Any) -> Gate:
    """Bound ``server``'s connections (a ``socketserver`` that starts a thread per request):
    at most :data:`~ckptrun.protocol.gate.MAX_PENDING` at once, each done within the gate's
    deadline -- a scrape takes milliseconds; a client that trickles its request line no longer
    holds a thread for as long as it likes."""
    gate = Gate("metrics connection")
    process, shutdown = server.process_request, server.shutdown_request

    def process_request(request: Any, client_address: Any) -> None:
        gate.admit(request, str(client_address[0]))
        try:
            process(request, client_address)
        except RuntimeError:  # no thread to be had now: the client retries
            gate.leave(request)
            request.close()

    def shutdown_request(request: Any) -> None:
        gate.leave(request)
        shutdown(request)

    server.process_request, server.shutdown_request = process_request, shutdown_request
    return gate


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
