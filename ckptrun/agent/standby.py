"""Standby machines (``--standby``): agents that join a running job without ranks and take
a lost machine's place the moment the survivors see it go.

What a replacement machine pays after a loss, a standby has paid already: starting the agent
(Python, torch, the rendezvous handler and its store connection) and its workers (a warm
spare per local rank has imported torch).  What is left is the survivors agreeing with it,
its restore and its first step.

**No rendezvous round.**  torch's dynamic rendezvous keeps a lost participant until its
keep-alive expires (seconds) and completes rounds on 1 s polls, so a new round costs 3-4 s
after the loss is seen.  The membership does not need one: the survivors keep their group
ranks and a standby takes exactly the lost ones.  So the survivors *offer* the lost places
in the rendezvous handler's own store (the one that outlives rounds), standbys *take* them,
and everyone forms the next membership under a fresh key prefix of that store
(:func:`ckptrun.agent.membership.join_round` with the ranks given).  Only where no standby
takes a place in :data:`TAKE_S` does the job fall back to a round of torch's rendezvous
(then with the standbys that took a place, and any replacement machine started by hand).

The keys (``ckptrun/standby/...`` in the handler's store):

* ``offer/<membership>`` -- the first survivor to ``compare_set`` it names the lost group
  ranks and the next membership's id; every survivor follows the stored offer.
* ``places`` / ``place/<n>`` / ``wanted`` -- the offer's winner publishes one record per
  lost rank; ``claimed`` -- standbys claim records one at a time (its value names the last
  claimant, so a ``compare_set`` says who won).  A standby never takes more places than were
  freed: a surplus standby in torch's round could complete it in a survivor's stead, and that
  survivor's memory would be out of the job.
* ``taken/<membership>/<node>`` -- the standby's token, or ``none`` once the survivors stop
  waiting.  Each is set exactly once; a takeover goes ahead only when all are tokens.
* ``waiting`` -- how many standbys wait: with none, survivors go straight to torch's round.
* ``over`` -- set by every member when the job ends: a waiting standby exits 0.  A member
  waits briefly (:func:`release_standbys`) until they have seen it, as the store host leaving
  first would leave them only a broken connection to read.

A standby is trusted no more than any machine of the job: the store's values are MAC'd with
the job secret (:mod:`ckptrun.store.authenticated`), and the replicas it restores from are
checked against their checksums as any replacement's are.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid
from typing import List, Optional

from ckptrun.agent.rendezvous import KEY_PREFIX, NodeInfo
from ckptrun.store.kvstore import as_text, own_client, wait_keys
from ckptrun.tiers.peer.standby_copies import StandbyHolder

K = KEY_PREFIX + "standby/"
WAITING, OVER = K + "waiting", K + "over"
PLACES, WANTED, CLAIMED = K + "places", K + "wanted", K + "claimed"
NONE = "none"
NOT_NEEDED = "the job finished without needing this standby machine"
POLL_S = 0.05
TAKE_S = 2.0  # how long survivors wait for standbys to take the offered places
FOLLOW_S = 10.0  # how long a survivor or standby waits for the others' keys of an offer
RELEASE_S = 3.0  # the longest a member waits at its end for the standbys to see it


def _membership_store(raw, membership: str):
    import torch.distributed as dist

    return dist.PrefixStore(f"{KEY_PREFIX}m/{membership}/", raw)


# ------------------------------------------------------------------ the survivors' side

def offer_places(agent, lost_nodes: List[int]) -> Optional[NodeInfo]:
    """Offer the lost machines' places to standbys.  The next membership (this agent keeps
    its rank) when standbys took every place; None: re-form through torch's rendezvous."""
    raw, info = agent.rdzv.store, agent.info
    if raw is None or info.membership is None:
        return None
    try:
        if raw.add(WAITING, 0) <= 0:
            return None
        mine = json.dumps({"lost": sorted(lost_nodes), "next": uuid.uuid4().hex,
                           "nnodes": info.group_world_size, "master_addr": info.master_addr,
                           "master_port": info.master_port, "run_id": info.run_id,
                           "use_agent_store": info.use_agent_store})
        got = as_text(raw.compare_set(f"{K}offer/{info.membership}", "", mine))
        offer = json.loads(got)
        if got == mine:  # this agent's offer stands: publish its places
            for g in offer["lost"]:
                n = raw.add(PLACES, 1)
                raw.set(f"{K}place/{n}", json.dumps({"membership": info.membership,
                                                     "node": g}))
                raw.add(WANTED, 1)
        if info.group_rank in offer["lost"]:
            return None  # the others count this machine as lost: it cannot stay
        if not _settle(raw, info.membership, offer["lost"], wait_s=TAKE_S):
            return None
    except Exception as e:  # noqa: BLE001 -- the store host gone, a malformed offer
        print(f"ckptrun: no standby took over ({type(e).__name__}: {e}); re-forming "
              "through the rendezvous", file=sys.stderr)
        return None
    return _next_info(raw, offer, info.group_rank)


def _settle(raw, membership: str, lost: List[int], wait_s: float) -> bool:
    """Wait up to ``wait_s`` for every lost place to be taken, then close the ones that were
    not (``none``): True when standbys took them all.  Every party reads the same answer."""
    keys = [f"{K}taken/{membership}/{g}" for g in lost]
    deadline = time.monotonic() + wait_s
    while not raw.check(keys) and time.monotonic() < deadline:
        time.sleep(POLL_S / 2)
    return all(as_text(raw.compare_set(k, "", NONE)) != NONE for k in keys)


def _next_info(raw, offer: dict, rank: int) -> NodeInfo:
    return NodeInfo(_membership_store(raw, offer["next"]), rank, int(offer["nnodes"]),
                    str(offer["master_addr"]), int(offer["master_port"]), str(offer["run_id"]),
                    bool(offer["use_agent_store"]), offer["next"])


def release_standbys(rdzv) -> None:
    """The job is over: tell the waiting standbys and give them a moment to read it."""
    store = rdzv.store
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(OVER, "1")
        deadline = time.monotonic() + RELEASE_S
        while store.add(WAITING, 0) > 0 and time.monotonic() < deadline:
            time.sleep(POLL_S)


# ------------------------------------------------------------------ the standby's side

def _claim(store, token: str) -> Optional[int]:
    """Claim one offered place (its number), if one is free."""
    while True:
        wanted = store.add(WANTED, 0)
        cur = as_text(store.compare_set(CLAIMED, "", "0:"))
        claimed = int(cur.partition(":")[0])
        if claimed >= wanted:
            return None
        mine = f"{claimed + 1}:{token}"
        if as_text(store.compare_set(CLAIMED, cur, mine)) == mine:
            return claimed + 1


def _take(store, n: int, token: str):
    """The claimed place ``n``: (``"member"``, NodeInfo) when the takeover goes ahead,
    (``"round"``, None) when it falls back to torch's round with this standby in it."""
    wait_keys(store, [f"{K}place/{n}"], FOLLOW_S)
    place = json.loads(as_text(store.get(f"{K}place/{n}")))
    membership, node = str(place["membership"]), int(place["node"])
    wait_keys(store, [f"{K}offer/{membership}"], FOLLOW_S)
    offer = json.loads(as_text(store.get(f"{K}offer/{membership}")))
    if node not in offer["lost"] or not 0 <= node < int(offer["nnodes"]):
        raise ValueError(f"place {n} names node {node}, which its offer did not free")
    key = f"{K}taken/{membership}/{node}"
    if as_text(store.compare_set(key, "", token)) != token:
        return "round", None  # the survivors stopped waiting: they re-form in torch's round
    if not _settle(store, membership, offer["lost"], wait_s=FOLLOW_S):
        return "round", None
    return "member", _next_info(store, offer, node)


def wait_for_a_place(agent, join_round, local_address) -> Optional[int]:
    """Wait, warm, until this standby has taken a lost machine's place (``None``: the agent
    goes on as a member, ``agent.info`` and its tiers set) or the job ended without needing
    it (the exit code).  ``join_round`` and ``local_address`` are membership's (passed in:
    membership imports this module)."""
    # its own client: a torch round's handler talks to the store on the other one
    store, t0 = own_client(agent.rdzv.store), time.monotonic()
    cfg = agent.cfg
    holder = None
    # the members push it their copies every round (CKPTRUN_STANDBY_COPIES=0: it pulls the
    # lost ranks' copies at the takeover instead, and the rounds stay as cheap as without it)
    if cfg.secret is not None and cfg.replicas > 1 and \
            os.environ.get("CKPTRUN_STANDBY_COPIES", "1") != "0":
        holder = StandbyHolder(cfg, own_client(agent.rdzv.store), agent.token,
                               _host(cfg, local_address))
    agent.standby_holder = holder
    agent.events.emit("standby", waiting=True,
                      holds_copies=holder is not None)
    # warm workers from the start: a spare per local rank, its rank given at "go"
    agent.launcher.spare_delay = 0.0
    agent.launcher.schedule_spares({})
    counted, joined, thread = False, {}, None

    def join_torch_round() -> None:
        try:
            joined["info"] = agent.rdzv.join()
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            joined["error"] = e

    try:
        while True:
            agent.launcher.tick()
            agent._write_status()
            try:
                if store.check([OVER]):
                    return _leave(NOT_NEEDED, 0)
                if not counted:
                    store.add(WAITING, 1)
                    counted = True
                n = _claim(store, agent.token) if thread is None else None
                if n is not None:
                    try:
                        how, info = _take(store, n, agent.token)
                    except (ValueError, KeyError, TypeError, TimeoutError) as e:
                        # a record that is not a place (forged, or from a broken offer):
                        # not this standby's end, it waits for the next one
                        print(f"ckptrun: standby: place {n} cannot be taken ({e}); still "
                              "waiting", file=sys.stderr)
                        continue
                    if how == "member":
                        store.add(WAITING, -1)
                        counted = False
                        if holder is not None:  # every copy stays (standby_copies.py)
                            holder.close()
                            agent.standby_holder = holder = None
                        if not join_round(agent, info.group_rank, None, joined=info,
                                          takeover=True):
                            return 1
                        break
                    if holder is not None:
                        holder.close()
                        agent.standby_holder = holder = None
                    thread = threading.Thread(target=join_torch_round, daemon=True,
                                              name="ckptrun-standby-join")
                    thread.start()
            except Exception as e:  # noqa: BLE001 -- the store host is gone, a bad record
                if thread is None or thread.is_alive():
                    return _leave(f"the job's rendezvous store cannot be read ({e}); "
                                  "nothing to take over", 1)
            if thread is not None and not thread.is_alive():
                if "error" in joined:
                    e = joined["error"]
                    if _closed(e):
                        return _leave(NOT_NEEDED, 0)
                    print(f"ckptrun: standby: rendezvous failed: {type(e).__name__}: {e}",
                          file=sys.stderr)
                    return 1
                if not join_round(agent, joined=joined["info"]):
                    return 1
                break
            time.sleep(POLL_S)
    finally:
        if counted:
            with contextlib.suppress(Exception):
                store.add(WAITING, -1)
        if holder is not None:
            with contextlib.suppress(Exception):
                holder.close()
            agent.standby_holder = None
    agent.events.emit("standby_joined", node=agent.info.group_rank,
                      seconds_waited=round(time.monotonic() - t0, 3))
    return None


def _closed(e: BaseException) -> bool:
    """torch's way of saying the job's rendezvous is over (closed by its members)."""
    return type(e).__name__ in ("RendezvousGracefulExitError", "RendezvousClosedError")


def _leave(why: str, code: int) -> int:
    print(f"ckptrun: standby: {why}", file=sys.stderr)
    return code


def _host(cfg, local_address) -> str:
    """Where the standby's replica server listens (where members reach it)."""
    try:
        return local_address(cfg, "127.0.0.1")
    except (OSError, ValueError):
        return "127.0.0.1"
