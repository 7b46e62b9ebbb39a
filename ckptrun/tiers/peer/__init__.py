"""The peer tier: copies of every machine's snapshots in other machines' memory (GEMINI).

* :mod:`~ckptrun.tiers.peer.placement` -- which machines hold whose copies (mixed placement);
* :mod:`~ckptrun.tiers.peer.wire` -- the wire format: framing, handshake, streams;
* :mod:`~ckptrun.tiers.peer.server` -- the replica server and the client operations;
* :mod:`~ckptrun.tiers.peer.copies` -- the copies an agent keeps, as slot files;
* :mod:`~ckptrun.tiers.peer.tier` -- :class:`ReplicaTier`: replication rounds and restore;
* :mod:`~ckptrun.tiers.peer.pacing` -- spacing rounds by the slowdown they cause;
* :mod:`~ckptrun.tiers.peer.beat_windows` -- cutting time at the workers' beats for the pacer.
"""
