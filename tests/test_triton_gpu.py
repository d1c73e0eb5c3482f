"""GPU-only properties of the Triton backend (skipped without CUDA): a step (per-client or
client-batched) is CUDA-graph capturable and replays to the eager result, never synchronises with
the host, and changing hyperparameters between steps compiles nothing new.

One optimizer per algorithm of the catalogue (``_builders``, ``_batched_builders``; a CPU test,
tests/test_gpu_harness.py, fails when an algorithm has none); FedSAM's steps get a closure."""

from __future__ import annotations

import pytest
import torch
from no_sync import no_host_sync

import fedopt_kernels as fk
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.fl import algorithm

pytestmark = pytest.mark.gpu

HAS_TRITON_CUDA = torch.cuda.is_available() and _registry.unavailable_reason("triton", torch.device("cuda")) is None
needs_triton_cuda = pytest.mark.skipif(not HAS_TRITON_CUDA, reason="needs CUDA and the triton backend on it")

SHAPES = [(256, 129), (4097,), (1,), (0,), (31, 3, 3)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).cuda()) for s in SHAPES]


def _builders():
    return {
        "feddecay": lambda ps: fk.FedDecaySGD(ps, lr=0.1, beta=0.8, momentum=0.9, weight_decay=0.01, backend="triton"),
        "neuron_lr": lambda ps: fk.NeuronLRSGD(
            ps,
            lr=0.1,
            momentum=0.5,
            backend="triton",
            neuron_scales={p: torch.linspace(0.5, 1.5, p.shape[0], device="cuda") for p in ps if p.dim() >= 1},
        ),
        "fednar": lambda ps: fk.FedNAR(ps, lr=0.1, weight_decay=0.05, max_norm=0.5, backend="triton"),
        "padamfed": lambda ps: fk.PAdaMFed(ps, lr=0.05, beta=0.5, backend="triton"),
        "feddyn": lambda ps: fk.FedDyn(ps, lr=0.1, alpha=0.1, momentum=0.9, weight_decay=0.01, backend="triton"),
        "fedsam": lambda ps: fk.FedSAM(ps, lr=0.1, rho=0.1, momentum=0.9, weight_decay=0.01, backend="triton"),
    }


def _step(opt, ps, **kwargs):
    """``opt.step()``; a step that takes two gradients (FedSAM) gets a closure writing the second one,
    ``g / 2 + x`` at the moved parameters, into the gradients in place (a graph captures it)."""
    if not algorithm.of_optimizer(type(opt)).closure_step:
        return opt.step(**kwargs)

    def closure():
        for p in ps:
            if p.grad is not None:
                p.grad.mul_(0.5).add_(p.detach())

    return opt.step(closure, **kwargs)


def _with_static_grads(ps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype).cuda()


@needs_triton_cuda
@pytest.mark.parametrize("name", sorted(_builders()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_of_k_steps_replays_to_the_eager_result(name, dtype):
    K = 4
    eager_ps, graph_ps = _params(dtype), _params(dtype)
    _with_static_grads(eager_ps)
    _with_static_grads(graph_ps)
    eager, graphed = _builders()[name](eager_ps), _builders()[name](graph_ps)
    eager.start_round()
    graphed.start_round()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(graphed, graph_ps)  # warm-up: builds the plan (tables, state) outside the capture
        _step(graphed, graph_ps)  # momentum buffers exist now: the plan is steady
    torch.cuda.current_stream().wait_stream(side)
    _step(eager, eager_ps)
    _step(eager, eager_ps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(K):
            _step(graphed, graph_ps)
    graph.replay()
    for _ in range(K):
        _step(eager, eager_ps)
    torch.cuda.synchronize()
    for a, b in zip(eager_ps, graph_ps):
        assert torch.equal(a.detach(), b.detach()), name


@needs_triton_cuda
@pytest.mark.parametrize("name", sorted(_builders()))
def test_step_never_synchronises_with_the_host(name):
    ps = _params()
    _with_static_grads(ps)
    opt = _builders()[name](ps)
    _steps_never_sync(lambda: _step(opt, ps))


def _steps_never_sync(step, warm: int = 1) -> None:
    """``step()`` ``warm`` times (state and schedule tables are created outside the checked region),
    then three times where a host synchronisation raises."""
    for _ in range(warm):
        step()
    with no_host_sync():
        for _ in range(3):
            step()
    torch.cuda.synchronize()


def _compiled_variants() -> int:
    from fedopt_kernels.triton_kernels import sgd, two_pass_kernels

    kernels = [
        sgd.sgd_kernel,
        two_pass_kernels.norm_kernel,
        two_pass_kernels.update_kernel,
        two_pass_kernels.finalize_kernel,
        two_pass_kernels.advance_kernel,
    ]
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


@needs_triton_cuda
def test_changing_hyperparameters_compiles_nothing_new():
    edits = {
        "feddecay": dict(lr=0.03, momentum=0.5, weight_decay=0.2, dampening=0.3),
        "neuron_lr": dict(lr=0.02, momentum=0.7, weight_decay=0.1),
        "fednar": dict(lr=0.5, max_norm=3.0, weight_decay=0.01, eps=1e-3, round_decay=0.5),
        "padamfed": dict(lr=0.2, beta=0.9, eps=1e-6),
        "feddyn": dict(lr=0.03, alpha=0.5, momentum=0.5, weight_decay=0.1, dampening=0.3),
        "fedsam": dict(lr=0.03, rho=0.5, adaptive=True, eta=0.1, eps=1e-6, momentum=0.5, weight_decay=0.1),
    }
    for name, build in _builders().items():
        ps = _params()
        _with_static_grads(ps)
        opt = build(ps)
        _step(opt, ps)
        _step(opt, ps)
        before = _compiled_variants()
        for key, value in edits[name].items():
            for group in opt.param_groups:
                group[key] = value
            _step(opt, ps)
        torch.cuda.synchronize()
        assert _compiled_variants() == before, f"{name}: a hyperparameter change compiled a new kernel"


# ---------------------------------------------------------------- client-batched optimizers
C = 5


def _stacked(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn((C,) + s, generator=g).cuda()) for s in SHAPES]


def _batched_builders():
    from fedopt_kernels.batched import BatchedFedDecaySGD, BatchedFedNAR, BatchedNeuronLRSGD, BatchedPAdaMFed
    from fedopt_kernels.optim.feddyn import BatchedFedDyn
    from fedopt_kernels.optim.fedsam import BatchedFedSAM

    return {
        "feddecay": lambda ps: BatchedFedDecaySGD(
            ps, lr=0.1, beta=0.8, momentum=0.9, weight_decay=0.01, backend="triton"
        ),
        "neuron_lr": lambda ps: BatchedNeuronLRSGD(
            ps,
            lr=0.1,
            momentum=0.5,
            backend="triton",
            neuron_scales={
                p: torch.linspace(0.5, 1.5, C * p.shape[1], device="cuda").view(C, -1) for p in ps if p.dim() >= 2
            },
        ),
        "fednar": lambda ps: BatchedFedNAR(ps, lr=0.1, weight_decay=0.05, max_norm=0.5, backend="triton"),
        "padamfed": lambda ps: BatchedPAdaMFed(ps, lr=0.05, beta=0.5, backend="triton"),
        "feddyn": lambda ps: BatchedFedDyn(ps, lr=0.1, alpha=0.1, momentum=0.9, backend="triton"),
        "fedsam": lambda ps: BatchedFedSAM(ps, lr=0.1, rho=0.1, adaptive=True, momentum=0.9, backend="triton"),
    }


@needs_triton_cuda
@pytest.mark.parametrize("name", sorted(_batched_builders()))
def test_batched_cuda_graph_replays_to_the_eager_result(name):
    """K batched steps, each with its own active mask (fixed device tensors), replay to the eager
    steps, per-client k included."""
    K = 3
    masks = [torch.tensor([c != s for c in range(C)], device="cuda") for s in range(K)]
    eager_ps, graph_ps = _stacked(), _stacked()
    _with_static_grads(eager_ps)
    _with_static_grads(graph_ps)
    eager, graphed = _batched_builders()[name](eager_ps), _batched_builders()[name](graph_ps)
    eager.start_round(round_index=[0, 1, 2, 3, 4], lr_scale=[1.0, 0.5, 2.0, 1.0, 0.25])
    graphed.start_round(round_index=[0, 1, 2, 3, 4], lr_scale=[1.0, 0.5, 2.0, 1.0, 0.25])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(graphed, graph_ps, active=masks[0])  # warm-up: plans, state and tables are built outside the capture
        _step(graphed, graph_ps, active=masks[1])
    torch.cuda.current_stream().wait_stream(side)
    _step(eager, eager_ps, active=masks[0])
    _step(eager, eager_ps, active=masks[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in range(K):
            _step(graphed, graph_ps, active=masks[s])
    graph.replay()
    for s in range(K):
        _step(eager, eager_ps, active=masks[s])
    torch.cuda.synchronize()
    for a, b in zip(eager_ps, graph_ps):
        assert torch.equal(a.detach(), b.detach()), name
    assert eager.round_step == graphed.round_step


@needs_triton_cuda
@pytest.mark.parametrize("name", sorted(_batched_builders()))
def test_batched_step_never_synchronises_with_the_host(name):
    ps = _stacked()
    _with_static_grads(ps)
    opt = _batched_builders()[name](ps)
    active = torch.tensor([True, False, True, True, False], device="cuda")
    _steps_never_sync(lambda: _step(opt, ps, active=active), warm=2)


@needs_triton_cuda
@pytest.mark.parametrize("name", sorted(_builders()))
def test_gradients_at_new_addresses_never_synchronise_with_the_host(name):
    """zero_grad(set_to_none=True): each step's new gradients get the plan's tables with their column
    rewritten (a pinned, non-blocking copy), never a wait for the device."""
    from fedopt_kernels.triton_kernels import plans

    ps = _params()
    opt = _builders()[name](ps)
    moved = plans.stats["moved"]

    def step():
        for p in ps:  # new tensors, made on the device (a copy from the host would be a sync itself)
            p.grad = torch.randn_like(p)
        _step(opt, ps)

    _steps_never_sync(step, warm=2)
    assert plans.stats["moved"] > moved


@needs_triton_cuda
def test_a_capture_with_gradients_at_new_addresses_is_refused_and_changes_nothing():
    """A new pointer table is copied from a host buffer a replay would re-read: a capture that needs
    one raises, naming the CUDA graph, and leaves the parameters and step counter as they were."""
    ps = _params()
    opt = _builders()["fednar"](ps)
    opt.start_round()
    alive = []  # every gradient stays alive: the caching allocator would hand their blocks back
    for _ in range(2):
        _with_static_grads(ps)
        alive.append([p.grad for p in ps])
        opt.step()
    _with_static_grads(ps)  # new addresses, allocated before the capture
    before = [p.detach().clone() for p in ps]
    k_before = opt.round_step
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()
    assert opt.round_step == k_before
    for a, b in zip(before, ps):
        assert torch.equal(a, b.detach())
