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


# ---------------------------------------------------------------- a closure that raises
class _Boom(Exception):
    pass


def _setup(backend, device, batched, seed=20):
    """FedSAM's full option set (momentum, FedProx, SCAFFOLD, two groups of its own) in its first round,
    per-client or client-batched over 3 clients, and step ``k``'s closure (the second gradients)."""
    cfg = catalogue.config("fedsam", catalogue.ALGOS["fedsam"].full)
    dtype = torch.float64 if supports(backend, torch.float64) else torch.float32
    C = 3
    shapes = [(5, 3), (4,), (2, 2, 3)]
    params = _params(*[((C,) if batched else ()) + s for s in shapes], dtype=dtype, seed=seed, device=device)
    opt = (cfg.build_batched if batched else cfg.build)(params, backend)
    order = [p for g in opt.param_groups for p in g["params"]]
    if batched:
        views = [[p[c] for p in order] for c in range(C)]
        opt.start_round(round_index=[0] * C, **cfg.batched_round_inputs(views, order, 0))

        def inputs(k):
            return cfg.batched_step_inputs(views, k, stacked=order)

    else:
        opt.start_round(**cfg.round_inputs(order, 0))

        def inputs(k):
            return cfg.step_inputs(order, k)

    g = torch.Generator().manual_seed(seed + 1)
    slots = [torch.zeros_like(p) for p in params]

    def step_inputs(k, active=None):
        for p, s in zip(params, slots):
            s.copy_(torch.randn(s.shape, generator=g))
            p.grad = s
        out = inputs(k)
        return out if active is None else dict(out, active=active)

    return params, opt, step_inputs


def _same_state(a, b, where=""):
    """Two state_dicts (or parts of them) hold the same values, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (
            where,
            sorted(a, key=str),
            sorted(b, key=str),
        )
        for key in a:
            _same_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _raise_in_closure(backend, device, batched, fail_at):
    """Step ``fail_at`` of two optimizers: in one the closure raises after writing the second
    gradients; that one must be where it was before the step (parameters, state_dict) and then take
    the next step to the bits of the other one, which never saw the failed step."""
    active = torch.tensor([True, False, True], device=device) if batched else None
    params, opt, inputs = _setup(backend, device, batched)
    twin_params, twin, twin_inputs = _setup(backend, device, batched)
    for k in range(fail_at):
        opt.step(**inputs(k, active))
        twin.step(**twin_inputs(k, active))
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    failing = inputs(fail_at, active)
    second = failing.pop("closure")

    def closure():
        second()  # the second gradients are written, then the user's code fails
        raise _Boom("in the closure")

    with pytest.raises(_Boom):
        opt.step(closure, **failing)
    twin_inputs(fail_at)  # the twin's gradient stream stays in step with the failing one's
    for i, (p, b) in enumerate(zip(params, before)):
        assert torch.equal(p.detach(), b), f"parameter {i} is not where the step began"
    _same_state(state, opt.state_dict(), "state_dict")
    opt.step(**inputs(fail_at + 1, active))
    twin.step(**twin_inputs(fail_at + 1, active))
    for i, (a, b) in enumerate(zip(params, twin_params)):
        assert torch.equal(a.detach(), b.detach()), f"parameter {i} after the next step"


@pytest.mark.parametrize("fail_at", [0, 2], ids=["first-step", "third-step"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_client", "batched"])
@pytest.mark.parametrize("backend,device", cases())
def test_a_closure_that_raises_leaves_the_model_and_optimizer_where_the_step_began(backend, device, batched, fail_at):
    """The closure raises after the ascent moved x: x is restored bit for bit (the active clients'
    only: the others never moved), the first step is forgotten (no pending second step, the same
    state_dict), and the next step is the step of an optimizer that never saw the failure."""
    require(backend, device)
    _raise_in_closure(backend, device, batched, fail_at)


def test_the_closure_check_can_fail(monkeypatch):
    """Not vacuous: without the restore (the first step only forgotten), the check above fails."""
    from fedopt_kernels.optim.fedsam import FedSAM

    monkeypatch.setattr(FedSAM, "_abandon", lambda self: setattr(self, "_pending", None))
    with pytest.raises(AssertionError, match="where the step began"):
        _raise_in_closure("reference", "cpu", False, 2)


# ---------------------------------------------------------------- allocations
def _fresh_tensors_per_step(backend, batched, replay, monkeypatch):
    """Tensors made by each of 6 steps of FedSAM's full option set (its closure's work not counted),
    with the replay path on CPU tensors when ``replay`` (a stand-in graph that re-runs the launch)."""
    from allocations import FreshTensors

    from fedopt_kernels.core import replay as _replay

    if replay:
        monkeypatch.setattr(_replay, "DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(_replay, "BACKENDS", ("cuda", "triton", "cpu", "reference"))
        monkeypatch.setattr(_replay.StepReplay, "_record", lambda self, device, run: _Rerun(run))
    params, opt, inputs = _setup(backend, "cpu", batched)
    active = torch.tensor([True, True, False]) if batched else None
    made = []
    for k in range(6):
        step_inputs = inputs(k, active)
        second = step_inputs.pop("closure")
        if active is not None:
            active[1] = k % 2 == 0  # in place, as a simulator keeps its mask

        def closure(second=second):
            seen.paused = True  # the closure's work is the user's (its backward)
            second()
            seen.paused = False

        with FreshTensors() as seen:
            opt.step(closure, **step_inputs)
        made.append(seen.ops)
    return made, opt


class _Rerun:
    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


@pytest.mark.parametrize("replay", [False, True], ids=["eager", "replaying"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_client", "batched"])
def test_no_step_after_the_first_makes_a_tensor(batched, replay, monkeypatch):
    """Every tensor FedSAM's steps need (the ascent's plan, counter and norm, the saved x, the masked
    restore, the descent's momentum buffers, hp rows, counters) is made by the first step and kept:
    later steps, eager or replayed, make none. On a GPU a tensor made in a step moves where the
    caching allocator puts the next gradients, and no step would replay (cpu backend: its kernels
    allocate nothing, so what is counted is the step's own Python side, the same on every backend)."""
    require("cpu", "cpu")
    made, opt = _fresh_tensors_per_step("cpu", batched, replay, monkeypatch)
    assert made[0], "the first step makes the state tensors"
    assert made[1:] == [[]] * 5, f"tensors made per step: {made}"
    if replay:
        stats = opt.replay_stats()
        assert stats["replayed"] >= 6 and stats["wasted"] == 0, stats  # both launches of the last steps


def test_the_tensor_count_can_fail(monkeypatch):
    """Not vacuous: a restore that makes a tensor each step (``x.copy_(where(...))``) is seen."""
    from fedopt_kernels.optim import sam_steps

    def allocating(xs, saved, mask):
        for x, s in zip(xs, saved):
            x.copy_(torch.where(mask.view((-1,) + (1,) * (x.dim() - 1)), s, x))

    monkeypatch.setattr(sam_steps, "masked_restore", allocating)
    made, _ = _fresh_tensors_per_step("cpu", True, False, monkeypatch)
    assert all(any("where" in op for op in ops) for ops in made[1:]), made
