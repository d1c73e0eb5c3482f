"""No import circles among the package's modules, counting imports made inside functions too.

A late import (inside a function) hides a circle from Python's loader but not from a reader: two
modules that need each other are one module in two files. Each module of ``fedopt_kernels`` (and of
``triton_kernels/``, installed as ``fedopt_kernels.triton_kernels``), and apart from them each module
of the benchmark suite ``bench/``, is parsed with ``ast``; every
``import`` / ``from ... import`` statement anywhere in it, and every ``importlib.import_module`` call
with a literal name, is an edge. Imports under ``if TYPE_CHECKING:`` count too: Python never runs
them, but a reader (and a type checker) follows them, and a circle drawn there is the same coupling
(break it with a small ``Protocol`` naming what is read, as ``fl.algorithm.RunSettings`` and
``sim.strategy.RoundHost`` do). A name computed at run time
(``f"fedopt_kernels.core.backends.{name}"``) cannot be followed and does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import AbstractSet, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (folder, the module name it is imported as)
PACKAGES = ((ROOT / "fedopt_kernels", "fedopt_kernels"), (ROOT / "triton_kernels", "fedopt_kernels.triton_kernels"))
BENCH = ((ROOT / "bench", "bench"),)  # the benchmark suite: a graph of its own (it imports the package)


def package_modules(packages: Sequence[Tuple[Path, str]] = PACKAGES) -> Dict[str, Path]:
    """module name -> file, for every module of the package (or of ``packages``)."""
    mods: Dict[str, Path] = {}
    for folder, name in packages:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([name] + parts)] = path
    return mods


def _all_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree``, ``if TYPE_CHECKING:`` blocks and function bodies included."""
    return ast.walk(tree)


def imported_names(module: str, path: Path, known: AbstractSet[str] = frozenset()) -> List[str]:
    """Absolute names of the modules ``module`` imports anywhere (``known``: the package's modules)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out: List[str] = []
    for node in _all_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from pkg import mod`` imports the module; ``from mod import attr`` the module holding it
            out += [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name == "import_module":
                out.append(node.args[0].value)
    return out


def import_graph(packages: Sequence[Tuple[Path, str]] = PACKAGES) -> Dict[str, Set[str]]:
    """module -> the modules of the same ``packages`` it imports."""
    mods = package_modules(packages)
    graph: Dict[str, Set[str]] = {}
    for module, path in mods.items():
        edges = {name for name in imported_names(module, path, set(mods)) if name in mods and name != module}
        graph[module] = edges
    return graph


def _cycle_through(graph: Dict[str, Set[str]], comp: Set[str], start: str) -> List[str]:
    """The shortest circle from ``start`` back to it inside strongly connected component ``comp``."""
    prev: Dict[str, Optional[str]] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & comp):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    step = prev[path[-1]]
                    assert step is not None  # only start has no predecessor, and the walk stops there
                    path.append(step)
                return [start] + path[::-1][1:] + [start]
            if nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    return [start]


def _canonical(cycle: List[str]) -> tuple:
    ring = cycle[:-1]
    i = ring.index(min(ring))
    return tuple(ring[i:] + ring[:i])


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Circles of ``graph``: the strongly connected components of more than one module (Tarjan), each
    shown as the shortest circle through each of its modules."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on: Set[str] = set()
    stack: List[str] = []
    comps: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out, seen = [], set()
    for comp in comps:  # the shortest circle through each module of each component, once each
        for start in sorted(comp):
            c = _cycle_through(graph, comp, start)
            if _canonical(c) not in seen:
                seen.add(_canonical(c))
                out.append(list(_canonical(c)) + [_canonical(c)[0]])
    return out


def test_the_graph_sees_late_imports(tmp_path):
    # the walker must find imports inside functions and under TYPE_CHECKING
    src = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
        "def f():\n    from . import c\n    from .e import g\n    import importlib\n"
        "    importlib.import_module('pkg.d')\n"
    )
    path = tmp_path / "a.py"
    path.write_text(src)
    names = imported_names("pkg.a", path, {"pkg.b", "pkg.c", "pkg.d", "pkg.e"})
    assert {"pkg.b", "pkg.c", "pkg.d", "pkg.e"} <= set(names)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import circles among the package's modules:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_import_cycles_in_bench():
    found = cycles(import_graph(BENCH))
    assert not found, "import circles among bench's modules:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_bench_cycle_check_can_fail(tmp_path, monkeypatch):
    """A circle drawn by a late import, in a folder laid out as bench/ is (a subpackage, relative imports)."""
    import test_import_graph

    pkg = tmp_path / "bench"
    (pkg / "clients").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "timing.py").write_text("def f():\n    from .clients import run\n")
    (pkg / "clients" / "__init__.py").write_text("")
    (pkg / "clients" / "run.py").write_text("from ..timing import f\n")
    (pkg / "report.py").write_text("from . import timing\n")
    assert cycles(import_graph(((pkg, "bench"),))) == [["bench.clients.run", "bench.timing", "bench.clients.run"]]
    monkeypatch.setattr(test_import_graph, "BENCH", ((pkg, "bench"),))
    with pytest.raises(AssertionError, match="bench.clients.run -> bench.timing"):
        test_no_import_cycles_in_bench()
