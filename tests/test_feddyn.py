"""FedDyn (docs/algorithms.md): the client step and g_i against a float64 statement of the rule,
fused backends against ``reference``, the client-batched form against the per-client optimizer,
bad input, state_dict round trips, and the server rule (alone and end to end on a quadratic)."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from fedopt_kernels import FedDecaySGD, catalogue
from fedopt_kernels.feddyn import (CATALOGUE_FULL, CATALOGUE_OPTIONS, BatchedFedDyn, FedDyn,
                                   feddyn_server_step)
from fedopt_kernels.server_rules import weighted_average_step

from backends import supports, usable
from harness import (SHAPE_SETS, TOLERANCE, RunResult, _state, assert_close_runs, backend_skip_reason,
                     make_grads, make_params)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUSED = [b for b in usable("cpu") if b != "reference"]
DTYPE_IDS = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}


def config(option: str) -> catalogue.Config:
    """A catalogue configuration from this module's option sets (as catalogue._algo builds them)."""
    spec = dict(CATALOGUE_OPTIONS[option])
    groups = spec.pop("groups", None)
    return catalogue.Config("feddyn", option, FedDyn, spec, groups=groups)


def drive(opt, params, shape_set: str, rounds, steps: int, seed: int = 0, first_step: int = 0) -> None:
    """Rounds ``rounds`` of ``steps`` seeded steps each, ``end_round()`` after each (as catalogue.run, plus g_i)."""
    for i, rnd in enumerate(rounds):
        if not (i == 0 and first_step > 0):  # resuming mid-round: the round is already started
            opt.start_round()
        for step in range(first_step if i == 0 else 0, steps):
            for p, g in zip(params, make_grads(params, shape_set, rnd * steps + step, seed)):
                p.grad = g
            opt.step()
        opt.end_round()


def run(option: str, shape_set: str, dtype: torch.dtype, backend: str, rounds: int = 3, steps: int = 3,
        seed: int = 0) -> RunResult:
    params = make_params(shape_set, dtype, seed)
    opt = config(option).build(params, backend)
    drive(opt, params, shape_set, range(rounds), steps, seed)
    return RunResult([p.detach().clone() for p in params], _state(opt, params), opt)


def _skip_unless(backend: str) -> None:
    why = backend_skip_reason(backend)
    if why is not None:
        pytest.skip(why)


# ---------------------------------------------------------------- the rule, in float64
def feddyn_f64(x_init, groups, grads, rounds: int, steps: int, *, beta=1.0, schedule="exponential",
               decay_every=1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False):
    """FedDyn's client written out: ``x`` per parameter, ``groups[i] = (lr, alpha)`` of parameter i,
    ``grads[rnd * steps + k][i]``. Returns the final parameters and g_i, in float64."""
    x = [t.double().clone() for t in x_init]
    gi = [torch.zeros_like(t) for t in x]
    for rnd in range(rounds):
        x0 = [t.clone() for t in x]
        buf = [None] * len(x)
        for k in range(steps):
            j = k // decay_every
            s = beta ** j if schedule == "exponential" else max(0.0, 1 - j * (1 - beta))
            for i, (lr, alpha) in enumerate(groups):
                g = grads[rnd * steps + k][i].double()
                d = (-g if maximize else g) + weight_decay * x[i] - gi[i] + alpha * (x[i] - x0[i])
                if momentum:
                    buf[i] = d.clone() if buf[i] is None else momentum * buf[i] + (1 - dampening) * d
                    d = d + momentum * buf[i] if nesterov else buf[i]
                x[i] = x[i] - lr * s * d
        for i, (_, alpha) in enumerate(groups):
            gi[i] = gi[i] - alpha * (x[i] - x0[i])
    return x, gi


VARIANTS = {
    "plain": {},
    "momentum_dampening": dict(momentum=0.9, dampening=0.3),
    "nesterov_wd": dict(momentum=0.8, nesterov=True, weight_decay=0.05),
    "decay_every2": dict(beta=0.6, decay_every=2, momentum=0.5),
    "linear_maximize": dict(beta=0.7, schedule="linear", maximize=True, weight_decay=0.01),
}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_and_dyn_grad_match_the_float64_rule(variant, backend):
    _skip_unless(backend)
    kw = VARIANTS[variant]
    shapes = [(5, 3), (7,), (2, 3, 2), (1,)]
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    rounds, steps = 3, 4
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(rounds * steps)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    # two groups with different lr and alpha: parameters 0, 2 and 1, 3
    opt = FedDyn([{"params": params[0::2]}, {"params": params[1::2], "lr": 0.03, "alpha": 0.7}],
                 lr=0.1, alpha=0.2, backend=backend, **kw)
    for rnd in range(rounds):
        opt.start_round()
        for k in range(steps):
            for p, g in zip(params, grads[rnd * steps + k]):
                p.grad = g.clone()
            opt.step()
        opt.end_round()
    groups = [(0.1, 0.2), (0.03, 0.7), (0.1, 0.2), (0.03, 0.7)]
    x, gi = feddyn_f64(init, groups, grads, rounds, steps, **kw)
    order = [0, 2, 1, 3]  # dyn_grad() is in param-group order
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach(), x[i], rtol=1e-12, atol=1e-12)
    for j, g in enumerate(opt.dyn_grad()):
        torch.testing.assert_close(g, gi[order[j]], rtol=1e-12, atol=1e-12)
    assert any(float(g.abs().max()) > 1e-3 for g in gi)  # the check is not vacuous


def test_dyn_grad_starts_at_zero_and_persists_across_start_round():
    p = torch.nn.Parameter(torch.randn(4))
    opt = FedDyn([p], lr=0.1, alpha=0.5)
    assert torch.equal(opt.dyn_grad()[0], torch.zeros(4))
    opt.start_round()
    p.grad = torch.ones(4)
    opt.step()
    opt.end_round()
    before = opt.dyn_grad()[0]
    assert float(before.abs().min()) > 0
    opt.start_round()
    assert torch.equal(opt.dyn_grad()[0], before)
    assert torch.equal(opt.state[p]["x0"], p.detach())
    # dyn_grad returns copies
    opt.dyn_grad()[0].fill_(7.0)
    assert torch.equal(opt.dyn_grad()[0], before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_a_client_without_steps_keeps_its_dyn_grad(dtype):
    params = make_params("odd", dtype, 1)
    opt = config("momentum").build(params, "reference")
    drive(opt, params, "odd", range(2), 2)
    kept = opt.dyn_grad()
    assert any(float(g.abs().max()) > 0 for g in kept)
    opt.start_round()
    opt.end_round()  # no step: x == x0
    for a, b in zip(kept, opt.dyn_grad()):
        assert torch.equal(a, b)


def test_state_is_in_the_parameter_dtype_and_group_alpha_is_readable():
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    opt = FedDyn([p], lr=0.1, alpha=0.25, momentum=0.9)
    assert opt.param_groups[0]["alpha"] == 0.25 and "prox_mu" not in opt.param_groups[0]
    p.grad = torch.ones_like(p)
    opt.step()  # starts the round itself
    opt.end_round()
    assert {k: v.dtype for k, v in opt.state[p].items()} == dict.fromkeys(("x0", "dyn_correction", "momentum_buffer"),
                                                                          torch.bfloat16)


def test_alpha_edit_in_the_group_takes_effect():
    a, b = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    opts = [FedDyn([a], lr=0.1, alpha=0.1), FedDyn([b], lr=0.1, alpha=0.5)]
    for opt in opts:
        opt.start_round()
    opts[0].param_groups[0]["alpha"] = 0.5
    for opt, p in zip(opts, (a, b)):
        for _ in range(3):
            p.grad = torch.full((3,), 2.0)
            opt.step()
        opt.end_round()
    assert torch.equal(a, b) and torch.equal(opts[0].dyn_grad()[0], opts[1].dyn_grad()[0])


# ---------------------------------------------------------------- end_round semantics
def test_end_round_before_start_round_and_twice_are_refused_and_change_nothing():
    p = torch.nn.Parameter(torch.randn(5))
    opt = FedDyn([p], lr=0.1, alpha=0.3, momentum=0.5)
    with pytest.raises(RuntimeError, match="before any start_round"):
        opt.end_round()
    assert not opt.state
    drive(opt, [p], "odd", range(1), 2)
    saved = _snapshot(opt, [p])
    with pytest.raises(RuntimeError, match="already called"):
        opt.end_round()
    _assert_unchanged(saved, opt, [p])
    p.grad = torch.ones(5)
    with pytest.raises(RuntimeError, match="after end_round"):
        opt.step()
    _assert_unchanged(saved, opt, [p])
    opt.start_round()  # the next round: steps and end_round work again
    opt.step()
    opt.end_round()


def test_end_round_state_survives_copies_and_state_dict():
    p = torch.nn.Parameter(torch.randn(5))
    opt = FedDyn([p], lr=0.1, alpha=0.3)
    drive(opt, [p], "odd", range(1), 2)
    clone = copy.deepcopy(opt)
    with pytest.raises(RuntimeError, match="already called"):
        clone.end_round()
    fresh = FedDyn([p], lr=0.1, alpha=0.3)
    fresh.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError, match="already called"):
        fresh.end_round()


# ---------------------------------------------------------------- bad input (nothing changes)
def _snapshot(opt, params):
    return ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()), opt.round_index, opt.round_step)


def _assert_unchanged(saved, opt, params):
    xs, sd, t, k = saved
    for a, p in zip(xs, params):
        assert torch.equal(a, p.detach())
    now = opt.state_dict()
    assert now["fedopt_round"] == sd["fedopt_round"] and (opt.round_index, opt.round_step) == (t, k)
    assert now["state"].keys() == sd["state"].keys()
    for pid, st in sd["state"].items():
        assert st.keys() == now["state"][pid].keys()
        for key, v in st.items():
            assert torch.equal(v, now["state"][pid][key]), key
    assert [{k: v for k, v in g.items() if k != "fedopt_round"} for g in now["param_groups"]] == \
           [{k: v for k, v in g.items() if k != "fedopt_round"} for g in sd["param_groups"]]


@pytest.mark.parametrize("alpha,exc", [(0.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), (True, TypeError), ("0.1", TypeError),
                                       (torch.tensor(0.1), TypeError)])
def test_bad_alpha_is_refused_naming_it(alpha, exc):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(exc, match="alpha"):
        FedDyn([p], lr=0.1, alpha=alpha)
    opt = FedDyn([p], lr=0.1, alpha=0.1)
    drive(opt, [p], "odd", range(1), 2)
    opt.start_round()
    q = torch.nn.Parameter(torch.randn(2))
    saved = _snapshot(opt, [p])
    with pytest.raises(exc, match="alpha"):  # a rejected group adds nothing
        opt.add_param_group({"params": [q], "alpha": alpha})
    assert len(opt.param_groups) == 1
    _assert_unchanged(saved, opt, [p])
    opt.param_groups[0]["alpha"] = alpha  # a hand edit is checked at the next step / end_round
    p.grad = torch.ones(3)
    with pytest.raises(exc, match="alpha"):
        opt.step()
    with pytest.raises(exc, match="alpha"):
        opt.end_round()
    opt.param_groups[0]["alpha"] = 0.1
    _assert_unchanged(saved, opt, [p])


def test_alpha_is_required():
    with pytest.raises(TypeError, match="alpha"):
        FedDyn([torch.nn.Parameter(torch.randn(3))], lr=0.1)


def test_prox_mu_and_correction_are_refused_and_change_nothing():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(TypeError, match="prox_mu"):
        FedDyn([p], lr=0.1, alpha=0.1, prox_mu=0.1)
    with pytest.raises(TypeError, match="prox_mu"):
        FedDyn([{"params": [p], "prox_mu": 0.1}], lr=0.1, alpha=0.1)
    with pytest.raises(TypeError, match="unexpected"):
        FedDyn([p], lr=0.1, alpha=0.1, mu=0.1)
    opt = FedDyn([p], lr=0.1, alpha=0.1, momentum=0.9)
    drive(opt, [p], "odd", range(1), 2)
    opt.start_round()
    p.grad = torch.ones(3)
    opt.step()
    saved = _snapshot(opt, [p])
    with pytest.raises(TypeError, match="correction"):
        opt.start_round(correction=[torch.zeros(3)])
    _assert_unchanged(saved, opt, [p])
    with pytest.raises(TypeError, match="prox_mu"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "prox_mu": 0.5})
    _assert_unchanged(saved, opt, [p])


def test_bad_backend_and_foreign_state_dict():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="backend"):
        FedDyn([p], lr=0.1, alpha=0.1, backend="tpu")
    other = FedDecaySGD([p], lr=0.1, beta=0.5, prox_mu=0.1)
    other.start_round()
    opt = FedDyn([p], lr=0.1, alpha=0.1)
    with pytest.raises(ValueError, match="FedDecaySGD"):
        opt.load_state_dict(other.state_dict())


def test_a_parameter_added_after_start_round_is_refused_until_the_next_round():
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = FedDyn([p], lr=0.1, alpha=0.1)
    opt.start_round()
    opt.add_param_group({"params": [q]})
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    saved = _snapshot(opt, [p, q])
    with pytest.raises(RuntimeError, match="start_round"):
        opt.step()
    with pytest.raises(RuntimeError, match="start_round"):
        opt.end_round()
    _assert_unchanged(saved, opt, [p, q])
    opt.start_round()
    opt.step()
    opt.end_round()


# ---------------------------------------------------------------- fused backends against reference
EQ_CASES = [(option, "odd") for option in CATALOGUE_OPTIONS] + \
           [(CATALOGUE_FULL, s) for s in SHAPE_SETS if s != "odd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("option,shapes", EQ_CASES)
def test_cpu_matches_reference(option, shapes, dtype):
    _skip_unless("cpu")
    ref = run(option, shapes, dtype, "reference")
    got = run(option, shapes, dtype, "cpu")
    assert_close_runs(ref, got, dtype, what=f"cpu/{option}/{shapes}")
    assert any(float(s["dyn_correction"].abs().max()) > 0 for s in ref.state if s["dyn_correction"].numel())


# the Triton interpreter is slow on the CPU: a subset of options, shapes and dtypes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("option,shapes", [(CATALOGUE_FULL, "odd"), (CATALOGUE_FULL, "noncontig"),
                                           ("groups", "frozen")])
def test_triton_matches_reference(option, shapes, dtype):
    _skip_unless("triton")
    ref = run(option, shapes, dtype, "reference", rounds=2, steps=2)
    got = run(option, shapes, dtype, "triton", rounds=2, steps=2)
    assert_close_runs(ref, got, dtype, what=f"triton/{option}/{shapes}")


@pytest.mark.parametrize("backend", ["reference"] + FUSED)
def test_bitwise_deterministic(backend):
    a = run(CATALOGUE_FULL, "odd", torch.float32, backend, rounds=2, steps=2)
    b = run(CATALOGUE_FULL, "odd", torch.float32, backend, rounds=2, steps=2)
    for x, y in zip(a.params + [t for s in a.state for t in s.values()],
                    b.params + [t for s in b.state for t in s.values()]):
        assert torch.equal(x, y)
