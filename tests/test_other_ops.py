"""A second op of a step (docs/dispatch.md, "A second op in a step"): ``OtherOp`` declarations and
the base's ``_run_op``, on a small optimizer that pushes its parameters with ``sam_ascent``.

FedSAM's ascent runs this way (tests/test_fedsam.py, tests/test_replay.py); a whole algorithm built
on it is tests/test_adding_an_algorithm.py's PushSGD. Here: the roles fed from the state and per
launch give the same bits, an hp edit reaches the kept plan, and bad declarations and inputs are
refused with their names, changing nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from backends import cases, require

from fedopt_kernels.core import plan_inputs
from fedopt_kernels.core.op_runner import OtherOp
from fedopt_kernels.core.ops import SAM_ASCENT, SGD
from fedopt_kernels.optim.sgd import SGDFamily

_PUSH_COLUMNS = {"eta": 0.0, "adaptive": 0.0}


class Pushed(SGDFamily):
    """SGD with a push op (``sam_ascent`` with w = 1) whose saved x is state key ``before``."""

    _state_keys = SGDFamily._state_keys + ("before",)
    _hp_columns = {"maximize": 0.0}
    _other_ops = (OtherOp("push", SAM_ASCENT, state={"saved_x": "before"}, columns=_PUSH_COLUMNS),)

    def __init__(self, params, backend="reference", rho=0.5):
        defaults = dict(
            lr=0.1, rho=rho, eps=1e-12, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, prox_mu=0.0
        )
        super().__init__(params, defaults, backend)


class PushedGiven(Pushed):
    """The same push, its saved x given at each launch instead of kept as state."""

    _other_ops = (OtherOp("push", SAM_ASCENT, step_roles=("saved_x",), columns=_PUSH_COLUMNS),)


def _params(seed=0, device="cpu"):
    """Four parameters (one of them empty), each with a gradient."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in ((5, 3), (4,), (0,), (7,))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device)
    return params


@pytest.mark.parametrize("backend, device", cases())
def test_state_fed_and_step_fed_roles_give_the_same_bits(backend, device):
    require(backend, device)
    a, b = _params(device=device), _params(device=device)
    before = [p.detach().clone() for p in a]
    opt_a, opt_b = Pushed(a, backend), PushedGiven(b, backend)
    given = [torch.zeros_like(p) for p in b]
    for _ in range(2):
        plan_a = opt_a._run_op("push")
        opt_b._run_op("push", saved_x=given)
    assert plan_a.order == [0, 1, 2, 3] and plan_a.spec.name == "sam_ascent"
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.detach(), y.detach()), i
        if x.numel():
            assert not torch.equal(x.detach(), before[i]), i  # the push moved it
            assert torch.equal(opt_a.state[x]["before"], given[i]), i  # both saved the x of the second push
    assert "before" not in opt_b.state.get(b[0], {})  # a step role is never state


def test_an_hp_edit_reaches_the_kept_plan():
    params = _params()
    x0 = [p.detach().clone() for p in params]
    opt = Pushed(params, rho=0.5)
    plan = opt._run_op("push")
    first = [p.detach() - x for p, x in zip(params, x0)]
    opt.param_groups[0]["rho"] = 1.0
    with torch.no_grad():
        for p, x in zip(params, x0):
            p.copy_(x)
    assert opt._run_op("push") is plan  # rows rewritten in place, the plan kept
    # e scales with rho exactly (a power of two); x + e and its difference from x round once each
    for p, x, d in zip(params, x0, first):
        if x.numel():
            atol = 4 * torch.finfo(x.dtype).eps * float((x.abs() + 2 * d.abs()).max())
            torch.testing.assert_close(p.detach() - x, 2 * d, rtol=0, atol=atol)


def test_a_plan_is_listed_and_reinstated_with_the_steps_own():
    params = _params()
    opt = Pushed(params)
    assert opt.step_plans == ()
    push = opt._run_op("push")
    opt.step()
    assert opt.step_plans == (push, opt.step_plan)
    push.hp.zero_()
    opt.reinstate_plans(opt.step_plans)
    assert float(push.hp[0, 0]) == 0.5  # its row written back from the param group, in place


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: OtherOp("x", SAM_ASCENT, state={"momentum_buffer": "m"}), ["momentum_buffer"]),
        (lambda: OtherOp("x", SAM_ASCENT, state={"saved_x": "s"}, step_roles=("saved_x",)), ["twice"]),
        (lambda: OtherOp("x", SGD, state={"neuron_scale": "r"}), ["per-row", "neuron_scale"]),
        (lambda: OtherOp("x", SAM_ASCENT, columns={"rh0": "rho"}), ["rh0"]),
        (lambda: OtherOp("x", dataclasses.replace(SAM_ASCENT, batched=True)), ["per-client"]),
    ],
)
def test_a_bad_declaration_is_refused_naming_what(make, words):
    with pytest.raises(ValueError) as err:
        make()
    assert all(w in str(err.value) for w in words), err.value


def test_bad_launch_inputs_are_refused_naming_them_and_change_nothing():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = PushedGiven(params)
    with pytest.raises(TypeError, match="saved_x"):
        opt._run_op("push")
    with pytest.raises(TypeError, match="no tensor for parameter 1"):
        opt._run_op("push", saved_x=[torch.zeros_like(params[0]), None, None, torch.zeros_like(params[3])])
    with pytest.raises(ValueError, match=r"saved_x of op 'push' for parameter 3 .*\(6,\)"):
        opt._run_op("push", saved_x=[torch.zeros_like(p) for p in params[:3]] + [torch.zeros(6)])
    with pytest.raises(KeyError, match="no other op 'pull'"):
        opt._run_op("pull")
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_a_tensor_in_an_hp_column_is_refused_naming_it():
    group = {"rho": torch.tensor(0.5), "eta": 0.0, "eps": 0.0, "adaptive": False}
    with pytest.raises(TypeError, match="'rho'"):
        plan_inputs.row(SAM_ASCENT, {}, group)
    assert plan_inputs.row(SAM_ASCENT, {"rho": 0.25}, group) == [0.25, 0.0, 0.0, 0.0]
