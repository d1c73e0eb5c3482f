"""The ops as torch.library ops: one declaration (``fedopt_kernels/core/ops.py``) that every layer reads.

* ``torch.library.opcheck`` on every op and backend (schema mutation annotations, fake tensors,
  AOT dispatch) with row groups that have every optional role and row groups that have none;
* the Triton kernels' roles and hp columns come from it; the benchmark's traffic is computed from it
  (the C++ side is generated from it: tests/test_op_header.py);
* ``torch.ops.fedopt.<op>`` computes what the optimizer's step computes;
* bad op arguments raise an error naming what is wrong.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from backends import cases, require
from op_harness import ALWAYS, HP, NON_NEGATIVE

import fedopt_kernels as fk
from fedopt_kernels.core import ops as _ops
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.core.ops import BATCHED, FRESH, OPS, PER_CLIENT

SHAPES = [(5, 3), (7,), (2, 3, 2)]


def _args(spec, device, dtype=torch.float32, backend="reference", amp=False, clients=0):
    """Arguments of ``spec``'s op: row group 0 has every optional role, row group 1 only those every row
    group has (op_harness.ALWAYS: PAdaMFed's D and acc, the moments). ``clients``: the batched form."""
    g = torch.Generator().manual_seed(0)
    lead = (clients,) if clients else ()

    def rnd(shape, dt=dtype):
        return torch.randn(lead + tuple(shape), generator=g).to(dtype=dt, device=device)

    n = len(SHAPES)
    row_of = [0, 1, 0]
    present = [(1 << len(spec.optional)) - 1, sum(1 << i for i, r in enumerate(spec.optional) if r.name in ALWAYS)]
    lists = [[rnd(s) for s in SHAPES], [rnd(s) for s in SHAPES]]
    for i, role in enumerate(spec.optional):
        ts = []
        for j in range(n):
            if present[row_of[j]] >> i & 1:
                if role.per_row:
                    ts.append((0.5 + torch.rand(lead + SHAPES[j][:1], generator=g)).to(device))
                else:
                    t = rnd(SHAPES[j], torch.float32 if role.state_typed else dtype)
                    ts.append(t.abs() if role.name in NON_NEGATIVE else t)
        lists.append(ts)
    rows = []
    for b in range(2):  # the GPU tests' values (tests/op_harness.py), ASAM in row group 0 only
        row = {**HP, "nesterov": 0.0, "rho": 0.5, "adaptive": float(b == 0)}
        rows.append([row[h] for h in spec.hps])
    hp = torch.tensor(rows, dtype=torch.float64, device=device)
    k = torch.zeros(1, dtype=torch.int32, device=device)
    table = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64, device=device)
    gs = torch.full((1,), 8.0, device=device) if amp else None
    fi = torch.zeros(1, device=device) if amp else None
    if not clients:
        return (*lists, row_of, present, hp, k, table, 1, gs, fi, backend)
    hp = torch.stack([hp * (1 + 0.1 * c) for c in range(clients)], 1).contiguous()  # per-client rows
    k = torch.tensor([0, 1, 0][:clients], dtype=torch.int32, device=device)
    active = torch.tensor([True, True, False][:clients], device=device)
    if spec.base == "sgd":
        present = [present[0] | FRESH, present[1]]
    return (*lists, row_of, present, hp, k, table, 1, gs, fi, active, backend)


def _require_op(backend, device, name):
    require(backend, device)
    why = _registry.unavailable_reason(backend, torch.device(device), name)
    if why is not None:
        pytest.skip(why)


# the GradScaler arguments' schema and fake handling in the full suite (opcheck is slow; the fast
# tier's kernel tests run every op with GradScaler's tensors: test_every_backend_computes_...)
@pytest.mark.parametrize("amp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "amp"])
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("backend,device", cases())
def test_opcheck(backend, device, name, amp):
    _require_op(backend, device, name)
    args = _args(OPS[name], device, backend=backend, amp=amp, clients=3 if OPS[name].batched else 0)
    torch.library.opcheck(_ops.torch_op(name), args)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("backend,device", cases(with_reference=False))
def test_every_backend_computes_what_reference_computes_through_torch_ops(backend, device, name):
    _require_op(backend, device, name)
    out = []
    for b in ("reference", backend):
        args = _args(OPS[name], device, backend=b, amp=True, clients=3 if OPS[name].batched else 0)
        _ops.torch_op(name)(*args)
        n = len(OPS[name].roles)
        out.append([t for lst in args[:n] for t in lst] + [args[n + 3]])
    for a, c in zip(*out):
        torch.testing.assert_close(c, a, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_reference_op_is_the_per_client_op_client_by_client(name):
    spec = BATCHED[name]
    args = _args(spec, "cpu", clients=3, amp=True)
    _ops.torch_op(name)(*args)
    n = len(spec.roles)
    hp, k, active = args[n + 2], args[n + 3], args[n + 8]
    for c in range(3):
        per = _args(PER_CLIENT[spec.base], "cpu", amp=True)
        lists = [[t[c].clone() for t in lst] for lst in _args(spec, "cpu", clients=3, amp=True)[:n]]
        ph = hp[:, c].clone()
        present = [m & ~FRESH for m in args[n + 1]]
        if spec.base == "sgd" and c != 1:  # FRESH row group, client at k == 0: the first-step rule
            ph[0, spec.hps.index("dampening")] = 0.0
        kc = torch.tensor([[0, 1, 0][c]], dtype=torch.int32)
        if active[c]:
            _ops.torch_op(spec.base)(
                *lists, per[n], present, ph, kc, per[n + 4], 1, per[n + 6], per[n + 7], "reference"
            )
        got = [t[c] for lst in args[:n] for t in lst]
        want = [t for lst in lists for t in lst]
        for a, b in zip(want, got):
            assert torch.equal(a, b)
        assert int(k[c]) == int(kc)


def test_triton_kernels_take_their_slots_and_columns_from_the_declaration(monkeypatch):
    require("triton")
    from fedopt_kernels.triton_kernels import declarations, fednar, padamfed, sgd

    for mod, name in ((sgd, "sgd"), (fednar, "fednar"), (padamfed, "padamfed")):
        spec = OPS[name]
        assert mod.ROLES == tuple(r.short for r in spec.roles)
        assert mod.HPN.value == len(spec.hps)
    shorts = [r.short for r in OPS["padamfed"].roles]
    assert (padamfed._ACC.value, padamfed._H.value) == (shorts.index("acc"), shorts.index("H"))
    assert (sgd._LR.value, sgd._NEST.value, sgd._MAX.value) == tuple(
        OPS["sgd"].hp_index(h) for h in ("lr", "nesterov", "maximize")
    )
    assert (fednar._MAX_NORM.value, fednar._PROX.value) == (
        OPS["fednar"].hp_index("max_norm"),
        OPS["fednar"].hp_index("prox_mu"),
    )
    # the constants follow the declaration, whatever its order
    monkeypatch.setitem(_ops.OPS, "padamfed", replace(OPS["padamfed"], hps=("eps", "beta", "lr")))
    assert [c.value for c in declarations.spec_columns("padamfed", "lr", "eps")] == [2, 0, 3]
    with pytest.raises(KeyError, match="no role"):
        declarations.spec_slots("padamfed", "buf")


def test_schema_marks_exactly_the_written_roles_as_mutated():
    assert set(BATCHED) == {f"{n}_batched" for n in PER_CLIENT}
    for spec in OPS.values():
        schema = torch._C.parse_schema(f"fedopt::{spec.schema()}")
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == {r.name for r in spec.roles if r.written} | {"k"}


def test_optimizer_step_is_the_op_with_the_plan_s_arguments():
    """Calling torch.ops.fedopt.sgd with what the optimizer's plan holds gives the optimizer's step."""
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    opt = fk.FedDecaySGD(a, lr=0.1, beta=0.5, momentum=0.9, backend="reference")
    grads = [torch.randn(s, generator=g) for s in SHAPES]
    for p, gr in zip(a, grads):
        p.grad = gr.clone()
    opt.step()
    opt.step()  # a steady plan
    plan = opt.step_plan
    b = [t.clone() for t in a]
    bufs = [t.clone() for t in plan.lists["momentum_buffer"]]
    k = opt._stepper.k.clone()
    _ops.torch_op("sgd")(
        b,
        [p.grad for p in a],
        bufs,
        [],
        [],
        [],
        plan.row_of,
        plan.present,
        plan.hp,
        k,
        opt.schedule.table(torch.device("cpu"), 2),
        1,
        None,
        None,
        "reference",
    )
    opt.step()
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y)
    assert int(k) == opt.round_step == 3


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bad_op_arguments_are_named(backend):
    require(backend)
    args = list(_args(OPS["sgd"], "cpu", backend=backend))
    bad = list(args)
    bad[2] = bad[2][:1]  # momentum_buffer list shorter than the present masks ask for
    with pytest.raises((ValueError, RuntimeError), match="momentum_buffer"):
        _ops.torch_op("sgd")(*bad)
    bad = list(args)
    bad[8] = bad[8].float()  # hp in float32
    with pytest.raises((ValueError, RuntimeError), match="hp must be"):
        _ops.torch_op("sgd")(*bad)
    bad = list(args)
    bad[-1] = "gpu"
    with pytest.raises(ValueError, match="gpu"):
        _ops.torch_op("sgd")(*bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("backend,device", cases(with_reference=False))
def test_opcheck_low_precision(backend, device, dtype):
    require(backend, device, dtype)
    torch.library.opcheck(_ops.torch_op("padamfed"), _args(OPS["padamfed"], device, dtype, backend))
