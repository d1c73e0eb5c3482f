"""FedSAM (docs/algorithms.md): the paper's step against an oracle written here in plain torch, its
invariants on every backend this machine runs, the two-step API, its state and its client-batched form.

Every fused backend against the reference over the catalogue's option sets (dtypes, odd sizes, many
tensors, rounds) is tests/test_equivalence.py's and tests/test_batched.py's, which read FedSAM's
option sets from its descriptor like every algorithm's.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from backends import cases, require, supports

import fedopt_kernels as fk
from fedopt_kernels.fl import catalogue
from fedopt_kernels.optim.fedsam import BatchedFedSAM

F64 = dict(dtype=torch.float64)


def _params(*shapes, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype=dtype, device=device)) for s in shapes]


def _quadratic(params, seed=1):
    """A loss whose gradient depends on where it is taken: 0.5 * sum_i a_i * x_i^2 + b_i * x_i."""
    g = torch.Generator().manual_seed(seed)
    coef = [(0.5 + torch.rand(p.shape, generator=g), torch.randn(p.shape, generator=g)) for p in params]

    def loss():
        return sum((0.5 * a.to(p) * p * p + b.to(p) * p).sum() for p, (a, b) in zip(params, coef))

    return loss


def _oracle(
    x,
    grad_at,
    lr,
    rho,
    adaptive=False,
    eta=0.01,
    momentum=0.0,
    dampening=0.0,
    weight_decay=0.0,
    nesterov=False,
    eps=1e-12,
    bufs=None,
):
    """SPEC §14 in float64, one step: the ascent from the gradient at x, the descent from x with the
    gradient at x + e (torch.optim.SGD's step with momentum buffers ``bufs``)."""
    g = grad_at(x)
    w = [xi.abs() + eta if adaptive else torch.ones_like(xi) for xi in x]
    norm = math.sqrt(sum(float(((wi * gi) ** 2).sum()) for wi, gi in zip(w, g)))
    e = [rho * wi * wi * gi / (norm + eps) for wi, gi in zip(w, g)]
    g2 = grad_at([xi + ei for xi, ei in zip(x, e)])
    out = []
    for i, (xi, gi) in enumerate(zip(x, g2)):
        d = gi + weight_decay * xi
        if momentum:
            bufs[i] = d.clone() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * d
            d = d + momentum * bufs[i] if nesterov else bufs[i]
        out.append(xi - lr * d)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(rho=0.05),
        dict(rho=0.5, momentum=0.9, weight_decay=0.01),
        dict(rho=0.2, adaptive=True, eta=0.1, momentum=0.9, nesterov=True),
        dict(rho=0.3, adaptive=True, momentum=0.5, dampening=0.3),
    ],
    ids=["sam", "momentum_wd", "asam_nesterov", "asam_dampening"],
)
def test_the_reference_step_is_the_papers(kw):
    """FedSAM (reference backend, float64) against the oracle above over three steps of a quadratic."""
    params = _params((4, 3), (5,))
    loss = _quadratic(params)
    x = [p.detach().clone() for p in params]
    bufs = [None, None]
    opt = fk.FedSAM(params, lr=0.1, backend="reference", **kw)

    def grad_at(point):
        pts = [t.clone().requires_grad_(True) for t in point]
        saved = [p.data for p in params]
        for p, t in zip(params, pts):
            p.data = t.detach()
        out = torch.autograd.grad(loss(), params)
        for p, s in zip(params, saved):
            p.data = s
        return [o.detach() for o in out]

    def closure():
        opt.zero_grad()
        value = loss()
        value.backward()
        return value

    for _ in range(3):
        x = _oracle(x, grad_at, lr=0.1, bufs=bufs, **kw)
        closure()
        opt.step(closure)
        for p, want in zip(params, x):
            torch.testing.assert_close(p.detach(), want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("backend,device", cases())
def test_rho_zero_is_the_sgd_step_exactly(backend, device):
    """SPEC: with rho = 0 FedSAM is §2's SGD step (FedDecaySGD without decay), bit for bit, and
    torch.optim.SGD's to float64 rounding."""
    require(backend, device)
    dtype = torch.float64 if supports(backend, torch.float64) else torch.float32
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    a = _params((7, 3), (5,), (1,), dtype=dtype, device=device)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    sam = fk.FedSAM(a, rho=0.0, backend=backend, **kw)
    sgd = fk.FedDecaySGD(b, beta=1.0, backend=backend, **kw)
    torch_sgd = torch.optim.SGD(c, **kw)
    for _step in range(4):
        grads = [torch.randn(p.shape, **F64).to(dtype=dtype, device=device) for p in a]
        for ps in (a, b, c):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        sam.step(lambda: None)  # the second gradient is the first
        sgd.step()
        torch_sgd.step()
    tol = 1e-13 if dtype == torch.float64 else None  # float32: torch's default, a few ulp
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend,device", cases())
def test_the_ascent_has_length_rho(backend, device, dtype):
    """SPEC: ||e|| = rho without adaptive (before eps): eps = 0 here, and the norm covers every tensor
    of every param group. The tolerance is the rounding of the n-element sums (n * eps of the dtype)."""
    require(backend, device)
    if not supports(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")
    params = _params((30, 7), (13,), (1,), (64,), dtype=dtype, device=device, seed=3)
    for p in params:
        p.grad = torch.randn(p.shape, dtype=dtype, device=device) * 1e3
    opt = fk.FedSAM([{"params": params[:2]}, {"params": params[2:]}], lr=0.1, rho=0.37, eps=0.0, backend=backend)
    before = [p.detach().clone() for p in params]
    opt.first_step()
    e = torch.cat([(p.detach() - b).double().reshape(-1) for p, b in zip(params, before)])
    n = e.numel()
    assert abs(float(e.norm()) - 0.37) <= 0.37 * n * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("backend,device", cases())
def test_the_second_step_starts_from_the_saved_x_bit_for_bit(backend, device, adaptive, dtype):
    """SPEC: the descent starts from the saved x exactly: with lr = 0 (no weight decay, no momentum)
    the parameters after both steps are the parameters before them, bit for bit, and the saved x is
    that x."""
    require(backend, device)
    params = _params((9, 5), (3,), (0,), dtype=dtype, device=device, seed=4)
    for p in params:
        p.grad = torch.randn(p.shape, device=device).to(dtype)
    opt = fk.FedSAM(params, lr=0.0, rho=0.5, adaptive=adaptive, backend=backend)
    before = [p.detach().clone() for p in params]
    opt.first_step()
    assert any(not torch.equal(p, b) for p, b in zip(params, before) if p.numel())
    for p, b in zip(params, before):
        assert torch.equal(opt.state[p]["saved_x"], b)
        p.grad = torch.randn(p.shape, device=device).to(dtype)  # the second gradient, at x + e
    opt.second_step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


def test_the_saved_x_survives_a_state_dict_between_the_two_steps():
    """A state_dict taken after first_step continues there: the copy's second step restores the
    saved x and descends exactly as the original's does."""
    params = _params((6, 4), (4,), seed=5)
    loss = _quadratic(params)
    opt = fk.FedSAM(params, lr=0.1, rho=0.2, momentum=0.9, backend="reference")
    for _ in range(2):  # momentum buffers and a round under way
        opt.zero_grad()
        loss().backward()
        opt.step(lambda: loss().backward())
    opt.zero_grad()
    loss().backward()
    opt.first_step()
    sd = torch.load(_saved(opt.state_dict()), weights_only=True)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]  # the perturbed model
    other = fk.FedSAM(twins, lr=0.1, rho=0.2, momentum=0.9, backend="reference")
    other.load_state_dict(sd)
    for a, b in zip(params, twins):
        a.grad = torch.randn(a.shape, **F64)
        b.grad = a.grad.clone()
    opt.second_step()
    other.second_step()
    for a, b in zip(params, twins):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="first_step"):
        other.second_step()


def _saved(sd):
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return buf


def test_the_two_step_form_is_enforced():
    (p,) = _params((3,))
    p.grad = torch.ones(3, **F64)
    opt = fk.FedSAM([p], lr=0.1)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"step\(\) needs a closure.*first_step\(\).*second_step\(\)"):
        opt.step()
    with pytest.raises(RuntimeError, match="second_step.*without first_step"):
        opt.second_step()
    assert torch.equal(p.detach(), before)
    opt.first_step()
    with pytest.raises(RuntimeError, match="first_step.*twice"):
        opt.first_step()
    opt.second_step()
    with pytest.raises(TypeError, match="active"):
        opt.first_step(active=[True])


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(rho=-0.1), "rho"),
        (dict(eta=-1.0), "eta"),
        (dict(eps=-1.0), "eps"),
        (dict(adaptive=1), "adaptive"),
        (dict(momentum=-0.5), "momentum"),
    ],
)
def test_bad_hyperparameters_are_named(kw, name):
    with pytest.raises((ValueError, TypeError), match=name):
        fk.FedSAM(_params((3,)), lr=0.1, **kw)


def test_a_rejected_step_changes_nothing():
    """A bad value found at the step (rho made negative) is refused before the ascent moves anything."""
    (p,) = _params((5,))
    p.grad = torch.ones(5, **F64)
    opt = fk.FedSAM([p], lr=0.1)
    opt.step(lambda: None)
    opt.param_groups[0]["rho"] = -1.0
    before = p.detach().clone()
    with pytest.raises(ValueError, match="rho"):
        opt.step(lambda: None)
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("backend,device", cases())
def test_each_client_is_the_per_client_optimizer_and_inactive_clients_keep_everything(backend, device):
    """The client-batched form: client c's steps are the per-client optimizer's on client c alone
    (its own norm), and an inactive client's parameters and state do not change."""
    require(backend, device)
    C = 3
    cfg = catalogue.config("fedsam", "momentum_wd")
    per = [_params((5, 3), (4,), dtype=torch.float32, device=device, seed=10 + c) for c in range(C)]
    stacked = [torch.nn.Parameter(torch.stack([per[c][i].detach() for c in range(C)])) for i in range(2)]
    batched = BatchedFedSAM(stacked, backend=backend, **cfg.kwargs)
    singles = [fk.FedSAM(per[c], backend=backend, **cfg.kwargs) for c in range(C)]
    active = torch.tensor([True, False, True], device=device)
    for step in range(3):
        grads = [[torch.randn(p.shape, device=device) for p in per[c]] for c in range(C)]
        for i, p in enumerate(stacked):
            p.grad = torch.stack([grads[c][i] for c in range(C)])
        mask = active if step == 1 else None
        state1 = copy.deepcopy(batched.state_dict()["state"])
        x1 = [p.detach()[1].clone() for p in stacked]
        batched.step(lambda: [setattr(p, "grad", p.grad + p.detach()) for p in stacked], active=mask)
        for c in range(C):
            if mask is not None and not mask[c]:
                continue
            for p, g in zip(per[c], grads[c]):
                p.grad = g
            singles[c].step(lambda c=c: [setattr(p, "grad", p.grad + p.detach()) for p in per[c]])
        if mask is not None:  # client 1 sat out: its parameters and every state tensor as they were
            assert all(torch.equal(p.detach()[1], x) for p, x in zip(stacked, x1))
            for k, st in batched.state_dict()["state"].items():
                for key, t in st.items():
                    assert torch.equal(t[1], state1[k][key][1]), key
    for i, p in enumerate(stacked):
        for c in range(C):
            torch.testing.assert_close(p.detach()[c], per[c][i].detach(), rtol=2e-5, atol=2e-6)


def test_a_copy_continues_as_the_original():
    """copy.deepcopy (and so pickle) of an optimizer between rounds continues exactly as the original."""
    params = _params((4, 2), (3,), seed=6)
    opt = fk.FedSAM(params, lr=0.1, rho=0.1, momentum=0.9)
    loss = _quadratic(params)
    loss().backward()
    opt.step(lambda: loss().backward())
    twin = copy.deepcopy(opt)
    twin_params = twin.param_groups[0]["params"]
    for a, b in zip(params, twin_params):
        a.grad = torch.randn(a.shape, **F64)
        b.grad = a.grad.clone()
    opt.step(lambda: None)
    twin.step(lambda: None)
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)


def test_a_batched_state_dict_between_the_two_steps_keeps_the_first_steps_mask():
    """An inactive client's saved x is not written by the ascent: a copy loaded between the two steps
    must restore only the active clients, as the original does."""
    C = 3
    stacked = [torch.nn.Parameter(torch.randn(C, 4, 2)), torch.nn.Parameter(torch.randn(C, 3))]
    opt = BatchedFedSAM(stacked, lr=0.1, rho=0.3, momentum=0.9, backend="reference")
    for p in stacked:
        p.grad = torch.randn(p.shape)
    opt.step(lambda: None)  # a step with every client: each has its saved x
    for p in stacked:
        p.grad = torch.randn(p.shape)
    opt.first_step(active=torch.tensor([True, False, True]))
    sd = copy.deepcopy(opt.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in stacked]
    other = BatchedFedSAM(twins, lr=0.1, rho=0.3, momentum=0.9, backend="reference")
    other.load_state_dict(sd)
    for a, b in zip(stacked, twins):
        a.grad = torch.randn(a.shape)
        b.grad = a.grad.clone()
    opt.second_step()
    other.second_step()
    for a, b in zip(stacked, twins):
        assert torch.equal(a, b)
