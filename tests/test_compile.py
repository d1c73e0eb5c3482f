"""``torch.compile(opt.step)`` for every optimizer on every backend: same bits as eager, one graph.

The compiled step is one opaque op (``fedopt::optimizer_step``) whose implementation is the eager
step, so the within-round counter, the schedule, per-round inputs and hyperparameter changes all
reach it; Dynamo never reads a hyperparameter, so an LR scheduler compiles nothing new. CI runs
reference and cpu on CPU; cuda and triton run where a GPU is present.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import cases, require
from torch._dynamo.testing import CompileCounterWithBackend

import fedopt_kernels as fk
from fedopt_kernels.fl import catalogue

# every algorithm's full option set, and the schedule and variance-reduction variants
CONFIGS = [(name, a.full) for name, a in catalogue.ALGOS.items()] + [("feddecay", "linear_every2"), ("padamfed", "vr")]


def _twins(cfg, backend, device, lr_on=None):
    """Two equal optimizers; ``lr_on``: the first group's lr as a 0-d tensor on that device."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in ((6, 3), (5,), (2, 2, 3))]
    a = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    b = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    if lr_on is None:
        return cfg.build(a, backend), a, cfg.build(b, backend), b

    def kw():
        return {**cfg.kwargs, "lr": torch.tensor(cfg.kwargs["lr"], dtype=torch.float64, device=lr_on)}

    return (
        cfg.cls(cfg.param_groups(a), backend=backend, **kw()),
        a,
        cfg.cls(cfg.param_groups(b), backend=backend, **kw()),
        b,
    )


@pytest.mark.parametrize("lr_on", [None, "cpu", "params"], ids=["float_lr", "cpu_tensor_lr", "device_tensor_lr"])
@pytest.mark.parametrize("algo,option", CONFIGS)
@pytest.mark.parametrize("backend,device", cases())
def test_compiled_step_equals_eager_and_a_scheduler_recompiles_nothing(backend, device, algo, option, lr_on):
    """A scheduler changes a float lr by assignment and a tensor lr in place: no new graph either way."""
    require(backend, device)
    if lr_on == "params" and device == "cpu":
        pytest.skip("the parameters are on the CPU: covered by cpu_tensor_lr")
    torch._dynamo.reset()
    cfg = catalogue.config(algo, option)
    eager, a, comp, b = _twins(cfg, backend, device, None if lr_on is None else "cpu" if lr_on == "cpu" else device)
    counter = CompileCounterWithBackend("inductor")
    # compiled before the schedulers exist: a scheduler wraps opt.step in a function Dynamo skips
    step = torch.compile(comp.step, backend=counter, fullgraph=True)
    two_steps = catalogue.ALGOS[algo].cls is fk.FedSAM  # its closure's forward and backward run between them
    if two_steps:
        first, second = (torch.compile(f, backend=counter, fullgraph=True) for f in (comp.first_step, comp.second_step))

        def step(closure):
            first()
            closure()
            second()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": the wrapper is bypassed
        sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9**e) for o in (eager, comp)]
    for rnd in range(2):
        eager.start_round(**cfg.round_inputs(a, rnd))
        comp.start_round(**cfg.round_inputs(b, rnd))
        for k in range(3):
            gstep = 3 * rnd + k
            grads = catalogue.rand_like_list(a, 50 + gstep, 1.0)
            for p, q, g in zip(a, b, grads):
                p.grad, q.grad = g, g.clone()
            eager.step(**cfg.step_inputs(a, gstep))
            step(**cfg.step_inputs(b, gstep))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for s in sched:
                    s.step()
    assert counter.frame_count == (2 if two_steps else 1), f"{counter.frame_count} graphs compiled"
    assert comp.round_step == eager.round_step == 3
    if lr_on is not None:  # the scheduler filled the tensor in place
        assert isinstance(comp.param_groups[0]["lr"], torch.Tensor)
        assert float(comp.param_groups[0]["lr"]) == cfg.kwargs["lr"] * 0.9**6
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
        for key, value in eager.state[p].items():
            assert torch.equal(comp.state[q][key], value), key


@pytest.mark.parametrize("backend,device", cases())
def test_compiled_training_step_with_forward_and_backward(backend, device):
    """A whole compiled training step (forward, backward, step, zero_grad) trains as the same step
    with only the model compiled does.

    The baseline compiles the model too: inductor's code for the model is not ours to test, and on
    some CPU settings (e.g. ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine) it computes another
    forward than eager does; what this test checks is that compiling the optimizer step with it
    changes nothing.
    """
    require(backend, device)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1)).to(device)
    y = x.sum(1, keepdim=True)
    runs = []
    for mode in ("eager", "model compiled", "whole step compiled"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device)
        opt = fk.FedNAR(model.parameters(), lr=0.05, weight_decay=1e-3, max_norm=1.0, backend=backend)
        opt.start_round()
        forward = lambda: torch.nn.functional.mse_loss(model(x), y)  # noqa: E731, B023 (called in this iteration)
        if mode == "model compiled":
            forward = torch.compile(forward)

        def train():  # called in this iteration only: the loop variables it reads are this iteration's
            loss = forward()  # noqa: B023
            loss.backward()
            opt.step()  # noqa: B023
            opt.zero_grad()  # noqa: B023
            return loss

        fn = torch.compile(train) if mode == "whole step compiled" else train
        runs.append([float(fn().detach()) for _ in range(30)])
        assert opt.round_step == 30
    eager, model_only, comp = runs
    assert eager[-1] < 0.3 * eager[0]
    for a, b in zip(model_only, comp):  # inductor may fuse the model's math differently: close, not equal
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a))
