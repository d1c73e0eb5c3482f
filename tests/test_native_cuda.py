"""What is specific to the ``cuda`` backend (csrc/cuda), on a GPU (skipped without one):

* a step captured in a CUDA graph and replayed gives the same bits as eager steps (every per-step
  scalar - lr_k, the norm, the clip / normalisation factor - lives on the device);
* ``torch.cuda.set_sync_debug_mode("error")`` raises nothing inside ``step()``;
* launches that split (more tensors or batches than one kernel-argument table holds) and mixed
  dtypes still match ``reference``;
* a plan change that would copy from the host while a graph is captured is refused, not recorded.
"""
from __future__ import annotations

import pytest
import torch

from fedopt_kernels import FedDecaySGD, FedNAR, NeuronLRSGD, PAdaMFed
from fedopt_kernels._registry import unavailable_reason

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    _WHY = unavailable_reason("cuda", torch.device("cuda"))
    if _WHY is not None:
        pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=f"cuda backend unavailable: {_WHY}")]

SHAPES = [(1000, 37), (16385,), (64, 3, 3, 3), (0,), (7,), (), (513, 3)]


def _make(name, params, backend):
    if name == "sgd":
        return FedDecaySGD(params, lr=0.1, beta=0.7, momentum=0.9, weight_decay=1e-3, nesterov=True,
                           decay_every=2, backend=backend)
    if name == "neuron":
        opt = NeuronLRSGD(params, lr=0.1, momentum=0.5, backend=backend)
        opt.set_neuron_scales({p: torch.linspace(0.5, 2.0, p.shape[0], device=p.device)
                               for p in params if p.dim() >= 1})
        return opt
    if name == "fednar":
        return FedNAR(params, lr=0.1, weight_decay=1e-2, max_norm=1.0, prox_mu=0.01, backend=backend)
    if name == "padamfed":
        return PAdaMFed(params, lr=0.01, beta=0.3, backend=backend)
    raise ValueError(name)


def _params(dtype=torch.float32, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device="cuda", dtype=dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(device="cuda", dtype=p.dtype) for p in params]


ALGOS = ["sgd", "neuron", "fednar", "padamfed"]
STEPS = 6


@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_graph_replay_equals_eager(algo):
    eager = _params()
    opt = _make(algo, eager, "cuda")
    opt.start_round()
    for k in range(STEPS):
        for p, g in zip(eager, _grads(eager, k)):
            p.grad = g
        opt.step()

    graphed = _params()
    opt = _make(algo, graphed, "cuda")
    opt.start_round()
    static = [torch.empty_like(p) for p in graphed]
    for p, s in zip(graphed, static):
        p.grad = s
    for k in range(2):  # eager warm-up: device counter, schedule table, state, a steady plan
        for s, g in zip(static, _grads(graphed, k)):
            s.copy_(g)
        opt.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()  # recorded, not run
    for k in range(2, STEPS):
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
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()  # first step: lazily created device tensors (counter, schedule table) may copy from the host
    grads = [_grads(params, k) for k in range(1, 4)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("algo", ["sgd", "fednar", "padamfed"])
def test_split_launches_and_mixed_dtypes_match_reference(algo):
    """150 tensors in 70 param groups, four dtypes: several tables per pass, two finalize launches."""
    shapes = [((i * 97) % 5000 + 1,) if i % 4 else (i % 9 + 1, 17) for i in range(150)]
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    out = {}
    for backend in ("reference", "cuda"):
        g = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device="cuda", dtype=dtypes[i % 4]))
                  for i, s in enumerate(shapes)]
        groups = [{"params": params[i::70]} for i in range(70)]
        opt = _make(algo, groups, backend)
        opt.start_round()
        for k in range(3):
            for p, gr in zip(params, _grads(params, k)):
                p.grad = gr
            opt.step()
        out[backend] = params
    for i, (a, b) in enumerate(zip(out["reference"], out["cuda"])):
        tol = {torch.float64: 1e-10, torch.float32: 2e-5}.get(a.dtype, 3e-2)
        torch.testing.assert_close(b.double(), a.double(), rtol=tol, atol=tol, msg=lambda m: f"tensor {i}: {m}")


def test_capture_refuses_a_plan_that_needs_a_host_copy():
    params = _params()
    opt = _make("sgd", params, "cuda")
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()  # fresh momentum buffers: the next step builds a new plan with other hp rows
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            opt.step()
