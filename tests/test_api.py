"""The optimizers behave as torch.optim users expect: closures, zero_grad, schedulers, param groups,
round API bookkeeping, backend selection and reporting."""

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels.core import registry as _registry

OPTIMIZERS = {
    "FedDecaySGD": lambda ps, **kw: fk.FedDecaySGD(ps, lr=0.1, beta=0.5, **kw),
    "NeuronLRSGD": lambda ps, **kw: fk.NeuronLRSGD(ps, lr=0.1, **kw),
    "FedNAR": lambda ps, **kw: fk.FedNAR(ps, lr=0.1, weight_decay=0.01, **kw),
    "PAdaMFed": lambda ps, **kw: fk.PAdaMFed(ps, lr=0.1, beta=0.5, **kw),
}


def test_public_names():
    for name in [
        "FedDecaySGD",
        "WithinRoundDecay",
        "NeuronLRSGD",
        "neuron_lr_scales",
        "FedNAR",
        "PAdaMFed",
        "theory_hparams",
        "available_backends",
    ]:
        assert name in fk.__all__ and hasattr(fk, name)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_is_a_torch_optimizer_with_closure_and_zero_grad(name):
    model = torch.nn.Linear(3, 2)
    opt = OPTIMIZERS[name](model.parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    x = torch.randn(4, 3)
    w0 = model.weight.detach().clone()

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert not torch.equal(model.weight.detach(), w0)
    opt.zero_grad()
    assert model.weight.grad is None


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_lr_scheduler_and_hand_edits_take_effect(name):
    p = torch.nn.Parameter(torch.zeros(4))
    opt = OPTIMIZERS[name]([p])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    p.grad = torch.ones(4)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = p.detach().clone()
    opt.step()
    torch.testing.assert_close(p.detach(), before)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_round_counters(name):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = OPTIMIZERS[name]([p])
    assert opt.round_index == -1
    p.grad = torch.ones(2)
    opt.step()  # implicit start_round
    assert (opt.round_index, opt.round_step) == (0, 1)
    opt.start_round()
    opt.step()
    opt.step()
    assert (opt.round_index, opt.round_step) == (1, 2)


def test_start_round_clears_momentum_unless_asked():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = fk.FedDecaySGD([p], lr=0.1, beta=1.0, momentum=0.9)
    p.grad = torch.ones(2)
    opt.step()
    assert "momentum_buffer" in opt.state[p]
    opt.start_round(reset_state=False)
    assert "momentum_buffer" in opt.state[p]
    opt.start_round()
    assert "momentum_buffer" not in opt.state[p]


def test_prox_anchor_is_round_start():
    p = torch.nn.Parameter(torch.ones(2))
    opt = fk.FedDecaySGD([p], lr=0.1, beta=1.0, prox_mu=1.0)
    opt.start_round()
    p.grad = torch.zeros(2)
    with torch.no_grad():
        p.add_(1.0)  # moved away from the anchor by 1: prox gradient is mu * 1
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((2,), 2.0 - 0.1))


def test_add_param_group_and_per_group_lr():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = fk.FedDecaySGD([a], lr=0.1, beta=1.0)
    opt.add_param_group({"params": [b], "lr": 0.01})
    a.grad = b.grad = torch.ones(2)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.full((2,), -0.1))
    torch.testing.assert_close(b.detach(), torch.full((2,), -0.01))
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": -1.0})


def test_available_backends_reports_reasons():
    ab = fk.available_backends()
    assert "reference" in ab
    assert set(ab) | set(ab.missing) == set(_registry.BACKENDS)
    for _name, why in ab.missing.items():
        assert isinstance(why, str) and why
    assert "available" in repr(ab)


def test_auto_picks_per_spec():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = fk.FedNAR([p], lr=0.1, weight_decay=0.0)
    expected = "cpu" if "cpu" in fk.available_backends("cpu") else "reference"
    assert opt.resolved_backend() == expected


def test_backend_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("FEDOPT_DISABLE_CPU", "1")
    monkeypatch.delitem(_registry._LOAD_ERRORS, "cpu", raising=False)
    try:
        assert "cpu" not in fk.available_backends("cpu")
        assert "FEDOPT_DISABLE_CPU" in fk.available_backends("cpu").missing["cpu"]
    finally:
        _registry._LOAD_ERRORS.pop("cpu", None)


def test_params_without_grad_are_skipped():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    for name, make in OPTIMIZERS.items():
        opt = make([a, b])
        a.grad, b.grad = torch.ones(2), None
        before = b.detach().clone()
        opt.step()
        assert torch.equal(b.detach(), before), name


def test_selfcheck_catches_a_wrong_backend(monkeypatch, capsys):
    """The install smoke test must fail when a backend computes something else than reference."""
    from fedopt_kernels import selfcheck
    from fedopt_kernels.core.reference import sgd_step

    def off_by_a_bit(*args, cache=None):
        sgd_step(*args)
        for p in args[0]:
            p.mul_(1.01)

    monkeypatch.setitem(_registry._LOAD_ERRORS, "cpu", None)
    monkeypatch.setitem(_registry.IMPLS["sgd"], "cpu", off_by_a_bit)
    monkeypatch.setitem(_registry.IMPLS["fednar"], "cpu", _registry.IMPLS["fednar"]["reference"])
    monkeypatch.setitem(_registry.IMPLS["padamfed"], "cpu", _registry.IMPLS["padamfed"]["reference"])
    monkeypatch.setattr(selfcheck, "TOL", {torch.float32: 2e-5})
    assert selfcheck.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FedDecaySGD" in out
