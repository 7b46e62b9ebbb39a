"""Training state <-> (JSON skeleton, list of tensors), without pickle; RNG capture.

A rank's snapshot is ``(meta, tensors)`` where ``meta`` is a JSON-able dict (see
:func:`make_meta`) and ``tensors[i]`` is the contiguous CPU tensor described by
``meta["tensors"][i]``.  ``meta["tree"]`` is the skeleton produced by :func:`flatten`; only
:func:`unflatten` interprets it.

Skeleton encoding: ``None``/``bool``/``int``/``str`` and finite floats are stored as
themselves (Python's ``json`` round-trips big ints and floats exactly); everything else is a
one-key tagged object, so a plain dict is always tagged (``{"d": [[key, value], ...]}``) and
can never be mistaken for a tag.  Dict keys are encoded like values, so ``1``, ``"1"`` and
``(1, 2)`` stay distinct.

The slot I/O (``write_slot``/``read_slot``/``verify_slot``) lives in :mod:`ckptrun.snapshot.slots`;
the package re-exports both.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import sys
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from ckptrun.snapshot.slots import dtype_from_name, dtype_name, meta_bytes
from ckptrun.torchcompat.dtensor import local_offset

FORMAT = 1

# numpy dtypes that torch.from_numpy accepts with the same meaning; others travel as raw bytes.
_NP_TORCH_KINDS = {"b", "i", "u", "f", "c"}


class Flattened:
    """Result of :func:`flatten_state`: skeleton, ``(path, tensor)`` pairs and which of them
    may be copied in the background -- the parameters and state of the optimizers found in
    the state, which only change inside ``optimizer.step()`` -- plus those optimizers (to
    hook their ``step``).  A parameter no optimizer of the state owns (a frozen or EMA copy,
    a second model) may be changed by the script at any time, so it is copied synchronously."""

    def __init__(self) -> None:
        self.tree: Any = None
        self.items: List[Tuple[str, torch.Tensor]] = []
        self.deferrable: List[bool] = []
        self.tensor_paths: Set[str] = set()  # real tensors (numpy-backed ones are not listed)
        self.optimizers: List[torch.optim.Optimizer] = []
        # index -> DTensor layout (global_shape, global_offset, placements, mesh_shape): the
        # snapshot holds the local shard; storage writes it as a sharded DCP chunk.
        self.shards: Dict[int, Dict[str, Any]] = {}
        self._paths: Set[str] = set()

    def add(self, path: str, t: torch.Tensor, deferrable: bool, tensor: bool = True) -> int:
        # Paths are readable keys; a rare collision ("a/b" vs {"a": {"b"}}) gets a suffix.
        unique, n = path, 1
        while unique in self._paths:
            n += 1
            unique = f"{path}#{n}"
        self._paths.add(unique)
        if tensor:
            self.tensor_paths.add(unique)
        self.items.append((unique, t))
        self.deferrable.append(deferrable)
        return len(self.deferrable) - 1


class Unsnapshottable(TypeError):
    """The state holds something a snapshot cannot hold (its type, not its value: saving
    again, or in a restarted process, fails the same way)."""


# a torch.Generator snapshots as {GENERATOR_KEY: its state}, put back with set_state()
GENERATOR_KEY = "generator_state"


def flatten(state: Any) -> Tuple[Any, List[Tuple[str, torch.Tensor]]]:
    """Split ``state`` into a JSON skeleton and its tensors (``[(path, tensor)]``).

    Values may be objects with ``state_dict()`` (stored as their state dict), tensors, numpy
    arrays and plain Python data.  Anything else raises :class:`Unsnapshottable` (a
    ``TypeError``) naming its path.
    """
    fl = flatten_state(state)
    return fl.tree, fl.items


def flatten_state(state: Any) -> Flattened:
    """Like :func:`flatten`, also reporting deferrable tensors and optimizers (for overlap)."""
    fl = Flattened()
    fl.optimizers = find_optimizers(state)
    live: Set[int] = set()
    cls = dtensor_class()
    for opt in fl.optimizers:
        ts = [p for g in opt.param_groups for p in g["params"]]
        ts += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        live.update((t.to_local() if cls is not None and isinstance(t, cls) else t).data_ptr()
                    for t in ts if t.numel())
    fl.tree = _enc(state, "", fl, live)
    return fl


def dtensor_class() -> Any:
    """``torch.distributed.tensor.DTensor``, or None while that module was never imported
    (then no DTensor exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing that module)."""
    cls = dtensor_class()
    return cls is not None and isinstance(x, cls)


def find_optimizers(x: Any, depth: int = 0) -> List[torch.optim.Optimizer]:
    """Optimizers reachable through the dicts/lists/tuples of a state (a few levels deep),
    and those an adapter object declares in its ``ckptrun_optimizers`` attribute."""
    if isinstance(x, torch.optim.Optimizer):
        return [x]
    declared = getattr(x, "ckptrun_optimizers", None)
    if declared is not None and not isinstance(x, (dict, list, tuple)):
        return list(declared)
    if depth >= 4 or not isinstance(x, (dict, list, tuple)):
        return []
    found: List[torch.optim.Optimizer] = []
    for v in (x.values() if isinstance(x, dict) else x):
        found.extend(o for o in find_optimizers(v, depth + 1) if o not in found)
    return found


def _escape(k: str) -> str:
    return k.replace("%", "%25").replace("/", "%2F")


def _join(path: str, key: Any) -> str:
    k = _escape(key if isinstance(key, str) else repr(key))
    return f"{path}/{k}" if path else k


def _enc(x: Any, path: str, fl: Flattened, live: Optional[Set[int]]) -> Any:
    """Encode ``x``; ``live`` holds the data pointers of deferrable tensors.

    The exact types state dicts are made of (str/int keys, plain tensors and parameters,
    lists) take a short path here -- ``save()`` runs this on every step; it returns what
    :func:`_enc_any` returns for them."""
    tx = type(x)
    if tx is str or tx is int or tx is bool or x is None:
        return x
    if tx is dict or tx is OrderedDict:
        out = []
        for k, v in x.items():
            tk = type(k)
            if tk is str:
                seg = k if "%" not in k and "/" not in k else _escape(k)
                out.append([k, _enc(v, f"{path}/{seg}" if path else seg, fl, live)])
            elif tk is int:
                seg = repr(k)
                out.append([k, _enc(v, f"{path}/{seg}" if path else seg, fl, live)])
            else:
                out.append([_enc_key(k, path), _enc(v, _join(path, k), fl, live)])
        return {"d": out}
    if tx is torch.Tensor or tx is torch.nn.Parameter:  # never a DTensor (a subclass)
        if x.layout != torch.strided:
            raise Unsnapshottable(f"ckptrun: cannot snapshot sparse tensor at {path or '<root>'!r}")
        deferrable = live is not None and x.numel() > 0 and x.data_ptr() in live
        return {"T": fl.add(path, x.detach(), deferrable)}
    if tx is float:
        return x if math.isfinite(x) else {"f": repr(x)}
    if tx is list or tx is tuple:
        return {"l" if tx is list else "t": [_enc(v, f"{path}/{i}" if path else str(i), fl, live)
                                             for i, v in enumerate(x)]}
    return _enc_any(x, path, fl, live)


def _enc_any(x: Any, path: str, fl: Flattened, live: Optional[Set[int]]) -> Any:
    """The general encoder: every type :func:`_enc` accepts."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if type(x) is int:
        return x
    if type(x) is float:
        return x if math.isfinite(x) else {"f": repr(x)}
    if is_dtensor(x):
        return _enc_dtensor(x, path, fl, live)
    if isinstance(x, torch.Tensor):
        if x.is_sparse or x.layout != torch.strided:
            raise Unsnapshottable(f"ckptrun: cannot snapshot sparse tensor at {path or '<root>'!r}")
        deferrable = live is not None and x.numel() > 0 and x.data_ptr() in live
        return {"T": fl.add(path, x.detach(), deferrable)}
    if isinstance(x, dict):
        return {"d": [[_enc_key(k, path), _enc(v, _join(path, k), fl, live)] for k, v in x.items()]}
    if type(x) is list:
        return {"l": [_enc(v, _join(path, i), fl, live) for i, v in enumerate(x)]}
    if type(x) is tuple:
        return {"t": [_enc(v, _join(path, i), fl, live) for i, v in enumerate(x)]}
    if isinstance(x, np.ndarray):
        return _enc_ndarray(x, path, fl)
    if isinstance(x, np.generic):
        if x.dtype.kind == "O":
            raise Unsnapshottable(f"ckptrun: cannot snapshot numpy object scalar at {path!r}")
        return {"ns": [x.dtype.str, x.tobytes().hex()]}
    if isinstance(x, (bytes, bytearray)):
        return {"b" if type(x) is bytes else "ba": base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, torch.dtype):
        return {"dt": dtype_name(x)}
    if isinstance(x, torch.Size):
        return {"S": list(x)}
    if isinstance(x, torch.device):
        return {"dev": str(x)}
    if hasattr(x, "state_dict") and callable(x.state_dict) and hasattr(x, "load_state_dict"):
        return {"o": _enc(x.state_dict(), path, fl, live)}
    if isinstance(x, torch.Generator):  # restored in place by load_into
        return {"o": _enc({GENERATOR_KEY: x.get_state()}, path, fl, live)}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # its fields, set back in place
        return {"o": _enc(dataclass_fields(x), path, fl, live)}
    raise Unsnapshottable(
        f"ckptrun: cannot snapshot {type(x).__module__}.{type(x).__qualname__} at "
        f"{path or '<root>'!r}: {_instead(x)}"
    )


def dataclass_fields(x: Any) -> Dict[str, Any]:
    """A dataclass instance's fields by name (not ``dataclasses.asdict``: that deep-copies
    them, tensors included, on every save)."""
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


def _instead(x: Any) -> str:
    """What to register instead of ``x``: the common mistakes get their own answer."""
    from torch.utils.data import DataLoader, Sampler

    if isinstance(x, DataLoader):
        return ("a DataLoader has no state_dict(); torchdata's StatefulDataLoader is a drop-in "
                "replacement that has (docs/exact.md, section 4)")
    if isinstance(x, Sampler):
        return ("a sampler's position is kept by the loader that iterates it: register a "
                "torchdata StatefulDataLoader instead")
    if hasattr(x, "__next__"):
        return ("an iterator's position cannot be read back: register the loader it comes "
                "from (a torchdata StatefulDataLoader), or draw batches from the step number")
    return ("use tensors, numpy arrays, plain Python data, dataclass instances, "
            "torch.Generator or objects with state_dict()/load_state_dict()")


def _enc_dtensor(x: Any, path: str, fl: Flattened, live: Optional[Set[int]]) -> Any:
    """A DTensor travels as its local shard (a plain ``"T"`` node, so every reader sees a
    tensor) plus its layout in ``fl.shards``; the adapter turns it back into a DTensor."""
    placements = []
    for p in x.placements:
        if p.is_shard():
            placements.append(f"S{p.dim}")
        elif p.is_replicate():
            placements.append("R")
        else:  # Partial: the value is a pending reduction, not state
            raise Unsnapshottable(f"ckptrun: cannot snapshot a DTensor with placement {p} at {path!r}")
    local = x.to_local().detach()
    deferrable = live is not None and local.numel() > 0 and local.data_ptr() in live
    idx = fl.add(path, local, deferrable)
    fl.shards[idx] = {"global_shape": list(x.shape), "global_offset": local_offset(x),
                      "placements": placements, "mesh_shape": list(x.device_mesh.shape)}
    return {"T": idx}


def _enc_key(k: Any, path: str) -> Any:
    if isinstance(k, (str, bool, type(None))) or type(k) in (int, float):
        return _enc(k, path, Flattened(), None)
    if type(k) is tuple:
        return {"t": [_enc_key(v, path) for v in k]}
    raise Unsnapshottable(f"ckptrun: unsupported dict key {k!r} ({type(k).__name__}) at {path or '<root>'!r}")


def _enc_ndarray(a: np.ndarray, path: str, fl: Flattened) -> Any:
    if a.dtype.kind in ("O", "V", "U", "S", "M", "m") or a.dtype.hasobject:
        if a.dtype.kind in ("U", "S", "M", "m"):
            raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            idx = fl.add(path, torch.from_numpy(raw.copy()), False, tensor=False)
            return {"N": idx, "np": a.dtype.str, "shape": list(a.shape)}
        raise Unsnapshottable(f"ckptrun: cannot snapshot numpy array of dtype {a.dtype} at {path!r}")
    native = a.dtype.isnative and a.dtype.kind in _NP_TORCH_KINDS
    if native:
        try:
            with warnings.catch_warnings():  # read-only arrays are only ever read here
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                t = torch.from_numpy(np.ascontiguousarray(a))
        except TypeError:
            native = False
    if not native:
        raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        t = torch.from_numpy(raw)
    # A snapshot must not alias a numpy array the script may keep mutating after save():
    # arrays are copied synchronously (deferrable=False).
    return {"N": fl.add(path, t, False, tensor=False), "np": a.dtype.str, "shape": list(a.shape)}


def unflatten(tree: Any, tensors: List[torch.Tensor]) -> Any:
    """Rebuild the state from a skeleton and its tensors (objects come back as state dicts)."""
    return _dec(tree, tensors)


def _dec(n: Any, ts: List[torch.Tensor]) -> Any:
    if not isinstance(n, dict):
        return n  # None, bool, int, str, finite float
    tag, v = next(iter(n.items()))  # the tag is always the first key
    if tag == "d":
        return {_dec(k, ts): _dec(val, ts) for k, val in v}
    if tag == "l":
        return [_dec(x, ts) for x in v]
    if tag == "t":
        return tuple(_dec(x, ts) for x in v)
    if tag == "T":
        return ts[v]
    if tag == "f":
        return float(v)
    if tag == "N":
        arr = ts[v].numpy()
        dt = np.dtype(n["np"])
        if arr.dtype != dt:
            arr = arr.view(np.uint8).view(dt)
        return arr.reshape(n["shape"])
    if tag == "ns":
        return np.frombuffer(bytes.fromhex(v[1]), dtype=np.dtype(v[0]))[0]
    if tag == "b":
        return base64.b64decode(v)
    if tag == "ba":
        return bytearray(base64.b64decode(v))
    if tag == "dt":
        return dtype_from_name(v)
    if tag == "S":
        return torch.Size(v)
    if tag == "dev":
        return torch.device(v)
    if tag == "o":
        return _dec(v, ts)
    raise ValueError(f"ckptrun: unknown snapshot tree tag {tag!r}")


# --------------------------------------------------------------------------- meta


def tensor_entries(items: List[Tuple[str, torch.Tensor]], offsets: List[int],
                   shards: Optional[Dict[int, Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """``meta["tensors"]``: one entry per ``(path, tensor)`` at its offset in the slot data
    area; ``shards`` (:attr:`Flattened.shards`) adds the DTensor layout fields."""
    entries = [
        {"path": p, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": int(o),
         "nbytes": t.numel() * t.element_size()}
        for (p, t), o in zip(items, offsets)
    ]
    for e, (_, t) in zip(entries, items):
        if t.device.type != "cpu":  # a restore gives it back there (snapshot.loading)
            e["device"] = str(t.device)
    for i, layout in (shards or {}).items():
        entries[i].update(layout)
    return entries


def make_meta(step: int, rank: int, world_size: int, tree: Any,
              items: List[Tuple[str, torch.Tensor]], offsets: List[int],
              shards: Optional[Dict[int, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The agreed ``meta`` dict for one rank's snapshot (offsets are in the slot data area)."""
    return {
        "format": FORMAT,
        "step": int(step),
        "rank": int(rank),
        "world_size": int(world_size),
        "tree": tree,
        "tensors": tensor_entries(items, offsets, shards),
    }


def meta_json(step: int, rank: int, world_size: int, tree: Any, tensors_json: bytes) -> bytes:
    """``meta_bytes(make_meta(...))`` from the JSON of ``meta["tensors"]`` (its
    :func:`~ckptrun.snapshot.slots.meta_bytes` encoding, which ``save()`` keeps while the layout
    stays the same): only the tree, which holds the plain values, is encoded again."""
    return b"".join((b'{"format":%d,"step":%d,"rank":%d,"world_size":%d,"tree":'
                     % (FORMAT, int(step), int(rank), int(world_size)),
                     meta_bytes(tree), b',"tensors":', tensors_json, b"}"))
