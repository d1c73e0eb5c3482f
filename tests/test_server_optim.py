"""The server optimizers (FedAvgM, FedAdam, FedYogi, FedAdagrad, FedExP) against a float64 oracle of
their papers' formulas, on every backend that implements their op: fp32/bf16/fp16/fp64 parameters,
odd sizes, many tensors, non-contiguous views, several rounds, hyperparameters varied.

The oracle is written here, independently of ``fedopt_kernels.functional``: float64 math, with the
parameters (and FedAvgM's momentum buffer, which torch keeps in the parameter's dtype) rounded to
their storage dtype after each step as the optimizers store them. The tolerance follows from that:
per step, one rounding of x (and of m) in the storage dtype, the float32 math's relative error on
the update, and for FedAvgM the momentum's carry of an m rounding into later steps.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
from backends import require

import fedopt_kernels as fk
from fedopt_kernels.core import registry as _registry

BACKENDS = _registry.BACKENDS
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
SHAPES = [(3, 5), (1,), (17,), (2, 3, 4), (0,), (33, 7), (5, 1, 3)] + [(i + 2,) for i in range(9)]
ROUNDS = 4


def _ulp(dtype: torch.dtype, mag: float) -> float:
    """One unit in the last place of ``dtype`` at magnitude ``mag`` (at least its smallest normal's)."""
    fi = torch.finfo(dtype)
    return fi.eps * max(2.0 ** math.floor(math.log2(max(mag, fi.tiny))), fi.tiny)


def _math_eps(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _params(dtype: torch.dtype, seed: int, noncontig: bool) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(SHAPES):
        base = torch.randn(s, generator=g, dtype=torch.float64)
        if noncontig and i % 2 == 0 and base.dim() >= 2 and base.numel() > 0:
            # a transposed view of a fresh tensor: non-contiguous, the only tensor on its storage
            p = base.transpose(0, -1).contiguous().to(dtype).transpose(0, -1)
        else:
            p = base.to(dtype)
        out.append(p)
    return out


def _grads(params: List[torch.Tensor], seed: int, scale: float) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale).to(p.dtype) for p in params]


# ------------------------------------------------------------------------------ the oracle
def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(torch.float64)


def oracle(name: str, kw: Dict[str, Any], params, grads_per_round, msns) -> Tuple[List[torch.Tensor], List[float]]:
    """Float64 run of the paper's formulas; returns the final parameters and each tensor's tolerance."""
    xs = [p.to(torch.float64) for p in params]
    dtype = params[0].dtype
    e32 = _math_eps(dtype)
    tol = [0.0] * len(xs)
    if name == "FedAvgM":
        lr, mom, nest = kw.get("lr", 1.0), kw.get("momentum", 0.9), kw.get("nesterov", False)
        ms = [torch.zeros_like(x) for x in xs]
        for grads in grads_per_round:
            for i, (x, g) in enumerate(zip(xs, grads)):
                g = g.to(torch.float64)
                m_exact = mom * ms[i] + g
                ms[i] = _round(m_exact, dtype)  # torch keeps the buffer in the parameter's dtype
                upd = lr * (g + mom * ms[i]) if nest else lr * ms[i]
                x_new = _round(x - upd, dtype)
                mmax = float(ms[i].abs().max()) if ms[i].numel() else 0.0
                xmax = float(x_new.abs().max()) if x_new.numel() else 0.0
                carry = (1 + mom) / (1 - mom) if mom < 1 else len(grads_per_round)
                umax = float(upd.abs().max()) if upd.numel() else 0.0
                tol[i] += _ulp(dtype, xmax) + lr * carry * _ulp(dtype, mmax) + 8 * e32 * (xmax + umax)
                xs[i] = x_new
        return xs, tol
    if name == "FedExP":
        lr, eps = kw.get("lr", 1.0), kw.get("eps", 1e-3)
        for grads, msn in zip(grads_per_round, msns):
            gs = [g.to(torch.float64) for g in grads]
            sq = sum(float((g * g).sum()) for g in gs)
            eta = max(1.0, msn / (2 * (sq + eps)))
            for i, (x, g) in enumerate(zip(xs, gs)):
                upd = lr * eta * g
                x_new = _round(x - upd, dtype)
                xmax = float(x_new.abs().max()) if x_new.numel() else 0.0
                tol[i] += _ulp(dtype, xmax) + 8 * e32 * (xmax + (float(upd.abs().max()) if upd.numel() else 0.0))
                xs[i] = x_new
        return xs, tol
    # Reddi et al., Algorithm 2
    lr, tau, bc = kw.get("lr", 1e-2), kw.get("tau", 1e-3), kw.get("bias_correction", False)
    if name == "FedAdagrad":
        b1, b2 = kw.get("beta1", 0.9), 0.0
    else:
        b1, b2 = kw.get("betas", (0.9, 0.99))
    v0 = kw.get("initial_accumulator_value")
    v0 = tau**2 if v0 is None else v0
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.full_like(x, v0) for x in xs]
    for t, grads in enumerate(grads_per_round, start=1):
        for i, (x, g) in enumerate(zip(xs, grads)):
            g = g.to(torch.float64)
            ms[i] = b1 * ms[i] + (1 - b1) * g
            if name == "FedAdam":
                vs[i] = b2 * vs[i] + (1 - b2) * g * g
            elif name == "FedYogi":
                vs[i] = vs[i] - (1 - b2) * g * g * torch.sign(vs[i] - g * g)
            else:
                vs[i] = vs[i] + g * g
            mh = ms[i] / (1 - b1**t) if bc else ms[i]
            vh = vs[i] / (1 - b2**t) if bc and name != "FedAdagrad" else vs[i]
            upd = lr * mh / (vh.sqrt() + tau)
            x_new = _round(x - upd, dtype)
            xmax = float(x_new.abs().max()) if x_new.numel() else 0.0
            # float32 math: m, v, sqrt, the division and the products, each a few ulps of the update
            tol[i] += _ulp(dtype, xmax) + 8 * e32 * xmax + 64 * e32 * (float(upd.abs().max()) if upd.numel() else 0.0)
            xs[i] = x_new
    return xs, tol


CONFIGS = [
    ("FedAvgM", dict(lr=0.7, momentum=0.9)),
    ("FedAvgM", dict(lr=1.0, momentum=0.5, nesterov=True)),
    ("FedAvgM", dict(lr=0.3, momentum=0.0)),
    ("FedAdam", dict()),
    ("FedAdam", dict(lr=0.05, betas=(0.5, 0.9), tau=1e-2, bias_correction=True)),
    ("FedAdam", dict(lr=0.1, betas=(0.0, 0.999), tau=1e-1, initial_accumulator_value=0.5)),
    ("FedYogi", dict()),
    ("FedYogi", dict(lr=0.03, betas=(0.8, 0.95), tau=1e-2, bias_correction=True, initial_accumulator_value=1e-6)),
    ("FedAdagrad", dict()),
    ("FedAdagrad", dict(lr=0.2, beta1=0.0, tau=0.5, bias_correction=True, initial_accumulator_value=2.0)),
    ("FedExP", dict()),
    ("FedExP", dict(eps=0.5, lr=0.8)),
]


def _msns(seed: int) -> List[float]:
    # rounds whose eta_g is 1 (a small mean) and rounds that extrapolate (a large one)
    return [0.1, 400.0, 3000.0, 1.0][:ROUNDS] if seed % 2 == 0 else [800.0, 2.0, 5000.0, 50.0][:ROUNDS]


def run(name: str, kw: Dict[str, Any], backend: str, dtype, seed: int, noncontig: bool, msn_tensor: bool = False):
    params = _params(dtype, seed, noncontig)
    start = [p.clone() for p in params]
    grads = [_grads(params, seed * 10 + r, 1.0) for r in range(ROUNDS)]
    msns = _msns(seed)
    opt = getattr(fk, name)(params, backend=backend, **kw)
    for r in range(ROUNDS):
        for p, g in zip(params, grads[r]):
            p.grad = g.clone()
        if name == "FedExP":
            opt.step(mean_sq_norm=torch.tensor(msns[r]) if msn_tensor else msns[r])
        else:
            opt.step()
    return opt, params, start, grads, msns


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_agrees_with_the_float64_oracle(backend, dtype, name, kw):
    cls = getattr(fk, name)
    require(backend, "cpu", dtype)
    why = _registry.unavailable_reason(backend, torch.device("cpu"), cls.op_spec().name)
    if why is not None:
        pytest.skip(why)
    seed = len(name) + len(kw)
    opt, params, start, grads, msns = run(name, kw, backend, dtype, seed, noncontig=True, msn_tensor=seed % 2 == 1)
    want, tol = oracle(name, kw, start, grads, msns)
    for i, (p, w, t) in enumerate(zip(params, want, tol)):
        err = float((p.to(torch.float64) - w).abs().max()) if p.numel() else 0.0
        assert err <= t, f"{name} {backend} {dtype} tensor {i}: |x - oracle| = {err:.3g} > {t:.3g}"
    moved = sum(float((p.double() - s.double()).abs().sum()) for p, s in zip(params, start))
    assert moved > 0


def test_the_oracle_check_can_fail():
    """A step with beta2 changed (Adam's v by another rule) lies outside the tolerance."""
    kw = dict(lr=0.05, betas=(0.5, 0.9), tau=1e-2)
    _, params, start, grads, msns = run("FedAdam", kw, "reference", torch.float32, 3, noncontig=False)
    want, tol = oracle("FedAdam", dict(kw, betas=(0.5, 0.91)), start, grads, msns)
    assert any(float((p.double() - w).abs().max()) > t for p, w, t in zip(params, want, tol) if p.numel())
    want, tol = oracle("FedYogi", kw, start, grads, msns)
    assert any(float((p.double() - w).abs().max()) > t for p, w, t in zip(params, want, tol) if p.numel())


def test_fedavgm_is_torch_sgd_with_momentum():
    for nesterov in (False, True):
        ps = _params(torch.float32, 5, False)
        qs = [p.clone() for p in ps]
        a = fk.FedAvgM(ps, lr=0.5, momentum=0.8, nesterov=nesterov, backend="reference")
        b = torch.optim.SGD(qs, lr=0.5, momentum=0.8, nesterov=nesterov)
        for r in range(3):
            for p, q, g in zip(ps, qs, _grads(ps, r, 1.0)):
                p.grad, q.grad = g.clone(), g.clone()
            a.step()
            b.step()
        for p, q in zip(ps, qs):
            big = float(q.abs().amax()) if q.numel() else 0.0
            torch.testing.assert_close(p, q, rtol=0, atol=8 * torch.finfo(torch.float32).eps * (1 + big))


def test_fedadam_with_bias_correction_and_tau_as_eps_is_torch_adam():
    """With bias correction, v0 = 0 and tau in eps's place, FedAdam's step is torch.optim.Adam's."""
    ps = _params(torch.float32, 6, False)
    qs = [p.clone() for p in ps]
    a = fk.FedAdam(ps, lr=0.01, betas=(0.9, 0.99), tau=1e-3, initial_accumulator_value=0.0, bias_correction=True)
    b = torch.optim.Adam(qs, lr=0.01, betas=(0.9, 0.99), eps=1e-3)
    for r in range(4):
        for p, q, g in zip(ps, qs, _grads(ps, r, 1.0)):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ bad input
def _small():
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]


@pytest.mark.parametrize(
    "name,kw,word",
    [
        ("FedAvgM", dict(lr=-1.0), "lr"),
        ("FedAvgM", dict(momentum=-0.1), "momentum"),
        ("FedAvgM", dict(momentum=0.0, nesterov=True), "nesterov"),
        ("FedAdam", dict(lr=-0.1), "lr"),
        ("FedAdam", dict(betas=(1.0, 0.99)), "beta1"),
        ("FedAdam", dict(betas=(0.9, -0.5)), "beta2"),
        ("FedYogi", dict(betas=(0.9, 1.5)), "beta2"),
        ("FedYogi", dict(tau=0.0), "tau"),
        ("FedAdam", dict(tau=-1e-3), "tau"),
        ("FedAdagrad", dict(beta1=1.0), "beta1"),
        ("FedAdagrad", dict(initial_accumulator_value=-1.0), "initial_accumulator_value"),
        ("FedAdam", dict(bias_correction=1), "bias_correction"),
        ("FedExP", dict(eps=0.0), "eps"),
        ("FedExP", dict(eps=-1.0), "eps"),
        ("FedExP", dict(lr=-1.0), "lr"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(name, kw, word):
    with pytest.raises((ValueError, TypeError), match=word):
        getattr(fk, name)(_small(), **kw)
    opt = getattr(fk, name)(_small())
    group = {"params": [torch.nn.Parameter(torch.randn(2))], **kw}
    with pytest.raises((ValueError, TypeError), match=word):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    "value,word",
    [
        (None, "mean_sq_norm"),
        (-1.0, "mean_sq_norm"),
        (float("nan"), "mean_sq_norm"),
        (torch.tensor([1.0, 2.0]), "mean_sq_norm"),
        ("3", "mean_sq_norm"),
        (torch.tensor(-2.0), "mean_sq_norm"),
    ],
)
def test_fedexp_needs_a_valid_mean_sq_norm_and_changes_nothing_without(value, word):
    ps = _small()
    before = [p.detach().clone() for p in ps]
    opt = fk.FedExP(ps)
    for p in ps:
        p.grad = torch.ones_like(p)
    with pytest.raises((ValueError, TypeError), match=word):
        if value is None:
            opt.step()
        else:
            opt.step(mean_sq_norm=value)
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert not opt.state and opt.state_dict()["fedopt_round"]["k"] == 0


def test_start_round_is_refused():
    for cls in (fk.FedAvgM, fk.FedAdam, fk.FedYogi, fk.FedAdagrad, fk.FedExP):
        with pytest.raises(TypeError, match="server optimizer"):
            cls(_small()).start_round()


# ------------------------------------------------------------------------------ properties
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_BETA = st.floats(0.0, 0.999)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["FedAdam", "FedYogi", "FedAdagrad", "FedExP", "FedAvgM"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=6),
    lr=st.floats(1e-4, 1.0),
    b1=_BETA,
    b2=_BETA,
    tau=st.floats(1e-6, 1.0),
    v0=st.one_of(st.none(), st.floats(0.0, 2.0)),
    bc=st.booleans(),
    msn=st.floats(0.0, 1e4),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_cpu_backend_is_bitwise_the_reference(name, dtype, sizes, lr, b1, b2, tau, v0, bc, msn, steps, seed):
    """The cpu kernels run the reference's float32 operations in its order (its square root correctly
    rounded, as IEEE's): the same bits for any hyperparameters and sizes."""
    require("cpu", "cpu")
    if _registry.unavailable_reason("cpu", torch.device("cpu"), getattr(fk, name).op_spec().name) is not None:
        pytest.skip("the cpu backend lacks the op")
    kw: Dict[str, Any] = {
        "FedAdam": dict(lr=lr, betas=(b1, b2), tau=tau, initial_accumulator_value=v0, bias_correction=bc),
        "FedYogi": dict(lr=lr, betas=(b1, b2), tau=tau, initial_accumulator_value=v0, bias_correction=bc),
        "FedAdagrad": dict(lr=lr, beta1=b1, tau=tau, initial_accumulator_value=v0, bias_correction=bc),
        "FedExP": dict(lr=lr, eps=tau),
        "FedAvgM": dict(lr=lr, momentum=b1, nesterov=bc and b1 > 0),
    }[name]
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    runs = {}
    for backend in ("reference", "cpu"):
        ps = [b.clone() for b in base]
        opt = getattr(fk, name)(ps, backend=backend, **kw)
        gg = torch.Generator().manual_seed(seed + 1)
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gg).to(dtype)
            opt.step(mean_sq_norm=msn) if name == "FedExP" else opt.step()
        runs[backend] = (ps, _state_of(opt))
    for a, b in zip(runs["reference"][0] + runs["reference"][1], runs["cpu"][0] + runs["cpu"][1], strict=True):
        assert torch.equal(a, b)


def _state_of(opt) -> List[torch.Tensor]:
    return [t for st_ in opt.state.values() for t in st_.values() if isinstance(t, torch.Tensor)]
