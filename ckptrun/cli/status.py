"""``ckptrun status [--run-dir DIR] [--json] [--watch]``: the job at a glance.

Reads ``<run-dir>/status.json`` (rewritten by the agent about once a second) and
``<run-dir>/events.jsonl``. Works for running and finished runs; a job whose status says it
is live but whose agent process is gone is reported as ``failed`` (agent died). Importing
this module must not import torch: ``ckptrun status`` is meant to answer instantly.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional

import click

from ckptrun.agent.events import EVENTS_FILE, STATUS_FILE, describe, read_events, read_json
from ckptrun.protocol.untrusted import UntrustedFile

RUNS_DIR = "ckptrun-runs"
LIVE_STATES = ("starting", "running", "restarting")
FAILURE_EVENTS = ("worker_failed", "hang_detected", "node_lost", "persist_failed",
                  "unwind_timeout")
RECENT_FAILURES = 10
_CHECKPOINT_KEYS = ("memory_step", "peer_step", "persisted_step", "persisted_url")


class NoRunError(Exception):
    """No run directory could be found; ``str(exc)`` is a one-line message."""


def _is_run_dir(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in (STATUS_FILE, EVENTS_FILE))


def _last_change(path: str) -> float:
    times = [0.0]
    for f in (STATUS_FILE, EVENTS_FILE):
        try:
            times.append(os.stat(os.path.join(path, f)).st_mtime)
        except OSError:
            pass
    return max(times)


def _subdirs(path: str) -> List[str]:
    try:
        return [p for p in (os.path.join(path, d) for d in os.listdir(path)) if os.path.isdir(p)]
    except OSError:
        return []


def find_run_dir(run_dir: Optional[str] = None, base: str = RUNS_DIR) -> str:
    """``run_dir`` if it holds a run, else the most recently updated run under ``base``."""
    if run_dir:
        if not os.path.isdir(run_dir):
            raise NoRunError(f"run directory {run_dir} does not exist")
        if not _is_run_dir(run_dir):
            raise NoRunError(f"{run_dir} holds no ckptrun run (no {STATUS_FILE} or {EVENTS_FILE})")
        return os.path.abspath(run_dir)
    runs = [d for d in _subdirs(base) if _is_run_dir(d)]
    # a job under srun has a run dir per machine: <base>/slurm-<job id>/node-<k>
    runs += [n for d in _subdirs(base) if not _is_run_dir(d) for n in _subdirs(d)
             if os.path.basename(n).startswith("node-") and _is_run_dir(n)]
    if not runs:
        raise NoRunError(f"no ckptrun run found under ./{base} (use --run-dir DIR)")
    return os.path.abspath(max(runs, key=_last_change))


def _pid_alive(pid: Any) -> bool:
    try:
        pid = int(pid)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except (TypeError, ValueError, OSError):
        return False
    try:  # a zombie has exited even though kill(0) succeeds
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        return True


def _state_from_events(events: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A minimal status for a run dir without ``status.json`` (agent died very early)."""
    out: Dict[str, Any] = {"state": "starting", "restarts": 0}
    for e in events:
        if e.get("event") == "start":
            out.update(nnodes=e.get("nnodes"), nproc_per_node=e.get("nproc_per_node"))
        elif e.get("event") == "restart":
            out["restarts"] = out["restarts"] + 1
            out["attempt"] = e.get("attempt")
        elif e.get("event") == "finished":
            out["state"] = "succeeded" if e.get("exit_code") == 0 else "failed"
    return out


def load_status(run_dir: str, now: Optional[float] = None) -> Dict[str, Any]:
    """The status of the run in ``run_dir`` as one JSON-able dict (DESIGN §1 keys and more)."""
    now = time.time() if now is None else now
    events = read_events(run_dir)
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if starts:  # a run dir is reused by the same job run again: its newest run counts
        events = events[starts[-1]:]
    raw = read_json(os.path.join(run_dir, STATUS_FILE))
    st: Dict[str, Any] = dict(raw) if isinstance(raw, dict) else _state_from_events(events)
    st.setdefault("run_id", os.path.basename(os.path.normpath(run_dir)))
    st.setdefault("state", "starting")
    st.setdefault("restarts", 0)
    st["workers"] = [dict(w) for w in st.get("workers") or [] if isinstance(w, dict)]
    ckpt = st.get("checkpoint") if isinstance(st.get("checkpoint"), dict) else {}
    st["checkpoint"] = {**{k: None for k in _CHECKPOINT_KEYS}, **ckpt}
    # the machines holding copies of this machine's snapshots, each with its newest step
    st["checkpoint"]["peers"] = [dict(p) for p in ckpt.get("peers") or []
                                 if isinstance(p, dict)]
    st["run_dir"] = os.path.abspath(run_dir)

    finished = [e for e in events if e.get("event") == "finished"]
    if st["state"] in LIVE_STATES and finished:
        # The agent logged its end but died before its last status.json rewrite.
        st["state"] = "succeeded" if finished[-1].get("exit_code") == 0 else "failed"
        st.setdefault("exit_code", finished[-1].get("exit_code"))
    elif st["state"] in LIVE_STATES and "agent_pid" in st and _agent_is_here(st):
        if not _pid_alive(st.get("agent_pid")):
            st["state"] = "failed"
            st["agent_died"] = True
            st["error"] = f"agent (pid {st.get('agent_pid')}) is gone: the agent died"
    if st["state"] in LIVE_STATES:
        # Ages were measured when status.json was written; they have grown since.
        lag = max(0.0, now - float(st.get("updated") or now))
        for w in st["workers"]:
            if isinstance(w.get("heartbeat_age_s"), (int, float)):
                w["heartbeat_age_s"] = round(w["heartbeat_age_s"] + lag, 3)
    if not st.get("failures"):
        st["failures"] = [e for e in events if e.get("event") in FAILURE_EVENTS][-RECENT_FAILURES:]
    st.update(_recoveries(events, finished, now))
    return st


def _recoveries(events: List[Dict[str, Any]], finished: List[Dict[str, Any]], now: float
                ) -> Dict[str, Any]:
    """``last_recovery`` (the newest ``recovered`` event) and ``training_time``: the time
    since the start, the downtime of its recoveries, and what is left -- time training."""
    recovered = [e for e in events if e.get("event") == "recovered"
                 and isinstance(e.get("downtime_s"), (int, float))]
    start = events[0].get("time") if events and events[0].get("event") == "start" else None
    out: Dict[str, Any] = {"last_recovery": dict(recovered[-1]) if recovered else None}
    if isinstance(start, (int, float)):
        end = finished[-1].get("time") if finished else now
        elapsed = max(0.0, float(end or now) - start)
        down = sum(float(e["downtime_s"]) for e in recovered)
        out["training_time"] = {"elapsed_s": round(elapsed, 3), "downtime_s": round(down, 3),
                                "effective_s": round(max(0.0, elapsed - down), 3),
                                "recoveries": len(recovered)}
    return out


def _agent_is_here(st: Dict[str, Any]) -> bool:
    """The agent pid is only checkable on the agent's machine (a shared run dir may not be)."""
    host = st.get("host") or st.get("hostname")
    return not host or host in (socket.gethostname(), socket.getfqdn())


def _fmt(value: Any, none: str = "-") -> str:
    return none if value is None else str(value)


def _peer_where(ck: dict) -> str:
    """Which machines hold this machine's copies, and how fast the last round went."""
    holders = ck.get("replica_holders")
    where = (f"CPU memory of node(s) {', '.join(str(h) for h in holders)}" if holders
             else "other nodes' CPU memory")
    rate, duty = ck.get("replication_mb_s"), ck.get("replication_duty")
    where = f"{where}, last round {rate:.0f} MB/s" if rate else where
    if isinstance(duty, (int, float)) and duty < 1:  # paced by --replication-budget
        cost = ck.get("replication_slowdown")
        where += f", rounds {duty:.0%} of the time" + (
            f" (training {cost:.0%} slower while one runs)" if cost is not None else "")
    return where


def _peer_row(p: dict, now: float) -> str:
    """One machine holding this machine's copies: when its newest copy arrived, how fast."""
    if p.get("holds_step") is None:
        return "no copy yet"
    when = (f"copy pushed {_age(max(0.0, now - p['updated']))} ago"
            if isinstance(p.get("updated"), (int, float)) else "holds a copy")
    return f"{when}, {p['mb_s']:.0f} MB/s" if p.get("mb_s") else when


def _age(value: Any) -> str:
    return f"{value:.1f}s" if isinstance(value, (int, float)) else "-"


def _when(ts: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if isinstance(ts, (int, float)) else "-"


def _failure_text(e: Dict[str, Any]) -> str:
    return describe(e) or json.dumps({k: v for k, v in e.items() if k not in ("time", "event")},
                                     default=str)


_STATE_STYLE = {"running": "green", "succeeded": "bold green", "failed": "bold red",
                "restarting": "yellow", "starting": "cyan"}


def render(st: Dict[str, Any], now: Optional[float] = None):
    """A rich renderable: header, workers table, checkpoint tiers (the peer tier with one row
    per machine holding this machine's copies), recent failures."""
    now = time.time() if now is None else now
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    state = st.get("state", "?")
    head = Text.assemble(
        ("ckptrun run ", "bold"), (str(st.get("run_id")), "bold cyan"), "  state: ",
        (state, _STATE_STYLE.get(state, "")),
        f"  attempt: {_fmt(st.get('attempt'))}  restarts: {_fmt(st.get('restarts'))}",
        f"  nodes: {_fmt(st.get('nnodes'))}  procs/node: {_fmt(st.get('nproc_per_node'))}",
    )
    parts: List[Any] = [head]
    if st.get("error"):
        parts.append(Text(str(st["error"]), style="red"))
    workers = Table(title="workers", title_justify="left", expand=False)
    for col in ("rank", "local", "node", "pid", "state", "step", "heartbeat age"):
        workers.add_column(col, justify="right" if col not in ("node", "state") else "left")
    for w in sorted(st["workers"], key=lambda w: (w.get("rank") is None, w.get("rank"))):
        workers.add_row(_fmt(w.get("rank")), _fmt(w.get("local_rank")), _fmt(w.get("node")),
                        _fmt(w.get("pid")), _fmt(w.get("state")), _fmt(w.get("step")),
                        _age(w.get("heartbeat_age_s")))
    parts.append(workers)
    hot = st.get("hot_spares") or []
    if hot:  # --hot-spares: which ranks have a replacement waiting at the resilient function
        ready = sorted(h["rank"] for h in hot if h.get("ready"))
        rest = len(hot) - len(ready)
        parts.append(Text(f"hot spares: {len(ready)} ready" + (
            f" (ranks {', '.join(map(str, ready))})" if ready else "") + (
            f", {rest} still starting" if rest else "")))
    ck = st["checkpoint"]
    tiers = Table(title="checkpoint", title_justify="left")
    tiers.add_column("tier")
    tiers.add_column("step", justify="right")
    tiers.add_column("where", overflow="fold")  # a URL is copied by users: never elide it
    tiers.add_row("memory", _fmt(ck.get("memory_step")), "local CPU memory (/dev/shm)")
    tiers.add_row("peer", _fmt(ck.get("peer_step")), _peer_where(ck))
    peers = ck.get("peers") or []
    for i, p in enumerate(peers):
        branch = "└" if i == len(peers) - 1 else "├"
        tiers.add_row(f" {branch} node {_fmt(p.get('node'), '?')}", _fmt(p.get("holds_step")),
                      _peer_row(p, now))
    tiers.add_row("storage", _fmt(ck.get("persisted_step")),
                  _fmt(ck.get("persisted_url") or st.get("persist_to")))
    parts.append(tiers)
    tt = st.get("training_time")
    if isinstance(tt, dict) and tt.get("elapsed_s"):
        share = 100.0 * tt["effective_s"] / tt["elapsed_s"]
        line = (f"training {tt['effective_s']:.1f} s of {tt['elapsed_s']:.1f} s ({share:.0f}%); "
                f"{tt['recoveries']} recover{'y' if tt['recoveries'] == 1 else 'ies'}, "
                f"{tt['downtime_s']:.2f} s down")
        last = st.get("last_recovery")
        if isinstance(last, dict):
            line += f"; last: {describe(last)}"
        parts.append(Text(line))
    failures = st.get("failures") or []
    if failures:
        table = Table(title="recent failures", title_justify="left")
        table.add_column("time")
        table.add_column("what")
        for e in failures[-RECENT_FAILURES:]:
            table.add_row(_when(e.get("time")), _failure_text(e))
        parts.append(table)
    return Group(*parts)


@click.command("status")
@click.option("--run-dir", "run_dir", metavar="DIR", default=None,
              help="The run's directory (default: the newest run under ./ckptrun-runs).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--watch", is_flag=True, help="Refresh until the job ends (Ctrl-C to stop).")
@click.option("--interval", default=1.0, show_default=True, metavar="SECONDS",
              type=click.FloatRange(min=0.05), help="Refresh period of --watch.")
@click.pass_context
def status_command(ctx: click.Context, run_dir: Optional[str], as_json: bool, watch: bool,
                   interval: float) -> None:
    """Show a run's state, workers, checkpoint tiers and recent failures."""
    try:
        path = find_run_dir(run_dir)
    except NoRunError as exc:
        click.echo(f"ckptrun: error: {exc}", err=True)
        ctx.exit(2)
    try:
        _show(path, as_json, watch, interval)
    except UntrustedFile as exc:
        click.echo(f"ckptrun: error: {exc}", err=True)
        ctx.exit(2)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        # a status.json or event of the right syntax and the wrong shape (someone else's)
        click.echo(f"ckptrun: error: {path}: status.json or events.jsonl is not what ckptrun "
                   f"writes ({type(exc).__name__}: {str(exc)[:200]})", err=True)
        ctx.exit(2)


def _show(path: str, as_json: bool, watch: bool, interval: float) -> None:
    if as_json and not watch:
        click.echo(json.dumps(load_status(path), default=str, indent=2))
        return
    if as_json:  # --json --watch: one object per line, each time it is refreshed
        try:
            while True:
                st = load_status(path)
                click.echo(json.dumps(st, default=str))
                if st["state"] not in LIVE_STATES:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            return
    from rich.console import Console

    console = Console()
    if not watch:
        console.print(render(load_status(path)))
        return
    if not console.is_terminal:  # a pipe or a file: a table per refresh, one after another
        try:
            while True:
                st = load_status(path)
                console.print(render(st))
                sys.stdout.flush()
                if st["state"] not in LIVE_STATES:
                    return
                time.sleep(interval)
        except (KeyboardInterrupt, BrokenPipeError):
            return
    from rich.live import Live

    try:
        with Live(render(load_status(path)), console=console, auto_refresh=False) as live:
            while True:
                st = load_status(path)
                live.update(render(st), refresh=True)
                if st["state"] not in LIVE_STATES:
                    return
                time.sleep(interval)
    except KeyboardInterrupt:
        return
