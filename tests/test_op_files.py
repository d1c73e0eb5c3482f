"""An op's kernels live in its own files, and nothing shared keeps a list of ops (docs/dispatch.md,
"Adding an algorithm"):

* ``csrc/build.py`` builds every source of ``csrc/cpu``, ``csrc/cuda`` and ``csrc/common`` (sorted),
  so an op's ``<op>_cpu.cpp`` / ``<op>.cu`` join the build by being there; it names no op;
* every declared op has those files, and a build of a declaration with an op that lacks them is
  refused with a message naming the missing file (rather than an undefined symbol at import);
* outside an op's own files (its entry points, ``common/<op>_hp.h`` and its chunk code headers) no
  C++ source names an op: the bindings and the entry-point headers reach every op through
  op_table.h's ``FO_FOR_EACH_OP``.
"""

from __future__ import annotations

import importlib.util
import re
import types
from dataclasses import replace
from pathlib import Path

import pytest

from fedopt_kernels.core.ops import OPS, PER_CLIENT

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
# the files an op owns ({op} is its name): its entry points (required) and chunk code headers
ENTRY = ("cpu/{op}_cpu.cpp", "cuda/{op}.cu")
OWN = ENTRY + ("common/{op}_hp.h", "cpu/{op}_tiles.h", "cuda/{op}_op.cuh")


def _build_module():
    # as setup.py loads it: beside the sources, not through the package
    spec = importlib.util.spec_from_file_location("_test_op_files_build", CSRC / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _code(path: Path) -> str:
    """The text of a source without its comments (and a Python file without docstrings)."""
    text = path.read_text()
    if path.suffix == ".py":
        return re.sub(r'#[^\n]*|"""[\s\S]*?"""', "", text)
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _names_op(code: str, op: str) -> bool:
    # the op as a word or the stem of one (sgd, sgd_slot, spec::sgd, SgdHp is the hp struct's)
    return re.search(rf"\b{op}(_\w*)?\b", code, re.I) is not None


def _sorted_sources(folder: str, *suffixes: str) -> list:
    return sorted(f"csrc/{folder}/{p.name}" for p in (CSRC / folder).iterdir() if p.suffix in suffixes)


def test_build_lists_every_source_of_the_folders():
    build = _build_module()
    common = _sorted_sources("common", ".cpp")
    assert build.CPU_SOURCES == _sorted_sources("cpu", ".cpp") + common
    assert build.CUDA_SOURCES == _sorted_sources("cuda", ".cpp", ".cu") + common
    code = _code(CSRC / "build.py")
    assert not [op for op in PER_CLIENT if _names_op(code, op)], "csrc/build.py names an op"


def test_every_declared_op_has_its_files():
    build = _build_module()
    for op in PER_CLIENT:
        for own in ENTRY:
            assert (CSRC / own.format(op=op)).is_file(), own.format(op=op)
    assert build.missing_op_sources("_C_cpu") == [] and build.missing_op_sources("_C_cuda") == []


def test_an_op_without_its_files_is_refused_by_name(monkeypatch):
    build = _build_module()
    sgd = OPS["sgd"]
    declared = dict(
        OPS,
        adamw=replace(sgd, name="adamw"),
        adamw_batched=replace(OPS["sgd_batched"], name="adamw_batched", base="adamw"),
    )
    monkeypatch.setattr(build, "_op_header_module", lambda: types.SimpleNamespace(OPS=declared))
    assert build.missing_op_sources("_C_cpu") == ["csrc/cpu/adamw_cpu.cpp"]
    assert build.missing_op_sources("_C_cuda") == ["csrc/cuda/adamw.cu"]
    with pytest.raises(build.CannotBuild, match=r"csrc/cpu/adamw_cpu\.cpp"):
        build.jit_spec("_C_cpu")


def test_no_shared_source_names_an_op():
    """The bindings, the entry-point headers and the drivers dispatch through FO_FOR_EACH_OP: a name
    of an op in them is a hand-kept registration."""
    own = {own.format(op=op) for op in PER_CLIENT for own in OWN}
    found = []
    for path in sorted(CSRC.rglob("*")):
        rel = path.relative_to(CSRC).as_posix()
        if path.suffix in (".h", ".cuh", ".cpp", ".cu", ".py") and rel not in own:
            code = _code(path)
            found += [f"{rel}: {op}" for op in PER_CLIENT if _names_op(code, op)]
    assert not found, found
    for bindings in ("cpu/bindings_cpu.cpp", "cuda/bindings_cuda.cpp", "common/binding.h"):
        assert (CSRC / bindings).is_file(), bindings
