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
from backends import cases, require

import fedopt_kernels as fk
from fedopt_kernels.core import plan_inputs as _params

KW = dict(lr=0.1, momentum=0.9, weight_decay=0.01)


class Pair:
    """FedDecaySGD with beta=1 (torch's SGD on the round API) and ``torch.optim.SGD``, from the same
    values, stepped with the same gradients: ``ours``/``a`` and ``oracle``/``b``."""

    def __init__(self, backend="reference", device="cpu", shapes=((3, 2), (4,), (5,)), seed=0, steps=0, **kw):
        require(backend, device)
        g = torch.Generator().manual_seed(seed)
        init = [torch.randn(s, generator=g) for s in shapes]
        self.device = device
        self.a = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        self.b = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        kw = {**KW, **kw}
        self.ours = fk.FedDecaySGD(self.a, beta=1.0, backend=backend, **kw)
        self.oracle = torch.optim.SGD(self.b, foreach=False, **kw)
        for s in range(steps):
            self.step(s)

    def step(self, seed, skip=()):
        g = torch.Generator().manual_seed(seed)
        for i, (p, q) in enumerate(zip(self.a, self.b)):
            grad = torch.randn(p.shape, generator=g).to(dtype=p.dtype, device=p.device)
            p.grad = None if i in skip else grad
            q.grad = None if i in skip else grad.clone()
        self.ours.step()
        self.oracle.step()

    def both(self, fn):
        """``fn(optimizer, params)`` applied to ours and to the oracle (the same change to both)."""
        fn(self.ours, self.a)
        fn(self.oracle, self.b)

    def check(self, rtol=1e-6, atol=1e-7):
        for p, q in zip(self.a, self.b):
            torch.testing.assert_close(p.detach().cpu().double(), q.detach().cpu().double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend,device", cases())
def test_plan_is_reused_between_unchanged_steps(backend, device):
    run = Pair(backend, device, steps=2)  # the first step's fresh momentum buffers: a one-step plan
    plan = run.ours.step_plan
    for s in range(2, 5):
        run.step(s)
        assert run.ours.step_plan is plan
    run.check()


@pytest.mark.parametrize("backend,device", cases())
def test_lr_change_refreshes_values_without_rebuilding(backend, device):
    run = Pair(backend, device)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5**e) for o in (run.ours, run.oracle)]
    run.step(0)
    run.step(1)
    plan = run.ours.step_plan
    for s in range(2, 6):
        for sched in scheds:
            sched.step()
        run.step(s)
    assert run.ours.step_plan is plan
    run.check()


@pytest.mark.parametrize("backend,device", cases())
def test_structural_hyperparameter_change_rebuilds(backend, device):
    run = Pair(backend, device, momentum=0.0, weight_decay=0.0, steps=1)
    # momentum buffers appear
    run.both(lambda o, _: o.param_groups[0].update(momentum=0.5, weight_decay=0.1, nesterov=True))
    for s in range(1, 4):
        run.step(s)
    run.check()
    with pytest.raises(ValueError, match="momentum"):
        run.ours.param_groups[0]["momentum"] = -1.0
        run.step(9)


@pytest.mark.parametrize("backend,device", cases())
def test_gradient_appearing_and_disappearing(backend, device):
    run = Pair(backend, device)
    for s, skip in enumerate([(1,), (), (0, 2), ()]):
        run.step(s, skip=skip)
    run.check()


@pytest.mark.parametrize("backend,device", cases())
def test_new_gradient_tensors_each_step(backend, device):
    """zero_grad(set_to_none=True): every step sees new gradient tensors (possibly at new addresses)."""
    run = Pair(backend, device)
    keep = []
    for s in range(4):
        keep.append([p.grad for p in run.a])  # old gradients stay alive: the new ones get new addresses
        run.step(s)
    run.check()


@pytest.mark.parametrize("backend,device", cases())
def test_parameter_storage_replaced(backend, device):
    run = Pair(backend, device, steps=2)
    new = torch.randn(4, device=device)
    run.both(lambda _, ps: setattr(ps[1], "data", new.clone()))
    run.step(2)
    run.step(3)
    run.check()


def test_dtype_change_through_data():
    run = Pair(momentum=0.0, steps=1)
    run.both(lambda _, ps: setattr(ps[0], "data", ps[0].data.double()))
    run.step(1)
    run.check()
    assert run.a[0].dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_device_change_through_data():
    run = Pair(momentum=0.0, steps=1)
    run.both(lambda _, ps: [setattr(p, "data", p.data.cuda()) for p in ps])
    run.step(1)
    run.check()
    assert run.ours.step_plan.device.type == "cuda"


@pytest.mark.parametrize("backend,device", cases())
def test_add_param_group_mid_run(backend, device):
    run = Pair(backend, device, steps=1)
    extra = torch.randn(6, device=device)

    def add(opt, ps):
        ps.append(torch.nn.Parameter(extra.clone()))
        opt.add_param_group({"params": [ps[-1]], "lr": 0.05})

    run.both(add)
    for s in range(1, 4):
        run.step(s)
    run.check()


@pytest.mark.parametrize("backend,device", cases())
def test_load_state_dict_mid_run(backend, device):
    run = Pair(backend, device, steps=2)
    # a second optimizer's state (other momentum buffers) loaded into ours
    other = fk.FedDecaySGD(run.a, beta=1.0, backend=backend, **KW)
    other.start_round()  # a round in progress (t = 0): loading it continues that round
    for p in run.a:
        other.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
    run.ours.load_state_dict(other.state_dict())
    oracle_sd = run.oracle.state_dict()
    for i in oracle_sd["state"]:
        oracle_sd["state"][i]["momentum_buffer"] = torch.full_like(run.b[i], 0.5)
    run.oracle.load_state_dict(oracle_sd)
    run.step(2)
    run.check()


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
    run = Pair(steps=1)

    def boom(*args, **kwargs):
        raise AssertionError("an error message was built on a step that raised nothing")

    monkeypatch.setattr(_params, "param_name", boom)
    for s in range(1, 4):
        run.step(s)  # new gradient tensors every step: still no message built
    run.ours.start_round()
    run.oracle.state.clear()  # what start_round does to momentum
    run.step(5)  # a plan rebuild builds none either
    run.check()


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


def test_the_plan_is_built_from_data_alone(monkeypatch):
    """Once the optimizer has gathered ``PlanInputs``, building, checking and updating a plan calls none
    of its hooks: the same plan comes out with every hook replaced by one that raises."""
    from fedopt_kernels.core.plan import StepPlan

    run = Pair(steps=2)
    opt = run.ours
    inputs = opt._stepper.plan_inputs()
    new_lr = opt._stepper.group_inputs([0])

    def boom(*args, **kwargs):
        raise AssertionError("the plan called back into the optimizer")

    for name in (
        "_validate_group",
        "_structure",
        "_hp_row",
        "_row_of",
        "_lr_factor",
        "_step_tensors",
        "_extra_present",
        "_step_roles",
        "_check_grad",
        "_name_of",
        "_group_rows",
        "_schedule",
        "_run",
    ):
        monkeypatch.setattr(opt, name, boom)
    for name in ("group_inputs", "plan_inputs", "gather", "run"):  # the optimizer's stepper, which calls them
        monkeypatch.setattr(opt._stepper, name, boom)
    plan = StepPlan(inputs)
    assert torch.equal(plan.hp, opt.step_plan.hp) and plan.order == opt.step_plan.order
    assert plan.lists.keys() == opt.step_plan.lists.keys()
    assert all(x is y for r in plan.lists for x, y in zip(plan.lists[r], opt.step_plan.lists[r]))
    assert plan.still_valid(opt.param_groups) is True
    opt.param_groups[0]["lr"] = 0.05
    assert plan.still_valid(opt.param_groups) == [0]
    assert plan.update_groups(new_lr)  # the record gathered before the edit: hp rows as given
    assert plan.hp[0, 0].item() == KW["lr"]


def test_a_key_added_to_a_param_group_is_taken_once():
    """A param group that gains a key (a scheduler's own entry, say) changes the values the plan
    compares: taken once, then the plan is steady again (not re-validated at every step)."""
    import fedopt_kernels as fk

    p = torch.nn.Parameter(torch.randn(4))
    opt = fk.FedNAR([p], lr=0.1, weight_decay=0.0, backend="reference")
    p.grad = torch.randn(4)
    opt.step()
    opt.param_groups[0]["initial_lr"] = 0.1
    plan = opt.step_plan
    assert plan.still_valid(opt.param_groups) == [0]
    assert plan.update_groups(opt._stepper.group_inputs([0]))
    assert plan.still_valid(opt.param_groups) is True
