"""Access to the rendezvous store (torch's c10d ``TCPStore``, or etcd) from the agent's threads.

* :mod:`~ckptrun.store.kvstore` -- one client per thread, waits that poll;
* :mod:`~ckptrun.store.etcd` -- the etcd-v2 rendezvous handler and its compare-and-set store.

Imports nothing else of ckptrun: the agent and the tiers both use it.
"""
