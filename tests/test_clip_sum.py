"""The clipped sum of a chunk of clients' replies (``fedopt_kernels.core.clip_sum``) on every backend:
against a float64 oracle (norms by ``math.fsum``), against the reference (the sums bit for bit given
the backend's own factors), determinism of the C++ kernel run to run and across thread counts, bad
input, the GPU kernels' fallback, and random inputs (hypothesis). Triton runs under
``TRITON_INTERPRET=1`` (tests/conftest.py); CUDA only where a GPU is visible."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from fedopt_kernels.core import clip_sum as cs
from fedopt_kernels.core.clip_sum import clip_sum

U = 2.0**-53  # float64's unit roundoff
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SHAPES = ((7,), (3, 5), (1,), (13, 3, 2), (129,), (0,), (2, 0, 3), (1031,))


def _device(backend: str) -> torch.device:
    return torch.device("cuda" if backend == "cuda" else "cpu")


def runnable(backend: str) -> str:
    why = cs.backends_with_kernel(_device(backend))[backend]
    if why is not None:
        pytest.skip(why)
    return backend


BACKENDS = [pytest.param(b, id=b) for b in ("reference", "cpu", "triton", "cuda")]


def chunk(dtype, clients, g, noncontiguous=False, shapes=SHAPES, scale=1.0):
    """``[C, *shape]`` tensors; non-contiguous: client as the last axis moved first (strided rows), or
    every other row of a larger tensor (contiguous rows, a row stride of two rows)."""
    out = []
    for i, shape in enumerate(shapes):
        base = torch.randn(*shape, 2 * clients, generator=g, dtype=torch.float64) * scale
        t = base.to(dtype).movedim(-1, 0)
        if noncontiguous:
            out.append(t[::2] if i % 2 else t[1::2])
        else:
            out.append(t[::2].contiguous())
    return out


def oracle(tensors, max_norm, active):
    """norms by math.fsum over exact float64 squares, factors, bits (Python floats and bools)."""
    C = tensors[0].shape[0]
    norms = []
    for c in range(C):
        sq = [float(x) ** 2 for t in tensors for x in t[c].double().flatten().tolist()]
        norms.append(math.sqrt(math.fsum(sq)))
    on = [True] * C if active is None else active.tolist()
    factors = [(min(1.0, max_norm / n) if n > 0 else 1.0) if on[c] else 0.0 for c, n in enumerate(norms)]
    below = [on[c] and n <= max_norm for c, n in enumerate(norms)]
    return norms, factors, below, on


def in_order(tensors, factors, on, out=None):
    """The reference's sums for given factors: ``s = fl(s + fl(f_c x_c))``, clients in order."""
    sums = [torch.zeros(t.shape[1:], dtype=torch.float64) for t in tensors] if out is None else out
    for s, t in zip(sums, tensors):
        for c in range(t.shape[0]):
            if on[c]:
                s.add_(t[c].cpu().double() * factors[c].cpu())
    return sums


def check_against_oracle(result, tensors, max_norm, active):
    norms, factors, below, on = oracle(tensors, max_norm, active)
    n = max(sum(t[0].numel() for t in tensors), 1)
    # n float64 additions of non-negative squares: relative (n - 1) u; sqrt halves it, with its own u
    norm_rel = (n + 1) * U
    for c, want in enumerate(norms):
        got = float(result.norms[c])
        if math.isfinite(want):
            assert abs(got - want) <= norm_rel * want, (c, got, want)
        f = float(result.factors[c])
        # C / norm: the norm's error plus the division's u; min(1, .) only removes error
        assert abs(f - factors[c]) <= (norm_rel + 2 * U) * factors[c], (c, f, factors[c])
        if abs(want - max_norm) > norm_rel * max_norm:  # a norm within rounding of the bound may go either way
            assert bool(result.below[c]) == below[c], (c, want, max_norm)
    # the sums: each term off by its factor's error and one rounding, then C roundings of the sums
    C = tensors[0].shape[0]
    for j, (s, t) in enumerate(zip(result.sums, tensors)):
        exact = sum(factors[c] * t[c].double() for c in range(C) if on[c]) if any(on) else torch.zeros(t.shape[1:])
        size = sum(factors[c] * t[c].double().abs() for c in range(C) if on[c]) if any(on) else torch.zeros(t.shape[1:])
        bound = (norm_rel + (C + 3) * U) * size
        assert s.dtype == torch.float64 and s.shape == t.shape[1:]
        assert bool(((s.cpu() - exact).abs() <= bound).all()), (j, (s.cpu() - exact).abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_every_backend_equals_the_float64_oracle(backend, dtype, noncontiguous):
    runnable(backend)
    g = torch.Generator().manual_seed(hash((str(dtype), noncontiguous)) % 2**31)
    tensors = [t.to(_device(backend)) for t in chunk(dtype, 5, g, noncontiguous)]
    mid = sorted(oracle(tensors, 1.0, None)[0])[2]  # the median norm: some clipped, some not
    for active in (None, torch.tensor([True, False, True, True, False])):
        if active is not None:
            for t in tensors:  # an inactive client's rows hold NaN and inf: they must not reach the sums
                if t[1].numel():
                    t[1].view(-1)[0] = float("nan")
                    t[4].view(-1)[-1] = float("inf")
            active = active.to(_device(backend))
        result = clip_sum(tensors, mid, active, backend=backend)
        check_against_oracle(result, tensors, mid, active)
        assert all(bool(torch.isfinite(s).all()) for s in result.sums)


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_its_factors_every_backend_sums_as_the_reference_bit_for_bit(backend):
    """No fused multiply-add, clients in order: the sums are the reference's arithmetic exactly."""
    runnable(backend)
    g = torch.Generator().manual_seed(11)
    dev = _device(backend)
    for dtype in DTYPES:
        tensors = [t.to(dev) for t in chunk(dtype, 6, g, noncontiguous=True)]
        active = torch.tensor([True, True, False, True, True, True], device=dev)
        start = [torch.randn(t.shape[1:], generator=g, dtype=torch.float64).to(dev) for t in tensors]
        out = [s.clone() for s in start]
        result = clip_sum(tensors, 0.7, active, out=out, backend=backend)
        assert all(s is o for s, o in zip(result.sums, out))  # added into the given sums
        want = in_order(tensors, result.factors, active.tolist(), [s.cpu().clone() for s in start])
        for got, w in zip(result.sums, want):
            assert torch.equal(got.cpu(), w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_tensors_and_a_large_client_row(backend):
    runnable(backend)
    g = torch.Generator().manual_seed(5)
    shapes = tuple((n,) for n in range(1, 41)) + ((3, 7001),)  # 41 tensors, one row over a chunk
    tensors = [t.to(_device(backend)) for t in chunk(torch.float32, 3, g, shapes=shapes)]
    check_against_oracle(clip_sum(tensors, 10.0, None, backend=backend), tensors, 10.0, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_norms_at_the_range_ends_do_not_overflow(backend):
    runnable(backend)
    dev = _device(backend)
    for scale in (1e-30, 1e30):
        tensors = [torch.full((2, 100), scale, dtype=torch.float32, device=dev)]
        result = clip_sum(tensors, 1.0, None, backend=backend)
        want = 10 * float(torch.tensor(scale, dtype=torch.float32))
        assert torch.allclose(result.norms.cpu(), torch.full((2,), want, dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy: C / 0 = inf
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_clients_and_a_zero_reply(backend):
    runnable(backend)
    dev = _device(backend)
    empty = clip_sum([torch.zeros(0, 4, device=dev)], 1.0, backend=backend)
    assert empty.norms.shape == (0,) and torch.equal(empty.sums[0].cpu(), torch.zeros(4, dtype=torch.float64))
    zero = clip_sum([torch.zeros(3, 4, device=dev), torch.ones(3, 2, device=dev)[:, :0]], 1.0, backend=backend)
    assert zero.factors.tolist() == [1.0] * 3 and zero.below.tolist() == [True] * 3  # norm 0: nothing to clip


def test_cpu_bits_do_not_depend_on_the_run_or_the_thread_count():
    runnable("cpu")
    g = torch.Generator().manual_seed(2)
    # past the kernel's serial threshold (2**16 elements), so two threads split both passes
    tensors = chunk(torch.float32, 9, g, shapes=((20011,), (37, 129), (5,)))
    active = torch.tensor([True] * 8 + [False])
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 2, 1):
            torch.set_num_threads(threads)
            runs.append(clip_sum(tensors, 3.0, active, backend="cpu"))
    finally:
        torch.set_num_threads(before)
    for r in runs[1:]:
        assert torch.equal(r.norms, runs[0].norms) and torch.equal(r.factors, runs[0].factors)
        assert all(torch.equal(a, b) for a, b in zip(r.sums, runs[0].sums))


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(tensors=[]), "tensors"),
        (dict(tensors=[torch.ones(2, 3), torch.ones(3, 3)]), "tensors"),
        (dict(tensors=[torch.ones(2, 3, dtype=torch.int64)]), "tensors"),
        (dict(tensors=[torch.ones(())]), "tensors"),
        (dict(max_norm=0.0), "max_norm"),
        (dict(max_norm=-1.0), "max_norm"),
        (dict(max_norm=float("nan")), "max_norm"),
        (dict(active=torch.ones(2)), "active"),
        (dict(active=torch.ones(3, dtype=torch.bool)), "active"),
        (dict(out=[torch.zeros(3, dtype=torch.float32)]), "out"),
        (dict(out=[torch.zeros(4, dtype=torch.float64)]), "out"),
        (dict(out=[]), "out"),
        (dict(backend="fastest"), "backend"),
    ],
)
def test_bad_input_is_named_and_changes_nothing(change, named):
    out = [torch.full((3,), 5.0, dtype=torch.float64)]
    args = dict(tensors=[torch.ones(2, 3)], max_norm=1.0, active=None, out=out, backend="auto")
    args.update(change)
    kept = [o.clone() for o in args["out"]] if args["out"] else []
    with pytest.raises(ValueError, match=named):
        clip_sum(**args)
    assert all(torch.equal(a, b) for a, b in zip(args["out"] or [], kept))


def test_a_backend_that_cannot_run_here_is_named():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match="backend='cuda'"):
        clip_sum([torch.ones(2, 3)], 1.0, backend="cuda")


def test_a_failing_gpu_kernel_falls_back_to_the_reference(monkeypatch):
    """A GPU kernel that fails part way (here: after writing into the sums) is dropped with a warning,
    and the reference's result comes back from the sums as they were."""
    runnable("triton")

    def broken(tensors, max_norm, active, out):
        for s in out:
            s.add_(1e9)
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(cs, "_compiled", lambda name: broken)
    monkeypatch.setattr(cs, "_DROPPED", set())
    g = torch.Generator().manual_seed(8)
    tensors = chunk(torch.float32, 4, g, shapes=((9,), (2, 3)))
    start = [torch.ones(t.shape[1:], dtype=torch.float64) for t in tensors]
    out = [s.clone() for s in start]
    with pytest.warns(RuntimeWarning, match="triton clip_sum kernel failed"):
        got = clip_sum(tensors, 0.5, None, out=out, backend="triton")
    want = clip_sum(tensors, 0.5, None, out=[s.clone() for s in start], backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(got.sums, want.sums))
    assert "triton" in cs._DROPPED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cs.choose(torch.device("cpu")) in ("cpu", "reference")  # the rest of the process: not triton


hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(
    clients=st.integers(1, 6),
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    dtype=st.sampled_from(DTYPES),
    log_scale=st.integers(-20, 20),
    bound=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_random_chunks_on_cpu_equal_the_oracle_and_stay_within_the_bound(clients, sizes, dtype, log_scale, bound, seed):
    backend = "cpu" if cs.backends_with_kernel(torch.device("cpu"))["cpu"] is None else "reference"
    g = torch.Generator().manual_seed(seed)
    scale = 2.0**log_scale if dtype in (torch.float32, torch.float64) else 1.0  # float16 overflows at 65504
    tensors = chunk(dtype, clients, g, noncontiguous=bool(seed % 2), shapes=tuple((n,) for n in sizes), scale=scale)
    result = clip_sum(tensors, bound, None, backend=backend)
    check_against_oracle(result, tensors, bound, None)
    # each client's clipped reply is within the bound, to the factor's rounding
    n = sum(sizes) + 1
    for c in range(clients):
        f = float(result.factors[c])
        assert 0.0 <= f <= 1.0
        assert f * float(result.norms[c]) <= bound * (1 + (n + 4) * U)


def test_the_torch_library_op_is_the_same_op():
    g = torch.Generator().manual_seed(4)
    tensors = chunk(torch.float32, 3, g, shapes=((5,), (2, 3)))
    active = torch.tensor([True, False, True])
    out = [torch.zeros(t.shape[1:], dtype=torch.float64) for t in tensors]
    norms, factors, below = torch.ops.fedopt.clip_sum(tensors, 0.5, active, out, "auto")
    want = clip_sum(tensors, 0.5, active)
    assert torch.equal(norms, want.norms) and torch.equal(factors, want.factors) and torch.equal(below, want.below)
    assert all(torch.equal(a, b) for a, b in zip(out, want.sums))
    with pytest.raises(ValueError, match="max_norm"):
        torch.ops.fedopt.clip_sum(tensors, -1.0, None, out, "auto")
    # its schema, fake (meta) shapes and torch.compile's dispatch, as PyTorch checks a custom op
    checks = torch.library.opcheck(torch.ops.fedopt.clip_sum.default, (tensors, 0.5, active, out, "auto"))
    assert set(checks.values()) == {"SUCCESS"}, checks


def test_the_cuda_extension_binds_the_op_where_it_is_built():
    """Without a GPU the CUDA kernels only compile (tests/test_cuda_build.py checks their code for
    sm_86 and sm_90, spills and local memory); the built extension must bind the entry point."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("fedopt_kernels._C_cuda") is None:
        pytest.skip("fedopt_kernels._C_cuda is not built here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import fedopt_kernels._C_cuda as m; print(m.clip_sum.__doc__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert proc.returncode == 0 and "clip_sum(tensors" in proc.stdout, proc.stderr[-2000:]
