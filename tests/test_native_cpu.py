"""What is specific to the ``cpu`` backend (C++ kernels in csrc/cpu), beyond the equivalence harness:

* the global norm and every update are bit-identical run to run *and* across thread counts
  (the norm's partial sums are per fixed 16384-element chunk, never per thread);
* float32/bfloat16 SGD is bit-identical to ``reference`` (same operation order, no FMA contraction);
* multi-tensor edge cases: thousands of tiny tensors, tensors straddling chunk and tile edges,
  neuron-scale rows crossing them, channels_last tensors, dtypes mixed inside one param group
  (float64 among them makes the norm float64), several groups with their own clip thresholds;
* the baseline and AVX2 copies of the kernels give the same bits;
* bad calls into the extension fail with an error naming the tensor.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels import FedDecaySGD, FedNAR, NeuronLRSGD, PAdaMFed
from fedopt_kernels.core.registry import unavailable_reason

_WHY = unavailable_reason("cpu", torch.device("cpu"))


def _must_have_been_built() -> bool:
    """A C++ compiler is here and the build was not switched off: a missing extension is a failure."""
    return os.environ.get("FEDOPT_BUILD_CPU", "") != "0" and any(shutil.which(c) for c in ("c++", "g++", "clang++"))


if _WHY is not None:
    if _must_have_been_built():

        def test_cpu_extension_was_built():
            pytest.fail(f"a C++ compiler is present but the cpu backend is unavailable: {_WHY}")

    pytestmark = pytest.mark.skip(reason=f"cpu backend unavailable: {_WHY}")

CHUNK = 16384  # csrc/cpu/cpu_tile.h kChunk


def _params(shapes, dtypes=(torch.float32,), seed=0, layout=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        t = torch.randn(s, generator=g).to(dtypes[i % len(dtypes)])
        if layout == "channels_last" and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        out.append(torch.nn.Parameter(t))
    return out


def _run(make_opt, shapes, backend, steps=3, dtypes=(torch.float32,), layout=None, grad_fn=None, seed=0):
    params = _params(shapes, dtypes, seed, layout)
    opt = make_opt(params, backend)
    opt.start_round()
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            if layout == "channels_last" and p.dim() == 4:
                p.grad = p.grad.contiguous(memory_format=torch.channels_last)
            if grad_fn is not None:
                p.grad = grad_fn(p.grad, step)
        opt.step()
    return [p.detach().clone() for p in params], opt


ALGOS = {
    "sgd": lambda ps, b: FedDecaySGD(ps, lr=0.1, beta=0.8, backend=b),
    "sgd_momentum": lambda ps, b: FedDecaySGD(
        ps, lr=0.05, beta=0.8, momentum=0.9, weight_decay=1e-3, nesterov=True, prox_mu=0.01, backend=b
    ),
    # the fused fast path (float32/float64, weight decay + momentum / Nesterov only)
    "sgd_fast": lambda ps, b: FedDecaySGD(ps, lr=0.05, beta=0.8, momentum=0.9, weight_decay=1e-3, backend=b),
    "sgd_fast_nesterov": lambda ps, b: FedDecaySGD(ps, lr=0.05, beta=0.8, momentum=0.9, nesterov=True, backend=b),
    "fednar": lambda ps, b: FedNAR(ps, lr=0.1, weight_decay=1e-2, max_norm=5.0, backend=b),
    "fednar_unclipped": lambda ps, b: FedNAR(ps, lr=0.1, weight_decay=1e-2, max_norm=1e6, prox_mu=0.1, backend=b),
    "padamfed": lambda ps, b: PAdaMFed(ps, lr=0.01, beta=0.4, backend=b),
}

# tensors that straddle chunk (16384) and tile (512) edges, plus small ones
EDGE_SHAPES = [(CHUNK - 1,), (CHUNK,), (CHUNK + 1,), (3 * CHUNK + 517,), (513,), (1,), (0,), (), (37, 29), (2, 3, 3, 3)]


def _bits(ts):
    return [t.view(torch.int16) if t.element_size() == 2 else t for t in ts]


def _assert_bitwise(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(_bits([x])[0], _bits([y])[0]), f"{what}: tensor {i} differs bitwise"


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_bitwise_identical_across_thread_counts(algo):
    old = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 3, 1):
            torch.set_num_threads(threads)
            runs.append(_run(ALGOS[algo], EDGE_SHAPES, "cpu")[0])
    finally:
        torch.set_num_threads(old)
    for r in runs[1:]:
        _assert_bitwise(runs[0], r, f"{algo} with another thread count")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algo", ["sgd", "sgd_momentum", "sgd_fast", "sgd_fast_nesterov"])
def test_sgd_bitwise_equal_to_reference(algo, dtype):
    """No reduction in SGD: same operation order as the reference, so the same bits."""
    ref = _run(ALGOS[algo], EDGE_SHAPES, "reference", dtypes=(dtype,))[0]
    got = _run(ALGOS[algo], EDGE_SHAPES, "cpu", dtypes=(dtype,))[0]
    _assert_bitwise(ref, got, f"{algo} {dtype}")


def _close(ref, got, rtol=2e-5, atol=2e-6):
    for i, (x, y) in enumerate(zip(ref, got)):
        torch.testing.assert_close(
            y.double(), x.double(), rtol=rtol, atol=atol, equal_nan=True, msg=lambda m, i=i: f"tensor {i}: {m}"
        )


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_thousands_of_tiny_tensors(algo):
    shapes = [((i % 7),) if i % 5 else (2, i % 3 + 1) for i in range(2000)]
    _close(_run(ALGOS[algo], shapes, "reference", steps=2)[0], _run(ALGOS[algo], shapes, "cpu", steps=2)[0])


@pytest.mark.parametrize("algo", ["sgd_momentum", "fednar", "padamfed"])
def test_channels_last_parameters(algo):
    """Dense tensors whose companions share their strides are processed in place, without copies."""
    shapes = [(8, 5, 3, 3), (16, 3, 7, 7), (5,)]
    ref = _run(ALGOS[algo], shapes, "reference", layout="channels_last")[0]
    got = _run(ALGOS[algo], shapes, "cpu", layout="channels_last")[0]
    _close(ref, got)
    assert got[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("algo", ["fednar", "padamfed", "sgd_momentum"])
def test_mixed_dtypes_in_one_group(algo):
    """float32, bfloat16 and float64 side by side; with a float64 parameter the norm is float64."""
    dtypes = (torch.float32, torch.bfloat16, torch.float64, torch.float16)
    ref = _run(ALGOS[algo], EDGE_SHAPES, "reference", dtypes=dtypes)[0]
    got = _run(ALGOS[algo], EDGE_SHAPES, "cpu", dtypes=dtypes)[0]
    for x, y in zip(ref, got):
        tol = {torch.float64: 1e-12, torch.float32: 2e-6}.get(x.dtype, 1e-2)
        torch.testing.assert_close(y.double(), x.double(), rtol=tol, atol=tol)


def test_fednar_groups_with_own_max_norm():
    """One global norm over all groups, each group clips with its own max_norm / eps / lr."""

    def make(ps, b):
        return FedNAR(
            [{"params": ps[:4], "max_norm": 0.5}, {"params": ps[4:], "max_norm": 50.0, "lr": 0.3, "weight_decay": 0.0}],
            lr=0.1,
            weight_decay=1e-2,
            backend=b,
        )

    _close(_run(make, EDGE_SHAPES, "reference")[0], _run(make, EDGE_SHAPES, "cpu")[0])


@pytest.mark.parametrize("nonfinite", [float("inf"), float("nan")])
def test_fednar_nonfinite_gradient_same_nan_pattern(nonfinite):
    def poison(g, step):
        if step == 1 and g.numel() > 3:
            g = g.clone()
            g.view(-1)[3] = nonfinite
        return g

    ref = _run(ALGOS["fednar"], EDGE_SHAPES, "reference", grad_fn=poison)[0]
    got = _run(ALGOS["fednar"], EDGE_SHAPES, "cpu", grad_fn=poison)[0]
    for x, y in zip(ref, got):
        assert torch.equal(torch.isnan(x), torch.isnan(y))
        assert torch.equal(torch.isinf(x), torch.isinf(y))
    _close(ref, got)


@pytest.mark.parametrize(
    "options",
    [
        dict(momentum=0.9),
        dict(momentum=0.9, weight_decay=1e-3, nesterov=True),
        dict(weight_decay=1e-3),
        dict(momentum=0.9, prox_mu=0.1),
    ],
)
def test_neuron_scales_rows_cross_tiles_and_chunks(options):
    """Rows of 700 and 16385 elements start inside tiles and chunks; float32/float64 without FedProx
    take the fast path (one loop per row), the others the staged one: both give the reference's bits."""
    shapes = [(30, 700), (3, CHUNK + 1), (50, 1), (7, 3, 3, 3), (5,)]

    def make(ps, b):
        opt = NeuronLRSGD(ps, lr=0.1, backend=b, **options)
        opt.set_neuron_scales({p: torch.linspace(0.5, 2.0, p.shape[0]) for p in ps if p.dim() >= 1})
        return opt

    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        ref = _run(make, shapes, "reference", dtypes=(dtype,))[0]
        got = _run(make, shapes, "cpu", dtypes=(dtype,))[0]
        _assert_bitwise(ref, got, f"NeuronLRSGD {dtype}")


def test_padamfed_variance_reduction_mixed_dtypes():
    shapes = [(CHUNK + 3,), (17, 5), (4,)]
    out = {}
    for b in ("reference", "cpu"):
        ps = _params(shapes, (torch.float32, torch.bfloat16, torch.float64))
        opt = PAdaMFed(ps, lr=0.01, beta=0.3, variance_reduction=True, backend=b)
        g = torch.Generator().manual_seed(5)
        opt.start_round(
            global_control=[torch.randn(p.shape, generator=g).to(p.dtype) for p in ps],
            momentum=[torch.randn(p.shape, generator=g).to(p.dtype) for p in ps],
        )
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step(anchor_grads=[torch.randn(p.shape, generator=g).to(p.dtype) for p in ps])
        out[b] = [p.detach().clone() for p in ps] + opt.local_control()
    for x, y in zip(out["reference"], out["cpu"]):
        tol = 1e-12 if x.dtype == torch.float64 else (2e-6 if x.dtype == torch.float32 else 1e-2)
        torch.testing.assert_close(y.double(), x.double(), rtol=tol, atol=tol)


def test_extension_errors_name_the_tensor():
    from fedopt_kernels import _C_cpu

    x, g = torch.zeros(4), torch.zeros(4)
    k, table = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.float64)
    hp = torch.tensor([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # momentum buffer of the wrong shape; present mask asking for a buffer that is not there
    with pytest.raises(RuntimeError, match="momentum_buffer"):
        _C_cpu.sgd([[x], [g], [torch.zeros(5)], [], [], []], [0], [1], hp, k, table, 1, None, None)
    with pytest.raises(RuntimeError, match="momentum_buffer"):
        _C_cpu.sgd([[x], [g], [], [], [], []], [0], [1], hp, k, table, 1, None, None)
    with pytest.raises(RuntimeError, match="neuron_scale"):
        _C_cpu.sgd(
            [[x.view(2, 2)], [g.view(2, 2)], [torch.zeros(2, 2)], [], [], [torch.ones(3)]],
            [0],
            [9],
            hp,
            k,
            table,
            1,
            None,
            None,
        )
    with pytest.raises(RuntimeError, match="dtype"):
        _C_cpu.fednar(
            [[x.int()], [g.int()], [], []],
            [0],
            [0],
            torch.tensor([[0.1, 0.0, 1.0, 1e-6, 0.0]], dtype=torch.float64),
            k,
            table,
            1,
            None,
            None,
        )
    with pytest.raises(RuntimeError, match="anchor_grad"):
        _C_cpu.padamfed(
            [[x], [g], [torch.zeros(4)], [torch.zeros(4)], []],
            [0],
            [7],
            torch.tensor([[0.1, 0.5, 1e-12]], dtype=torch.float64),
            k,
            table,
            1,
            None,
            None,
        )
    with pytest.raises(RuntimeError, match="hp must be"):
        _C_cpu.sgd([[x], [g], [], [], [], []], [0], [0], hp.float(), k, table, 1, None, None)
    with pytest.raises(RuntimeError, match="found_inf"):
        _C_cpu.sgd([[x], [g], [], [], [], []], [0], [0], hp, k, table, 1, None, torch.zeros(1, dtype=torch.float64))
    assert int(k) == 0, "a rejected call must not advance the step counter"


def test_a_norm_ops_device_scratch_goes_back_through_the_optimizers_cache():
    """The compiled ops return the scratch they used (the cuda norm ops' float64 buffer) and the
    wrapper hands it back the next step through the optimizer's cache, so an eager GPU step allocates
    nothing (a per-step allocation moved the next gradients, and steps stopped replaying)."""
    from fedopt_kernels.core.backends._native import _wrap

    seen, made = [], torch.zeros(3, dtype=torch.float64)

    def ext_op(roles, *rest):
        scratch = rest[-1]  # passed by position (a keyword costs pybind11 0.6 us a call)
        seen.append(scratch)
        return made if scratch is None else scratch

    op = _wrap(ext_op, "fednar", 2, "cuda", batched=False)
    args = ([], [], [0], [0], None, None, None, 1, None, None, "cuda")
    cache: dict = {}
    op(*args, cache=cache)
    op(*args, cache=cache)
    op(*args)  # no cache (a step on copies of the parameters): nothing to hand back, nothing kept
    assert seen[0] is None and seen[1] is made and seen[2] is None and cache["scratch"] is made
    # the CPU kernels sum their norms on the stack: no scratch, so the cache stays without one
    params = [torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3, 2))]
    opt = FedNAR(params, lr=0.1, weight_decay=0.01, max_norm=1.0, backend="cpu")
    for _ in range(2):
        for q in params:
            q.grad = torch.randn_like(q)
        opt.step()
    assert "scratch" not in opt.step_plan.cache


def test_available_backends_lists_cpu():
    assert "cpu" in fk.available_backends("cpu")


def _assert_avx2_same_bits_as_baseline(run, what):
    """``run()`` (the tensors a run ends with) under the AVX2 kernels, then the baseline ones: same bits."""
    from fedopt_kernels import _C_cpu

    try:
        _C_cpu.set_isa("avx2")
    except RuntimeError as exc:
        _C_cpu.set_isa("auto")
        pytest.skip(f"no AVX2 kernels here: {exc}")
    try:
        wide = run()
        assert _C_cpu.set_isa("base") == "base"
        narrow = run()
    finally:
        _C_cpu.set_isa("auto")
    _assert_bitwise(wide, narrow, f"{what}: avx2 vs baseline")


ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_baseline_and_avx2_kernels_give_the_same_bits(algo):
    """The chunk code is compiled for the baseline ISA and for AVX2 (picked at run time)."""
    _assert_avx2_same_bits_as_baseline(lambda: _run(ALGOS[algo], EDGE_SHAPES, "cpu", dtypes=ALL_DTYPES)[0], algo)


# ---------------------------------------------------------------- client-batched ops (docs/client_batched.md)
# One pass over all clients' tensors; FedNAR / PAdaMFed form one norm per client from the same
# fixed-chunk partials as the per-client op, so each client's result is the per-client kernel's.

from fedopt_kernels.batched import BatchedFedDecaySGD, BatchedFedNAR, BatchedPAdaMFed  # noqa: E402

# (batched maker, per-client maker); SGD with dampening so the FRESH first-step rule matters
_SGD_KW: Dict[str, Any] = dict(lr=0.05, beta=0.8, momentum=0.9, dampening=0.1, weight_decay=1e-3, prox_mu=0.01)
_NAR_KW: Dict[str, Any] = dict(lr=0.1, weight_decay=1e-2, max_norm=5.0, prox_mu=0.1)
_PAD_KW: Dict[str, Any] = dict(lr=0.01, beta=0.4)
BATCHED_ALGOS = {
    "sgd_momentum": (
        lambda ps, b: BatchedFedDecaySGD(ps, backend=b, **_SGD_KW),
        lambda ps, b: FedDecaySGD(ps, backend=b, **_SGD_KW),
    ),
    "sgd_fast": (
        lambda ps, b: BatchedFedDecaySGD(ps, lr=0.05, beta=0.8, momentum=0.9, weight_decay=1e-3, backend=b),
        lambda ps, b: FedDecaySGD(ps, lr=0.05, beta=0.8, momentum=0.9, weight_decay=1e-3, backend=b),
    ),
    "fednar": (lambda ps, b: BatchedFedNAR(ps, backend=b, **_NAR_KW), lambda ps, b: FedNAR(ps, backend=b, **_NAR_KW)),
    "padamfed": (
        lambda ps, b: BatchedPAdaMFed(ps, backend=b, **_PAD_KW),
        lambda ps, b: PAdaMFed(ps, backend=b, **_PAD_KW),
    ),
}
BATCHED_SHAPES = EDGE_SHAPES  # a () parameter is a [C] stack of scalars
BATCHED_STEPS = 3


def _active(step, clients):
    """Client c sits out step s when (c + s) % 4 == 1: counters diverge, client 1's first step comes late."""
    return [(c + step) % 4 != 1 for c in range(clients)]


def _client_grads(shapes, clients, steps, dtypes, seed=1):
    """grads[step][c][i]; client c's gradients scaled by 0.05 * (c + 1) so some clip and some do not."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            [(torch.randn(s, generator=g) * 0.05 * (c + 1)).to(dtypes[i % len(dtypes)]) for i, s in enumerate(shapes)]
            for c in range(clients)
        ]
        for _ in range(steps)
    ]


def _run_batched(make, shapes, clients, backend, dtypes=(torch.float32,), steps=BATCHED_STEPS, round_inputs=None):
    init = [_params(shapes, dtypes, seed=10 + c) for c in range(clients)]
    params = [
        torch.nn.Parameter(torch.stack([init[c][i].detach() for c in range(clients)])) for i in range(len(shapes))
    ]
    opt = make(params, backend)
    opt.start_round(**(round_inputs or {}))
    grads = _client_grads(shapes, clients, steps, dtypes)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.stack([grads[step][c][i] for c in range(clients)])
        opt.step(active=torch.tensor(_active(step, clients)))
    return [p.detach().clone() for p in params], opt


def _run_alone(make, shapes, clients, c, backend, dtypes=(torch.float32,), steps=BATCHED_STEPS):
    """Client c with the per-client optimizer, taking the steps its active mask gives it."""
    params = _params(shapes, dtypes, seed=10 + c)
    opt = make(params, backend)
    opt.start_round()
    grads = _client_grads(shapes, clients, steps, dtypes)
    for step in range(steps):
        if not _active(step, clients)[c]:
            continue
        for i, p in enumerate(params):
            p.grad = grads[step][c][i]
        opt.step()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize(
    "dtypes", [(torch.float32,), (torch.float32, torch.bfloat16, torch.float64, torch.float16)], ids=["fp32", "mixed"]
)
@pytest.mark.parametrize("algo", sorted(BATCHED_ALGOS))
def test_batched_each_client_bitwise_equal_to_the_per_client_kernel(algo, dtypes):
    """Same chunks, same partials, same order: client c of the batched op is the per-client op's bits
    (its own norm, its own k, late first steps under FRESH, skipped steps while inactive)."""
    make_b, make_1 = BATCHED_ALGOS[algo]
    C = 4
    got, opt = _run_batched(make_b, BATCHED_SHAPES, C, "cpu", dtypes)
    for c in range(C):
        want, alone = _run_alone(make_1, BATCHED_SHAPES, C, c, "cpu", dtypes)
        _assert_bitwise(want, [t[c] for t in got], f"{algo} client {c}")
        assert opt.round_step[c] == alone.round_step
    assert opt.round_step != [opt.round_step[0]] * C  # the masks did make the counters differ


@pytest.mark.parametrize("algo", sorted(BATCHED_ALGOS))
def test_batched_bitwise_identical_across_thread_counts_and_runs(algo):
    make = BATCHED_ALGOS[algo][0]
    old = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 2, 1):
            torch.set_num_threads(threads)
            runs.append(_run_batched(make, BATCHED_SHAPES, 3, "cpu")[0])
    finally:
        torch.set_num_threads(old)
    assert sum(t.numel() for t in runs[0]) >= 4 * CHUNK  # large enough for the parallel path
    for r in runs[1:]:
        _assert_bitwise(runs[0], r, f"batched {algo} with another thread count / run")


@pytest.mark.parametrize("algo", sorted(BATCHED_ALGOS))
def test_batched_baseline_and_avx2_kernels_give_the_same_bits(algo):
    make = BATCHED_ALGOS[algo][0]
    _assert_avx2_same_bits_as_baseline(
        lambda: _run_batched(make, BATCHED_SHAPES, 3, "cpu", ALL_DTYPES)[0], f"batched {algo}"
    )


@pytest.mark.parametrize("algo", sorted(BATCHED_ALGOS))
def test_batched_fifty_small_cnn_clients_match_reference(algo):
    """The simulator's CNN, 50 clients with their own round index, lr scale and active masks."""
    from bench.shapes import SIZES

    make = BATCHED_ALGOS[algo][0]
    C = 50
    inputs = dict(round_index=[c % 4 for c in range(C)], lr_scale=[0.5 + c / C for c in range(C)])
    ref, ref_opt = _run_batched(make, SIZES["small_cnn"], C, "reference", round_inputs=inputs)
    got, opt = _run_batched(make, SIZES["small_cnn"], C, "cpu", round_inputs=inputs)
    if algo.startswith("sgd"):
        _assert_bitwise(ref, got, f"batched {algo}")  # no reduction: the reference's bits
    else:
        _close(ref, got)
    assert opt.round_step == ref_opt.round_step


@pytest.mark.parametrize("op", ["sgd_batched", "fednar_batched", "padamfed_batched"])
def test_batched_found_inf_changes_nothing(op):
    """GradScaler found an inf: no client moves and no counter advances (active or not)."""
    from fedopt_kernels import _C_cpu
    from fedopt_kernels.core.ops import BATCHED

    spec = BATCHED[op]
    C, g = 3, torch.Generator().manual_seed(3)
    x, grad = torch.randn(C, 4, 5, generator=g), torch.randn(C, 4, 5, generator=g)
    lists = [[x], [grad]] + [[] for _ in spec.optional]
    present = [0]
    if op == "padamfed_batched":  # D and acc are always there
        lists[2], lists[3], present = [torch.zeros(C, 4, 5)], [torch.zeros(C, 4, 5)], [3]
    hp = torch.full((1, C, len(spec.hps)), 0.5, dtype=torch.float64)
    k = torch.tensor([0, 2, 1], dtype=torch.int32)
    table = torch.ones(1, dtype=torch.float64)
    before = [t.clone() for lst in lists for t in lst]
    getattr(_C_cpu, op)(
        lists, [0], present, hp, k, table, 1, torch.full((1,), 4.0), torch.ones(1), torch.tensor([True, False, True])
    )
    for a, b in zip(before, [t for lst in lists for t in lst]):
        assert torch.equal(a, b)
    assert k.tolist() == [0, 2, 1]
    getattr(_C_cpu, op)(
        lists, [0], present, hp, k, table, 1, torch.full((1,), 4.0), torch.zeros(1), torch.tensor([True, False, True])
    )
    assert k.tolist() == [1, 2, 2]
    assert not torch.equal(lists[0][0][0], before[0][0]) and torch.equal(lists[0][0][1], before[0][1])
