"""What is specific to the ``cuda`` backend (csrc/cuda), on a GPU (skipped without one):

* a step captured in a CUDA graph and replayed gives the same bits as eager steps (every per-step
  scalar - lr_k, the norm, the clip / normalisation factor - lives on the device);
* ``torch.cuda.set_sync_debug_mode("error")`` raises nothing inside ``step()``;
* launches that split (more tensors or row groups than one kernel-argument table holds) and mixed
  dtypes still match ``reference``;
* a plan change that would copy from the host while a graph is captured is refused, not recorded;
* the client-batched ops (one launch per pass and dtype over every client): each client equals the
  reference batched op (the per-client reference step) with clients that span several chunks,
  clients whose slices are not 16-byte aligned, split tables, mixed dtypes, per-client k / active /
  FRESH, and C = 1000 clients of the simulator's small CNN; their norms are deterministic; batched
  optimizer steps replay from a CUDA graph bit for bit and never sync;
* the norm ops (per-client and batched) on views one element off alignment give the bits of the
  same op on aligned clones: the scalar and the vector path sum in one element-to-thread order.
"""

from __future__ import annotations

import pytest
import torch
from no_sync import no_host_sync
from op_harness import BF16, F16, F32, F64, MANY, MIXED, op_args, same_roles

from fedopt_kernels import FedDecaySGD, FedDyn, FedNAR, FedSAM, NeuronLRSGD, PAdaMFed
from fedopt_kernels.core import ops as _ops
from fedopt_kernels.core.ops import BATCHED, FRESH, OPS, PER_CLIENT
from fedopt_kernels.core.registry import unavailable_reason
from fedopt_kernels.fl import algorithm, catalogue

pytestmark = [pytest.mark.gpu]

if torch.cuda.is_available():
    _WHY = unavailable_reason("cuda", torch.device("cuda"))
    if _WHY is not None:
        pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=f"cuda backend unavailable: {_WHY}")]

SHAPES = [(1000, 37), (16385,), (64, 3, 3, 3), (0,), (7,), (), (513, 3)]


def _make(name, params, backend, replay=True):
    """``replay=False``: the optimizer records no graphs of its own (tests of a user's own capture)."""
    kw = {} if replay else {"replay": False}
    if name == "sgd":
        return FedDecaySGD(
            params,
            lr=0.1,
            beta=0.7,
            momentum=0.9,
            weight_decay=1e-3,
            nesterov=True,
            decay_every=2,
            backend=backend,
            **kw,
        )
    if name == "neuron":
        opt = NeuronLRSGD(params, lr=0.1, momentum=0.5, backend=backend, **kw)
        opt.set_neuron_scales(
            {p: torch.linspace(0.5, 2.0, p.shape[0], device=p.device) for p in params if p.dim() >= 1}
        )
        return opt
    if name == "fednar":
        return FedNAR(params, lr=0.1, weight_decay=1e-2, max_norm=1.0, prox_mu=0.01, backend=backend, **kw)
    if name == "padamfed":
        return PAdaMFed(params, lr=0.01, beta=0.3, backend=backend, **kw)
    if name == "feddyn":
        return FedDyn(params, lr=0.1, alpha=0.1, momentum=0.9, weight_decay=1e-3, backend=backend, **kw)
    if name == "fedsam":  # dampening 0: its first (fresh-momentum) step has the rows of the later ones
        return FedSAM(params, lr=0.1, rho=0.2, adaptive=True, momentum=0.9, weight_decay=1e-3, backend=backend, **kw)
    raise ValueError(name)


def _second_gradient(params):
    """A closure for a step that takes one (FedSAM): the second gradient, ``g / 2 + x`` at the
    parameters the ascent moved to, written in place (a graph captures it; no tensor is made)."""

    def closure():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(0.5).add_(p.detach())

    return closure


def _step(opt, params, **kwargs):
    """``opt.step()``, with a closure for an optimizer whose step takes two gradients (FedSAM)."""
    if algorithm.of_optimizer(type(opt)).closure_step:
        return opt.step(_second_gradient(params), **kwargs)
    return opt.step(**kwargs)


def _params(dtype=torch.float32, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device="cuda", dtype=dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(device="cuda", dtype=p.dtype) for p in params]


# the per-client GPU tests' optimizers, one per algorithm of the catalogue (tests/test_gpu_harness.py
# fails on the CPU when an algorithm has none)
ALGOS = ["sgd", "neuron", "fednar", "padamfed", "feddyn", "fedsam"]
STEPS = 6


@pytest.mark.parametrize("warmup", [1, 2], ids=["after-first-step", "after-two-steps"])
@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_graph_replay_equals_eager(algo, warmup):
    """A user's own capture of ``step()`` replays to the eager bits; capturing right after the first
    (fresh-momentum) step needs no host copy either: the rebuilt plan's hp rows are already on the
    device."""
    eager = _params()
    opt = _make(algo, eager, "cuda")
    opt.start_round()
    for k in range(STEPS):
        for p, g in zip(eager, _grads(eager, k)):
            p.grad = g
        _step(opt, eager)

    graphed = _params()
    opt = _make(algo, graphed, "cuda", replay=False)
    opt.start_round()
    static = [torch.empty_like(p) for p in graphed]
    for p, s in zip(graphed, static):
        p.grad = s
    for k in range(warmup):  # eager warm-up: device counter, schedule table, state
        for s, g in zip(static, _grads(graphed, k)):
            s.copy_(g)
        _step(opt, graphed)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(opt, graphed)  # recorded, not run (FedSAM: ascent, closure, restore and descent)
    for k in range(warmup, STEPS):
        for s, g in zip(static, _grads(graphed, k)):
            s.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"{algo}: parameter {i} differs between eager and graph replay"


@pytest.mark.parametrize("algo", ALGOS)
def test_step_never_syncs(algo):
    params = _params()
    opt = _make(algo, params, "cuda")
    opt.start_round()
    _steps_never_sync(opt, params)


def _steps_never_sync(opt, params, **step_kwargs) -> None:
    """A first step (lazily created device tensors, counter and schedule table, may copy from the
    host), then three steps with new gradients where a host synchronisation raises."""
    for k in range(4):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        if k == 0:
            _step(opt, params, **step_kwargs)
            continue
        with no_host_sync():
            _step(opt, params, **step_kwargs)


@pytest.mark.parametrize("algo", ["sgd", "fednar", "padamfed", "fedsam"])
def test_split_launches_and_mixed_dtypes_match_reference(algo):
    """150 tensors in 70 param groups, four dtypes: several tables per pass, two finalize launches."""
    shapes = [((i * 97) % 5000 + 1,) if i % 4 else (i % 9 + 1, 17) for i in range(150)]
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    out = {}
    for backend in ("reference", "cuda"):
        g = torch.Generator().manual_seed(3)
        params = [
            torch.nn.Parameter(torch.randn(s, generator=g).to(device="cuda", dtype=dtypes[i % 4]))
            for i, s in enumerate(shapes)
        ]
        groups = [{"params": params[i::70]} for i in range(70)]
        opt = _make(algo, groups, backend)
        opt.start_round()
        for k in range(3):
            for p, gr in zip(params, _grads(params, k)):
                p.grad = gr
            _step(opt, params)
        out[backend] = params
    for i, (a, b) in enumerate(zip(out["reference"], out["cuda"])):
        tol = {torch.float64: 1e-10, torch.float32: 2e-5}.get(a.dtype, 3e-2)
        torch.testing.assert_close(b.double(), a.double(), rtol=tol, atol=tol, msg=lambda m, i=i: f"tensor {i}: {m}")


@pytest.mark.parametrize("algo", ALGOS)
def test_capture_refuses_a_hyperparameter_change_that_needs_a_host_copy(algo):
    """New hyperparameter values reach the device by a host copy, which a graph would replay from a
    freed host buffer: a capture that needs one raises, naming the CUDA graph, and changes nothing."""
    params = _params()
    opt = _make(algo, params, "cuda", replay=False)
    opt.start_round()
    for k in range(2):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        _step(opt, params)
    group = opt.param_groups[0]
    group["lr"] = group["lr"] * 0.5
    before = [p.detach().clone() for p in params]
    k_before = opt.round_step
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            _step(opt, params)  # FedSAM: the ascent is captured (not run), its descent's new rows refused
    assert opt.round_step == k_before
    for a, b in zip(before, params):
        assert torch.equal(a, b.detach())
    _step(opt, params)  # eagerly, the new lr is taken
    assert opt.round_step == k_before + 1


def test_per_client_sgd_ignores_the_fresh_bit():
    """FRESH belongs to sgd_batched; the per-client op computes what it computes without it."""
    out = []
    for backend in ("reference", "cuda"):
        args = _op_args(OPS["sgd"], [((1000, 37), torch.float32, 0), ((7,), torch.float32, 0)], backend)
        args[len(OPS["sgd"].roles) + 1][0] |= FRESH
        _ops.torch_op("sgd")(*args)
        out.append(args)
    _assert_same_roles(OPS["sgd"], out[0], out[1], exact=False)


# ------------------------------------------------------------------ client-batched ops (docs/client_batched.md)
def _op_args(spec, layout, backend, clients=0, seed=0):
    """tests/op_harness.py's arguments of op ``spec`` on the GPU (a CPU test builds and runs every op
    through the same harness, tests/test_gpu_harness.py)."""
    return op_args(spec, layout, backend, "cuda", clients, seed)


_assert_same_roles = same_roles


@pytest.mark.parametrize("layout", [MIXED, MANY], ids=["mixed", "many"])
@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_op_matches_reference_per_client(name, layout):
    spec = BATCHED[name]
    C = 6
    out = {}
    for backend in ("reference", "cuda"):
        args = _op_args(spec, layout, backend, clients=C)
        for _ in range(3):  # k advances per active client; FRESH only at a client's k == 0
            _ops.torch_op(name)(*args)
        out[backend] = args
    _assert_same_roles(spec, out["reference"], out["cuda"], exact=False)
    n = len(spec.roles)
    assert out["cuda"][n + 3].tolist() == [
        (0 if c % 3 == 0 else 1 + c % 2) + (3 if c % 4 != 3 else 0) for c in range(C)
    ]


@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_client_is_bitwise_the_per_client_cuda_op(name):
    """Same kernels, same slot order per client: client c of a batched step has the bits of the
    per-client cuda op run on client c's slices alone (FRESH at k == 0 spelled as dampening 0)."""
    spec = BATCHED[name]
    n = len(spec.roles)
    C = 5
    args = _op_args(spec, MIXED, "cuda", clients=C, seed=3)
    init = [[t.clone() for t in lst] for lst in args[:n]]
    k0 = args[n + 3].clone()
    _ops.torch_op(name)(*args)
    row_of, present, hp = args[n], args[n + 1], args[n + 2]
    for c in range(C):
        if not bool(args[n + 8][c]):
            continue
        lists = [[t[c].clone() for t in lst] for lst in init]
        hc = hp[:, c].clone()
        if spec.base == "sgd" and int(k0[c]) == 0:
            for b, m in enumerate(present):
                if m & FRESH:
                    hc[b, spec.hps.index("dampening")] = 0.0
        kc = k0[c : c + 1].clone()
        _ops.torch_op(spec.base)(*lists, row_of, [m & ~FRESH for m in present], hc, kc, *args[n + 4 : n + 8], "cuda")
        for r, (want, got) in enumerate(zip(lists, args[:n])):
            for i, (a, b) in enumerate(zip(want, got)):
                assert torch.equal(a, b[c]), f"client {c}: {spec.roles[r].name}[{i}] differs from the per-client op"
        assert int(kc) == int(args[n + 3][c])


# odd sizes (every chunk ends in a partial vector) and float64 tensors: the norm and its factor are
# then float64, so x shows any difference in the norm's bits
ODD = [((3, 7001), F64, 0), ((5,), F32, 0), ((33, 3), F16, 0), ((17, 1025), F32, 0), ((1001,), BF16, 0), ((7,), F64, 0)]


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view one element into a larger buffer: off every vector alignment."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return out.copy_(t)


NORM_OPS = [name for name, spec in PER_CLIENT.items() if spec.norm]  # every two-pass op of the declaration


@pytest.mark.parametrize("batched", [False, True], ids=["per_client", "batched"])
@pytest.mark.parametrize("base", NORM_OPS)
def test_norm_op_on_unaligned_views_is_bitwise_the_aligned_op(base, batched):
    """The scalar (unaligned) path gives each thread the elements the vector path gives it, in the
    same order, so the norm, and x through it, does not depend on where the tensors start."""
    name = f"{base}_batched" if batched else base
    spec = OPS[name]
    n = len(spec.roles)
    aligned = _op_args(spec, ODD, "cuda", clients=4 if batched else 0, seed=11)
    shifted = [[_shifted(t) for t in lst] for lst in aligned[:n]] + list(aligned[n:])
    shifted[n + 3] = aligned[n + 3].clone()  # k advances in place
    assert all(t.data_ptr() % 16 for lst in shifted[:n] for t in lst)
    assert all(t.data_ptr() % 256 == 0 for lst in aligned[:n] for t in lst)
    for _ in range(2):
        _ops.torch_op(name)(*aligned)
        _ops.torch_op(name)(*shifted)
    _assert_same_roles(spec, aligned, shifted, exact=True)


@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_op_is_deterministic(name):
    spec = BATCHED[name]
    runs = []
    for _ in range(2):
        args = _op_args(spec, MIXED, "cuda", clients=9, seed=5)
        for _ in range(2):
            _ops.torch_op(name)(*args)
        runs.append(args)
    _assert_same_roles(spec, runs[0], runs[1], exact=True)


def test_batched_op_skips_everything_on_found_inf():
    spec = BATCHED["fednar_batched"]
    n = len(spec.roles)
    args = _op_args(spec, MIXED, "cuda", clients=4)
    args[n + 7] = torch.ones(1, device="cuda")  # found_inf
    before = [[t.clone() for t in lst] for lst in args[:n]] + [None] * 3 + [args[n + 3].clone()]
    _ops.torch_op("fednar_batched")(*args)
    _assert_same_roles(spec, before, args, exact=True)


def _small_cnn_shapes():
    from fedopt_kernels.sim.models.small import SmallCNN

    return [tuple(p.shape) for p in SmallCNN((1, 28, 28), 10).parameters()]


@pytest.mark.parametrize("name", list(BATCHED))
def test_thousand_clients_small_cnn_match_reference(name):
    """C = 1000 clients of the simulator's small CNN: 7 blocks per client, one launch per pass."""
    spec = BATCHED[name]
    layout = [(s, F32, 0) for s in _small_cnn_shapes()]
    args = _op_args(spec, layout, "cuda", clients=1000, seed=2)
    n = len(spec.roles)
    # the reference on CPU copies (1000 per-client steps are quicker there than as tiny GPU launches)
    ref = (
        [[t.cpu() for t in lst] for lst in args[:n]]
        + [a.cpu() if isinstance(a, torch.Tensor) else a for a in args[n:-1]]
        + ["reference"]
    )
    for _ in range(2):
        _ops.torch_op(name)(*args)
        _ops.torch_op(name)(*ref)
    _assert_same_roles(spec, ref, args, exact=False)


BATCHED_CFGS = [(name, a.full) for name, a in catalogue.ALGOS.items()]  # every algorithm, every role
C_GRAPH = 5


def _batched_setup(algo, option):
    cfg = catalogue.config(algo, option)
    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn((C_GRAPH,) + s, generator=g).cuda())
        for s in [(1000, 37), (16385,), (64, 3, 3, 3), (7,), (513, 3)]
    ]
    opt = cfg.build_batched(params, "cuda")
    ordered = [p for grp in opt.param_groups for p in grp["params"]]
    views = [[p[c] for p in ordered] for c in range(C_GRAPH)]
    opt.start_round(
        round_index=[c % 3 for c in range(C_GRAPH)],
        lr_scale=[1.0 + 0.25 * c for c in range(C_GRAPH)],
        **cfg.batched_round_inputs(views, ordered, 0),
    )
    return params, opt


def _active(k):
    return torch.tensor([(c + k) % 4 != 0 for c in range(C_GRAPH)], device="cuda")


@pytest.mark.parametrize("algo,option", BATCHED_CFGS)
def test_batched_cuda_graph_replay_equals_eager(algo, option):
    """A user's capture of a batched step (FedSAM's: ``step(closure, active=...)``, its closure
    writing the second gradients in place) replays to the eager bits."""
    eager, opt = _batched_setup(algo, option)
    for k in range(STEPS):
        for p, g in zip(eager, _grads(eager, k)):
            p.grad = g
        _step(opt, eager, active=_active(k))

    graphed, opt = _batched_setup(algo, option)
    static = [torch.empty_like(p) for p in graphed]
    active = _active(0)
    for p, s in zip(graphed, static):
        p.grad = s
    for k in range(2):  # eager warm-up: counters, state, a steady plan
        for s, g in zip(static, _grads(graphed, k)):
            s.copy_(g)
        active.copy_(_active(k))
        _step(opt, graphed, active=active)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(opt, graphed, active=active)  # recorded, not run
    for k in range(2, STEPS):
        for s, g in zip(static, _grads(graphed, k)):
            s.copy_(g)
        active.copy_(_active(k))
        graph.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"{algo}/{option}: parameter {i} differs between eager and graph replay"
    assert opt.round_step == [sum((c + k) % 4 != 0 for k in range(STEPS)) for c in range(C_GRAPH)]


@pytest.mark.parametrize("algo,option", BATCHED_CFGS)
def test_batched_step_never_syncs(algo, option):
    params, opt = _batched_setup(algo, option)
    _steps_never_sync(opt, params, active=_active(0))
