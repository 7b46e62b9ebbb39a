"""The standby takeover's store protocol (``ckptrun.agent.standby``), on an in-memory store:
survivors offer the lost places, standbys claim them -- never more than were freed -- and
everyone reads one answer; what is not a place is refused in one line."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ckptrun.agent import standby
from ckptrun.agent.rendezvous import NodeInfo


def survivor(store, node: int, nnodes: int = 3, membership: str = "m1"):
    info = NodeInfo(None, node, nnodes, "127.0.0.1", 29500, "job", True, membership)
    return SimpleNamespace(rdzv=SimpleNamespace(store=store), info=info)


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(standby, "TAKE_S", 0.5)
    monkeypatch.setattr(standby, "FOLLOW_S", 2.0)


def test_no_standby_waiting_means_no_offer():
    store = dist.HashStore()
    assert standby.offer_places(survivor(store, 0), [2]) is None
    assert not store.check([f"{standby.K}offer/m1"])


def test_a_standby_takes_the_place_and_both_sides_form_the_same_membership():
    store = dist.HashStore()
    store.add(standby.WAITING, 1)
    got = {}

    def the_standby():
        while (n := standby._claim(store, "tokS")) is None:
            pass
        got["standby"] = standby._take(store, n, "tokS")

    t = threading.Thread(target=the_standby)
    t.start()
    mine = standby.offer_places(survivor(store, 0), [2])
    t.join(5)
    how, theirs = got["standby"]
    assert how == "member" and mine is not None
    assert (mine.group_rank, theirs.group_rank) == (0, 2)  # survivors keep, it takes 2
    assert mine.membership == theirs.membership != "m1"  # a fresh membership for both
    assert theirs.group_world_size == 3 and theirs.master_port == 29500
    # the other survivor follows the same offer (it does not publish places again)
    other = standby.offer_places(survivor(store, 1), [2])
    assert other is not None and other.membership == mine.membership
    assert store.add(standby.WANTED, 0) == 1


def test_surplus_standbys_claim_nothing():
    store = dist.HashStore()
    store.add(standby.WANTED, 1)
    claims = []

    def claim(tok):
        claims.append(standby._claim(store, tok))

    ts = [threading.Thread(target=claim, args=(f"t{i}",)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    assert sorted(c for c in claims if c is not None) == [1]  # one place, one claimant


def test_an_untaken_place_falls_back_to_the_rendezvous_for_everyone():
    store = dist.HashStore()
    store.add(standby.WAITING, 1)
    # two machines lost, the one standby takes one place only
    assert standby.offer_places(survivor(store, 0), [1, 2]) is None
    n = standby._claim(store, "tokS")
    assert standby._take(store, n, "tokS") == ("round", None)  # closed: "none"


def test_a_place_that_its_offer_did_not_free_is_refused():
    store = dist.HashStore()
    store.set(f"{standby.K}offer/m1", json.dumps({"lost": [2], "next": "m2", "nnodes": 3,
                                                 "master_addr": "x", "master_port": 1,
                                                 "run_id": "job", "use_agent_store": True}))
    store.set(f"{standby.K}place/1", json.dumps({"membership": "m1", "node": 0}))
    with pytest.raises(ValueError, match="did not free"):
        standby._take(store, 1, "tokS")
    store.set(f"{standby.K}place/2", "not json")
    with pytest.raises(ValueError):
        standby._take(store, 2, "tokS")


def test_a_takeover_whose_member_never_comes_is_not_formed_for_anyone():
    """A machine lost just after the one the offer named (its link broke a moment later)
    never joins the takeover's membership: both who came hear "not formed" -- even the one
    that checks after the deadline, when it might see every key but the dead one's -- and
    they re-form in torch's round instead of waiting for it."""
    from ckptrun.agent.membership import NotFormed, assign_ranks

    store = dist.HashStore()
    errors = []

    def member(rank):
        try:
            assign_ranks(store, rank, 3, rank, None, timeout_s=0.3, agreed=True)
        except NotFormed as e:
            errors.append((rank, str(e)))

    ts = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]  # 2 never comes
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    assert sorted(r for r, _ in errors) == [0, 1], errors
    # a member arriving late sees every key now, but the verdict stands
    store.set("ckptrun/member/2", json.dumps({"old": 2, "epoch": None}))
    with pytest.raises(NotFormed):
        assign_ranks(store, 2, 3, 2, None, timeout_s=0.3, agreed=True)


def test_a_takeover_whose_members_all_come_is_formed():
    from ckptrun.agent.membership import assign_ranks

    store = dist.HashStore()
    ranks = {}

    def member(rank):
        ranks[rank] = assign_ranks(store, rank, 3, rank, None, timeout_s=5, agreed=True)[0]

    ts = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert ranks == {0: 0, 1: 1, 2: 2}
