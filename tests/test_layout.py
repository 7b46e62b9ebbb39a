"""The package layout's rules, read from the import graph and the docs (docs/architecture.md):

* no import circles inside ``ckptrun`` (function-level imports count too);
* the worker side, the snapshot format and the protocol never import the agent or the
  command line -- they share only the protocol and the format with it;
* the tiers never import the agent, the worker side or the command line, and the agent never
  imports the worker side;
* every package is installed (pyproject's list), and every ``ckptrun.x.y`` name and
  ``ckptrun/x/y.py`` path that a docstring or a doc names exists.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
from typing import Dict, List, Set

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "ckptrun"


def _modules() -> Dict[str, pathlib.Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    for path in (ROOT / "adapters").glob("*.py"):  # installed as ckptrun.adapters.*
        name = "ckptrun.adapters" + ("" if path.stem == "__init__" else "." + path.stem)
        mods[name] = path
    return mods


MODULES = _modules()


def _owner(name: str) -> str:
    """The module a dotted import name lives in (``a.b.c`` -> ``a.b`` if c is a name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: pathlib.Path) -> Set[str]:
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_owner(a.name) for a in node.names if a.name.startswith("ckptrun")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptrun"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in MODULES else _owner(node.module))
    return out - {""}


GRAPH = {m: _imports(p) - {m} for m, p in MODULES.items()}


def _reaches(start: str, goal: str) -> List[str]:
    """An import path from ``start`` to ``goal`` ([] if none)."""
    seen, stack = {start}, [(start, [start])]
    while stack:
        node, path = stack.pop()
        for dep in GRAPH.get(node, ()):
            if dep == goal:
                return path + [dep]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return []


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_tree_has_packages_per_role_and_tier():
    for pkg in ("cli", "agent", "worker", "snapshot", "protocol", "store", "tiers",
                "tiers/memory", "tiers/peer", "tiers/durable", "torchcompat"):
        assert (PKG / pkg / "__init__.py").is_file(), pkg
    flat = sorted(p.name for p in PKG.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "config.py", "sim.py"], flat


def test_no_import_circles():
    # the package root is the public facade: it imports lazily, and ``__version__`` is read
    # from it; an edge into it is not a circle through the code behind it
    for module in GRAPH:
        if module == "ckptrun":
            continue
        loop = _reaches(module, module)
        assert not loop or "ckptrun" in loop[1:-1], " -> ".join(loop)


@pytest.mark.parametrize("side,forbidden", [
    (("ckptrun.worker",), ("ckptrun.agent", "ckptrun.cli", "ckptrun.store",
                           "ckptrun.tiers.memory", "ckptrun.tiers.peer",
                           "ckptrun.tiers.stack", "ckptrun.tiers.restore_decision")),
    (("ckptrun.snapshot",), ("ckptrun.agent", "ckptrun.cli", "ckptrun.worker",
                             "ckptrun.tiers", "ckptrun.store")),
    (("ckptrun.protocol",), ("ckptrun.agent", "ckptrun.cli", "ckptrun.worker",
                             "ckptrun.tiers", "ckptrun.store", "ckptrun.snapshot")),
    (("ckptrun.tiers",), ("ckptrun.agent", "ckptrun.cli", "ckptrun.worker")),
    (("ckptrun.store",), ("ckptrun.agent", "ckptrun.cli", "ckptrun.worker", "ckptrun.tiers")),
    (("ckptrun.agent",), ("ckptrun.cli", "ckptrun.worker")),
    # the seam over torch's internals is a leaf: everything may use it, it uses nothing
    (("ckptrun.torchcompat",), ("ckptrun.agent", "ckptrun.cli", "ckptrun.worker",
                                "ckptrun.tiers", "ckptrun.store", "ckptrun.snapshot",
                                "ckptrun.protocol", "ckptrun.adapters", "ckptrun.config")),
    (("ckptrun.adapters",), ("ckptrun.agent", "ckptrun.cli", "ckptrun.tiers")),
])
def test_who_may_import_whom(side, forbidden):
    for module, deps in GRAPH.items():
        if not _in(module, *side):
            continue
        bad = sorted(d for d in deps if _in(d, *forbidden))
        assert not bad, f"{module} imports {bad}"


def test_the_rules_would_catch_a_violation():
    """The graph is really read: known edges are in it."""
    assert "ckptrun.tiers.restore_decision" in GRAPH["ckptrun.agent.supervisor"]
    assert "ckptrun.protocol" in GRAPH["ckptrun.worker.heartbeat"]
    assert _reaches("ckptrun.cli.commands", "ckptrun.tiers.interface")


def test_every_package_is_installed():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(ckptrun(?:\.\w+)*)"', text.split("[tool.setuptools]")[1]))
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages <= listed, sorted(packages - listed)


_NAME = re.compile(r"(?<![\w./-])ckptrun(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w.-])(?:ckptrun|adapters)/[\w/]+\.py")
_NOT_NAMES = {"ckptrun.json"}  # the durable index file


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _texts():
    for path in sorted(PKG.rglob("*.py")) + sorted((ROOT / "adapters").glob("*.py")):
        yield path, path.read_text()
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        yield path, path.read_text()


def test_every_named_module_and_path_exists():
    missing = []
    for path, text in _texts():
        for name in set(_NAME.findall(text)) - _NOT_NAMES:
            if not _resolves(name):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
        for rel in set(_PATH.findall(text)):
            if not (ROOT / rel).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {rel}")
    assert not missing, "\n".join(sorted(missing))
