"""The package's folders are its layers, and every name the documentation gives still imports.

Layers, lowest first (README, "Layout"; docs/dispatch.md): ``functional`` (the algorithms' math in plain
torch, which imports nothing of the package), ``core`` (kernel dispatch, no FL concepts; the Triton
sources installed as ``fedopt_kernels.triton_kernels`` belong to it), ``batched`` (the client-batched
mixin), ``optim`` (the optimizers, ``torch.optim`` classes that know no FL), ``fl`` (the algorithms'
descriptors on those optimizers, settings, server rules, the client round), the package's
``__init__``, then the front ends ``sim``, ``selfcheck`` and ``flower``. A module imports only
from its own layer or lower ones: every import counts, late and ``TYPE_CHECKING`` ones included
(the graph of tests/test_import_graph.py). ``sim`` has layers of its own (its
``__init__``): ``data``, ``models``, ``batched``, the round loop (the modules of ``sim`` itself),
``cli``.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest
from test_import_graph import import_graph, package_modules

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fedopt_kernels"
RANK = {
    "functional": -1,
    "core": 0,
    "triton_kernels": 0,
    "batched": 1,
    "optim": 2,
    "fl": 3,
    "privacy": 3,
    "": 4,
    "sim": 5,
    "selfcheck": 5,
    "flower": 6,
}
MAX_ROOT_MODULES = 10
# "": the round loop, the modules of sim/ itself
SIM_RANK = {"data": 0, "models": 1, "batched": 2, "": 3, "cli": 4}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_package_root_holds_few_modules():
    modules = sorted(p.name for p in PKG.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, f"{len(modules)} modules at the package root: {modules}"


MAX_MODULE_LINES = 700  # a module a reader can hold: split a longer one by concern


def long_modules(paths, limit: int = MAX_MODULE_LINES) -> List[str]:
    """``path (lines)`` of every file in ``paths`` longer than ``limit`` lines."""
    out = []
    for path in paths:
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({n})")
    return out


def test_no_module_of_the_package_is_over_700_lines():
    assert long_modules(sorted(PKG.rglob("*.py"))) == []


# the Triton sources (installed as fedopt_kernels.triton_kernels) and the benchmark suite, outside PKG
OTHER_MODULE_FOLDERS = ("triton_kernels", "bench")


def test_no_module_of_the_triton_kernels_or_the_benchmarks_is_over_700_lines():
    paths = sorted(p for folder in OTHER_MODULE_FOLDERS for p in (ROOT / folder).rglob("*.py"))
    read = {p.relative_to(ROOT).as_posix() for p in paths}
    assert {"triton_kernels/launcher.py", "bench/host.py", "bench/clients/run.py"} <= read  # the folders were found
    assert long_modules(paths) == []


def test_the_module_length_check_can_fail(tmp_path):
    path = tmp_path / "long.py"
    path.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules([path]) == [f"{path} ({MAX_MODULE_LINES + 1})"]


def test_every_module_belongs_to_a_layer():
    assert {layer(m) for m in import_graph()} <= set(RANK), "a folder with no place in RANK: add it to the layers"


def test_imports_only_go_down_the_layers():
    upward = sorted(f"{a} -> {b}" for a, bs in import_graph().items() for b in bs if RANK[layer(b)] > RANK[layer(a)])
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_layer_check_can_fail(monkeypatch):
    import test_layers

    monkeypatch.setitem(test_layers.RANK, "optim", 9)  # optim above everyone: the descriptors' imports of it go up
    with pytest.raises(AssertionError, match="optim"):
        test_imports_only_go_down_the_layers()


def sim_layer(module: str) -> str:
    """The layer of a module of ``fedopt_kernels.sim``: its folder, or "" for the modules of sim/ itself."""
    folder = module.split(".")[2:3]
    return folder[0] if folder and folder[0] in SIM_RANK else ""


def test_every_folder_of_sim_is_one_of_its_layers():
    folders = {p.parent.name for p in (PKG / "sim").glob("*/*.py")}
    assert folders == set(SIM_RANK) - {""}, "a folder of sim/ with no place in SIM_RANK: add it to sim's layers"


def test_sim_imports_only_go_down_its_layers():
    upward = sorted(
        f"{a} -> {b}"
        for a, bs in import_graph().items()
        if layer(a) == "sim"
        for b in bs
        if layer(b) == "sim" and SIM_RANK[sim_layer(b)] > SIM_RANK[sim_layer(a)]
    )
    assert not upward, "imports from a higher layer of sim:\n" + "\n".join(upward)


def test_the_sim_layer_check_can_fail(monkeypatch):
    import test_layers

    monkeypatch.setitem(test_layers.SIM_RANK, "data", 9)  # data on top: the models' imports of it go up
    with pytest.raises(AssertionError, match="sim.models"):
        test_sim_imports_only_go_down_its_layers()


_DOTTED = re.compile(r"\bfedopt_kernels(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_FROM = re.compile(r"\bfrom (fedopt_kernels(?:\.[A-Za-z_][A-Za-z0-9_]*)*) import ([A-Za-z_][A-Za-z0-9_, ]*)")


def documented_names() -> List[str]:
    """Every ``fedopt_kernels.…`` name README.md and docs/ give, dotted or as ``from … import …``."""
    names = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        names |= set(_DOTTED.findall(text))
        for mod, imported in _FROM.findall(text):
            names |= {f"{mod}.{n.strip()}" for n in imported.split(",") if n.strip()}
    # the compiled extensions may be absent from an install by design (docs/backends.md)
    return sorted(n for n in names if not n.startswith(("fedopt_kernels._C_", "fedopt_kernels.<")))


def resolve(name: str) -> object:
    """Import ``name`` as a module, or as an attribute of the longest module prefix that imports."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_docs_name_something():
    assert {
        "fedopt_kernels.available_backends",
        "fedopt_kernels.batched",
        "fedopt_kernels.flower",
        "fedopt_kernels.sim",
    } <= set(documented_names())


@pytest.mark.parametrize("name", documented_names())
def test_every_documented_name_imports(name):
    if name.startswith("fedopt_kernels.flower"):
        pytest.importorskip("flwr")
    resolve(name)


@pytest.mark.parametrize("name", importlib.import_module("fedopt_kernels").__all__)
def test_every_public_name_imports(name):
    assert getattr(importlib.import_module("fedopt_kernels"), name) is resolve(f"fedopt_kernels.{name}")


def test_resolve_fails_on_a_moved_name():
    with pytest.raises((ModuleNotFoundError, AttributeError)):
        resolve("fedopt_kernels._ops.OPS")


# ------------------------------------------------------------------ private attributes
def _defined_private_names(tree: ast.AST) -> Set[str]:
    """``_names`` a module defines: module globals, functions, classes, class attributes and
    ``self._x = ...`` assignments."""
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own(node.value):
            out.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def _own(node: ast.expr) -> bool:
    """``self._x``, ``cls._x`` and ``super()._x``: a class reading its own (or its bases') members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reads(sources: Dict[str, str]) -> List[str]:
    """``module:line: what`` for each read of a private name another module of ``sources`` defines
    (``obj._x``, ``getattr(obj, "_x")``, ``from mod import _x``). Privates of other libraries
    (torch's, argparse's) are not this package's to fix and are not reported."""
    trees = {m: ast.parse(src) for m, src in sources.items()}
    defined = {m: _defined_private_names(t) for m, t in trees.items()}
    found = []
    for module, tree in trees.items():
        others = set().union(*(d for m, d in defined.items() if m != module))
        for node in ast.walk(tree):
            name: object = None  # a str when node reads a name (a constant's value may be anything)
            if isinstance(node, ast.Attribute) and not _own(node.value):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and not _own(node.args[0])
            ):
                name = node.args[1].value
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fedopt_kernels")):
                found += [
                    f"{module}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__") and a.name in others
                ]
            if (
                isinstance(name, str)
                and name.startswith("_")
                and not name.startswith("__")
                and name in others
                and name not in defined[module]
            ):
                # node is an Attribute or a Call here: an expression, which has a line
                found.append(f"{module}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_names():
    sources = {m: p.read_text() for m, p in package_modules().items()}
    found = private_reads(sources)
    assert not found, "private names read across modules (give them a public name):\n" + "\n".join(found)


def test_the_private_read_check_can_fail():
    sources = {
        "pkg.a": "class A:\n    def __init__(self):\n        self._plan = None\n        self._own = 1\n",
        "pkg.b": "def f(opt):\n    opt._plan = 1\n    return getattr(opt, '_plan'), opt._torch_thing\n"
        "from .a import _helper\n",
        "pkg.c": "def _helper():\n    pass\n",
    }
    found = private_reads(sources)
    # _own is a's own; _torch_thing is defined nowhere in the package (another library's)
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "from .a import _helper",
        "getattr(opt, '_plan')",
        "opt._plan",
    ]


def test_backends_never_import_the_registry():
    # a backend registers into core/impl_table.py; importing the registry, which loads backends,
    # would make loading a backend load the registry back
    graph = import_graph()
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if m.startswith(("fedopt_kernels.core.backends", "fedopt_kernels.core.reference"))
        for t in ts
        if t == "fedopt_kernels.core.registry"
    )
    assert not bad, "backends importing the registry:\n" + "\n".join(bad)


# ------------------------------------------------------------------ the optimizer's hooks
def _documented_hooks() -> Set[str]:
    text = (ROOT / "docs" / "dispatch.md").read_text()
    section = text[text.index("## Extending FedOptimizer") : text.index("## torch.compile")]
    return set(re.findall(r"^\| `(_[a-z0-9_]+)", section, re.M))


def _overridden_hooks() -> Dict[str, Set[str]]:
    """Base members (``_x``) each optimizer class and the client-batched mixin define again."""
    import fedopt_kernels  # noqa: F401  (registers every algorithm)
    from fedopt_kernels.batched.mixin import ClientBatched
    from fedopt_kernels.core.optimizer import FedOptimizer
    from fedopt_kernels.fl import algorithm

    classes = {ClientBatched} | {c for a in algorithm.ALGORITHMS.values() for c in (a.optimizer, a.batched)}
    classes |= {base for c in list(classes) for base in c.__mro__ if issubclass(base, FedOptimizer)}
    out: Dict[str, Set[str]] = {}
    for cls in classes - {FedOptimizer}:
        names = {
            n
            for n in vars(cls)
            if n.startswith("_")
            and not n.startswith("__")
            and (hasattr(FedOptimizer, n) or n in FedOptimizer.__annotations__)
        }
        if names:
            out[cls.__qualname__] = names
    return out


def test_every_overridden_optimizer_hook_is_documented():
    documented = _documented_hooks()
    missing = sorted(f"{cls}.{n}" for cls, names in _overridden_hooks().items() for n in names - documented)
    assert not missing, "hooks overridden but missing from docs/dispatch.md's hook table:\n" + "\n".join(missing)


def test_every_documented_hook_exists():
    from fedopt_kernels.batched.mixin import ClientBatched
    from fedopt_kernels.core.optimizer import FedOptimizer

    documented = _documented_hooks()
    assert len(documented) > 15  # the table was found and read
    assert (
        sorted(
            n
            for n in documented
            if not hasattr(FedOptimizer, n) and n not in FedOptimizer.__annotations__ and n not in vars(ClientBatched)
        )
        == []
    )


def test_the_fast_tiers_slow_files_exist():
    from conftest import SLOW_FILES

    assert sorted(f for f in SLOW_FILES if not (ROOT / "tests" / f).is_file()) == []


# ------------------------------------------------------------------ private modules and stale names
def _private_module(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _package(module: str) -> str:
    """The package (layer) a module belongs to: ``pkg.core`` for ``pkg.core.backends._native``."""
    return ".".join(module.split(".")[:2])


def private_module_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``a -> b`` for each import of a private module (a ``_name`` in its path) from another package
    (layer folder: core, fl, batched, optim, sim, flower) than the one that holds it: a private
    module is its own package's business."""
    found = []
    for a, bs in graph.items():
        for b in bs:
            if _private_module(b) and _package(a) != _package(b):
                found.append(f"{a} -> {b}")
    return sorted(found)


def test_no_private_module_is_imported_from_another_package():
    found = private_module_imports(import_graph())
    assert not found, "private modules imported across packages (give them a public name):\n" + "\n".join(found)


def test_the_private_module_check_can_fail():
    graph = {
        "pkg.optim.a": {"pkg.batched._mixin"},
        "pkg.batched.b": {"pkg.batched._mixin"},
        "pkg.core.backends.cpu": {"pkg.core.backends._native"},
        "pkg.core.x": {"pkg.core.backends._native"},
        "pkg.sim.y": {"pkg.core.backends._native"},
    }
    assert private_module_imports(graph) == [
        "pkg.optim.a -> pkg.batched._mixin",
        "pkg.sim.y -> pkg.core.backends._native",
    ]


# paths the package's comments name that are not this repository's (LEAF's source tree)
_FOREIGN_PATHS = {"models/utils/language_utils.py"}
_PATH = re.compile(r"(?<![\w/<.-])((?:[A-Za-z_][\w-]*/)+[A-Za-z_][\w-]*\.(?:py|md|h|cpp|cu|cuh|sh|toml))(?![\w/])")
_PRIVATE_ATTR = re.compile(r"(?<![\w.])(_[a-z][a-z0-9_]*)\.([A-Za-z_]\w*)")


def _docstrings_and_comments(path: Path) -> List[tuple]:
    """(line, text) of every docstring and comment of a module."""
    import io
    import tokenize

    src = path.read_text()
    out = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(src).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def stale_names(modules: Dict[str, Path], absent: Optional[List[str]] = None) -> List[str]:
    """What the package's docstrings and comments name that is not there any more: a file path that
    exists nowhere in the tree; ``_mod.NAME`` where ``_mod`` is no module but ``mod`` is (a module
    renamed to its public name); a ``fedopt_kernels.…`` name that does not import. A name whose
    module is there but does not load on this machine goes to ``absent`` (``absent_here``)."""
    short = {m.rsplit(".", 1)[-1] for m in modules}
    found = []
    for _module, path in modules.items():
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for line, text in _docstrings_and_comments(path):
            for rel in _PATH.findall(text):
                places = [ROOT, PKG, ROOT / "csrc", path.parent, PKG / "core", PKG / "sim"]
                if rel not in _FOREIGN_PATHS and not any((p / rel).exists() for p in places):
                    found.append(f"{where}:{line}: file {rel}")
            for mod, attr in _PRIVATE_ATTR.findall(text):
                if mod not in short and mod[1:] in short:
                    found.append(f"{where}:{line}: {mod}.{attr} (the module is {mod[1:]})")
            for name in _DOTTED.findall(text):
                if name.startswith(("fedopt_kernels._C_", "fedopt_kernels.flower")):
                    continue  # the compiled extensions may be absent; Flower is an extra
                try:
                    why = absent_here(name.rstrip("."))
                except (ModuleNotFoundError, AttributeError):
                    found.append(f"{where}:{line}: {name}")
                    continue
                if why is not None and absent is not None:
                    absent.append(f"{where}:{line}: {name} ({why})")
    return found


def absent_here(name: str) -> Optional[str]:
    """None when ``name`` resolves (``resolve``); the reason when its module is in the tree but does
    not load on this machine (a backend raising ``AbsentHere`` without triton or CUDA, a missing
    optional package): information about the machine, not a stale name. A name that is in no module
    raises ModuleNotFoundError or AttributeError, as ``resolve`` does."""
    if name.startswith("fedopt_kernels.triton_kernels"):
        # the triton backend names the checkout's kernels so when it loads (an editable install
        # elsewhere, or none, does not map the name): load it as a user's first triton step does
        try:
            importlib.import_module("fedopt_kernels.core.backends.triton")
        except ImportError as exc:
            return f"fedopt_kernels.core.backends.triton does not load here: {exc}"
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing.startswith("fedopt_kernels") or not missing:
                continue  # the module (or a package above it) is not in the tree: try a shorter prefix
            return f"{module} needs {missing}, not installed here"
        except ImportError as exc:  # AbsentHere, or another refusal to load on this machine
            return f"{module} does not load here: {exc}"
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return None
    raise ModuleNotFoundError(name)


def test_docstrings_and_comments_name_what_exists():
    from test_import_graph import package_modules

    absent: List[str] = []
    found = stale_names(package_modules(), absent)
    assert not found, "stale names in docstrings and comments:\n" + "\n".join(found)
    if absent:  # information: what this machine lacks (triton, CUDA), named in the test's output
        print("named but not loadable here:\n" + "\n".join(absent))


def test_a_backend_absent_here_is_information_not_a_stale_name(tmp_path, monkeypatch):
    """Without triton (torch's CPU build), the triton backend raises AbsentHere on import; without an
    optional package, a module raises ModuleNotFoundError naming it: neither is a stale name."""
    import sys

    from fedopt_kernels.core.impl_table import AbsentHere

    pkg = tmp_path / "fedopt_kernels_absent_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "refuses.py").write_text(f"from {AbsentHere.__module__} import AbsentHere\nraise AbsentHere('no triton')\n")
    (pkg / "needs.py").write_text("import no_such_optional_package_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    assert "no triton" in str(absent_here("fedopt_kernels_absent_probe.refuses.Thing"))
    assert "no_such_optional_package_here" in str(absent_here("fedopt_kernels_absent_probe.needs"))
    assert absent_here("fedopt_kernels.core.impl_table.AbsentHere") is None
    with pytest.raises(AttributeError):
        absent_here("fedopt_kernels.core.impl_table.NoSuchName")


def test_the_stale_name_check_can_fail(tmp_path):
    mod = tmp_path / "mod.py"
    mod.write_text(
        '"""Reads ``_ops.OPS`` and ``core/no_such_file.py``; see fedopt_kernels.no_such_name."""\n'
        "# core/plan.py and ``ops.OPS`` are there\n"
    )
    found = stale_names({"fedopt_kernels.core.ops": PKG / "core" / "ops.py", "x.mod": mod})
    assert [f.split(": ", 1)[1] for f in found if "mod.py" in f] == [
        "file core/no_such_file.py",
        "_ops.OPS (the module is ops)",
        "fedopt_kernels.no_such_name",
    ]
