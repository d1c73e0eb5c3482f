"""The papers' invariants (docs/algorithms.md), checked on the reference backend in float64.

These catch a wrong reference: the fused backends are only as right as the reference they match.
"""

import math

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels.core.schedules import DecaySchedule

F64 = dict(dtype=torch.float64)


def _params(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, **F64)) for s in shapes]


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _same_as_torch_sgd(make, a, sgd_kw, steps=3):
    """``make(a)`` and ``torch.optim.SGD(copy of a, **sgd_kw)`` stepped with the same float64 gradients
    end with the same parameters (to float64 rounding)."""
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours, theirs = make(a), torch.optim.SGD(b, **sgd_kw)
    for _ in range(steps):
        grads = [torch.randn(p.shape, **F64) for p in a]
        _set_grads(a, grads)
        _set_grads(b, grads)
        ours.step()
        theirs.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------- FedDecay (docs/algorithms.md)
@pytest.mark.parametrize(
    "schedule,beta,every",
    [
        ("exponential", 0.7, 1),
        ("exponential", 0.5, 3),
        ("linear", 0.8, 1),
        ("linear", 0.3, 2),
        ("exponential", 0.0, 1),
        ("exponential", 1.0, 1),
        (lambda j: 1.0 / (1 + j), 0.5, 1),
        (torch.tensor([1.0, 0.5, 0.25, 0.2, 0.1, 0.0, 0.0]), 0.5, 1),
    ],
)
def test_feddecay_eq5_total_step_is_lr_times_sum_of_schedule(schedule, beta, every):
    """Paper Eq. 5: with a fixed gradient and no momentum, x0 - xK = lr * sum_k s(k // every) * g."""
    (p,) = _params((5, 4))
    g = torch.randn(5, 4, **F64)
    lr, K = 0.3, 7
    opt = fk.FedDecaySGD([p], lr=lr, beta=beta, schedule=schedule, decay_every=every, backend="reference")
    x0 = p.detach().clone()
    opt.start_round()
    for _ in range(K):
        p.grad = g.clone()
        opt.step()
    sched = DecaySchedule(beta, schedule, every)
    total = sum(sched.value(k // every) for k in range(K))
    if isinstance(schedule, str) and schedule == "exponential":
        assert math.isclose(total, sum(beta ** (k // every) for k in range(K)))
    torch.testing.assert_close(x0 - p.detach(), lr * total * g, rtol=1e-12, atol=1e-12)


def test_feddecay_beta0_is_fedsgd_and_beta1_is_fedavg():
    g = torch.randn(6, **F64)
    for beta, moved_steps in ((0.0, 1), (1.0, 4)):
        (p,) = _params((6,))
        x0 = p.detach().clone()
        opt = fk.FedDecaySGD([p], lr=0.1, beta=beta, backend="reference")
        for _ in range(4):
            p.grad = g.clone()
            opt.step()
        torch.testing.assert_close(x0 - p.detach(), 0.1 * moved_steps * g)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(momentum=0.9),
        dict(momentum=0.9, dampening=0.3),
        dict(momentum=0.8, nesterov=True, weight_decay=0.1),
        dict(weight_decay=0.05, maximize=True),
    ],
)
def test_feddecay_is_torch_sgd_with_decayed_lr(kw):
    """Within a round, FedDecaySGD == torch.optim.SGD whose lr is set to lr * beta**k before step k."""
    a = _params((4, 3), (5,), seed=1)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours = fk.FedDecaySGD(a, lr=0.2, beta=0.6, backend="reference", **kw)
    theirs = torch.optim.SGD(b, lr=0.2, **kw)
    for _rnd in range(2):
        ours.start_round()
        theirs.state.clear()  # a new round clears momentum, as a fresh torch optimizer per round would
        for k in range(4):
            grads = [torch.randn(p.shape, **F64) for p in a]
            _set_grads(a, grads)
            _set_grads(b, grads)
            for grp in theirs.param_groups:
                grp["lr"] = 0.2 * 0.6**k
            ours.step()
            theirs.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13)


def test_within_round_decay_scheduler_drives_adam():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=0.01)
    sched = fk.WithinRoundDecay(opt, beta=0.5, decay_every=2)
    seen = []
    for _rnd in range(2):
        sched.start_round()
        for _ in range(5):
            seen.append(opt.param_groups[0]["lr"])
            p.grad = torch.ones(3)
            opt.step()
            sched.step()
    expected = [0.01 * 0.5 ** (k // 2) for k in range(5)]
    assert seen == pytest.approx(expected * 2)


def test_linear_schedule_reaches_zero_and_stays():
    s = DecaySchedule(0.6, "linear")
    assert [s.value(j) for j in range(5)] == pytest.approx([1.0, 0.6, 0.2, 0.0, 0.0])


# ---------------------------------------------------------------- FedNLR (docs/algorithms.md)
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 6, 3)
        self.fc1 = torch.nn.Linear(6 * 6 * 6, 16)
        self.fc2 = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def test_neuron_lr_scales_mean_one_and_ratio_mu():
    torch.manual_seed(0)
    net = _Net().double()
    batches = [(torch.randn(16, 1, 8, 8, **F64), torch.zeros(16)) for _ in range(3)]
    scales = fk.neuron_lr_scales(net, batches)
    layers = [net.conv, net.fc1, net.fc2]
    L = len(layers)
    for ell, m in enumerate(layers, start=1):
        r = scales[m.weight]
        assert r.shape == (m.weight.shape[0],)
        assert torch.equal(scales[m.bias], r), "a bias shares its weight's scale"
        mu = 1 + ell / L + math.log10(r.numel())
        assert r.mean().item() == pytest.approx(1.0, rel=1e-12)
        assert (r.max() / r.min()).item() == pytest.approx(mu, rel=1e-9)


def test_neuron_lr_scales_follow_activation_order_and_relu():
    """Units with larger mean (relu'd) activation get larger scales; the last layer uses raw outputs."""
    lin1, lin2 = torch.nn.Linear(2, 3).double(), torch.nn.Linear(3, 2).double()
    with torch.no_grad():
        lin1.weight.copy_(torch.tensor([[1.0, 0.0], [2.0, 0.0], [-5.0, 0.0]]))
        lin1.bias.zero_()
        lin2.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]))
        lin2.bias.zero_()
    net = torch.nn.Sequential(lin1, torch.nn.ReLU(), lin2)
    x = torch.ones(4, 2, **F64)
    s = fk.neuron_lr_scales(net, [x])
    r1 = s[lin1.weight]
    # hbar = relu(1, 2, -5) = (1, 2, 0): unit 1 largest, unit 2 smallest
    assert r1[1] > r1[0] > r1[2]
    # last layer raw: (1, -1) -> unit 0 larger
    assert s[lin2.weight][0] > s[lin2.weight][1]


def test_neuron_lr_scales_degenerate_layer_is_ones():
    lin = torch.nn.Linear(3, 4).double()
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(0.5)
    s = fk.neuron_lr_scales(lin, [torch.randn(5, 3, **F64)])
    assert torch.equal(s[lin.weight], torch.ones(4, **F64))


def test_neuron_lr_scales_restores_training_mode():
    net = _Net()
    net.train()
    fk.neuron_lr_scales(net, [torch.randn(2, 1, 8, 8)])
    assert net.training


def test_neuron_lr_sgd_scales_rows():
    w, b = _params((3, 4), (3,))
    r = torch.tensor([0.5, 1.0, 2.0], **F64)
    opt = fk.NeuronLRSGD([w, b], lr=0.1, neuron_scales={w: r, b: r}, backend="reference")
    gw, gb = torch.randn(3, 4, **F64), torch.randn(3, **F64)
    w0, b0 = w.detach().clone(), b.detach().clone()
    w.grad, b.grad = gw, gb
    opt.step()
    torch.testing.assert_close(w0 - w.detach(), 0.1 * r[:, None] * gw)
    torch.testing.assert_close(b0 - b.detach(), 0.1 * r * gb)


def test_neuron_lr_sgd_without_scales_is_torch_sgd():
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    _same_as_torch_sgd(lambda a: fk.NeuronLRSGD(a, backend="reference", **kw), _params((4, 3), (4,), seed=3), kw)


# ---------------------------------------------------------------- FedNAR (docs/algorithms.md)
@pytest.mark.parametrize("max_norm", [0.01, 0.5, 3.0, 1e9])
def test_fednar_update_norm_bounded_by_lr_t_times_max_norm(max_norm):
    params = _params((10, 5), (7,), seed=4)
    opt = fk.FedNAR(params, lr=0.3, weight_decay=0.1, max_norm=max_norm, round_decay=0.9, backend="reference")
    for rnd in range(3):
        opt.start_round()
        lt = 0.3 * 0.9**rnd
        for _ in range(2):
            _set_grads(params, [5 * torch.randn(p.shape, **F64) for p in params])
            before = [p.detach().clone() for p in params]
            opt.step()
            delta = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, params)])
            assert delta.norm().item() <= lt * max_norm * (1 + 1e-12)


def test_fednar_equals_sgd_with_weight_decay_when_unclipped():
    kw = dict(lr=0.1, weight_decay=0.01)
    _same_as_torch_sgd(
        lambda a: fk.FedNAR(a, max_norm=1e6, backend="reference", **kw), _params((6, 3), (3,), seed=5), kw
    )


def test_fednar_clip_matches_clip_grad_norm_and_anneals():
    a = _params((6, 3), (3,), seed=6)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt = fk.FedNAR(a, lr=0.2, weight_decay=0.1, max_norm=0.7, round_decay=0.8, backend="reference")
    for rnd in range(3):
        opt.start_round()
        grads = [3 * torch.randn(p.shape, **F64) for p in a]
        _set_grads(a, grads)
        opt.step()
        with torch.no_grad():
            ds = [g + 0.1 * p for g, p in zip(grads, b)]
            for p, d in zip(b, ds):
                p.grad = d
            torch.nn.utils.clip_grad_norm_(b, 0.7)
            for p in b:
                p -= 0.2 * 0.8**rnd * p.grad
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- PAdaMFed (docs/algorithms.md)
@pytest.mark.parametrize("vr", [False, True])
def test_padamfed_every_step_moves_exactly_eta(vr):
    params = _params((8, 4), (5,), (1,), seed=7)
    eta = 0.05
    opt = fk.PAdaMFed(params, lr=eta, beta=0.3, variance_reduction=vr, backend="reference")

    def ctl(s):
        return [torch.randn(p.shape, generator=torch.Generator().manual_seed(s), **F64) for p in params]

    for rnd in range(2):
        opt.start_round(global_control=ctl(rnd), local_control=ctl(rnd + 10), momentum=ctl(rnd + 20))
        for k in range(3):
            _set_grads(params, [torch.randn(p.shape, **F64) for p in params])
            before = [p.detach().clone() for p in params]
            opt.step(**({"anchor_grads": ctl(100 + k)} if vr else {}))
            delta = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, params)])
            assert delta.norm().item() == pytest.approx(eta, rel=1e-12)


def test_padamfed_direction_and_local_control():
    params = _params((3, 2), (2,), seed=8)
    c = [torch.randn(p.shape, **F64) for p in params]
    ci = [torch.randn(p.shape, **F64) for p in params]
    m = [torch.randn(p.shape, **F64) for p in params]
    beta, eta = 0.4, 0.1
    opt = fk.PAdaMFed(params, lr=eta, beta=beta, backend="reference")
    opt.start_round(global_control=c, local_control=ci, momentum=m)
    grads_seen = []
    for _ in range(3):
        G = [torch.randn(p.shape, **F64) for p in params]
        grads_seen.append(G)
        _set_grads(params, G)
        before = [p.detach().clone() for p in params]
        opt.step()
        v = [beta * (g - cc + c0) + (1 - beta) * mm for g, cc, c0, mm in zip(G, ci, c, m)]
        n = torch.cat([t.flatten() for t in v]).norm()
        for b, p, vv in zip(before, params, v):
            torch.testing.assert_close(b - p.detach(), eta * vv / n, rtol=1e-12, atol=1e-14)
    for i, new_ci in enumerate(opt.local_control()):
        torch.testing.assert_close(new_ci, sum(G[i] for G in grads_seen) / 3)


def test_padamfed_vr_direction():
    (p,) = _params((4,), seed=9)
    c, ci, m, H, G = (torch.randn(4, **F64) for _ in range(5))
    opt = fk.PAdaMFed([p], lr=1.0, beta=0.25, variance_reduction=True, backend="reference")
    opt.start_round(global_control=[c], local_control=[ci], momentum=[m])
    before = p.detach().clone()
    p.grad = G.clone()
    opt.step(anchor_grads=[H])
    v = G + 0.25 * (c - ci) + 0.75 * (m - H)
    torch.testing.assert_close(before - p.detach(), v / v.norm())


def test_theory_hparams():
    eta, gamma, beta = fk.theory_hparams(S=10, K=5, T=100)
    assert eta == pytest.approx(1 / (5 * 10))
    assert gamma == pytest.approx(50**0.25 / 100**0.75)
    assert beta == pytest.approx(math.sqrt(50 / 100))
    eta, gamma, beta = fk.theory_hparams(S=10, K=5, T=100, variance_reduction=True)
    assert eta == pytest.approx(1 / 500)
    assert gamma == beta == pytest.approx(50 ** (1 / 3) / 100 ** (2 / 3))
    assert fk.theory_hparams(S=100, K=100, T=1)[2] == 1.0
