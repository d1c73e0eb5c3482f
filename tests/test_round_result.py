"""A round whose new model or server state is not finite is refused (fedopt_kernels.sim.round_result):
named in the round's record, the previous model and server state kept, client by client and
client-batched alike (a run on several processes: tests/test_sim_rank_agreement.py).

The case that needs the check: PAdaMFed updates of 3e38, each finite (the screen accepts them),
whose server step overflows float32.
"""

import pytest
import torch
from test_sim_streamed import config

from fedopt_kernels.sim.round_result import not_finite
from fedopt_kernels.sim.simulation import Simulation

pytestmark = pytest.mark.usefixtures("one_thread")


def huge_updates(sim, value=3e38):
    """Every client's update (and control change) replaced by finite ``value``s."""
    finish = sim.strategy.finish

    def spy(cid, opt, t):
        u = finish(cid, opt, t)
        u.delta = [torch.full_like(d, value) for d in u.delta]
        if "dc" in u.extra:
            u.extra["dc"] = [torch.full_like(d, value) for d in u.extra["dc"]]
        return u

    sim.strategy.finish = spy
    return finish


@pytest.mark.parametrize("batched", [1, 4], ids=["sequential", "client-batched"])
def test_finite_updates_whose_aggregate_overflows_refuse_the_round(batched):
    sim = Simulation(config("padamfed", client_batched=batched, rounds=3))
    sim.run_round(0)
    x = [p.clone() for p in sim.global_params]
    state = {k: [v.clone() for v in vs] for k, vs in sim.strategy.state.items()}
    finish = huge_updates(sim)
    rec = sim.run_round(1)
    assert "left_out" not in rec  # every update was finite: the screen took them all
    assert rec["refused"].startswith("the aggregate is not finite (inf or NaN: model[0]")
    assert all(torch.equal(a, b) for a, b in zip(sim.global_params, x, strict=True))
    assert all(torch.equal(a, b) for k in state for a, b in zip(sim.strategy.state[k], state[k], strict=True))
    assert all(torch.equal(p.detach(), g) for p, g in zip(sim.model.parameters(), x, strict=True))
    sim.strategy.finish = finish
    rec = sim.run_round(2)  # the run goes on from the kept model
    assert "refused" not in rec
    assert all(bool(torch.isfinite(p).all()) for p in sim.global_params)


def test_a_round_whose_aggregate_is_finite_is_not_refused():
    sim = Simulation(config("padamfed"))
    huge_updates(sim, 1e30)
    assert "refused" not in sim.run_round(0)


def test_the_refusal_names_each_tensor_that_is_not_finite():
    ok = [torch.zeros(3), torch.ones(2, 2)]
    assert not_finite({"x": ok, "c": ok}) is None
    assert not_finite({"x": [], "steps": [torch.tensor(3)]}) is None  # integers are always finite
    why = not_finite({"x": [ok[0], torch.tensor([1.0, float("nan")])], "c": ok, "m": [torch.tensor(float("-inf"))]})
    assert "inf or NaN: model[1], m[0])" in why
