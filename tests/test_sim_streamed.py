"""Streamed aggregation: each client's update is folded into the round as soon as it exists, then dropped.

A round holds one client's update at a time (sequential and client-batched), whatever its number
of clients; what it computes is each server rule's formula over the accepted updates, checked in
float64 against the formulas written out here (the list form the rules had), with a refused
client among them.
"""

import weakref

import pytest
import torch

from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.simulation import Simulation

pytestmark = pytest.mark.usefixtures("one_thread")


def config(algorithm, **kw):
    base = dict(
        algorithm=algorithm,
        dataset="synthetic",
        clients=30,
        holdout_fraction=0.0,
        clients_per_round=12,
        rounds=2,
        local_steps=2,
        model="mlp",
        hidden=8,
        backend="reference",
        device="cpu",
        finetune_steps=0,
    )
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize("batched", [1, 5], ids=["sequential", "client-batched"])
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "padamfed", "feddyn"])
def test_a_round_holds_one_update_at_a_time(algorithm, batched):
    sim = Simulation(config(algorithm, client_batched=batched))
    made = []  # weak references to every update made
    finish = sim.strategy.finish
    most = []

    def finishing(cid, opt, t):
        u = finish(cid, opt, t)
        most.append(sum(r() is not None for r in made))  # those not yet dropped, before this one
        made.append(weakref.ref(u))
        return u

    sim.strategy.finish = finishing
    for t in range(2):
        sim.run_round(t)
    assert len(most) == 2 * 12
    assert max(most) == 0, most  # every earlier update was gone when the next one was made


def _recording(sim, bad=None):
    """Record (client, weight, delta, dc) of every update in float64; spoil client ``bad``'s delta."""
    seen = []
    finish = sim.strategy.finish

    def spy(cid, opt, t):
        u = finish(cid, opt, t)
        if cid == bad:
            u.delta[0] = torch.full_like(u.delta[0], float("nan"))
        else:
            dc = u.extra.get("dc")
            seen.append((cid, u.weight, [d.clone() for d in u.delta], None if dc is None else [d.clone() for d in dc]))
        return u

    sim.strategy.finish = spy
    return seen


@pytest.mark.parametrize("batched", [1, 4], ids=["sequential", "client-batched"])
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "feddyn", "padamfed"])
def test_the_streamed_round_is_the_rule_over_the_accepted_updates(algorithm, batched):
    sim = Simulation(config(algorithm, client_batched=batched), dtype=torch.float64)
    sim.run_round(0)
    before = sim.sample_rng.bit_generator.state
    victim = sim.sample_clients()[3]  # one of the next round's clients
    sim.sample_rng.bit_generator.state = before
    x = [p.clone() for p in sim.global_params]
    state = {k: [v.clone() for v in vs] for k, vs in sim.strategy.state.items()}
    seen = _recording(sim, bad=victim)
    rec = sim.run_round(1)
    assert [d["client"] for d in rec["left_out"]] == [victim]
    hp, N, S = sim.hp, sim.cfg.num_train_clients, len(seen)
    deltas = [d for _, _, d, _ in seen]
    want = {}
    if algorithm in ("fedavg", "scaffold"):
        W = sum(w for _, w, _, _ in seen)
        want["x"] = [x[j] + hp["server_lr"] * sum(w * d[j] for _, w, d, _ in seen) / W for j in range(len(x))]
    if algorithm == "scaffold":
        want["c"] = [state["c"][j] + sum(dc[j] for *_, dc in seen) / N for j in range(len(x))]
    if algorithm == "feddyn":
        a = hp["dyn_alpha"]
        h = [state["h"][j] - a / N * sum(d[j] for d in deltas) for j in range(len(x))]
        want["h"] = h
        want["x"] = [x[j] + sum(d[j] for d in deltas) / S - h[j] / a for j in range(len(x))]
    if algorithm == "padamfed":
        eta, gamma, beta, K = hp["lr"], hp["server_lr"], hp["beta"], sim.cfg.local_steps
        dc = [sum(r[j] for *_, r in seen) for j in range(len(x))]
        want["x"] = [x[j] + gamma * sum(d[j] for d in deltas) / S / (eta * K) for j in range(len(x))]
        want["m"] = [beta * (dc[j] / S + state["c"][j]) + (1 - beta) * state["m"][j] for j in range(len(x))]
        want["c"] = [state["c"][j] + dc[j] / N for j in range(len(x))]
    got = {"x": sim.global_params, **sim.strategy.state}
    assert set(want) <= set(got)
    for key, tensors in want.items():
        for a_, b_ in zip(got[key], tensors):
            # a few float64 roundings of sums of S terms, each as large as the largest term
            scale = max(float(b_.abs().max()), max(float(d.abs().max()) for d in sum(deltas, [])))
            assert float((a_ - b_).abs().max()) <= 64 * S * torch.finfo(torch.float64).eps * scale, key
