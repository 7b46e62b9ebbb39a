"""torch's internals are touched in one package, ``ckptrun/torchcompat/``, and nowhere else.

Product code (``ckptrun/`` and ``adapters/``) outside that package must not:

* import a private torch module or a private name from torch (``torch.distributed._x``,
  ``from torch... import _y``);
* read or write a private attribute of a torch module it imported (``dist._world``), or patch
  any attribute of one (``c10d.helper = ...``);
* name, as an attribute or through ``getattr``/``hasattr``/``setattr``, a private name that
  torch defines (its Python sources and its C extension's classes) and ckptrun does not --
  ``ddp.reducer._rebuild_buckets()``, ``getattr(ddp, "_comm_hooks")``;
* call a torch-specific dunder protocol (``x.__create_chunk_list__()``) or rewrite a
  function's defaults (``fn.__defaults__ = ...``).

The names torch defines are read from the torch this test runs on, so a release that adds
private names widens the check by itself.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sysconfig
from typing import Iterable, List, Set

import pytest

pytestmark = pytest.mark.compat("no private torch name outside ckptrun/torchcompat/")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEAM = ROOT / "ckptrun" / "torchcompat"
PATCHED_FUNCTION_ATTRS = {"__defaults__", "__kwdefaults__", "__code__"}
# private names of other libraries that torch happens to define too, each with whose it is
NOT_TORCH = {
    "_reset_state": "accelerate's AcceleratorState/GradientState (ckptrun/worker/collectives.py)",
}

_DEF = re.compile(r"^\s*(?:def|class)\s+(_{1,2}[A-Za-z]\w*)", re.M)
_ASSIGN = re.compile(r"^\s*(?:self\.)?(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=[^=]", re.M)
_DUNDER_DEF = re.compile(r"def\s+(__[a-z]\w*__)\s*\(")
_DUNDER_ANY = re.compile(r"\b(__[a-z]\w*__)\b")


def product_files() -> List[pathlib.Path]:
    """Every product module outside the seam."""
    files = [*(ROOT / "ckptrun").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]
    return sorted(f for f in files if SEAM not in f.parents)


def _torch_sources() -> Iterable[pathlib.Path]:
    import torch

    return pathlib.Path(torch.__file__).parent.rglob("*.py")


@pytest.fixture(scope="module")
def torch_names() -> dict:
    """``private``: single-underscore names torch defines (Python and C extension);
    ``dunders``: dunder methods torch defines that Python's data model does not."""
    import torch

    private: Set[str] = set()
    torch_dunders: Set[str] = set()
    for path in _torch_sources():
        text = path.read_text(errors="replace")
        private.update(_DEF.findall(text))
        private.update(_ASSIGN.findall(text))
        torch_dunders.update(_DUNDER_DEF.findall(text))
    seen: Set[int] = set()

    def walk(obj: object, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        for name in dir(obj):
            if name.startswith("_") and not name.startswith("__"):
                private.add(name)
            try:
                sub = getattr(obj, name)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(sub, type) or (type(sub).__name__ == "module"
                                         and getattr(sub, "__name__", "").startswith("torch._C")):
                walk(sub, depth + 1)

    walk(torch._C, 0)
    private = {n for n in private if not n.startswith("__")}
    python_dunders: Set[str] = set()
    for t in (object, type, int, float, list, dict, str, tuple, set, bytes, complex):
        python_dunders.update(n for n in dir(t) if n.startswith("__"))
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib.glob("*.py"):
        python_dunders.update(_DUNDER_ANY.findall(path.read_text(errors="replace")))
    return {"private": private, "dunders": torch_dunders - python_dunders}


def own_names(files: Iterable[pathlib.Path]) -> Set[str]:
    """Every name ckptrun binds itself (functions, classes, attributes, variables, arguments)."""
    out: Set[str] = set()
    for path in files:
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                    and n.func.id == "setattr" and len(n.args) > 1 \
                    and isinstance(n.args[1], ast.Constant):
                out.add(str(n.args[1].value))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def violations(source: str, where: str, torch_private: Set[str], torch_dunders: Set[str],
               own: Set[str]) -> List[str]:
    """What ``source`` does with torch's internals, one line each (empty: nothing)."""
    tree = ast.parse(source)
    torch_aliases: Set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    torch_aliases.add(a.asname or a.name.partition(".")[0])
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch":
            for a in n.names:
                torch_aliases.add(a.asname or a.name)  # a module or a torch object
    out = []
    for n in ast.walk(tree):
        line = f"{where}:{getattr(n, 'lineno', '?')}"
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split("."))):
                    out.append(f"{line}: imports torch's private module {a.name}")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch":
            if any(map(_private, n.module.split("."))):
                out.append(f"{line}: imports from torch's private module {n.module}")
            out += [f"{line}: imports torch's private {a.name}" for a in n.names if _private(a.name)]
        elif isinstance(n, ast.Attribute):
            root = _root(n)
            from_torch = isinstance(root, ast.Name) and root.id in torch_aliases
            if from_torch and isinstance(n.ctx, ast.Store):
                out.append(f"{line}: patches torch's {n.attr}")
            elif from_torch and _private(n.attr):
                out.append(f"{line}: names torch's private {n.attr}")
            elif _private(n.attr) and n.attr in torch_private and n.attr not in own \
                    and n.attr not in NOT_TORCH:
                out.append(f"{line}: names torch's private {n.attr}")
            elif n.attr in torch_dunders:
                out.append(f"{line}: calls torch's protocol {n.attr}")
            elif n.attr in PATCHED_FUNCTION_ATTRS and isinstance(n.ctx, ast.Store):
                out.append(f"{line}: rewrites a function's {n.attr}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                and n.func.id in ("getattr", "hasattr", "setattr", "delattr") \
                and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) \
                and isinstance(n.args[1].value, str):
            name = n.args[1].value
            root = _root(n.args[0])
            from_torch = isinstance(root, ast.Name) and root.id in torch_aliases
            if (_private(name) and (from_torch or (name in torch_private and name not in own))) \
                    or name in torch_dunders:
                out.append(f"{line}: {n.func.id}(..., {name!r}) names torch's private {name}")
    return out


def test_product_code_outside_the_seam_names_no_private_torch_attribute(torch_names) -> None:
    files = product_files()
    own = own_names(files)
    found = []
    for path in files:
        found += violations(path.read_text(), str(path.relative_to(ROOT)),
                            torch_names["private"], torch_names["dunders"], own)
    assert not found, ("torch's internals used outside ckptrun/torchcompat/ "
                       "(move the use into the seam):\n" + "\n".join(found))


@pytest.mark.parametrize("snippet", [
    "import torch.distributed as dist\nx = dist._world.pg_map\n",
    "import torch.distributed.distributed_c10d as c10d\nc10d.new_group = print\n",
    "from torch.distributed.checkpoint.filesystem import _StorageInfo\n",
    "from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter\n",
    "import torch._dynamo\n",
    "def f(ddp):\n    return ddp.reducer._rebuild_buckets()\n",
    "def f(ddp):\n    return getattr(ddp, '_comm_hooks', None)\n",
    "def f(x):\n    return x.__create_chunk_list__()\n",
    "def f(fn):\n    fn.__defaults__ = (None,)\n",
])
def test_the_check_finds_each_kind_of_use(torch_names, snippet: str) -> None:
    """The scan above would catch each way product code has reached into torch."""
    found = violations(snippet, "snippet", torch_names["private"], torch_names["dunders"],
                       own={"f", "ddp", "x", "fn"})
    assert found, f"not flagged: {snippet!r}"


def test_own_private_names_are_not_flagged(torch_names) -> None:
    snippet = ("class A:\n    def __init__(self):\n        self._lock = 1\n"
               "    def g(self):\n        return self._lock\n")
    assert violations(snippet, "s", torch_names["private"], torch_names["dunders"],
                      own_names_from(snippet)) == []


def own_names_from(source: str) -> Set[str]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(source)
        f.flush()
        return own_names([pathlib.Path(f.name)])


def test_a_torch_below_the_floor_is_refused_in_one_line_before_anything_starts(
        tmp_path, monkeypatch) -> None:
    """``ckptrun run`` on torch 2.4 says which torch it needs, exit code 2, and starts nothing
    (the installed version is faked: the metadata lookup is the only thing asked)."""
    import subprocess
    import sys

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "from importlib import metadata\n"
        "_real = metadata.version\n"
        "metadata.version = lambda name: '2.4.1' if name == 'torch' else _real(name)\n")
    env = dict(__import__("os").environ, PYTHONPATH=str(shim))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ckptrun.cli", "--standalone", "--run-dir",
                           str(run_dir), "train.py"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("ckptrun: error: ckptrun needs torch>=2.7; this environment "
                                   "has torch 2.4.1 (pip install 'torch>=2.7')"), proc.stderr
    assert not run_dir.exists()
