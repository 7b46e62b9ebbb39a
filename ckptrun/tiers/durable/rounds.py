"""Durable checkpoints of a job spread over several machines: persist rounds in the store.

A durable step needs every rank, and each machine holds only its own ranks.  Node 0 leads:
its :class:`~ckptrun.tiers.durable.persister.Persister` decides when a persist is due, and each of its
attempts is a *round* ``r`` in the rendezvous store:

1. the leader posts ``want`` (the oldest acceptable step); every node posts the newest step
   all its local ranks committed; the round's step ``S`` lies a little after the newest any
   node posted (so no node can have overwritten it yet: workers keep only their newest
   commits) -- far enough ahead that every node is watching its slots when it is committed --
   or -1 when that is older than ``want``; the final round of a finished (or preempted)
   job takes the newest step every node holds instead;
2. every node waits until its ranks commit ``S``, copies it out of the worker slots (pinned)
   and writes it as its *part*
   (:func:`ckptrun.tiers.durable.storage.write_parts`) -- the nodes write in parallel -- then posts the
   part's JSON description (or an error);
3. the leader finalizes (``.metadata`` then ``ckptrun.json``) and posts ``done``; every node
   then reports ``persisted`` (or ``persist_failed``) in its own events.

Nothing here ever blocks training: it runs in the persister's and the followers' threads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ckptrun.protocol import SlotState
from ckptrun.store.kvstore import as_text, own_client, wait_keys
from ckptrun.tiers.durable import storage

log = logging.getLogger(__name__)

KEY = "ckptrun/persist/"
WAIT_S = 120.0  # a round in which some node does not answer for this long fails


# The end of the message of a persist refused because the machines do not share --persist-to
# (read by every node's persister from the leader's answer: a misconfiguration, not retried)
NOT_SHARED = "--persist-to must be storage every machine shares"


class JobEnded(Exception):
    """The round's step will never be committed: the workers finished first."""


class RoundStopped(RuntimeError):
    """The tier was stopped (the membership changed, the job is over) while a round waited
    for a node: the round is abandoned, which is no failure of the step it was for."""


class PersistRounds:
    """One node's side of the rounds (see the module docstring)."""

    def __init__(self, store, node: int, nnodes: int, ranks: List[int], memory,
                 emit: Callable[..., Any], url: str, threads: int = 2,
                 every_steps: Optional[int] = None) -> None:
        # the rounds run in the persister's or the follower's thread, on their own client;
        # the agent's thread (the end of the job) keeps the agent's
        self.store, self._agent_store = own_client(store), store
        self.node, self.nnodes = node, nnodes
        self.ranks, self.memory, self.emit, self.url = ranks, memory, emit, url
        self.threads = threads
        self.every_steps = every_steps  # --persist-every N: rounds take multiples of N
        self.round = 0
        self.final_step: Optional[int] = None  # set for the last round of a finished job
        self._stop = threading.Event()
        self._done = threading.Event()  # the job ended: stop waiting for steps to appear
        self._thread: Optional[threading.Thread] = None

    # -- leader (node 0): the Persister's reader and writer ---------------------------------
    def read(self, min_step: int) -> Optional[Tuple[int, Dict[int, tuple]]]:
        """Open a round: agree on its step; None when no step >= min_step exists everywhere."""
        self.round += 1
        k = f"{KEY}{self.round}/"
        self.store.set(k + "want", str(min_step))
        try:
            posted = self._agree(k, self._newest())
            if self.final_step is not None:
                # The job is over: the newest step every node holds.  A preempted job's
                # machines were stopped independently, so one may be a step behind the
                # leader (its ranks hold that step and the one before, never less).
                step = min(self.final_step, *posted)
                if step < 1:
                    self.store.set(k + "step", "-1")
                    return None
            else:
                step = max(posted) + self._lead()
                if step < min_step:
                    self.store.set(k + "step", "-1")
                    return None
                if self.every_steps:
                    step = -(-step // self.every_steps) * self.every_steps  # the next multiple
            self.store.set(k + "step", str(step))
            return step, self._read_step(step)
        except JobEnded:
            self.store.set(k + "done", "skip")  # not a failure: the final round follows
            return None
        except RoundStopped:  # the agent is re-forming the job: no step was due yet
            with contextlib.suppress(Exception):  # the store may be what went away
                self.store.set(k + "done", "skip")
            return None
        except Exception as e:
            self.store.set(k + "done", f"error: {type(e).__name__}: {e}")  # never leave a
            raise  # follower waiting for a round that will not finish

    def write(self, url: str, step: int, snaps: Dict[int, tuple], world_size: int,
              threads: int = 2) -> Dict[str, Any]:
        """Write node 0's part, gather the others', finalize; announce the outcome."""
        k = f"{KEY}{self.round}/"
        t0 = time.monotonic()
        try:
            parts = [storage.write_parts(url, step, snaps, node=self.node, threads=threads)]
            for g in range(1, self.nnodes):
                raw = self._wait(k + f"part/{g}")
                if raw.startswith("error:"):
                    raise storage.StorageError(f"node {g}: {raw[6:].strip()}")
                parts.append(json.loads(raw))
            _check_visible(url, step, parts[1:])
            index = storage.finalize(url, step, parts, world_size)
        except Exception as e:
            self.store.set(k + "done", f"error: {e}")
            raise
        self.store.set(k + "done", "ok")
        return {"bytes": index["bytes"], "seconds": time.monotonic() - t0,
                "url": storage.step_url(url, step)}

    def job_done(self, final_step: Optional[int]) -> None:
        """The workers are gone: a round waiting for a step that will never be committed
        gives up now; the final round (leader) persists ``final_step``."""
        self.final_step = final_step
        self._done.set()

    def close_leader(self) -> None:
        """After the leader's last round (the final persist): followers may stop."""
        try:
            self._agent_store.set(f"{KEY}closed", str(self.round))
        finally:
            self._stop.set()

    # -- followers (nodes 1..N-1) ----------------------------------------------------------
    def start_follower(self) -> None:
        """Start answering the leader's rounds (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._follow, name="ckptrun-persist-rounds",
                                        daemon=True)
        self._thread.start()

    def finish_follower(self, timeout: float = 60.0) -> None:
        """At a successful end: keep answering until the leader's final round is over."""
        self._done.set()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and \
                    not self._agent_store.check([f"{KEY}closed"]):
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 -- the leader left and took the store with it
            pass
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _follow(self) -> None:
        while not self._stop.is_set():
            k = f"{KEY}{self.round + 1}/"
            try:
                if not self.store.check([k + "want"]):
                    self._stop.wait(0.1)
                    continue
                self.round += 1
                self._answer(k)
            except Exception as e:  # noqa: BLE001 -- the store may be gone at the end
                log.debug("persist round %s: %s", k, e)
                self._stop.wait(0.5)

    def _answer(self, k: str) -> None:
        self._agree(k, self._newest())
        step = int(self._wait(k + "step"))
        if step < 0:
            return
        t0, part = time.monotonic(), None
        try:
            snaps = self._read_step(step)
            part = storage.write_parts(self.url, step, snaps, node=self.node,
                                       threads=self.threads)
            part["url"] = self.url  # for the leader's message if it cannot see the files
            self.store.set(k + f"part/{self.node}", json.dumps(part))
        except Exception as e:  # noqa: BLE001
            self.store.set(k + f"part/{self.node}", f"error: {type(e).__name__}: {e}")
        done = self._wait(k + "done")
        if done == "skip":
            return
        if done == "ok":
            self.emit("persisted", step=step, url=storage.step_url(self.url, step),
                      bytes=int(part["bytes"]) if part else 0,
                      seconds=round(time.monotonic() - t0, 4))
        else:
            self.emit("persist_failed", step=step, error=done.partition("error:")[2].strip())

    # -- shared ----------------------------------------------------------------------------
    def _newest(self) -> int:
        """Newest step every local rank committed (headers only), -1 if none."""
        step = self.memory.newest_committed(self.ranks)
        return -1 if step is None else step

    def _agree(self, k: str, newest: int) -> List[int]:
        """Post this node's newest step; returns the newest step of every node."""
        self.store.set(k + f"newest/{self.node}", str(newest))
        return [int(self._wait(k + f"newest/{g}")) for g in range(self.nnodes)]

    def _lead(self, seconds: float = 0.3) -> int:
        """How many steps ahead of the newest the round's step lies: about ``seconds`` of
        training (from the commit times in the slot headers), at least 2 -- the time every
        node needs to learn the step and be watching its slots when it is committed."""
        rates = []
        for r in self.ranks:
            done = sorted((h.step, h.commit_time) for h in self.memory.headers(r).values()
                          if h.state == SlotState.COMMITTED)
            if len(done) >= 2 and done[-1][0] > done[0][0]:
                rates.append((done[-1][1] - done[0][1]) / (done[-1][0] - done[0][0]))
        interval = max(rates) if rates else 0.0
        return max(2, min(1000, int(seconds / interval) + 1)) if interval > 0 else 2

    def _read_step(self, step: int) -> Dict[int, tuple]:
        """Private copies of every local rank's ``step``, as soon as it is committed (the
        slots are polled: a step stays in them only for the next couple of saves)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            held = [self.memory.steps(r) for r in self.ranks]
            if all(step in h for h in held):
                return {r: self.memory.read(r, step) for r in self.ranks}
            if self._done.is_set():
                raise JobEnded(f"the job ended before step {step}")
            if self._stop.is_set():  # a machine lost: the job re-forms, the step never comes
                raise RoundStopped(f"stopped while waiting for step {step}")
            if any(h and min(h) > step for h in held) or time.monotonic() > deadline:
                raise KeyError(f"step {step} is not (or no longer) in this node's memory")
            time.sleep(0.002)

    def _wait(self, key: str) -> str:
        """The value of ``key`` once some node set it.  Waits in short slices: a thread
        must never sit in a long store call when the agent exits."""
        if not wait_keys(self.store, [key], WAIT_S, stop=self._stop):
            raise RoundStopped(f"stopped while waiting for {key}")
        return as_text(self.store.get(key))


def _check_visible(url: str, step: int, parts: List[Dict[str, Any]]) -> None:
    """Refuse to finalize ``step`` unless every file the other nodes wrote is visible, whole,
    at the leader's ``url``.  Storage that is not shared (each machine's own local path, e.g.
    the default ``<run-dir>/checkpoints`` on a node-local disk) would otherwise give a step
    that looks complete and that no machine can read."""
    import fsspec

    need: Dict[str, Tuple[int, int, str]] = {}  # file -> (bytes it must hold, node, url)
    for part in parts:
        for entry in part["ranks"].values():
            for e in [entry.get("meta"), *entry.get("tensors", [])]:
                if e and e.get("file") and not e.get("alias"):
                    end = int(e["offset"]) + int(e["length"])
                    if end > need.get(e["file"], (0,))[0]:
                        need[e["file"]] = (end, int(part["node"]), part.get("url", "?"))
    if not need:
        return
    fs, path = fsspec.core.url_to_fs(storage.step_url(url, step))
    fs.invalidate_cache(path)  # listings may be cached (s3fs): the files are new
    try:
        listing = fs.ls(path, detail=True)
    except FileNotFoundError:
        listing = []  # not even the step's directory: nothing of theirs is here
    have = {d["name"].rstrip("/").rsplit("/", 1)[-1]: int(d.get("size") or 0) for d in listing}
    for name, (end, node, theirs) in sorted(need.items()):
        if have.get(name, -1) < end:
            raise storage.StorageError(
                f"node {node} wrote {name} to {theirs}, but {storage.step_url(url, step)} has "
                f"{'no such file' if name not in have else 'a shorter one'}: {NOT_SHARED}")

