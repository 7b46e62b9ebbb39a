"""torch's ``EtcdStore``: how it names keys and encodes values in etcd.

:class:`ckptrun.store.etcd.CasEtcdStore` adds ``compare_set`` and ``multi_get`` to torch's
``EtcdStore`` (``torch.distributed.elastic.rendezvous.etcd_store``); to read and write the
same etcd keys as the store's own methods, it must encode them as the store does, with its
private ``_encode``/``_decode`` (base64 text).  Checked on torch 2.7.0, 2.13.0 and 2.15.0.
"""

from __future__ import annotations

from typing import Any


def encode(store: Any, value: Any) -> str:
    """``value`` (a key or a value) as ``store`` writes it to etcd."""
    return store._encode(value)


def decode(store: Any, raw: Any) -> bytes:
    """A value ``store`` wrote to etcd, decoded."""
    return store._decode(raw)
