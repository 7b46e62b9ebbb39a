"""The ``etcd-v2`` rendezvous with a store that has everything the agents use.

torch's ``etcd-v2`` backend hands out an ``EtcdStore`` that implements ``set``, ``get``,
``add``, ``wait`` and ``check`` only.  ckptrun's job coordination needs ``compare_set`` (the
epoch key that counts each failure once, job-wide) and ``multi_get``; calling them on torch's
store fails inside the C++ ``PrefixStore`` with "Not implemented".  :class:`CasEtcdStore` adds
both on top of etcd's own atomic operations (create-if-absent and compare-and-swap), so that
the agents need no store hosted by any of them: with etcd, losing the machine that would have
hosted a c10d store loses nothing but that machine.

The handler is built from torch's public pieces (``create_backend`` for the etcd client and
rendezvous state, ``create_handler`` for the dynamic rendezvous); only the store differs.
"""

from __future__ import annotations

import hashlib
import time
from typing import List, Sequence

from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

from ckptrun.store.kvstore import as_bytes
from ckptrun.torchcompat import etcd_store as etcd_codec

_CAS_RETRY_S = 0.01


class CasEtcdStore(EtcdStore):
    """torch's ``EtcdStore`` plus ``compare_set`` and ``multi_get``."""

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        """c10d semantics: set ``desired`` if the current value is ``expected`` (an empty
        ``expected`` matches a missing key); return the value the key holds afterwards
        (for a missing key and a non-empty ``expected``: ``expected``, like ``TCPStore``)."""
        import etcd  # python-etcd: present whenever torch's etcd backend could be created

        path = self.prefix + etcd_codec.encode(self, key)
        expected = as_bytes(expected_value)
        desired = etcd_codec.encode(self, desired_value)
        while True:
            try:
                node = self.client.get(key=path)
            except etcd.EtcdKeyNotFound:
                if expected:
                    return expected
                try:
                    self.client.write(key=path, value=desired, prevExist=False)
                    return as_bytes(desired_value)
                except etcd.EtcdAlreadyExist:
                    time.sleep(_CAS_RETRY_S)  # created meanwhile: compare with that value
                    continue
            current = etcd_codec.decode(self, node.value)
            if current != expected:
                return current
            try:
                self.client.test_and_set(key=path, value=desired, prev_value=node.value)
                return as_bytes(desired_value)
            except etcd.EtcdCompareFailed:
                time.sleep(_CAS_RETRY_S)  # changed meanwhile: compare again

    def multi_get(self, keys: Sequence) -> List[bytes]:
        """Values of ``keys`` (each waited for like ``get``)."""
        return [self.get(k) for k in keys]



def create_etcd_v2_handler(params, key=None, on_forged=None):
    """A dynamic-rendezvous handler on etcd whose store is a :class:`CasEtcdStore`; with
    ``key``, its values and the handler's pickled state are MAC'd
    (:mod:`ckptrun.store.authenticated`).  Returns (handler, the store it keeps its state in)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    from ckptrun.store.authenticated import AuthenticatedBackend, AuthenticatedStore

    backend, store = create_backend(params)
    # torch keeps every job's store under one fixed prefix (its own keys carry the run id);
    # ckptrun's -- the epoch, the done counts, a standby's offers -- do not, so on an etcd
    # that several jobs share they get a prefix of the job's own: a job finishing must not
    # tell the next job's standby that its job is over
    # (a digest of the run id: any string is a legal --rdzv-id, not every string a key path)
    run = hashlib.sha256(params.run_id.encode()).hexdigest()[:32]
    prefix = f"{store.prefix.rstrip('/')}/run-{run}"
    cas = CasEtcdStore(store.client, prefix, store.timeout)
    if key is None:
        return create_handler(cas, backend, params), cas
    sealed = AuthenticatedStore(cas, key, on_forged)
    return create_handler(sealed, AuthenticatedBackend(backend, key, on_forged), params), sealed
