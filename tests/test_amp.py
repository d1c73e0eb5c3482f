"""GradScaler without a host sync: gradients unscaled inside the kernels, inf/NaN steps skipped.

``_step_supports_amp_scaling`` makes ``torch.amp.GradScaler.step`` hand the optimizer its
``grad_scale`` and ``found_inf`` tensors instead of unscaling (and reading ``found_inf`` back) on
the host. The result must equal the unscale-then-step path, and a skipped step must leave
parameters, state and the round counters as if it had not happened.
"""

from __future__ import annotations

import pytest
import torch
from backends import cases, grad_scaler_unscales, require
from no_sync import no_host_sync

from fedopt_kernels.fl import catalogue

# GradScaler hands its tensors to the optimizers that say they take them (all but FedSAM, whose step
# takes a closure, which GradScaler.step refuses: docs/algorithms.md says how to combine the two)
ALGOS = [name for name, a in catalogue.ALGOS.items() if a.cls._step_supports_amp_scaling]


def _twins(cfg, backend, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in ((6, 3), (5,), (33,))]
    a = [torch.nn.Parameter(t.clone().to(device=device, dtype=dtype)) for t in init]
    b = [torch.nn.Parameter(t.clone().to(device=device, dtype=dtype)) for t in init]
    fused, plain = cfg.build(a, backend), cfg.build(b, backend)
    plain._step_supports_amp_scaling = False  # GradScaler then unscales on the host and checks found_inf
    return fused, a, plain, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("backend,device", cases())
def test_in_kernel_unscaling_equals_unscale_then_step(backend, device, algo, dtype):
    require(backend, device, dtype)
    why = grad_scaler_unscales(device, dtype)
    if why is not None:  # the comparison's unscale-then-step side is torch's own code
        pytest.skip(why)
    cfg = catalogue.config(algo)
    fused, a, plain, b = _twins(cfg, backend, device, dtype)
    scalers = [torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=2) for _ in range(2)]
    fused.start_round(**cfg.round_inputs(a, 0))
    plain.start_round(**cfg.round_inputs(b, 0))
    for k in range(6):
        grads = catalogue.rand_like_list(a, 10 + k, 1.0)
        if k == 3:
            grads[1][2] = float("inf")  # this step is skipped and the scale halves
        for (opt, ps), scaler in zip(((fused, a), (plain, b)), scalers):
            for p, g in zip(ps, grads):
                p.grad = scaler.scale(g.clone())
            scaler.step(opt, **cfg.step_inputs(ps, k))
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert fused.round_step == plain.round_step == 5
    exact = dtype == torch.float32
    for p, q in zip(a, b):
        if exact:
            assert torch.equal(p.detach(), q.detach())
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-2, atol=2e-2)
        for key, value in plain.state[q].items():
            if exact:
                assert torch.equal(fused.state[p][key], value), key
    if algo == "padamfed":  # K counts the steps that happened
        for c, d in zip(fused.local_control(), plain.local_control()):
            torch.testing.assert_close(c, d)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("backend,device", cases())
def test_a_skipped_step_changes_nothing(backend, device, algo):
    require(backend, device)
    cfg = catalogue.config(algo)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in ((4, 3), (7,))]
    opt = cfg.build(params, backend)
    opt.start_round(**cfg.round_inputs(params, 0))
    for p, g in zip(params, catalogue.rand_like_list(params, 1, 1.0)):
        p.grad = g
    opt.step(**cfg.step_inputs(params, 0))
    before = (
        [p.detach().clone() for p in params],
        [{k: v.clone() for k, v in opt.state[p].items()} for p in params],
        opt.round_step,
    )
    opt.grad_scale = torch.full((1,), 1024.0, device=device)
    opt.found_inf = torch.ones((1,), device=device)
    opt.step(**cfg.step_inputs(params, 1))
    del opt.grad_scale, opt.found_inf
    assert opt.round_step == before[2] == 1
    for p, x in zip(params, before[0]):
        assert torch.equal(p.detach(), x)
    for p, st in zip(params, before[1]):
        for key, value in st.items():
            assert torch.equal(opt.state[p][key], value), key


def test_bad_grad_scale_is_refused_before_anything_changes():
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = catalogue.config("fednar").build(params, "reference")
    params[0].grad = torch.ones(3)
    before = params[0].detach().clone()
    opt.grad_scale = torch.ones(2)
    with pytest.raises(TypeError, match="grad_scale"):
        opt.step()
    del opt.grad_scale
    assert torch.equal(params[0].detach(), before) and opt.round_step == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_scaler_step_never_syncs_on_the_gpu(backend, algo):
    require(backend, "cuda")
    cfg = catalogue.config(algo)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((64, 3), (7,))]
    opt = cfg.build(params, backend)
    scaler = torch.amp.GradScaler("cuda")
    opt.start_round(**cfg.round_inputs(params, 0))
    for k in range(3):  # warm-up: plans, tables, kernels
        for p, g in zip(params, catalogue.rand_like_list(params, k, 1.0)):
            p.grad = scaler.scale(g)
        scaler.step(opt, **cfg.step_inputs(params, k))
        scaler.update()
    for p, g in zip(params, catalogue.rand_like_list(params, 9, 1.0)):
        p.grad = scaler.scale(g)
    inputs = cfg.step_inputs(params, 9)
    with no_host_sync():
        scaler.step(opt, **inputs)
    torch.cuda.synchronize()
