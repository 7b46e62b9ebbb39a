"""The one interface every checkpoint tier offers the agent, and what the agent gives a tier.

A tier is one place a rank's snapshot can come back from: this machine's memory, a peer
machine's memory, durable storage.  The agent holds them in an ordered list, nearest first
(:func:`ckptrun.tiers.stack.build_tiers`), and knows them only through :class:`Tier`:

* for a restore, before the workers of an attempt start, :func:`ckptrun.tiers.restore_decision.
  decide_restore` asks each tier in turn which steps it :meth:`~Tier.offers` for this node's
  ranks, agrees on one step with the other machines, and has the tier
  :meth:`~Tier.materialise` it into the ranks' slot files -- the worker's ``restore()`` reads
  it from there, whichever tier served it;
* around that, a tier's life follows the job's: :meth:`~Tier.attempt_started` when an
  attempt's workers run, :meth:`~Tier.tick` from the supervision loop, :meth:`~Tier.close`
  when the membership changes (the agent builds the tiers anew for the new membership; shared
  memory stays), :meth:`~Tier.finished` when the job ends, :meth:`~Tier.status` for
  ``status.json``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ckptrun.config import AgentConfig
from ckptrun.protocol import ControlBlock
from ckptrun.tiers.memory.node import NodeMemory


@dataclass
class TierContext:
    """What a tier gets from the agent that runs it (one membership of the job)."""

    cfg: AgentConfig
    node: int  # this machine's group rank
    nnodes: int
    store: Any  # the rendezvous store (a torch ``Store``), shared by every machine of the job
    memory: NodeMemory  # this machine's slots (agent-owned shared memory)
    control: ControlBlock  # this machine's control block (heartbeats, pins)
    token: str  # this agent's job token: its shared-memory files are named after it
    emit: Callable[..., Dict[str, Any]]  # ``EventLog.emit``: one event into events.jsonl
    address: Optional[str] = None  # where other machines reach this one (None: one machine)
    master_addr: str = "127.0.0.1"
    job_store: Any = None  # the rendezvous handler's own store: outlives memberships (standbys)

    @property
    def ranks(self) -> List[int]:
        """This machine's global ranks, in local-rank order."""
        n = self.cfg.nproc_per_node
        return [self.node * n + lr for lr in range(n)]

    @property
    def world_size(self) -> int:
        return self.nnodes * self.cfg.nproc_per_node


class Tier(ABC):
    """A place snapshots can be restored from (see the module docstring)."""

    #: ``"memory"``, ``"peer"`` or ``"storage"``: names the agreement rounds and the events
    name: str = ""
    #: why the last copy this tier offered was refused (damaged, crafted), for the user; None
    rejected: Optional[str] = None

    @abstractmethod
    def offers(self, ranks: List[int], attempt: int, max_step: Optional[int]) -> List[int]:
        """Steps (at most ``max_step``; None: any) this tier could put into the slots of every
        one of ``ranks``.  Cheap: headers, inventories, listings -- nothing copied or hashed."""

    @abstractmethod
    def materialise(self, ranks: List[int], attempt: int, step: int) -> Optional[str]:
        """Make ``step`` of every rank in ``ranks`` ready in its slot files (the workers are
        stopped), verified.  Returns the tier that served it (``"memory"`` when every byte was
        already on this machine, ``"peer"``, ``"storage"``), or None if some rank cannot
        have it; never raises for a bad copy (it is skipped, the next tier or step is tried)."""

    def settle(self, ranks: List[int], step: int) -> None:  # noqa: B027  (optional: a no-op by default)
        """The job restores ``step``: forget what belongs to a newer, abandoned timeline."""

    def attempt_started(self, attempt: int) -> None:  # noqa: B027  (optional: a no-op by default)
        """The workers of ``attempt`` were started."""

    def tick(self) -> None:  # noqa: B027  (optional: a no-op by default)
        """Called from the supervision loop (about every ``--monitor-interval``)."""

    def finished(self, exit_code: int, stopped: bool = False) -> None:
        """The job ends here with ``exit_code``; ``stopped``: by a signal (a preemption).
        A job that succeeded or was stopped keeps its newest step (the durable tier)."""
        self.close()

    def close(self) -> None:  # noqa: B027  (optional: a no-op by default)
        """Stop threads and servers (membership changed, or the job is over); keep the data."""

    def status(self) -> Dict[str, Any]:
        """This tier's part of ``status.json``'s ``checkpoint`` object."""
        return {}
