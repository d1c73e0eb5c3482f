"""Every fused backend against ``reference``: algorithm x option x shape set x dtype x device.

Parameters *and* optimizer state are compared after several rounds of several steps. A backend
appears here as soon as it registers with ``fedopt_kernels.core.registry``; unavailable ones are
skipped with the reason ``available_backends()`` gives.
"""

from typing import Any, Dict

import pytest
import torch
from harness import (
    ALGOS,
    DTYPES,
    FUSED_BACKENDS,
    assert_close_runs,
    backend_skip_reason,
    cases,
    make_grads,
    make_params,
    run_case,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPE_IDS = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}
# the fast tier compares float32 (computed in place) and bfloat16 (converted on load and store);
# float16 (the same conversion path) and float64 (its own compute type, which the simulator's
# --validate runs of the fast tier use end to end) run in the full suite
FAST_DTYPES = (torch.float32, torch.bfloat16)


def _matches_reference_params():
    """backend x case x dtype x device. The chunk-boundary shapes (tensors of up to 65,537 elements,
    several rounds) cost most of this file's fast-tier time, nearly all of it in the reference run:
    they run in the full suite, and the fast tier keeps them in test_bitwise_deterministic. Triton's
    chunks are blocks of elements whatever the dtype, and under the interpreter (CPU tensors) its
    block follows the tensor sizes rather than the GPU's, so there the chunk shapes run in float32
    only; the other shape sets take every dtype through the same kernels' loads and stores."""
    out = []
    for backend in FUSED_BACKENDS:
        for algo, option, shapes in cases():
            for dtype in DTYPES:
                for device in DEVICES:
                    interpreted = backend == "triton" and device == "cpu"
                    if interpreted and shapes == "chunk" and dtype != torch.float32:
                        continue
                    slow = shapes == "chunk" or dtype not in FAST_DTYPES
                    out.append(
                        pytest.param(
                            backend,
                            algo,
                            option,
                            shapes,
                            dtype,
                            device,
                            id=f"{backend}-{algo}-{option}-{shapes}-{DTYPE_IDS[dtype]}-{device}",
                            marks=pytest.mark.slow if slow else (),
                        )
                    )
    return out


def _require(backend, device):
    why = backend_skip_reason(backend, device)
    if why is not None:
        pytest.skip(why)


def _run_or_skip_fp64(fn, backend, dtype):
    """float64 is optional for fused backends: they either match or refuse it with a TypeError naming it."""
    try:
        return fn()
    except TypeError as exc:
        if dtype == torch.float64 and "float64" in str(exc):
            pytest.skip(f"{backend} does not support float64: {exc}")
        raise


_REFERENCE_CACHE: Dict[Any, Any] = {}


def _reference(algo, option, shapes, dtype):
    key = (algo, option, shapes, dtype)
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = run_case(algo, option, shapes, dtype, "reference")
    return _REFERENCE_CACHE[key]


@pytest.mark.parametrize("backend,algo,option,shapes,dtype,device", _matches_reference_params())
def test_matches_reference(backend, algo, option, shapes, dtype, device):
    _require(backend, device)
    ref = _reference(algo, option, shapes, dtype)
    got = _run_or_skip_fp64(lambda: run_case(algo, option, shapes, dtype, backend, device=device), backend, dtype)
    assert_close_runs(ref, got, dtype, what=f"{backend}/{algo}/{option}/{shapes}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_bitwise_deterministic(backend, algo, device):
    """The same run twice gives identical bits (no atomics, fixed reduction order)."""
    _require(backend, device)
    option = ALGOS[algo].full
    a = run_case(algo, option, "chunk", torch.float32, backend, device=device)
    b = run_case(algo, option, "chunk", torch.float32, backend, device=device)
    for x, y in zip(
        a.params + [t for s in a.state for t in s.values()], b.params + [t for s in b.state for t in s.values()]
    ):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_state_dict_loads_across_backends(backend, algo, dtype):
    """A state saved mid-round by ``reference`` continues on ``backend`` (and back) to the same result."""
    _require(backend, "cpu")
    option = ALGOS[algo].full
    full = _reference(algo, option, "odd", dtype)
    for first, second in (("reference", backend), (backend, "reference")):
        half = run_case(algo, option, "odd", dtype, first, snapshot=(1, 0))
        rest = run_case(
            algo,
            option,
            "odd",
            dtype,
            second,
            load_from={"params": half.params, "state_dict": half.state_dict},
            start_at=(1, 1),
        )
        assert_close_runs(full, rest, dtype, what=f"{first}->{second}")


def _nonfinite_grads(params, kind):
    grads = make_grads(params, "odd", 0, 0)
    big = max(range(len(params)), key=lambda i: params[i].numel())
    grads[big] = grads[big].clone()
    grads[big].view(-1)[0] = float("nan") if kind == "nan" else float("inf")
    return grads


# the Triton interpreter computes in numpy, which warns on inf * 0 and inf - inf; a GPU makes the same NaN silently
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_nonfinite_gradients_propagate_like_reference(backend, algo, kind):
    _require(backend, "cpu")
    cfg = ALGOS[algo].options[ALGOS[algo].full]
    results = []
    for b in ("reference", backend):
        params = make_params("odd", torch.float32, 0)
        opt = cfg.build(params, b)
        ordered = [p for g in opt.param_groups for p in g["params"]]
        opt.start_round(**cfg.round_inputs(ordered, 0, 0))
        for p, g in zip(params, _nonfinite_grads(params, kind)):
            p.grad = g
        opt.step(**cfg.step_inputs(ordered, 0, 0))
        results.append([p.detach().clone() for p in params])
    for x, y in zip(*results):
        assert torch.equal(torch.isnan(x), torch.isnan(y)), "NaN pattern differs from reference"
        assert torch.equal(torch.isinf(x), torch.isinf(y)), "inf pattern differs from reference"
        torch.testing.assert_close(y, x, rtol=2e-5, atol=2e-6, equal_nan=True)
