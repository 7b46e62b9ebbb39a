"""``ckptrun restore``: list restorable steps, export one, or roll a live job back.

::

    ckptrun restore --list [--run-dir DIR | --from URL] [--json]
    ckptrun restore [--run-dir DIR | --from URL] [--step N] --to URL [--format dcp|torch]
    ckptrun restore --rollback N [--run-dir DIR]

Sources: a run directory (its live memory tier -- the slot files named in ``status.json``
``slots`` -- and its durable tier ``persist_to``) or a durable URL (``--from``: a persist
root, a ``step-<N>`` directory or an earlier export).  ``--format torch`` writes one file
loadable with ``torch.load(path, weights_only=True)``: ``{"step", "world_size", "ranks":
{rank: nested state}, "full": nested state}`` where numpy arrays became tensors and numpy
scalars Python numbers.  ``full`` is the state as one unsharded process would hold it: rank
0's, with every DTensor (FSDP2) shard assembled whole from all ranks' shards, so
``model.load_state_dict(export["full"]["model"])`` loads an FSDP2 job's weights into a plain
model (the unsharded tensors are rank 0's objects: ``torch.save`` stores them once).
Errors are one line on stderr, exit code 2.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import click

from ckptrun.protocol.untrusted import UntrustedFile

Snapshot = Tuple[Dict[str, Any], list]


class RestoreError(Exception):
    """A one-line problem for the user (exit code 2)."""


# --------------------------------------------------------------------------- sources


class Source:
    """Where checkpoints come from: a run's memory slots and/or a durable URL."""

    def __init__(self, run_dir: Optional[str], from_url: Optional[str]) -> None:
        self.run_dir, self.status, self.slots, self.live = None, {}, {}, False
        self.url = from_url
        if from_url:
            return
        from ckptrun.cli.status import LIVE_STATES, NoRunError, find_run_dir, load_status

        try:
            self.run_dir = find_run_dir(run_dir)
        except NoRunError as e:
            raise RestoreError(str(e)) from e
        try:
            self.status = load_status(self.run_dir)
        except UntrustedFile as e:  # a run directory someone else wrote into
            raise RestoreError(str(e)) from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise RestoreError(f"{self.run_dir}: status.json or events.jsonl is not what "
                               f"ckptrun writes ({type(e).__name__}: {str(e)[:200]})") from e
        self.live = self.status.get("state") in LIVE_STATES
        if self.live:
            self.slots = {int(r): list(p) for r, p in (self.status.get("slots") or {}).items()}
        self.url = self.status.get("persist_to") or os.path.join(self.run_dir, "checkpoints")

    def memory_steps(self) -> Dict[int, Dict[int, str]]:
        """``{step: {rank: slot path}}`` for steps committed by every rank of the job."""
        from ckptrun.protocol import SlotHeader, SlotState, open_shm_file

        per_rank: Dict[int, Dict[int, str]] = {}
        world = 0
        for rank, paths in self.slots.items():
            per_rank[rank] = {}
            for p in paths:
                try:
                    mm = open_shm_file(p, write=False)
                except (OSError, ValueError):
                    continue
                h = SlotHeader.unpack_from(mm)
                mm.close()
                if h.state == SlotState.COMMITTED:
                    per_rank[rank][h.step] = p
                    world = max(world, h.world_size)
        if not per_rank or set(per_rank) != set(range(world)):
            return {}  # this node does not hold every rank (multi-node): not exportable alone
        common = set.intersection(*(set(v) for v in per_rank.values()))
        return {s: {r: per_rank[r][s] for r in per_rank} for s in sorted(common)}

    def storage_steps(self) -> List[Dict[str, Any]]:
        from ckptrun.tiers.durable import storage

        if self.url is None:
            return []
        try:
            if storage.read_index(self.url, None) is not None:  # a single step dir / export
                dir_url, step = storage.resolve(self.url)
                idx = storage.read_index(dir_url, None)
                return [{"step": step, "url": dir_url, "bytes": idx["bytes"], "time": idx["time"],
                         "world_size": idx["world_size"]}]
            return storage.list_steps(self.url)
        except storage.StorageError as e:
            if self.run_dir is not None:
                return []  # the run's storage may be gone; memory may still do
            raise RestoreError(str(e)) from e

    def restorable(self) -> List[Dict[str, Any]]:
        """One entry per step, newest last: ``{step, tiers, url, bytes, time}``."""
        out: Dict[int, Dict[str, Any]] = {}
        for s, paths in self.memory_steps().items():
            out[s] = {"step": s, "tiers": ["memory"], "url": None, "slots": paths,
                      "bytes": None, "time": None}
        for st in self.storage_steps():
            e = out.setdefault(st["step"], {"step": st["step"], "tiers": [], "slots": None})
            e["tiers"].append("storage")
            e.update(url=st["url"], bytes=st["bytes"], time=st["time"])
        return [out[s] for s in sorted(out)]

    def read(self, entry: Dict[str, Any], progress=None) -> Tuple[int, Dict[int, Snapshot]]:
        """All ranks of a restorable step: memory first, durable storage as the fallback."""
        from ckptrun.tiers.durable import storage

        if entry.get("slots"):
            try:
                return len(entry["slots"]), {r: _read_slot(p, entry["step"], progress)
                                             for r, p in sorted(entry["slots"].items())}
            except RestoreError:
                if not entry.get("url"):
                    raise
        try:
            world = storage.read_index(entry["url"], None)["world_size"]
            snaps = {}
            for r in range(world):
                snaps[r] = storage.read_rank(entry["url"], None, r)
                if progress:
                    progress()
            return world, snaps
        except storage.StorageError as e:
            raise RestoreError(str(e)) from e


def _read_slot(path: str, step: int, progress=None) -> Snapshot:
    """Copy one committed slot out of a live job's memory, seqlock-checked and verified."""
    from ckptrun.protocol import SlotHeader, open_shm_file
    from ckptrun.snapshot import read_slot, verify_slot

    try:
        mm = open_shm_file(path, write=False)
    except (OSError, ValueError) as e:
        raise RestoreError(f"slot {path} is gone: {e}") from e
    try:
        h, meta, views = read_slot(mm)
        if h.step != step or not verify_slot(mm, h):
            raise RestoreError(f"slot {path} no longer holds a verified step {step}")
        tensors = [v.clone() for v in views]
        del views
        after = SlotHeader.unpack_from(mm)
        if (after.state, after.step, after.seq) != (h.state, h.step, h.seq):
            raise RestoreError(f"slot {path} was rewritten while being read; try again")
    except ValueError as e:
        raise RestoreError(f"slot {path}: {e}") from e
    finally:
        try:
            mm.close()
        except BufferError:
            pass  # a view is still referenced; the mapping goes with the process
    if progress:
        progress()
    return meta, tensors


# --------------------------------------------------------------------------- export


def weights_only_safe(obj: Any) -> Any:
    """Make unflattened state loadable with ``weights_only=True`` (numpy -> torch/python)."""
    import numpy as np
    import torch

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj)) if obj.dtype.kind in "biufc" \
            else obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {weights_only_safe(k): weights_only_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(weights_only_safe(v) for v in obj)
    if isinstance(obj, bytearray):
        return bytes(obj)
    return obj


def export(step: int, world: int, snaps: Dict[int, Snapshot], to_url: str, fmt: str) -> int:
    """Write ``snaps`` to ``to_url`` as a DCP directory or one torch file; returns bytes."""
    from ckptrun.tiers.durable import storage

    if fmt == "dcp":
        return storage.write_step(to_url, step, snaps, world, threads=2, standalone=True)["bytes"]
    import fsspec
    import torch

    from ckptrun.snapshot import unflatten
    from ckptrun.snapshot.shards import whole_tensors

    ranks = {r: weights_only_safe(unflatten(m["tree"], ts)) for r, (m, ts) in snaps.items()}
    try:
        full = weights_only_safe(unflatten(snaps[min(snaps)][0]["tree"], whole_tensors(snaps)))
    except (KeyError, ValueError) as e:
        raise RestoreError(f"step {step}: the ranks' shards do not make whole tensors: {e}") from e
    with fsspec.open(to_url, "wb", auto_mkdir=True) as f:
        torch.save({"step": step, "world_size": world, "ranks": ranks, "full": full}, f)
        return f.tell()


# --------------------------------------------------------------------------- command


def _fail(message: str) -> None:
    click.echo(f"ckptrun: error: {message}", err=True)
    raise click.exceptions.Exit(2)


@click.command("restore")
@click.option("--list", "list_", is_flag=True, help="List the steps that can be restored.")
@click.option("--run-dir", type=str, default=None, help="Run directory (default: newest run).")
@click.option("--from", "from_url", type=str, default=None, help="Durable checkpoint URL.")
@click.option("--step", type=int, default=None, help="Step to export (default: newest).")
@click.option("--to", "to_url", type=str, default=None, help="Export destination URL.")
@click.option("--format", "fmt", type=click.Choice(["dcp", "torch"]), default="dcp",
              show_default=True, help="dcp: a DCP directory; torch: one torch.load-able file.")
@click.option("--rollback", type=int, default=None, help="Restart the live job from step N.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def restore_command(list_: bool, run_dir: Optional[str], from_url: Optional[str],
                    step: Optional[int], to_url: Optional[str], fmt: str,
                    rollback: Optional[int], as_json: bool) -> None:
    """List, export or roll back checkpoints of a ckptrun job."""
    modes = sum([list_, to_url is not None, rollback is not None])
    if modes != 1:
        _fail("choose exactly one of --list, --to URL, --rollback N")
    if run_dir and from_url:
        _fail("--run-dir and --from are mutually exclusive")
    if rollback is not None and from_url:
        _fail("--rollback works on a live run (--run-dir), not on --from")
    try:
        src = Source(run_dir, from_url)
        entries = src.restorable()
        if list_:
            _print_list(src, entries, as_json)
        elif rollback is not None:
            _rollback(src, entries, rollback)
        else:
            _export(src, entries, step, to_url, fmt, as_json)
    except RestoreError as e:
        _fail(str(e))


def _print_list(src: Source, entries: List[Dict[str, Any]], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"run_dir": src.run_dir, "persist_to": src.url,
                               "steps": [{k: v for k, v in e.items()} for e in entries]}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"restorable steps ({src.run_dir or src.url})")
    for col in ("step", "memory", "storage", "size", "persisted"):
        table.add_column(col, overflow="fold")  # URLs are what users copy: never elide them
    for e in entries:
        mem = f"{len(e['slots'])} ranks" if e.get("slots") else "-"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"])) if e["time"] else "-"
        size = f"{e['bytes'] / 2**20:.1f} MiB" if e["bytes"] is not None else "-"
        table.add_row(str(e["step"]), mem, e["url"] or "-", size, when)
    Console().print(table)
    if not entries:
        click.echo("no restorable steps")


def _pick(entries: List[Dict[str, Any]], step: Optional[int]) -> Dict[str, Any]:
    if not entries:
        raise RestoreError("no restorable step found")
    if step is None:
        return entries[-1]
    for e in entries:
        if e["step"] == step:
            return e
    raise RestoreError(f"step {step} is not restorable (have: {[e['step'] for e in entries]})")


def _export(src: Source, entries, step, to_url, fmt, as_json) -> None:
    from rich.console import Console
    from rich.progress import Progress

    entry = _pick(entries, step)
    t0 = time.monotonic()
    # On stderr so stdout carries only the result line (or JSON).
    with Progress(transient=True, disable=as_json, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"reading step {entry['step']}", total=None)
        world, snaps = src.read(entry, progress=lambda: bar.advance(task))
        bar.update(task, description=f"writing {to_url}")
        try:
            nbytes = export(entry["step"], world, snaps, to_url, fmt)
        except RestoreError:
            raise
        except Exception as e:  # noqa: BLE001 -- any storage error is one line for the user
            raise RestoreError(f"cannot write {to_url}: {type(e).__name__}: {e}") from e
    res = {"step": entry["step"], "to": to_url, "format": fmt, "bytes": nbytes,
           "world_size": world, "seconds": round(time.monotonic() - t0, 3),
           "tier": "memory" if entry.get("slots") else "storage"}
    click.echo(json.dumps(res) if as_json else
               f"exported step {res['step']} ({world} ranks, {nbytes} bytes, from {res['tier']}) "
               f"to {to_url} as {fmt} in {res['seconds']}s")


def _rollback(src: Source, entries: List[Dict[str, Any]], step: int) -> None:
    from ckptrun.agent.events import write_json_atomic

    if src.run_dir is None or not src.live:
        raise RestoreError(f"the run in {src.run_dir} is not live (state "
                           f"{src.status.get('state')}); --rollback needs a running job")
    _pick(entries, step)
    path = os.path.join(src.run_dir, "rollback.json")
    write_json_atomic(path, {"step": step, "time": time.time()})
    os.chmod(path, 0o600)
    click.echo(f"rollback to step {step} requested ({path})")
