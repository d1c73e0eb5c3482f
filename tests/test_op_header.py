"""The C++ side of the one declaration: ``op_table.h`` is generated from ``fedopt_kernels/core/ops.py``.

* the generated header, compiled on its own, declares every op's slots, present bits, hp columns,
  role table and FRESH exactly as ``_ops.OPS`` does (a small C++ program prints what it sees);
* the built extensions report the layout they were compiled with (``op_layout``): a build from a
  header of another declaration fails here;
* the generator refuses what C++ could not name or the bindings could not bind;
* the build generates the header itself (``csrc/build.py`` as setup.py loads it), nothing under
  ``csrc/`` is generated or committed, and no C++ source spells a role or hp name by hand.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from host_cxx import compiler, generated_include

from fedopt_kernels.core import op_header as _op_header
from fedopt_kernels.core.ops import FRESH, OPS, PER_CLIENT, Role

ROOT = Path(__file__).resolve().parent.parent

# prints, per op: its slots, bits, hp columns and role table, one fact a line
PRINTER = r"""
#include <cstdio>
#include "op_table.h"
using namespace fo;
template <class S> void roles() {
  for (int i = 0; i < S::kSlots; ++i)
    std::printf("%s role %d %s %d %d %d %d %d\n", S::kName, i, S::kRoles[i].name, S::kRoles[i].state_typed,
                S::kRoles[i].written, S::kRoles[i].per_row, static_cast<int>(S::kRoles[i].bit), S::kStateSlot[i]);
  for (int i = 0; i < S::kHps; ++i) std::printf("%s hp %d %s\n", S::kName, i, S::kHpNames[i]);
  std::printf("%s flags %s %d %d\n", S::kName, S::kBatchedName, S::kNorm, S::kSchedule);
}
int main() {
  std::printf("fresh %d max_slots %d\n", static_cast<int>(kFreshBit), kMaxSlots);
#define PRINT(op) roles<spec::op>();
  FO_FOR_EACH_OP(PRINT)
%CONSTANTS%
  return 0;
}
"""


def _constants() -> str:
    """printf lines of every named constant: <op>_slot::<SHORT>, <op>_bit::<SHORT>, <op>_hp::<NAME>."""
    lines = []
    for spec in PER_CLIENT.values():
        op = spec.name
        for r in spec.roles:
            lines.append(f'  std::printf("{op} slot {r.short} %d\\n", static_cast<int>({op}_slot::{r.short.upper()}));')
        for r in spec.optional:
            lines.append(f'  std::printf("{op} bit {r.short} %d\\n", static_cast<int>({op}_bit::{r.short.upper()}));')
        for h in spec.hps:
            lines.append(f'  std::printf("{op} col {h} %d\\n", static_cast<int>({op}_hp::{h.upper()}));')
        lines.append(
            f'  std::printf("{op} counts %d %d\\n", static_cast<int>({op}_slot::COUNT), '
            f"static_cast<int>({op}_hp::COUNT));"
        )
    return "\n".join(lines)


def _expected() -> list:
    out = [f"fresh {FRESH} max_slots {max(len(s.roles) for s in PER_CLIENT.values())}"]
    for spec in PER_CLIENT.values():
        op = spec.name
        for i, r in enumerate(spec.roles):
            bit = spec.bit(r.name) if i >= 2 else 0
            out.append(
                f"{op} role {i} {r.name} {int(r.state_typed)} {int(r.written)} {int(r.per_row)} {bit} "
                f"{int(r.state_typed)}"
            )
        out += [f"{op} hp {i} {h}" for i, h in enumerate(spec.hps)]
        out.append(f"{op} flags {op}_batched {int(spec.norm)} {int(spec.schedule)}")
    for spec in PER_CLIENT.values():
        op = spec.name
        out += [f"{op} slot {r.short} {i}" for i, r in enumerate(spec.roles)]
        out += [f"{op} bit {r.short} {spec.bit(r.name)}" for r in spec.optional]
        out += [f"{op} col {h} {spec.hp_index(h)}" for h in spec.hps]
        out.append(f"{op} counts {len(spec.roles)} {len(spec.hps)}")
    return out


def test_generated_header_declares_every_op_as_ops_py(tmp_path):
    generated = generated_include(tmp_path)
    src = tmp_path / "printer.cpp"
    src.write_text(PRINTER.replace("%CONSTANTS%", _constants()))
    exe = tmp_path / "printer"
    build = subprocess.run(
        [compiler(), "-std=c++17", "-Wall", "-Werror", "-I", generated, str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == _expected()


def _layout(spec) -> tuple:
    """What op_layout returns for ``spec``, from the declaration."""
    roles = [
        (r.name, r.state_typed, r.written, r.per_row, 0 if i < 2 else spec.bit(r.name))
        for i, r in enumerate(spec.roles)
    ]
    return roles, list(spec.hps), FRESH


@pytest.mark.parametrize("ext", ["_C_cpu", "_C_cuda"])
def test_built_extension_was_compiled_with_the_declared_layout(ext):
    try:
        mod = importlib.import_module(f"fedopt_kernels.{ext}")
    except ImportError as exc:
        pytest.skip(f"{ext} not built here: {exc}")
    for name, spec in OPS.items():
        assert hasattr(mod, name), f"{ext} does not bind {name}"
        roles, hps, fresh = mod.op_layout(name)
        assert ([tuple(r) for r in roles], list(hps), fresh) == _layout(spec), name
        assert mod.op_signature(name) == ([r.name for r in spec.roles], list(spec.hps)), name
    with pytest.raises(ValueError, match="unknown op"):
        mod.op_layout("adam")


def bound_names(doc: str) -> list:
    """The argument names of a pybind11 function, from the signature line of its docstring."""
    args = doc.splitlines()[0].partition("(")[2].rpartition(")")[0]
    depth, pieces, piece = 0, [], ""
    for ch in args:  # split at the commas outside brackets (types such as list[int, str] hold some)
        depth += 1 if ch in "[(" else -1 if ch in "])" else 0
        if ch == "," and depth == 0:
            pieces.append(piece)
            piece = ""
        else:
            piece += ch
    return [p.split(":")[0].strip() for p in pieces + [piece]]


def schema_names(spec) -> list:
    """The argument names of ``spec``'s torch.library schema after its tensor lists."""
    args = spec.schema().partition("(")[2].rpartition(") ->")[0].split(", ")
    return [a.rsplit(" ", 1)[1] for a in args[len(spec.roles) :]]


@pytest.mark.parametrize("ext", ["_C_cpu", "_C_cuda"])
def test_built_extension_names_its_arguments_as_the_schema_does(ext):
    """The bindings' scalar arguments carry the schema's names (lists, then row_of, present, ...):
    one name per idea from the op declaration down to the C++ entry point."""
    try:
        mod = importlib.import_module(f"fedopt_kernels.{ext}")
    except ImportError as exc:
        pytest.skip(f"{ext} not built here: {exc}")
    for name, spec in OPS.items():
        want = ["lists"] + [n for n in schema_names(spec) if n != "backend"] + ["scratch"]
        assert bound_names(getattr(mod, name).__doc__) == want, name


def test_the_argument_name_check_can_fail():
    doc = "sgd(lists: list[list[int]], batch: list[int], present: list[int], scratch: object = None) -> None"
    assert bound_names(doc) == ["lists", "batch", "present", "scratch"]
    assert schema_names(OPS["sgd"])[0] == "row_of" != bound_names(doc)[1]


def test_generator_refuses_what_cpp_cannot_name():
    sgd = OPS["sgd"]
    bad_role = replace(sgd, roles=sgd.roles[:2] + (Role("x-0", "x-0"),))
    with pytest.raises(ValueError, match="C\\+\\+ identifier"):
        _op_header.render(
            {"sgd": bad_role, "sgd_batched": replace(bad_role, name="sgd_batched", batched=True, base="sgd")}
        )
    clash = replace(sgd, hps=("lr", "LR"))
    with pytest.raises(ValueError, match="collide"):
        _op_header.render({"sgd": clash, "sgd_batched": replace(clash, name="sgd_batched", batched=True, base="sgd")})
    with pytest.raises(ValueError, match="roles and hp columns"):
        _op_header.render(
            {"sgd": sgd, "sgd_batched": replace(OPS["fednar"], name="sgd_batched", batched=True, base="sgd")}
        )
    with pytest.raises(ValueError, match="no batched form"):
        _op_header.render({"sgd": sgd})


def test_the_build_generates_the_header_and_csrc_holds_no_copy(tmp_path):
    # csrc/build.py as setup.py loads it (beside the sources, not through the package)
    spec = importlib.util.spec_from_file_location("_test_op_header_build", ROOT / "csrc" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    folder = build.write_op_header(str(tmp_path / "gen"))
    assert (Path(folder) / "op_table.h").read_text() == _op_header.render()
    assert not list((ROOT / "csrc").rglob("op_table.h")), "op_table.h is generated into the build's folder only"
    # as in setup.py's process: the package is not imported, its sources beside csrc/ are read
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('b', sys.argv[1]); "
        "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b); "
        "b.write_op_header(sys.argv[2]); assert 'fedopt_kernels' not in sys.modules"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "csrc" / "build.py"), str(tmp_path / "setup")],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "setup" / "op_table.h").read_text() == _op_header.render()


def test_no_cpp_source_spells_a_role_or_hp_name():
    """Role and hp names reach C++ only through op_table.h: a quoted name in csrc/ is a hand-kept copy."""
    names = {r.name for s in OPS.values() for r in s.roles} | {h for s in OPS.values() for h in s.hps} | set(OPS)
    found = []
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".h", ".cuh", ".cpp", ".cu"):
            code = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)  # comments may name them
            for lit in re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"', code):
                if lit in names:
                    found.append(f'{path.relative_to(ROOT)}: "{lit}"')
    assert not found, found
