"""The memory tier: the workers' slots in agent-owned shared memory, seen from the agent.

* :mod:`~ckptrun.tiers.memory.node` -- :class:`NodeMemory`: which steps each rank holds,
  verification, pinned reads of live slots, materialising copies, cleanup;
* :mod:`~ckptrun.tiers.memory.tier` -- :class:`MemoryTier`, the :class:`~ckptrun.tiers.
  interface.Tier` over it.
"""
