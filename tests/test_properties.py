"""Property tests over random problems: shapes x dtypes x option sets x element magnitudes.

For every generated problem, each fused backend matches ``reference`` (parameters and state, NaN
for NaN), and the papers' invariants hold on every backend: a FedNAR step moves the parameters by
at most ``l_t * max_norm``, a PAdaMFed step by exactly ``eta``. Magnitudes span the range the
global norm must handle (elements in [1e-30, 1e30]; float16 in its own range).
"""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from backends import supports, usable  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedopt_kernels.fl import catalogue  # noqa: E402

BACKENDS = [b for b in usable("cpu") if b != "reference"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# decimal exponent range of gradient magnitudes per dtype
EXPONENTS = {torch.float32: (-30, 30), torch.float64: (-30, 30), torch.bfloat16: (-30, 30), torch.float16: (-3, 3)}
# relative tolerance of a parameter after a few steps, per dtype
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 5e-2, torch.float16: 1e-2}
OPTIONS = [(a, o) for a, algo in catalogue.ALGOS.items() for o in algo.options]

shapes_st = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5)
COMMON = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _problem(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(magnitude):
    def make(params, step):
        g = torch.Generator().manual_seed(1000 + step)
        return [(torch.randn(p.shape, generator=g, dtype=torch.float64) * magnitude).to(p.dtype) for p in params]

    return make


def _state(opt, params):
    return [
        {k: v.detach().double().clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params
    ]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, scale: float) -> None:
    a, b = a.double(), b.double()
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN pattern differs"
    torch.testing.assert_close(b, a, rtol=rtol, atol=rtol * scale, equal_nan=True)


@pytest.mark.skipif(not BACKENDS, reason="no fused backend on this machine")
@COMMON
@given(
    option=st.sampled_from(OPTIONS),
    shapes=shapes_st,
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_fused_backends_match_reference(option, shapes, dtype, data, seed):
    lo, hi = EXPONENTS[dtype]
    magnitude = 10.0 ** data.draw(st.integers(lo, hi), label="exponent")
    cfg = catalogue.config(*option)
    ref_params = _problem(shapes, dtype, seed)
    ref = catalogue.run(cfg, ref_params, "reference", rounds=2, steps=2, seed=seed, grads=_grads(magnitude))
    scale = max([1.0] + [float(p.detach().double().abs().max()) for p in ref_params if p.numel()])
    for backend in BACKENDS:
        if not supports(backend, dtype):
            continue
        params = _problem(shapes, dtype, seed)
        opt = catalogue.run(cfg, params, backend, rounds=2, steps=2, seed=seed, grads=_grads(magnitude))
        for a, b in zip(ref_params, params):
            _close(a.detach(), b.detach(), RTOL[dtype], scale)
        for sa, sb in zip(_state(ref, ref_params), _state(opt, params)):
            assert sorted(sa) == sorted(sb)
            for key in sa:
                s = max(1.0, float(sa[key][torch.isfinite(sa[key])].abs().max()) if sa[key].numel() else 1.0)
                _close(sa[key], sb[key], RTOL[dtype], s)


def _moved(before, params) -> float:
    return math.sqrt(sum(float(((x - p.detach().double()) ** 2).sum()) for x, p in zip(before, params)))


@COMMON
@given(
    shapes=shapes_st.filter(lambda s: any(math.prod(x) > 0 for x in s)),
    exponent=st.integers(-30, 30),
    max_norm=st.floats(1e-3, 1e3),
    wd=st.sampled_from([0.0, 1e-3, 0.5]),
    seed=st.integers(0, 2**16),
    backend=st.sampled_from(["reference"] + BACKENDS),
)
def test_fednar_update_norm_never_exceeds_lr_times_max_norm(shapes, exponent, max_norm, wd, seed, backend):
    params = _problem(shapes, torch.float32, seed)
    lr = 0.1
    opt = catalogue.Config(
        "fednar",
        "prop",
        catalogue.ALGOS["fednar"].cls,
        dict(lr=lr, weight_decay=wd, max_norm=max_norm, round_decay=0.9),
    ).build(params, backend)
    opt.start_round()
    opt.start_round()  # round t = 1: l_t = lr * 0.9
    for step in range(2):
        for p, g in zip(params, _grads(10.0**exponent)(params, step)):
            p.grad = g
        before = [p.detach().double().clone() for p in params]
        opt.step()
        assert _moved(before, params) <= lr * 0.9 * max_norm * (1 + 1e-5) + 1e-6


@COMMON
@given(
    shapes=shapes_st.filter(lambda s: sum(math.prod(x) for x in s) > 0),
    exponent=st.integers(-25, 30),
    eta=st.floats(1e-4, 1.0),
    beta=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    backend=st.sampled_from(["reference"] + BACKENDS),
)
def test_padamfed_step_is_exactly_eta(shapes, exponent, eta, beta, seed, backend):
    params = _problem(shapes, torch.float32, seed)
    opt = catalogue.Config(
        "padamfed", "prop", catalogue.ALGOS["padamfed"].cls, dict(lr=eta, beta=max(beta, 1e-3), eps=1e-300)
    ).build(params, backend)
    opt.start_round()
    for step in range(2):
        for p, g in zip(params, _grads(10.0**exponent)(params, step)):
            p.grad = g
        before = [p.detach().double().clone() for p in params]
        opt.step()
        # float32 parameters: each element rounds once, so the step is eta to float32 precision
        scale = max(float(b.abs().max()) for b in before if b.numel())
        assert abs(_moved(before, params) - eta) <= 2e-6 * eta + 1e-7 * scale * math.sqrt(
            sum(b.numel() for b in before)
        )
