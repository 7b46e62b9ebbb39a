"""A standby's copies (``ckptrun.tiers.peer.standby_copies``): members find it through the
rendezvous handler's store and push it their round copies; it keeps them all when it takes a
place, until its new membership's rounds replaced them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch.distributed as dist
from test_replication import make_slot, read_data

from ckptrun.protocol.job_secret import job_key
from ckptrun.tiers.peer.copies import MapCache, PeerStore
from ckptrun.tiers.peer.standby_copies import StandbyHolder, StandbyTargets, describe

SECRET = b"a test job secret of enough bytes"


def cfg(nnodes: int = 2, nproc: int = 2):
    return SimpleNamespace(max_nodes=nnodes, nproc_per_node=nproc, secret=SECRET,
                           rdzv_id="job1", rdzv_endpoint="127.0.0.1:1", local_addr=None)


def test_members_push_their_round_to_the_standby_and_it_keeps_the_place_it_takes(token):
    store = dist.HashStore()
    holder = StandbyHolder(cfg(), store, token + "-s", "127.0.0.1")
    try:
        key = job_key(SECRET, "job1")
        datas = {}
        for node in (0, 1):
            targets = StandbyTargets(store, key, node)
            assert targets.addresses() == [holder.server.address]
            own = {}
            for lr in range(2):
                rank = node * 2 + lr
                datas[rank] = os.urandom(1 << 20)
                own[rank] = f"/dev/shm/ckptrun-{token}-m{node}-r{rank}"
                make_slot(own[rank], 12, datas[rank], rank=rank)
            assert targets.push_round(own, 12, None, MapCache()) >= 2 << 20
            assert targets.status() == {"{}:{}".format(*holder.server.address): 12}
        assert holder.held_step() == 12  # every rank of the job at one step
        assert describe(holder)["standby_holds_step"] == 12
        for rank, data in datas.items():
            assert read_data(holder.copies.copies(rank)[12]) == data

        holder.close()  # it took node 1's place
        kept = PeerStore(token + "-s", pin_ranks=[2, 3])  # its replica tier (same token)
        # every rank's copies stay: another machine may turn out lost too
        assert sorted(kept.holdings()) == [0, 1, 2, 3]
        assert read_data(kept.copies(3)[12]) == datas[3]
        # gone from the store: members stop pushing to it
        targets = StandbyTargets(store, key, 0)
        assert targets.addresses() == []
        # the replica tier drops the others once its rounds replaced every copy
        assert kept.drop_others() == [0, 1]
        assert sorted(PeerStore(token + "-s").holdings()) == [2, 3]
    finally:
        holder.server.stop()


def test_a_push_with_another_jobs_key_is_refused(token):
    store = dist.HashStore()
    holder = StandbyHolder(cfg(), store, token + "-s", "127.0.0.1")
    try:
        src = f"/dev/shm/ckptrun-{token}-x"
        make_slot(src, 3, b"x" * 4096, rank=0)
        targets = StandbyTargets(store, job_key(b"another job's secret, 32 bytes..", "job1"), 0)
        assert targets.push_round({0: src}, 3, None, MapCache()) == 0
        assert targets.status() is None and holder.held_step() is None
    finally:
        holder.close()
