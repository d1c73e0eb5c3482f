"""The cached step plan: reused while nothing changes, never stale when something does.

Each cause of change named by the dispatch design (add_param_group, load_state_dict, start_round
inputs, set_neuron_scales, ``p.data = ...``, a gradient appearing or disappearing, dtype and
device, a hyperparameter value) is applied in the middle of a run; the next step must equal an
independent oracle: ``torch.optim.SGD`` (FedDecaySGD with beta=1 is SGD) or the update written
out by hand. The oracle is stepped with the same change applied, so a stale plan shows as a
difference. Error messages are built only when raising.
"""
from __future__ import annotations

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels import _params

from backends import cases, require

KW = dict(lr=0.1, momentum=0.9, weight_decay=0.01)


def _pair(shapes=((3, 2), (4,), (5,)), seed=0, device="cpu", backend="reference", **kw):
    """(ours, params) and (torch SGD, params) starting from the same values."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in shapes]
    a = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    b = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    kw = {**KW, **kw}
    ours = fk.FedDecaySGD(a, beta=1.0, backend=backend, **kw)
    oracle = torch.optim.SGD(b, foreach=False, **kw)
    return ours, a, oracle, b


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(dtype=p.dtype, device=p.device) for p in params]


def _step(ours, a, oracle, b, seed, skip=()):
    for i, (p, q, g) in enumerate(zip(a, b, _grads(a, seed))):
        p.grad = None if i in skip else g
        q.grad = None if i in skip else g.clone()
    ours.step()
    oracle.step()


def _same(a, b, rtol=1e-6, atol=1e-7):
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach().cpu().double(), q.detach().cpu().double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend,device", cases())
def test_plan_is_reused_between_unchanged_steps(backend, device):
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend)
    _step(ours, a, oracle, b, 0)  # fresh momentum buffers: a one-step plan
    _step(ours, a, oracle, b, 1)
    plan = ours._plan
    for s in range(2, 5):
        _step(ours, a, oracle, b, s)
        assert ours._plan is plan
    _same(a, b)


@pytest.mark.parametrize("backend,device", cases())
def test_lr_change_refreshes_values_without_rebuilding(backend, device):
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend)
    sched_a = torch.optim.lr_scheduler.LambdaLR(ours, lambda e: 0.5 ** e)
    sched_b = torch.optim.lr_scheduler.LambdaLR(oracle, lambda e: 0.5 ** e)
    _step(ours, a, oracle, b, 0)
    _step(ours, a, oracle, b, 1)
    plan = ours._plan
    for s in range(2, 6):
        sched_a.step()
        sched_b.step()
        _step(ours, a, oracle, b, s)
    assert ours._plan is plan
    _same(a, b)


@pytest.mark.parametrize("backend,device", cases())
def test_structural_hyperparameter_change_rebuilds(backend, device):
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend, momentum=0.0, weight_decay=0.0)
    _step(ours, a, oracle, b, 0)
    for o in (ours, oracle):
        o.param_groups[0]["momentum"] = 0.5   # momentum buffers appear
        o.param_groups[0]["weight_decay"] = 0.1
        o.param_groups[0]["nesterov"] = True
    for s in range(1, 4):
        _step(ours, a, oracle, b, s)
    _same(a, b)
    with pytest.raises(ValueError, match="momentum"):
        ours.param_groups[0]["momentum"] = -1.0
        _step(ours, a, oracle, b, 9)


@pytest.mark.parametrize("backend,device", cases())
def test_gradient_appearing_and_disappearing(backend, device):
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend)
    _step(ours, a, oracle, b, 0, skip=(1,))
    _step(ours, a, oracle, b, 1)
    _step(ours, a, oracle, b, 2, skip=(0, 2))
    _step(ours, a, oracle, b, 3)
    _same(a, b)


@pytest.mark.parametrize("backend,device", cases())
def test_new_gradient_tensors_each_step(backend, device):
    """zero_grad(set_to_none=True): every step sees new gradient tensors (possibly at new addresses)."""
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend)
    keep = []
    for s in range(4):
        keep.append([p.grad for p in a])  # old gradients stay alive: the new ones get new addresses
        _step(ours, a, oracle, b, s)
    _same(a, b)


@pytest.mark.parametrize("backend,device", cases())
def test_parameter_storage_replaced(backend, device):
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend)
    _step(ours, a, oracle, b, 0)
    _step(ours, a, oracle, b, 1)
    with torch.no_grad():
        new = torch.randn(4, device=device)
        a[1].data = new.clone()
        b[1].data = new.clone()
    _step(ours, a, oracle, b, 2)
    _step(ours, a, oracle, b, 3)
    _same(a, b)


def test_dtype_change_through_data():
    ours, a, oracle, b = _pair(momentum=0.0)
    _step(ours, a, oracle, b, 0)
    a[0].data = a[0].data.double()
    b[0].data = b[0].data.double()
    _step(ours, a, oracle, b, 1)
    _same(a, b)
    assert a[0].dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_device_change_through_data():
    ours, a, oracle, b = _pair(momentum=0.0)
    _step(ours, a, oracle, b, 0)
    for ps in (a, b):
        for p in ps:
            p.data = p.data.cuda()
    _step(ours, a, oracle, b, 1)
    _same(a, b)
    assert ours._plan.device.type == "cuda"


@pytest.mark.parametrize("backend,device", cases())
def test_add_param_group_mid_run(backend, device):
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend)
    _step(ours, a, oracle, b, 0)
    extra = torch.randn(6, device=device)
    pa, pb = torch.nn.Parameter(extra.clone()), torch.nn.Parameter(extra.clone())
    ours.add_param_group({"params": [pa], "lr": 0.05})
    oracle.add_param_group({"params": [pb], "lr": 0.05})
    a.append(pa)
    b.append(pb)
    for s in range(1, 4):
        _step(ours, a, oracle, b, s)
    _same(a, b)


@pytest.mark.parametrize("backend,device", cases())
def test_load_state_dict_mid_run(backend, device):
    require(backend, device)
    ours, a, oracle, b = _pair(device=device, backend=backend)
    _step(ours, a, oracle, b, 0)
    _step(ours, a, oracle, b, 1)
    # a second optimizer's state (other momentum buffers) loaded into ours
    other = fk.FedDecaySGD(a, beta=1.0, backend=backend, **KW)
    other.start_round()  # a round in progress (t = 0): loading it continues that round
    for p in a:
        other.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
    sd = other.state_dict()
    ours.load_state_dict(sd)
    oracle_sd = oracle.state_dict()
    for i in oracle_sd["state"]:
        oracle_sd["state"][i]["momentum_buffer"] = torch.full_like(b[i], 0.5)
    oracle.load_state_dict(oracle_sd)
    _step(ours, a, oracle, b, 2)
    _same(a, b)


@pytest.mark.parametrize("backend,device", cases())
def test_start_round_inputs_reach_the_next_step(backend, device):
    """A new SCAFFOLD correction each round: d = g + c (checked by hand, FedDecaySGD beta=1, no momentum)."""
    require(backend, device)
    p = torch.nn.Parameter(torch.zeros(5, device=device))
    opt = fk.FedDecaySGD([p], lr=1.0, beta=1.0, backend=backend)
    expected = torch.zeros(5, device=device)
    for rnd in range(3):
        c = torch.full((5,), float(rnd + 1), device=device)
        opt.start_round(correction=[c])
        p.grad = torch.ones(5, device=device)
        opt.step()
        expected -= 1.0 + (rnd + 1)
        torch.testing.assert_close(p.detach(), expected)


@pytest.mark.parametrize("backend,device", cases())
def test_set_neuron_scales_reaches_the_next_step(backend, device):
    require(backend, device)
    w = torch.nn.Parameter(torch.zeros(3, 2, device=device))
    opt = fk.NeuronLRSGD([w], lr=1.0, backend=backend)
    expected = torch.zeros(3, 2, device=device)
    for r in ([1.0, 2.0, 3.0], [0.5, 0.5, 4.0]):
        scale = torch.tensor(r, device=device)
        opt.set_neuron_scales({w: scale})
        w.grad = torch.ones(3, 2, device=device)
        opt.step()
        expected -= scale[:, None].expand(3, 2)
        torch.testing.assert_close(w.detach(), expected)


@pytest.mark.parametrize("backend,device", cases())
def test_padamfed_controls_of_each_round_are_used(backend, device):
    """D = beta*(c - c_i) + (1 - beta)*m changes every round; a step with G = 0 moves along -D."""
    require(backend, device)
    p = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = fk.PAdaMFed([p], lr=0.5, beta=0.5, backend=backend)
    for rnd in range(3):
        c = torch.tensor([1.0, 0.0, 0.0, 0.0], device=device).roll(rnd)
        before = p.detach().clone()
        opt.start_round(global_control=[c])
        p.grad = torch.zeros(4, device=device)
        opt.step()
        torch.testing.assert_close(p.detach() - before, -0.5 * c)


def test_error_messages_are_not_built_on_the_steady_path(monkeypatch):
    ours, a, oracle, b = _pair(backend="reference")
    _step(ours, a, oracle, b, 0)

    def boom(*args, **kwargs):
        raise AssertionError("an error message was built on a step that raised nothing")

    monkeypatch.setattr(_params, "param_name", boom)
    for s in range(1, 4):
        _step(ours, a, oracle, b, s)  # new gradient tensors every step: still no message built
    ours.start_round()
    oracle.state.clear()  # what start_round does to momentum
    _step(ours, a, oracle, b, 5)  # a plan rebuild builds none either
    _same(a, b)


def test_a_rejected_hyperparameter_edit_leaves_no_stale_row_behind():
    """Two groups edited at once, one edit invalid: after fixing it, both new values are used."""
    a = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = fk.FedDecaySGD([{"params": [a[0]]}, {"params": [a[1]]}], lr=1.0, beta=1.0, backend="reference")
    for p in a:
        p.grad = torch.ones(2)
    opt.step()
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    opt.param_groups[1]["lr"] = 0.25
    opt.step()
    torch.testing.assert_close(a[0].detach(), torch.full((2,), -1.5))
    torch.testing.assert_close(a[1].detach(), torch.full((2,), -1.25))
