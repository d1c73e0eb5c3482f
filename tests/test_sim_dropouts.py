"""The simulator's aggregation leaves a bad client update out as a logged dropout (never a NaN model).

A client whose update is not finite (a diverging client, a NaN control change) or whose weight is
not a valid example count is left out; the round aggregates the others exactly as if that client
had not been sampled, the server state stays finite, and the reason is logged and recorded.
"""

import logging

import pytest
import torch

from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.simulation import Simulation

pytestmark = pytest.mark.usefixtures("one_thread")


def config(algorithm):
    return SimConfig(
        algorithm=algorithm,
        clients=6,
        holdout_fraction=0.0,
        rounds=2,
        local_steps=2,
        clients_per_round=3,
        model="mlp",
        backend="reference",
        device="cpu",
        finetune_steps=0,
    )


def _spoil(sim, bad_client, fault):
    finish = sim.strategy.finish

    def spoiled(cid, opt, t):
        u = finish(cid, opt, t)
        if cid == bad_client:
            if fault == "nan-delta":
                u.delta[0] = torch.full_like(u.delta[0], float("nan"))
            elif fault == "inf-dc":
                u.extra["dc"][-1] = torch.full_like(u.extra["dc"][-1], float("inf"))
            elif fault == "huge-weight":
                u.weight = 1e308
            elif fault == "shape":
                u.delta[1] = u.delta[1][:-1]
        return u

    sim.strategy.finish = spoiled


@pytest.mark.parametrize(
    "algorithm,fault",
    [
        ("fedavg", "nan-delta"),
        ("fednar-scaffold", "inf-dc"),
        ("padamfed", "nan-delta"),
        ("padamfed", "inf-dc"),
        ("fednar", "huge-weight"),
        ("scaffold", "shape"),
    ],
)
def test_a_bad_update_is_a_logged_dropout(algorithm, fault, caplog):
    sim, twin = Simulation(config(algorithm)), Simulation(config(algorithm))
    sim.run_round(0)
    twin.run_round(0)
    sampled = twin.sample_clients()
    twin.sample_rng = None  # twin: the same round without the bad client
    bad = sampled[1]
    twin.sample_clients = lambda: [c for c in sampled if c != bad]
    _spoil(sim, bad, fault)
    with caplog.at_level(logging.WARNING, logger="fedopt_kernels.sim"):
        rec = sim.run_round(1)
    twin.run_round(1)
    assert [d["client"] for d in rec["left_out"]] == [bad]
    logged = [r.getMessage() for r in caplog.records if "left client" in r.getMessage()]
    assert len(logged) == 1 and f"client {bad}" in logged[0]
    for a, b in zip(sim.global_params, twin.global_params):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    state, twins = sim.strategy.server_state(), twin.strategy.server_state()
    assert state.keys() == twins.keys()
    for key, value in state.items():
        if isinstance(
            value, dict
        ):  # the client-state store, {client id: tensors}: the left-out client kept nothing new
            assert value.keys() == twins[key].keys(), key
            pairs = [(a, b) for cid in value for a, b in zip(value[cid], twins[key][cid], strict=True)]
        else:
            pairs = list(zip(value, twins[key], strict=True))
        assert pairs or not value, key
        for a, b in pairs:
            assert torch.equal(a, b), key
    if sim.strategy.rule.keeps:
        assert state["kept"], "the store was compared"
    assert rec["train_loss"] == rec["train_loss"]  # not NaN


def test_a_round_with_only_bad_updates_keeps_the_model(caplog):
    sim = Simulation(config("fedavg"))
    sim.run_round(0)
    before = [p.clone() for p in sim.global_params]
    finish = sim.strategy.finish

    def all_bad(cid, opt, t):
        u = finish(cid, opt, t)
        u.delta[0] = u.delta[0] * float("inf")
        return u

    sim.strategy.finish = all_bad
    with caplog.at_level(logging.WARNING, logger="fedopt_kernels.sim"):
        rec = sim.run_round(1)
    assert len(rec["left_out"]) == 3 and any("no usable client update" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(a, b) for a, b in zip(sim.global_params, before))
