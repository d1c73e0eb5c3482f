"""Client-batched optimizers (docs/client_batched.md): client c's result is the per-client optimizer's, alone.

Every algorithm and option set of the catalogue runs on C stacked clients with per-client round
indices, learning-rate scales, round inputs (corrections, scales, controls), per-step inputs and
active masks, on reference and every fused backend that implements the batched ops; each client
is compared with the package's per-client optimizer (reference backend) run on that client alone.
"""

from __future__ import annotations

import pytest
import torch
from backends import DEVICES

from fedopt_kernels.core import registry as _registry
from fedopt_kernels.fl import catalogue

SHAPES = [(4, 3), (7,), (2, 3, 2), (0,), (33,)]
C = 3
ROUNDS, STEPS = 2, 3
T = [0, 2, 5]  # per-client round index of the first round
SCALE = [1.0, 0.5, 2.0]  # per-client learning-rate scale
ACTIVE = [[True] * C, [True, False, True], [False, False, True]]  # client 1 stops after 1 step, client 0 after 2
TOL = {torch.float32: (2e-5, 2e-6), torch.float64: (1e-10, 1e-12), torch.bfloat16: (3e-2, 3e-2)}


def _init(dtype, device):
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(s, generator=g).to(dtype=dtype, device=device) for s in SHAPES] for _ in range(C)]


def _grad(step, c, p):
    g = torch.Generator().manual_seed(1000 + 10 * step + c)
    return torch.randn(p.shape, generator=g).to(dtype=p.dtype, device=p.device)


def _per_client(cfg, init, c, backend="reference"):
    params = [torch.nn.Parameter(t.clone()) for t in init[c]]
    opt = cfg.build(params, backend)
    ordered = [p for g in opt.param_groups for p in g["params"]]  # per-parameter inputs follow this order
    for _ in range(T[c]):
        opt.start_round()
    for rnd in range(ROUNDS):
        inputs = cfg.round_inputs(ordered, rnd, 100 * c)
        opt.start_round(**inputs)
        for group in opt.param_groups:  # this round's lr of client c
            group["lr"] = (
                cfg.kwargs["lr"] * SCALE[c]
                if group is opt.param_groups[0]
                else cfg.groups["lr"] * SCALE[c]
                if cfg.groups and "lr" in cfg.groups
                else cfg.kwargs["lr"] * SCALE[c]
            )
        for k in range(STEPS):
            if not ACTIVE[k][c]:
                continue
            for p in params:
                p.grad = _grad(rnd * STEPS + k, c, p)
            opt.step(**cfg.step_inputs(ordered, rnd * STEPS + k, 100 * c))
    return params, opt


def _batched(cfg, init, backend):
    params = [torch.nn.Parameter(torch.stack([init[c][i] for c in range(C)]).clone()) for i in range(len(SHAPES))]
    opt = cfg.build_batched(params, backend)
    ordered = [p for g in opt.param_groups for p in g["params"]]
    views = [[p[c] for p in ordered] for c in range(C)]
    for rnd in range(ROUNDS):
        opt.start_round(
            round_index=[t + rnd for t in T], lr_scale=SCALE, **cfg.batched_round_inputs(views, ordered, rnd)
        )
        for k in range(STEPS):
            for p in params:
                p.grad = torch.stack([_grad(rnd * STEPS + k, c, p[c]) for c in range(C)])
            opt.step(
                active=torch.tensor(ACTIVE[k], device=params[0].device),
                **cfg.batched_step_inputs(views, rnd * STEPS + k),
            )
    return params, opt


def _backends(op: str, device: str):
    out = []
    for b in _registry.BACKENDS:
        why = _registry.unavailable_reason(b, torch.device(device), op)
        out.append(pytest.param(b, marks=pytest.mark.skipif(why is not None, reason=str(why))))
    return out


CASES = [(a, o) for a, algo in catalogue.ALGOS.items() for o in algo.options]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("algo,option", CASES)
@pytest.mark.parametrize("backend", _registry.BACKENDS)
def test_each_client_matches_the_per_client_optimizer(backend, algo, option, dtype, device):
    cfg = catalogue.config(algo, option)
    why = _registry.unavailable_reason(backend, torch.device(device), cfg.cls._spec.name + "_batched")
    if why is not None:
        pytest.skip(why)
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("triton takes float32/bfloat16/float16")
    init = _init(dtype, device)
    params, opt = _batched(cfg, init, backend)
    rtol, atol = TOL[dtype]
    exact = backend == "reference"
    for c in range(C):
        ref, ref_opt = _per_client(cfg, init, c)
        for i, (a, b) in enumerate(zip(ref, params)):
            if exact:
                assert torch.equal(a.detach(), b.detach()[c]), f"client {c} parameter {i}"
            else:
                torch.testing.assert_close(b.detach()[c], a.detach(), rtol=rtol, atol=atol)
            for key, value in ref_opt.state[a].items():
                got = opt.state[b][key][c]
                if exact:
                    assert torch.equal(got, value), (c, i, key)
                else:
                    torch.testing.assert_close(got, value, rtol=rtol, atol=atol)
        assert opt.round_step[c] == ref_opt.round_step
    if algo == "padamfed":
        for c in range(C):
            ref, ref_opt = _per_client(cfg, init, c)
            for x, y in zip(ref_opt.local_control(), opt.local_control()):
                torch.testing.assert_close(y[c], x, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo,option", CASES)
@pytest.mark.parametrize("backend", [b for b in _registry.BACKENDS if b != "reference"])
def test_each_client_is_bitwise_the_same_backends_per_client_step(backend, algo, option, device):
    """The batched kernels are the per-client kernels over client slices: on one backend, client c's
    parameters and state are the bits of that backend's per-client optimizer on client c alone,
    whatever the slices' alignment (odd sizes put most of them off 16 bytes)."""
    cfg = catalogue.config(algo, option)
    for op in (cfg.cls._spec.name, cfg.cls._spec.name + "_batched"):
        why = _registry.unavailable_reason(backend, torch.device(device), op)
        if why is not None:
            pytest.skip(why)
    init = _init(torch.float32, device)
    params, opt = _batched(cfg, init, backend)
    for c in range(C):
        ref, ref_opt = _per_client(cfg, init, c, backend)
        for i, (a, b) in enumerate(zip(ref, params)):
            assert torch.equal(a.detach(), b.detach()[c]), f"client {c} parameter {i}"
            for key, value in ref_opt.state[a].items():
                assert torch.equal(opt.state[b][key][c], value), (c, i, key)


def _stacked(c=C, shapes=((4, 3), (5,))):
    return [torch.nn.Parameter(torch.randn(c, *s)) for s in shapes]


def test_leading_dimensions_must_agree():
    with pytest.raises(ValueError, match="leading"):
        catalogue.config("fednar").build_batched(
            [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4, 2))]
        )
    with pytest.raises(ValueError, match="0-dim"):
        catalogue.config("fednar").build_batched([torch.nn.Parameter(torch.tensor(1.0))])


@pytest.mark.parametrize("active", [torch.ones(4, dtype=torch.bool), torch.ones(3), [True, False]])
def test_bad_active_mask_is_refused_and_changes_nothing(active):
    params = _stacked()
    opt = catalogue.config("feddecay", "momentum").build_batched(params)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="active"):
        opt.step(active=active)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert opt.round_step == [0, 0, 0]


def test_bad_per_client_inputs_are_named():
    params = _stacked()
    opt = catalogue.config("fednar").build_batched(params)
    with pytest.raises(ValueError, match="round_index"):
        opt.start_round(round_index=[0, 1])
    with pytest.raises(ValueError, match="lr_scale"):
        opt.start_round(lr_scale=[1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="correction"):
        opt.start_round(correction=[torch.zeros(2, 4, 3), torch.zeros(3, 5)])
    nlr = catalogue.config("neuron_lr", "scales").build_batched(params)
    with pytest.raises(ValueError, match=r"\[clients, M\]"):
        nlr.set_neuron_scales({params[0]: torch.ones(4)})
    assert opt.round_index == -1


def test_inactive_clients_keep_parameters_state_and_counter():
    params = _stacked()
    opt = catalogue.config("feddecay", "momentum").build_batched(params)
    opt.start_round()
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in params]
    opt.step(active=torch.tensor([False, True, False]))
    for p, b, m in zip(params, before, bufs):
        assert torch.equal(p.detach()[0], b[0]) and torch.equal(p.detach()[2], b[2])
        assert not torch.equal(p.detach()[1], b[1])
        assert torch.equal(opt.state[p]["momentum_buffer"][0], m[0])
    assert opt.round_step == [1, 2, 1]
