"""The Triton backend's multi-tensor launcher: plan cache, launches per dtype, staging, the
compiled kernels' 1-D path (run under the interpreter), bitwise determinism, speed, bad input.

Numerical agreement with ``reference`` over the full option matrix is test_equivalence.py's job;
here each check compares against ``reference`` only where a launcher code path needs it.
Runs on CUDA tensors with a GPU, else on CPU tensors under TRITON_INTERPRET=1 (conftest.py).
"""

from __future__ import annotations

import time
from typing import Callable, List

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels.core import registry as _registry

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_WHY = _registry.unavailable_reason("triton", DEVICE)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

if _WHY is None:
    import triton.language as tl

    from fedopt_kernels.triton_kernels import declarations, launcher, plans, tiles
    from fedopt_kernels.triton_kernels.jit_mode import interpreted

INTERPRETED = _WHY is None and interpreted()
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="monkeypatches the interpreter's tile choice")

TOL = {torch.float32: (2e-5, 2e-6), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture(autouse=True)
def _fresh_cache():
    plans.clear_cache()
    plans.stats.update(builds=0, hits=0, moved=0)
    yield
    plans.clear_cache()


def _params(shapes, dtype=torch.float32, seed=0) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(DEVICE)) for s in shapes]


def _grads(params, seed) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype).to(DEVICE) for p in params]


def _copy(params) -> List[torch.nn.Parameter]:
    out = []
    for p in params:
        if p.is_contiguous() and p.data_ptr() % 16:  # keep a misaligned view misaligned
            skip = (p.data_ptr() % 16) // p.element_size()
            q = torch.empty(p.numel() + skip, dtype=p.dtype, device=p.device)[skip:].view(p.shape)
        else:
            q = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
        q.copy_(p.detach())
        out.append(torch.nn.Parameter(q))
    return out


# one builder per op, with the options that give every role of its kernels
def _sgd(ps, backend):
    scales = {p: torch.linspace(0.5, 1.5, p.shape[0], device=DEVICE) for p in ps if p.dim() >= 1}
    return fk.NeuronLRSGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, prox_mu=0.1, neuron_scales=scales, backend=backend
    )


def _fednar(ps, backend):
    return fk.FedNAR(ps, lr=0.1, weight_decay=0.05, max_norm=0.5, prox_mu=0.2, backend=backend)


def _padamfed(ps, backend):
    return fk.PAdaMFed(ps, lr=0.05, beta=0.4, variance_reduction=True, backend=backend)


BUILDERS = {"sgd": _sgd, "fednar": _fednar, "padamfed": _padamfed}


def _run(build: Callable, params, backend: str, steps: int = 3) -> List[torch.Tensor]:
    ps = _copy(params)
    opt = build(ps, backend)
    kw = {}
    if isinstance(opt, (fk.FedDecaySGD, fk.NeuronLRSGD, fk.FedNAR)):
        kw["correction"] = [0.1 * g for g in _grads(ps, 99)]
    opt.start_round(**kw)
    for s in range(steps):
        for p, g in zip(ps, _grads(ps, s)):
            p.grad = g
        step_kw = {"anchor_grads": _grads(ps, 50 + s)} if isinstance(opt, fk.PAdaMFed) else {}
        opt.step(**step_kw)
    state = [t for p in ps for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in ps] + [t.clone() for t in state]


def _assert_close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True)


def _last_plan():
    return next(reversed(plans._CACHE.values()))


# ---------------------------------------------------------------- plan cache
def test_plan_is_reused_while_the_tensor_set_is_unchanged_and_rebuilt_when_it_changes():
    ps = _params([(5, 3), (7,), (130,)])
    # replay=False: on a GPU a replayed step calls no backend, and this is about the backend's plans
    opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, momentum=0.9, backend="triton", replay=False)
    grads = _grads(ps, 0)
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()  # builds: momentum buffers are new
    opt.step()  # momentum buffers exist now, with new addresses -> one more build
    builds = plans.stats["builds"]
    plan = opt.step_plan.cache["plan"]
    for _ in range(3):
        for g, new in zip(grads, _grads(ps, 1)):
            g.copy_(new)  # same tensors, new values: no rebuild
        opt.step()
    # the optimizer's cache hands the same launcher plan back without re-keying every tensor
    assert plans.stats["builds"] == builds and opt.step_plan.cache["plan"] is plan

    old = ps[1].grad
    ps[1].grad = old.clone()  # a new gradient tensor (old kept alive: the address differs)
    opt.step()
    # moved gradients: the plan's tables with the gradient column rewritten, nothing built
    moved = opt.step_plan.cache["plan"]
    assert plans.stats["builds"] == builds and plans.stats["moved"] == 1 and moved is not plan
    g_col = declarations.spec_roles("sgd")[0].index("g")
    assert moved.launches[0].meta[:, g_col].tolist() == [g.data_ptr() for g in (ps[0].grad, ps[1].grad, ps[2].grad)]
    assert plan.launches[0].meta[:, g_col].tolist()[1] == old.data_ptr()  # the first plan is unchanged
    opt.step()
    ps[1].grad = old  # back to the first address set: its plan again
    opt.step()
    assert opt.step_plan.cache["plan"] is plan and plans.stats["moved"] == 1 and plans.stats["builds"] == builds
    ps[1].grad = old.t().contiguous().t() if old.dim() > 1 else torch.randn(15, device=DEVICE)[1:8]  # misaligned
    assert ps[1].grad.data_ptr() % 16 != 0
    opt.step()  # another layout: staged, so a plan of its own
    assert plans.stats["builds"] == builds + 1 and plans.stats["moved"] == 1

    with torch.no_grad():
        ps[2].data = torch.zeros(64, device=DEVICE)  # new shape
    ps[2].grad = torch.ones(64, device=DEVICE)
    opt.start_round()
    opt.step()
    assert plans.stats["builds"] >= builds + 2


def test_one_launch_per_dtype_signature_and_zero_size_tensors_skipped():
    ps = (
        _params([(4, 3), (9,)])
        + _params([(6,)], torch.bfloat16)
        + _params([(0,), (3, 0)])
        + _params([(5,)], torch.float16)
    )
    opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, backend="triton")
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    opt.step()
    plan = _last_plan()
    assert len(plan.launches) == 3  # fp32, bf16, fp16; the zero-size tensors are in none
    assert sorted(lau.meta.shape[0] for lau in plan.launches) == [1, 1, 2]

    only_empty = _params([(0,), (0, 4)])
    opt = fk.FedNAR(only_empty, lr=0.1, weight_decay=0.1, backend="triton")
    for p in only_empty:
        p.grad = torch.zeros_like(p)
    opt.step()  # nothing to do, nothing launched, no error
    assert _last_plan().launches == []


def test_noncontiguous_and_misaligned_tensors_are_staged_and_correct():
    base = torch.randn(12, 10, device=DEVICE)
    flat = torch.randn(101, device=DEVICE)
    params = [
        torch.nn.Parameter(base.t()),  # transposed
        torch.nn.Parameter(base[:, ::2]),  # strided
        torch.nn.Parameter(flat[1:]),  # contiguous but 4 bytes off 16-byte alignment
        torch.nn.Parameter(torch.randn(33, device=DEVICE)),
    ]
    assert params[2].data_ptr() % 16 != 0
    for name, build in BUILDERS.items():
        want = _run(build, params, "reference")
        got = _run(build, params, "triton")
        _assert_close(got, want, torch.float32)
        staged = {(role, i) for _, role, i, _, _ in _last_plan().staged}
        assert {("x", 0), ("x", 1), ("x", 2)} <= staged, (name, staged)
        assert ("x", 3) not in staged


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_gradients_at_new_addresses_every_step_give_the_bits_of_fixed_ones(op, monkeypatch):
    """zero_grad(set_to_none=True): new gradient (and anchor gradient) tensors every step. The plan
    made for them by rewriting the table (LaunchPlan.moved) must give the bits of gradients kept in
    place, with staged parameters and gradients (transposed, misaligned) among the tensors."""
    if INTERPRETED:
        monkeypatch.setattr(plans, "FORCE_TILE", (2, 64))
    base = torch.randn(12, 10, device=DEVICE)
    params = [
        torch.nn.Parameter(base.t()),
        torch.nn.Parameter(torch.randn(101, device=DEVICE)[1:]),
        *_params([(130,), (17, 5), (1,)], seed=7),
    ]

    def laid_out(i: int, g: torch.Tensor) -> torch.Tensor:
        """Gradient 0 transposed in memory, gradient 2 off 16-byte alignment: both are staged."""
        if i == 0:
            return g.t().contiguous().t()
        if i == 2:
            out = torch.empty(g.numel() + 1, dtype=g.dtype, device=g.device)[1:].view(g.shape)
            return out.copy_(g)
        return g

    def run(moving: bool):
        ps = _copy(params)
        opt = BUILDERS[op](ps, "triton")
        opt.start_round()
        kept = [laid_out(i, torch.zeros_like(p)) for i, p in enumerate(ps)]
        kept_anchor = [torch.zeros_like(p) for p in ps]
        alive = []  # every step's tensors stay alive: a caching allocator would hand their blocks back
        for s in range(5):
            grads = [laid_out(i, g) for i, g in enumerate(_grads(ps, s))]
            anchors = _grads(ps, 50 + s)
            if not moving:
                grads = [k.copy_(g) for k, g in zip(kept, grads)]
                anchors = [k.copy_(g) for k, g in zip(kept_anchor, anchors)]
            alive.append((grads, anchors))
            for p, g in zip(ps, grads):
                p.grad = g
            opt.step(**({"anchor_grads": anchors} if isinstance(opt, fk.PAdaMFed) else {}))
        state = [t for p in ps for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
        return [p.detach().clone() for p in ps] + [t.clone() for t in state]

    fixed = run(moving=False)
    builds, moved = plans.stats["builds"], plans.stats["moved"]
    plans.clear_cache()
    moving = run(moving=True)
    assert plans.stats["moved"] - moved >= 3 and plans.stats["builds"] - builds <= 2
    for a, b in zip(moving, fixed):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_batched_gradients_at_new_addresses_give_the_bits_of_fixed_ones(op, monkeypatch):
    """The client-batched form through an optimizer's cache: stacked gradients at new addresses each
    step, client slices on and off 16-byte alignment ((65,) and (3, 30))."""
    from fedopt_kernels.core.backends.triton import STEPS
    from fedopt_kernels.core.ops import OPS

    if INTERPRETED:
        monkeypatch.setattr(plans, "FORCE_TILE", (1, 64))
    spec = OPS[f"{op}_batched"]
    moving_lists = [1] + [2 + j for j, r in enumerate(spec.optional) if r.name == "anchor_grad"]
    args = _batched_args(op, BATCHED_SHAPES, 3, amp=False)
    n = len(spec.roles)

    def run(moving: bool):
        lists = [[t.clone() for t in lst] for lst in args[:n]]
        rest = list(args[n:])
        rest[3] = rest[3].clone()  # k
        cache: dict = {}
        alive = []  # every step's tensors stay alive: a caching allocator would hand their blocks back
        for s in range(4):
            for j in moving_lists:
                fresh = [t * (1.0 + 0.25 * s) for t in args[j]]
                alive.append(fresh)
                lists[j] = fresh if moving else [k.copy_(f) for k, f in zip(lists[j], fresh)]
            STEPS[f"{op}_batched"](*lists, *rest, "triton", cache=cache)
        return [t for lst in lists for t in lst] + [rest[3]]

    fixed = run(moving=False)
    moved = plans.stats["moved"]
    moving = run(moving=True)
    assert plans.stats["moved"] - moved >= 3
    for a, b in zip(moving, fixed):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- the compiled kernels' 1-D path
@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_one_chunk_per_program_path_matches_reference(op, dtype, monkeypatch):
    """ROWS == 1 is what runs on a GPU: full chunks take the unmasked branch, tails the masked
    one, norm programs loop over several chunks (few norm programs)."""
    monkeypatch.setattr(plans, "FORCE_TILE", (1, 64))
    monkeypatch.setattr(plans, "MAX_NORM_PROGRAMS", 3)
    params = _params([(64,), (65,), (1,), (0,), (5, 13), (130,), (3, 70)], dtype)
    want = _run(BUILDERS[op], params, "reference")
    got = _run(BUILDERS[op], params, "triton")
    _assert_close(got, want, dtype)
    assert all(lau.rows == 1 and lau.block == 64 for lau in _last_plan().launches)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_only_branches_match_reference(dtype, monkeypatch):
    """The compiled kernels' 32-bit per-neuron row arithmetic, run under the interpreter."""
    monkeypatch.setattr(plans, "FORCE_TILE", (1, 32))
    monkeypatch.setattr(tiles, "INTERPRETED", tl.constexpr(False))
    params = _params([(7, 9), (40, 3), (33,), (2, 2, 17)], dtype)
    want = _run(_sgd, params, "reference", steps=2)
    got = _run(_sgd, params, "triton", steps=2)
    _assert_close(got, want, dtype)


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_bitwise_deterministic_across_runs_and_plan_rebuilds(op, monkeypatch):
    if INTERPRETED:  # several norm programs and slots, so the fixed-order reduction is exercised
        monkeypatch.setattr(plans, "FORCE_TILE", (2, 64))
        monkeypatch.setattr(plans, "MAX_NORM_PROGRAMS", 4)
    params = _params([(300,), (17, 5), (1,), (129,), (64, 8)], torch.float32, seed=3) + _params(
        [(200,)], torch.bfloat16, seed=4
    )
    first = _run(BUILDERS[op], params, "triton")
    plans.clear_cache()
    second = _run(BUILDERS[op], params, "triton")
    for a, b in zip(first, second):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- client-batched ops
def _batched_args(name: str, shapes, C: int, dtype=torch.float32, seed: int = 0, amp: bool = True, found: float = 0.0):
    """Arguments of ``<name>_batched`` over stacked ``[C, *shape]`` tensors: even-indexed tensors in
    row group 0 (every optional role; FRESH for sgd), odd ones in row group 1 (none but PAdaMFed's D/acc);
    per-client hp rows, per-client k (0, 1, 2, 0, ...) and an active mask with clients 2, 5, ...
    off. ``dtype`` may be a list (one per shape)."""
    from fedopt_kernels.core.ops import FRESH, OPS

    spec = OPS[f"{name}_batched"]
    g = torch.Generator().manual_seed(seed)
    dts = dtype if isinstance(dtype, list) else [dtype] * len(shapes)

    def rnd(shape, dt):
        return torch.randn((C,) + tuple(shape), generator=g).to(dtype=dt, device=DEVICE)

    row_of = [i % 2 for i in range(len(shapes))]
    present = [
        (1 << len(spec.optional)) - 1,
        sum(1 << i for i, r in enumerate(spec.optional) if r.name in ("D", "acc")),
    ]
    lists = [[rnd(s, dt) for s, dt in zip(shapes, dts)], [rnd(s, dt) for s, dt in zip(shapes, dts)]]
    for i, role in enumerate(spec.optional):
        ts = []
        for j, (s, dt) in enumerate(zip(shapes, dts)):
            if present[row_of[j]] >> i & 1:
                if role.per_row:
                    ts.append((0.5 + torch.rand((C,) + tuple(s[:1]), generator=g)).to(DEVICE))
                else:
                    ts.append(rnd(s, torch.float32 if role.state_typed else dt))
        lists.append(ts)
    base = {
        "lr": 0.1,
        "momentum": 0.9,
        "dampening": 0.2,
        "weight_decay": 0.01,
        "prox_mu": 0.2,
        "nesterov": 0.0,
        "maximize": 0.0,
        "max_norm": 0.5,
        "eps": 1e-6,
        "beta": 0.5,
    }
    hp = torch.tensor(
        [[[base[h] * (1 + 0.1 * c + 0.3 * b) for h in spec.hps] for c in range(C)] for b in range(2)],
        dtype=torch.float64,
        device=DEVICE,
    )
    if "nesterov" in spec.hps:
        hp[1, :, spec.hps.index("nesterov")] = 1.0
    if spec.base == "sgd":
        present[0] |= FRESH
    k = torch.tensor([c % 3 for c in range(C)], dtype=torch.int32, device=DEVICE)
    active = torch.tensor([c % 3 != 2 for c in range(C)], device=DEVICE)
    table = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64, device=DEVICE)
    gs = torch.full((1,), 4.0, device=DEVICE) if amp else None
    fi = torch.full((1,), found, device=DEVICE) if amp else None
    return [*lists, row_of, present, hp, k, table, 1, gs, fi, active]


def _run_batched(name: str, args, backend: str, steps: int = 2) -> List[torch.Tensor]:
    """``steps`` calls of the op on copies of ``args``; every tensor it may write, and k."""
    from fedopt_kernels.core import ops as _ops

    n = len(_ops.OPS[f"{name}_batched"].roles)
    lists = [[t.clone() for t in lst] for lst in args[:n]]
    rest = list(args[n:])
    rest[3] = rest[3].clone()  # k
    for _ in range(steps):
        _ops.torch_op(f"{name}_batched")(*lists, *rest, backend)
    return [t for lst in lists for t in lst] + [rest[3]]


BATCHED_SHAPES = [(64,), (65,), (1,), (0,), (5, 13), (3, 30)]


@interpreter_only
@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_batched_one_chunk_per_program_path_matches_reference(op, monkeypatch):
    """The compiled kernels' 1-D path for the batched ops (float32; the dtype helpers are the
    per-client ones): client slices off 16-byte alignment ((65,): client 1) go to launches
    without the 128-bit promise; two steps, so FRESH applies to client 0's first one only."""
    monkeypatch.setattr(plans, "FORCE_TILE", (1, 64))
    args = _batched_args(op, BATCHED_SHAPES, 3)
    want = _run_batched(op, args, "reference")
    got = _run_batched(op, args, "triton")
    _assert_close(got, want, torch.float32)
    lau = _last_plan().launches
    assert all(la.batched and la.rows == 1 and la.block == 64 for la in lau)
    assert {la.aligned for la in lau} == {True, False}


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_batched_found_inf_skips_every_client(op):
    args = _batched_args(op, [(5, 3), (7,)], 4, found=1.0)
    before = [t.clone() for lst in args[:-9] for t in lst] + [args[-6].clone()]
    got = _run_batched(op, args, "triton", steps=1)
    for a, b in zip(got, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_batched_bitwise_deterministic_across_runs_and_plan_rebuilds(op, monkeypatch):
    if INTERPRETED:  # several chunks per tile and per client, two launches (dtypes) in each client's norm
        monkeypatch.setattr(plans, "FORCE_TILE", (2, 64))
    shapes = [(130,), (17, 5), (1,), (64, 3)]
    args = _batched_args(op, shapes, 3, [torch.float32] * 3 + [torch.bfloat16], seed=3)
    first = _run_batched(op, args, "triton", steps=1)
    plans.clear_cache()
    second = _run_batched(op, args, "triton", steps=1)
    for a, b in zip(first, second):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_batched_many_clients_small_cnn_matches_reference(op):
    """C = 50 clients of the simulator's small CNN: per-client norms, k, hp rows and active flags."""
    from bench.shapes import SIZES

    args = _batched_args(op, SIZES["small_cnn"], 50, seed=5)
    want = _run_batched(op, args, "reference", steps=1)
    got = _run_batched(op, args, "triton", steps=1)
    _assert_close(got, want, torch.float32)


def test_batched_fresh_bit_follows_the_round():
    """A round kept with its momentum buffers (reset_state=False) is not FRESH: the plan (cached by
    the optimizer) must not keep the first round's dampening-0 rule."""
    from fedopt_kernels.batched import BatchedFedDecaySGD

    init = _params([(3, 4, 3), (3, 5)], seed=7)
    out = []
    for backend in ("reference", "triton"):
        ps = _copy(init)
        opt = BatchedFedDecaySGD(ps, lr=0.1, beta=0.5, momentum=0.9, dampening=0.5, backend=backend)
        for rnd in range(2):
            opt.start_round(reset_state=rnd == 0)
            for s in range(2):
                for p, g in zip(ps, _grads(ps, 10 * rnd + s)):
                    p.grad = g
                opt.step(active=[True, s == 0, True])
        out.append([p.detach().clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps])
    _assert_close(out[1], out[0], torch.float32)


# ---------------------------------------------------------------- the interpreter's scalars
def _strict_index(monkeypatch) -> None:
    """Interpreted tensors convert to an index only when 0-d, as under Triton 3.6's interpreter with
    NumPy >= 2.4 (its ``int()`` of the one-element 1-d arrays that stand for scalars raises there),
    whichever Triton and NumPy run here."""
    import operator

    import triton.runtime.interpreter as interp

    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None:
        pytest.skip("this Triton's interpreter patches its tensors elsewhere: nothing to make strict")

    def strict(tensor, *scope):  # Triton >= 3.6 passes a scope that undoes the patch after the launch
        patch(tensor, *scope)
        index = lambda self: operator.index(self.handle.data)  # noqa: E731
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            monkeypatch.setattr(tensor, "__index__", index)

    monkeypatch.setattr(interp, "_patch_lang_tensor", strict)


@interpreter_only
@pytest.mark.parametrize("tile", [(1, 64), (2, 64)], ids=["rows1", "rows2"])
@pytest.mark.parametrize("op", ["fednar", "padamfed"])
def test_loop_bounds_need_no_lenient_scalar_conversion(op, tile, monkeypatch):
    """Every loop of the norm kernels (per-client norm programs over several tiles, the batched
    finalize over launches, slots and hp rows, the slot sums) with runtime bounds."""
    _strict_index(monkeypatch)
    monkeypatch.setattr(plans, "FORCE_TILE", tile)
    monkeypatch.setattr(plans, "MAX_NORM_PROGRAMS", 3)
    params = _params([(64,), (65,), (1,), (5, 13), (130,)])
    _assert_close(_run(BUILDERS[op], params, "triton"), _run(BUILDERS[op], params, "reference"), torch.float32)
    args = _batched_args(op, BATCHED_SHAPES, 3)
    _assert_close(_run_batched(op, args, "triton"), _run_batched(op, args, "reference"), torch.float32)


# ---------------------------------------------------------------- speed of the interpreter path
@interpreter_only
def test_step_over_250_small_tensors_is_fast_under_the_interpreter():
    ps = _params([(1 + (i * 37) % 61, 1 + i % 7) for i in range(250)])
    opts = [
        fk.FedDecaySGD(ps, lr=0.1, beta=0.5, momentum=0.9, backend="triton"),
        fk.FedNAR(ps, lr=0.1, weight_decay=0.01, backend="triton"),
        fk.PAdaMFed(ps, lr=0.1, beta=0.5, backend="triton"),
    ]
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    for opt in opts:
        opt.step()
        opt.step()  # plans built
        t0 = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - t0
        assert elapsed < 1.0, f"{type(opt).__name__}: {elapsed:.3f} s for one step over 250 tensors"


# ---------------------------------------------------------------- bad input and availability
def test_float64_is_refused_with_a_message_naming_dtype_and_backend():
    ps = _params([(3,)], torch.float64)
    ps[0].grad = torch.ones_like(ps[0])
    opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, backend="triton")
    with pytest.raises(TypeError) as info:
        opt.step()
    assert "torch.float64" in str(info.value) and "'triton'" in str(info.value)


def test_device_check_explains_interpreter_and_cuda():
    check = _registry.DEVICE_OK["triton"]
    if INTERPRETED:
        assert check(torch.device("cpu")) is None
        assert "TRITON_INTERPRET" in check(torch.device("cuda"))
    else:
        assert check(torch.device("cuda")) is None
        assert "TRITON_INTERPRET" in check(torch.device("cpu"))
    assert "not supported" in check(torch.device("meta"))


def test_kernels_load_from_a_source_checkout_without_the_installed_mapping(tmp_path):
    """backends/triton.py falls back to loading the top-level triton_kernels/ folder."""
    import subprocess
    import sys

    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'fedopt_kernels.triton_kernels':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fedopt_kernels.core.backends.triton as b\n"
        "import fedopt_kernels.triton_kernels as k\n"
        "print(k.__file__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("triton_kernels/__init__.py")


class _FakeCuda:
    """Stands in for torch.cuda's pool API on a machine without CUDA, recording what happens."""

    def __init__(self, fail_make=False, fail_enter=False):
        self.current, self.events = 0, []
        self.fail_make, self.fail_enter = fail_make, fail_enter
        fake = self

        class Pool:
            def __init__(self):
                if fake.fail_make:
                    raise RuntimeError("no pools with this allocator")
                self.device = fake.current  # a pool belongs to the device current at its creation

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                self.before, fake.current = fake.current, self.index

            def __exit__(self, *exc):
                fake.current = self.before

        class Routing:
            def __init__(self, pool, device):
                assert pool.device == device, "a pool used on another device (torch asserts)"
                self.device = device

            def __enter__(self):
                if fake.fail_enter:
                    raise RuntimeError("cannot route")
                fake.events.append(("enter", self.device))

            def __exit__(self, *exc):
                fake.events.append(("exit", self.device))

        self.MemPool, self.device, self.use_mem_pool = Pool, Device, Routing


@pytest.mark.parametrize("failure", [None, "make", "enter"])
def test_tables_come_from_a_pool_of_the_plans_own_device(monkeypatch, failure):
    """The private pool is made on the plan's device (not the current one: torch asserts otherwise),
    routing ends after the build even when it raises, and a pool that cannot be had falls back to
    the shared pool instead of failing the step."""
    fake = _FakeCuda(fail_make=failure == "make", fail_enter=failure == "enter")
    for name in ("MemPool", "device", "use_mem_pool"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(plans, "_POOLS", {})
    with plans._table_pool(torch.device("cuda", 1)):
        pass
    with pytest.raises(ValueError):
        with plans._table_pool(torch.device("cuda", 1)):
            raise ValueError("a failing build")
    if failure is None:
        assert fake.events == [("enter", 1), ("exit", 1)] * 2 and fake.current == 0
    else:
        assert fake.events == [] and plans._POOLS[1] is None


# ---------------------------------------------------------------- bound launches
class _CompiledStandIn:
    """What a compiled launch returns on a GPU (triton's CompiledKernel): ``run`` is its launcher."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log
        self.function, self.packed_metadata = f"function of {kernel.name}", ("metadata",)

    def run(self, *args):
        self.log.append(("bound", self.kernel.name, args))


class _KernelStandIn:
    """A kernel with the real one's parameters whose launches only say what they were given."""

    def __init__(self, real, name, log):
        self.arg_names, self.name, self.log = real.arg_names, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", self.name, (grid, args, kwargs)))
            return _CompiledStandIn(self, self.log)

        return launch


def _as_bound(kernel, grid, args, kwargs):
    """The launcher call a bound launch of ``kernel[grid](*args, **kwargs)`` must make."""
    values = [args[i] if i < len(args) else kwargs[n] for i, n in enumerate(kernel.arg_names)]
    g = (tuple(grid) + (1, 1))[:3]
    return (
        *g,
        7,
        f"function of {kernel.name}",
        ("metadata",),
        None,
        None,
        None,
        *[v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values],
    )


@pytest.mark.parametrize("op", ["sgd", "fednar"])
def test_a_bound_launch_passes_what_the_first_launch_passed(op, monkeypatch):
    """Triton's own launch path binds every argument, works out its specialisation and looks the
    compiled kernel up at each launch: most of an eager step's host time on a GPU. After a first
    launch, launcher.launch calls the compiled kernel it returned directly, with the arguments of
    that launch in the kernel's parameter order (tensors as addresses), while the step's own inputs
    are the same (step_key); a new schedule table, launch hooks or FEDOPT_TRITON_BIND=0 take triton's
    path again. (Interpreted launches return no compiled kernel: stand-ins here.)"""
    import triton

    from fedopt_kernels.triton_kernels import sgd, two_pass_kernels

    log: list = []
    kernels = {}
    for mod, name in [
        (sgd, "sgd_kernel"),
        (two_pass_kernels, "norm_kernel"),
        (two_pass_kernels, "update_kernel"),
        (two_pass_kernels, "advance_kernel"),
    ]:
        kernels[name] = _KernelStandIn(getattr(mod, name), name, log)
        monkeypatch.setattr(mod, name, kernels[name])
    monkeypatch.setattr(launcher, "_stream", lambda: 7)
    from fedopt_kernels.core import schedules

    monkeypatch.setattr(schedules, "_PREFILL", 8)  # FedDecaySGD's schedule table grows after 8 steps
    ps = _params([(5, 3), (7,), (130,)])
    if op == "sgd":
        opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, decay_every=1, backend="triton", replay=False)
    else:
        opt = fk.FedNAR(ps, lr=0.1, weight_decay=0.01, backend="triton", replay=False)
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    for _ in range(4):
        opt.step()
    jit = [entry for entry in log if entry[0] == "jit"]
    bound = [entry for entry in log if entry[0] == "bound"]
    per_step = len(jit)  # the first step's launches, through triton's path
    assert per_step == 2 and len(bound) == 3 * per_step
    for i, (_, name, args) in enumerate(bound):
        _, _, first = jit[i % per_step]
        assert name == jit[i % per_step][1] and args == _as_bound(kernels[name], *first), name

    if op == "sgd":  # the schedule table outgrows itself: a new table, new addresses, triton's path again
        log.clear()
        for _ in range(10):
            opt.step()
        assert any(e[0] == "jit" for e in log[2:]) and log[-1][0] == "bound"
    log.clear()
    hook = lambda *a: None  # noqa: E731 - a launch hook (a profiler's)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        opt.step()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert [e[0] for e in log] == ["jit"] * per_step
    monkeypatch.setattr(launcher, "_BIND", False)
    log.clear()
    opt.step()
    opt.step()
    assert [e[0] for e in log] == ["jit"] * (2 * per_step)
