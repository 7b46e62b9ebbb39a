"""The checkpoint tiers: where snapshots are kept and where a restore takes them from.

* :mod:`~ckptrun.tiers.interface` -- :class:`Tier`, the one interface the agent knows a tier
  by, and :class:`TierContext`, what a tier gets from the agent;
* :mod:`~ckptrun.tiers.stack` -- the agent's ordered list: memory, peer, durable;
* :mod:`~ckptrun.tiers.restore_decision` -- where a restore comes from (one function over
  that list);
* :mod:`ckptrun.tiers.memory` -- this machine's slots, as the agent sees them;
* :mod:`ckptrun.tiers.peer` -- copies in other machines' memory (GEMINI): placement, wire
  protocol, server, copies, rounds, pacing;
* :mod:`ckptrun.tiers.durable` -- storage through fsspec in DCP format: format, persister,
  multi-machine persist rounds.

Tiers never import the agent, the worker side or the command line; what they need of the
agent comes in the :class:`TierContext`.  This ``__init__`` imports nothing, so that the
worker side can read the durable format without loading the other tiers.
"""
