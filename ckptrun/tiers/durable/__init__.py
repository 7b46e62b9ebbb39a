"""The durable tier: checkpoints in storage (any fsspec URL) in DCP format.

* :mod:`~ckptrun.tiers.durable.storage` -- the format: ``step-<N>/`` DCP directories plus
  ``ckptrun.json``, written and read back without unpickling;
* :mod:`~ckptrun.tiers.durable.persister` -- the background persistence thread;
* :mod:`~ckptrun.tiers.durable.rounds` -- several machines: persist rounds led by node 0;
* :mod:`~ckptrun.tiers.durable.tier` -- :class:`DurableTier`, the
  :class:`~ckptrun.tiers.interface.Tier` over them.
"""
