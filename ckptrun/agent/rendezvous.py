"""Rendezvous through torch's own handlers, and job-wide coordination through its store.

:class:`Rendezvous` wraps ``torch.distributed.elastic.rendezvous`` (public API only:
``RendezvousParameters``, ``registry.get_rendezvous_handler``, ``next_rendezvous``) and
turns its result into this node's place in the job (group rank, master address/port).

:class:`JobCoordinator` is the fast path for restarts when membership is unchanged: instead
of a full re-rendezvous (torch's dynamic rendezvous polls with 1 s delays) every agent
watches one key, the *epoch* ``"<attempt>:<restarts>:<state>"``.  A node whose workers fail
moves it from attempt k to k+1 with ``compare_set``, so a failure in attempt k is counted
exactly once however many nodes report it, and the restart budget is job-wide.  The attempt
number is what workers get as ``TORCHELASTIC_RESTART_COUNT``: identical on every node and
new for every attempt, so torch's agent-store namespace ``/worker/attempt_<k>`` never serves
a previous attempt's keys.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from ckptrun.config import AgentConfig
from ckptrun.protocol.job_secret import ENV_SECRET, ENV_SECRET_FILE, job_key, local_secret
from ckptrun.store.kvstore import as_text, wait_keys

KEY_PREFIX = "ckptrun/"
RUN, FAILED, FATAL = "run", "failed", "fatal"


@dataclass
class NodeInfo:
    """This node's place in the job after a rendezvous."""

    store: Any  # torch.distributed.Store shared by all agents of this round
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    use_agent_store: bool
    # this membership's id, shared by its agents (None where the backend keeps no store of
    # its own): standbys are offered the places of a membership's lost machines by it
    membership: Optional[str] = None


def _c10d_handler(params, key: Optional[bytes], on_forged):
    """torch's c10d dynamic rendezvous from its public pieces -- ``create_backend`` makes the
    ``TCPStore`` exactly as torchrun would, ``create_handler`` the handler -- with the store
    MAC'd and the handler's pickled state kept by :class:`SealedStoreBackend` (unless
    ``--insecure``).  Returns (handler, its store): a standby reads the job's state there."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from ckptrun.store.authenticated import AuthenticatedStore, SealedStoreBackend

    backend, raw = create_backend(params)
    if key is None:
        return create_handler(raw, backend, params), raw
    store = AuthenticatedStore(raw, key, on_forged)
    return create_handler(store, SealedStoreBackend(store, params.run_id), params), store


def resolve_rdzv(cfg: AgentConfig):
    """torchrun's rules: ``--standalone`` and single-node static become c10d on localhost:0."""
    backend, endpoint, run_id = cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.rdzv_id
    configs = dict(cfg.rdzv_configs)
    if cfg.standalone or (backend == "static" and not endpoint and cfg.master_port is None
                          and cfg.max_nodes == 1):
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
    if backend == "static":
        configs["rank"] = cfg.node_rank
        if not endpoint:
            endpoint = f"{cfg.master_addr}:{cfg.master_port or 29500}"
    return backend, endpoint, run_id, configs


def store_key(cfg: AgentConfig) -> Optional[bytes]:
    """The key every value in the rendezvous store is MAC'd with: from the job secret (one
    machine: a secret of its own), or None for an ``--insecure`` job, whose store cannot be
    authenticated (a key agreed through the store would be the store's to read)."""
    if cfg.secret is not None:
        return job_key(cfg.secret, f"{cfg.rdzv_id}|rendezvous store")
    return None if cfg.max_nodes > 1 else local_secret()


class Rendezvous:
    """A torch rendezvous handler for this agent, on an authenticated store
    (:mod:`ckptrun.store.authenticated`) unless the job is ``--insecure``."""

    def __init__(self, cfg: AgentConfig, on_forged: Optional[Callable[[str], None]] = None):
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous import registry as rdzv_registry

        self.cfg = cfg
        self.key = store_key(cfg)
        self.on_forged = on_forged
        backend, endpoint, run_id, configs = resolve_rdzv(cfg)
        self.backend = backend
        if backend in ("c10d", "etcd-v2"):
            # torch drops a dead participant after keep_alive_interval * max_attempt seconds
            # (default 5 x 3); 1 x 3 lets a replacement machine in quickly.  --rdzv-conf wins.
            configs.setdefault("keep_alive_interval", 1)
            configs.setdefault("keep_alive_max_attempt", 3)
        params = RendezvousParameters(
            backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes, local_addr=cfg.local_addr, **configs,
        )
        self.store = None  # the handler's own store (dynamic backends): outlives rounds
        if backend == "etcd-v2":
            # torch's etcd store lacks compare_set, which the job epoch needs.
            from ckptrun.store.etcd import create_etcd_v2_handler

            self.handler, self.store = create_etcd_v2_handler(params, self.key, on_forged)
        elif backend == "c10d":
            self.handler, self.store = _c10d_handler(params, self.key, on_forged)
        else:
            self.handler = rdzv_registry.get_rendezvous_handler(params)
        self._static_master = None
        if backend == "static":
            host, _, port = endpoint.rpartition(":")
            self._static_master = (host, int(port))

    def join(self) -> NodeInfo:
        """Run one round of torch's rendezvous (first start, or membership changed)."""
        info = self.handler.next_rendezvous()
        boot = info.bootstrap_store_info
        addr, port = boot.master_addr, boot.master_port
        if self.backend != "static":
            # torch 2.13 (shared TCPStore) publishes MASTER_ADDR/PORT in a round's store only
            # from a rank 0 that has no bootstrap info yet: after a re-rendezvous a survivor
            # never does, and a newcomer waits for the keys until its read timeout.  Every
            # node offers the values it holds; the first one wins (they only serve attempt 0).
            from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo as S

            info.store.compare_set(S.MASTER_ADDR_KEY, "", str(addr))
            info.store.compare_set(S.MASTER_PORT_KEY, "", str(port))
        store = info.store
        if self._static_master is not None:  # torchrun: explicit master for static only
            addr, port = self._static_master
            if self.key is not None:  # no handler state to seal, but ckptrun's own values
                from ckptrun.store.authenticated import AuthenticatedStore

                store = AuthenticatedStore(store, self.key, self.on_forged)
        membership = None
        if self.store is not None:
            membership = as_text(info.store.compare_set(KEY_PREFIX + "membership", "",
                                                        uuid.uuid4().hex))
        return NodeInfo(store, info.rank, info.world_size, addr, int(port),
                        self.handler.get_run_id(), bool(self.handler.use_agent_store),
                        membership)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join (scale-up); 0 when the backend cannot tell."""
        try:
            return int(self.handler.num_nodes_waiting())
        except Exception:
            return 0

    def shutdown(self) -> None:
        try:
            self.handler.shutdown()
        except Exception:
            pass  # the store host may already be gone at the very end


@dataclass(frozen=True)
class Epoch:
    """The job-wide restart state every agent watches."""

    attempt: int
    restarts: int
    state: str = RUN

    def encode(self) -> str:
        return f"{self.attempt}:{self.restarts}:{self.state}"

    @classmethod
    def decode(cls, raw) -> Epoch:
        a, r, s = as_text(raw).split(":")
        return cls(int(a), int(r), s)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class JobCoordinator:
    """Job-wide epoch, restart budget, restore-step agreement and exit barrier."""

    def __init__(self, store, group_rank: int, nnodes: int, max_restarts: int,
                 timeout_s: float = 300.0):
        self.store, self.group_rank, self.nnodes = store, group_rank, nnodes
        self.max_restarts = max_restarts
        self.timeout = timedelta(seconds=timeout_s)
        self._key = KEY_PREFIX + "epoch"
        self._attempt_store = None  # node 0: the store served to this attempt's workers
        # Called while waiting on other nodes; raises (e.g. NodeLost) to abandon the wait
        # when a node of this round is gone -- it would never post its key.
        self.check: Callable[[], None] = lambda: None

    def init(self) -> Epoch:
        """The current epoch; the first agent to ask creates ``0:0:run``."""
        return Epoch.decode(self.store.compare_set(self._key, "", Epoch(0, 0).encode()))

    def poll(self) -> Epoch:
        return Epoch.decode(self.store.get(self._key))

    def _advance(self, seen_attempt: int, make) -> Epoch:
        while True:
            cur = self.poll()
            if cur.attempt != seen_attempt or cur.state != RUN:
                return cur  # someone else already moved on: not counted twice
            new = make(cur)
            got = Epoch.decode(self.store.compare_set(self._key, cur.encode(), new.encode()))
            if got == new or got.attempt != seen_attempt or got.state != RUN:
                return got

    def report_failure(self, attempt: int) -> Epoch:
        """Workers of ``attempt`` failed here: next attempt, or FAILED once the budget is spent."""
        def nxt(cur: Epoch) -> Epoch:
            spent = cur.restarts + 1 > self.max_restarts
            return Epoch(cur.attempt + (0 if spent else 1), cur.restarts + (0 if spent else 1),
                         FAILED if spent else RUN)

        return self._advance(attempt, nxt)

    def report_stop(self, attempt: int) -> Epoch:
        """The job fails now, budget or not (a restart loop): every agent exits 1."""
        return self._advance(attempt, lambda cur: Epoch(cur.attempt, cur.restarts, FAILED))

    def report_fatal(self, attempt: int) -> Epoch:
        """An error a restart cannot fix: every agent stops with exit code 2."""
        return self._advance(attempt, lambda cur: Epoch(cur.attempt, cur.restarts, FATAL))

    def request_restart(self, attempt: int) -> Epoch:
        """A restart that is not a failure (rollback): new attempt, budget untouched."""
        return self._advance(attempt, lambda cur: Epoch(cur.attempt + 1, cur.restarts))

    # -- per-attempt agreements ----------------------------------------------------------
    def _wait(self, keys: List[str]) -> None:
        """``store.wait`` in short slices, calling :attr:`check` between them."""
        wait_keys(self.store, keys, self.timeout.total_seconds(), check=self.check)

    def _gather(self, name: str, key: str, value: str) -> List[str]:
        prefix = f"{KEY_PREFIX}{name}/{key}/"
        self.store.set(prefix + str(self.group_rank), value)
        keys = [prefix + str(g) for g in range(self.nnodes)]
        self._wait(keys)
        return [v.decode() for v in self.store.multi_get(keys)]

    def agree_common_step(self, key: str, steps: List[int]) -> Optional[int]:
        """The newest step every node offers in ``steps`` (None if there is none)."""
        if self.nnodes == 1:
            return max(steps) if steps else None
        common = set(steps)
        for v in self._gather("restore", key, json.dumps(sorted(steps))):
            common &= set(json.loads(v))
        return max(common) if common else None

    def agree_restore_step(self, key: str, local_step: Optional[int]) -> Optional[int]:
        """The step every node can restore (min over nodes); None if one has none.
        ``key`` names the round (attempt and tier): each round is used once."""
        if self.nnodes == 1:
            return local_step
        steps = [int(v) for v in self._gather("restore", key, str(
            -1 if local_step is None else local_step))]
        return None if min(steps) < 0 else min(steps)

    def master_port(self, attempt: int, info: NodeInfo, own_addr: Optional[str] = None
                    ) -> Tuple[str, int]:
        """(MASTER_ADDR, MASTER_PORT) for ``attempt``: a store no earlier attempt has used.

        torch 2.13 workers no longer prefix their keys by attempt ("a new TCPStore for every
        retry"): torch's agent gets a new store from every re-rendezvous.  The fast path has
        no new round, so node 0 hosts a fresh store per attempt (agent store) or picks a
        fresh port for rank 0's own store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
        reusing the old one makes gloo connect to the previous attempt's addresses.
        Node 0 publishes its own address (``own_addr``): after a re-rendezvous torch's round
        rank 0, whose address ``info.master_addr`` is, need not be our group rank 0.
        """
        if attempt == 0:
            return info.master_addr, info.master_port
        key = f"{KEY_PREFIX}port/{attempt}"
        if self.group_rank == 0:
            addr = own_addr or info.master_addr
            if info.use_agent_store:
                import torch.distributed as dist

                old = self._attempt_store
                self._attempt_store = dist.TCPStore(
                    addr, 0, None, True, self.timeout, wait_for_workers=False,
                    multi_tenant=True)
                port = self._attempt_store.port
                del old  # the previous attempt's workers are gone
            else:
                port = free_port(addr)
            self.store.compare_set(key, "", f"{addr}:{port}")
        self._wait([key])
        host, _, port = self.store.get(key).decode().rpartition(":")
        return host, int(port)

    def set_rollback(self, attempt: int, step: int) -> None:
        """Attempt ``attempt`` restores exactly ``step`` (``ckptrun restore --rollback``)."""
        self.store.set(f"{KEY_PREFIX}rollback/{attempt}", str(step))

    def rollback_step(self, attempt: int) -> Optional[int]:
        key = f"{KEY_PREFIX}rollback/{attempt}"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def mark_done(self, attempt: int) -> None:
        """This node's workers all succeeded in ``attempt``."""
        self.store.add(f"{KEY_PREFIX}done/{attempt}", 1)

    def all_done(self, attempt: int) -> bool:
        return self.store.add(f"{KEY_PREFIX}done/{attempt}", 0) >= self.nnodes

    def exit_barrier(self, attempt: int, timeout_s: float = 30.0) -> None:
        """Wait until every node knows the job is over before the store host leaves."""
        if self.nnodes == 1:
            return
        key = f"{KEY_PREFIX}exit/{attempt}"
        self.store.add(key, 1)
        import time

        deadline = time.monotonic() + timeout_s
        try:
            while self.store.add(key, 0) < self.nnodes and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            pass  # a node that counted itself already left and took the store with it


# ---------------------------------------------------------------------------- worker environment


def agent_base_env(cfg: AgentConfig) -> Dict[str, str]:
    """The environment every worker inherits before its own variables: torchrun sets
    ``OMP_NUM_THREADS=1`` (nproc > 1, unset) and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` in its
    own ``os.environ``; here they go into a copy, the agent's environment stays untouched."""
    env = dict(os.environ)
    for name in (ENV_SECRET, ENV_SECRET_FILE):  # the job secret is the agent's, not the script's
        # (the same names as job_secret.without_secret, for the agent's other helpers)
        env.pop(name, None)
    if "OMP_NUM_THREADS" not in env and cfg.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = cfg.signals_to_handle
    return env


def torchrun_env(cfg: AgentConfig, *, local_rank: int, group_rank: int, group_world_size: int,
                 master_addr: str, master_port: int, attempt: int, run_id: str,
                 use_agent_store: bool, error_file: str) -> Dict[str, str]:
    """Exactly the variables torch's LocalElasticAgent gives a worker (homogeneous ranks)."""
    world = cfg.nproc_per_node * group_world_size
    rank = group_rank * cfg.nproc_per_node + local_rank
    env = {
        "RANK": str(rank), "GROUP_RANK": str(group_rank), "ROLE_RANK": str(rank),
        "ROLE_NAME": cfg.role, "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port), "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts), "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LOCAL_RANK": str(local_rank), "TORCHELASTIC_ERROR_FILE": error_file,
    }
    if cfg.virtual_local_rank:  # as torchrun: every worker sees its own GPU as device 0
        env["LOCAL_RANK"] = "0"
        visible = os.getenv("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible is not None else [str(i) for i in range(
            cfg.nproc_per_node)]
        if local_rank >= len(gpus):
            raise ValueError(f"local_rank {local_rank} exceeds available GPUs in "
                             f"CUDA_VISIBLE_DEVICES={visible}")
        env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank]
    return env
