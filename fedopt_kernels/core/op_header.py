"""The C++ view of ``ops.OPS``: renders ``op_table.h``, the header the C++ and CUDA sources index
every op's arguments with (docs/dispatch.md, "One declaration per op").

The header is generated when an extension is built (``csrc/build.py`` writes it into the build's own
include folder for setup.py, the on-first-use build and the tests that compile kernel code); it is
never committed, so the C++ code cannot drift from the declaration. Per per-client op ``<op>`` it
holds:

* ``<op>_slot::<SHORT>``: each role's slot (tensor-list position), ``<op>_slot::COUNT``;
* ``<op>_bit::<SHORT>``: each optional role's bit of a row group's ``present`` mask;
* ``<op>_hp::<NAME>``: each hp column, ``<op>_hp::COUNT``;
* ``spec::<op>``: names (the op's and its batched form's), role table (name, state-typed, written,
  per-row, present bit), hp names, ``kNorm`` / ``kSchedule``;

and, for all ops, ``kFreshBit`` (``ops.FRESH``), ``kMaxSlots`` and ``FO_FOR_EACH_OP(X)``, which
expands ``X(<op>)`` once per per-client op.
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional

from .ops import FRESH, OPS, OpSpec

HEADER_NAME = "op_table.h"


def _ident(text: str, what: str) -> str:
    name = text.upper()
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"{what} {text!r} does not make a C++ identifier")
    return name


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _enum(namespace: str, names: List[str], values: List[int], count: Optional[int]) -> str:
    items = [f"{n} = {v}" for n, v in zip(names, values, strict=True)]
    if count is not None:
        items.append(f"COUNT = {count}")
    return f"namespace {namespace} {{ enum : int {{ {', '.join(items)} }}; }}"


def _batched_forms(ops: Mapping[str, OpSpec]) -> Dict[str, str]:
    """per-client op name -> its batched form's name; the batched form must share roles and hps."""
    out = {}
    for spec in ops.values():
        if not spec.batched:
            continue
        base = ops.get(spec.base)
        if base is None or base.roles != spec.roles or base.hps != spec.hps:
            raise ValueError(f"batched op {spec.name!r} must have the roles and hp columns of {spec.base!r}")
        out[spec.base] = spec.name
    return out


def _op_block(spec: OpSpec, batched_name: str) -> List[str]:
    op = spec.name
    if not op.isidentifier():
        raise ValueError(f"op name {op!r} is not a C++ identifier")
    slots = [_ident(r.short, f"role short name of {op}") for r in spec.roles]
    hps = [_ident(h, f"hp column of {op}") for h in spec.hps]
    for what, names in (("role short names", slots), ("hp columns", hps)):
        if len(set(names)) != len(names) or "COUNT" in names:
            raise ValueError(f"{op}: {what} collide in C++ (with each other or COUNT): {names}")
    opt = slots[2:]
    bits = [0, 0] + [spec.bit(r.name) for r in spec.optional]
    roles = ",\n      ".join(
        f'{{"{r.name}", {_bool(r.state_typed)}, {_bool(r.written)}, {_bool(r.per_row)}, {b}}}'
        for r, b in zip(spec.roles, bits, strict=True)
    )
    hp_names = ", ".join(f'"{h}"' for h in spec.hps)
    state = ", ".join(_bool(r.state_typed) for r in spec.roles)
    lines = [
        f"// ---- {op}: {' '.join(spec.doc.split())}" if spec.doc else f"// ---- {op}",
        _enum(f"{op}_slot", slots, list(range(len(slots))), len(slots)),
    ]
    if opt:
        lines.append(_enum(f"{op}_bit", opt, [spec.bit(r.name) for r in spec.optional], None))
    lines += [
        _enum(f"{op}_hp", hps, list(range(len(hps))), len(hps)),
        "namespace spec {",
        f"struct {op} {{",
        f'  static constexpr const char* kName = "{op}";',
        f'  static constexpr const char* kBatchedName = "{batched_name}";',
        f"  static constexpr int kSlots = {len(slots)};",
        f"  static constexpr int kHps = {len(hps)};",
        f"  static constexpr bool kNorm = {_bool(spec.norm)};",
        f"  static constexpr bool kSchedule = {_bool(spec.schedule)};",
        f"  static constexpr RoleDecl kRoles[kSlots] = {{\n      {roles}}};",
        f"  static constexpr const char* kHpNames[kHps] = {{{hp_names}}};",
        f"  static constexpr bool kStateSlot[kSlots] = {{{state}}};",
        "};",
        "}  // namespace spec",
        "",
    ]
    return lines


def render(ops: Optional[Mapping[str, OpSpec]] = None, fresh: int = FRESH) -> str:
    """The text of ``op_table.h`` for ``ops`` (default: every op of ``ops.OPS``)."""
    ops = OPS if ops is None else ops
    batched = _batched_forms(ops)
    per_client = [s for s in ops.values() if not s.batched]
    for spec in per_client:
        if spec.name not in batched:
            raise ValueError(f"op {spec.name!r} has no batched form (the bindings bind both)")
    max_slots = max(len(s.roles) for s in per_client)
    out = [
        "// Generated from fedopt_kernels/core/ops.py by fedopt_kernels/core/op_header.py when the extension is built:",
        "// do not edit, and do not commit (docs/dispatch.md). Every op's roles, optional-role bits and hp",
        "// columns, in the order of its declaration.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace fo {",
        "",
        "// One role (tensor list) of an op.",
        "struct RoleDecl {",
        "  const char* name;",
        "  bool state_typed;  // float32 storage (float64 for float64 parameters), not the parameter's dtype",
        "  bool written;      // the op stores into it",
        "  bool per_row;      // one value per output unit ([shape[0]]), not one per element",
        "  int32_t bit;       // its bit of a row group's `present` mask (optional roles); 0: every row group has it",
        "};",
        "",
        "// bit of sgd_batched's present mask: the round started with fresh momentum buffers (ops.FRESH)",
        f"constexpr int32_t kFreshBit = {int(fresh)};",
        f"constexpr int kMaxSlots = {max_slots};",
        "",
    ]
    for spec in per_client:
        out += _op_block(spec, batched[spec.name])
    out += [
        "// X(op) once per per-client op (each also has the batched form spec::op::kBatchedName)",
        "#define FO_FOR_EACH_OP(X) " + " ".join(f"X({s.name})" for s in per_client),
        "",
        "}  // namespace fo",
        "",
    ]
    return "\n".join(out)


def write(folder: str, text: Optional[str] = None) -> str:
    """Write ``op_table.h`` into ``folder`` (only when its text changes, so builds stay incremental);
    returns ``folder``, the directory to put on the include path."""
    text = render() if text is None else text
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, HEADER_NAME)
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return folder
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return folder


if __name__ == "__main__":  # python -m fedopt_kernels.core.op_header [FOLDER]: print, or write into FOLDER
    import sys

    if len(sys.argv) > 1:
        print(write(sys.argv[1]))
    else:
        sys.stdout.write(render())
