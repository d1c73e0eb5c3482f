"""FedNova's server rule (fl/fednova.py): its normalizer, its aggregate in float64, FedAvg at equal work.

Two computations of the same aggregate are compared after their one rounding to float32: both
hold the exact mean to ~1e-15 relative in float64 before it, so their float32 results differ by at
most one unit in the last place (a value that close to a rounding boundary), never more.
"""

import math
import random
from typing import Any, Dict, List

import pytest
import torch

from fedopt_kernels.fl.fednova import normalizer
from fedopt_kernels.fl.fold import weight_exponent
from fedopt_kernels.fl.server_rules import RULES, weighted_average_step
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.simulation import Simulation

pytestmark = pytest.mark.usefixtures("one_thread")

EPS32 = torch.finfo(torch.float32).eps
SHAPES = [(7, 3), (5,), (2, 3, 4)]


def within_one_ulp(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    """Every element of a and b (float32) at most one float32 unit apart."""
    return all(
        bool(((x.double() - y.double()).abs() <= EPS32 * torch.maximum(x.abs(), y.abs()).double()).all())
        for x, y in zip(a, b, strict=True)
    )


def random_round(seed: int, clients: int):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(s, generator=g) for s in SHAPES]
    deltas = [[0.1 * torch.randn(s, generator=g) for s in SHAPES] for _ in range(clients)]
    weights = [float(n) for n in torch.randint(1, 500, (clients,), generator=g).tolist()]
    return x, deltas, weights


def nova(x, deltas, weights, a, server_lr=1.0):
    replies = [{"nova_a": ai} for ai in a]
    hp = {"server_lr": server_lr}
    return RULES["nova"].step(x, {}, deltas, weights, replies, hp, 10, 1)["x"]


def nova_float64(x, deltas, weights, a, server_lr=1.0):
    """SPEC's FedNova step, term by term in float64, rounded once."""
    W = sum(weights)
    tau_eff = sum(w * ai for w, ai in zip(weights, a)) / W
    out = []
    for j, xj in enumerate(x):
        mean = sum(w / W * d[j].double() / ai for w, d, ai in zip(weights, deltas, a))
        out.append((xj.double() + server_lr * tau_eff * mean).float())
    return out


# ------------------------------------------------------------------ the normalizer
@pytest.mark.parametrize("steps", [0, 1, 2, 7, 40])
def test_normalizer_plain_momentum_and_proximal_closed_forms(steps):
    assert normalizer(steps) == steps
    for rho in (0.0, 0.5, 0.9, 0.99):
        want = sum((1 - rho**k) / (1 - rho) for k in range(1, steps + 1))
        assert math.isclose(normalizer(steps, lr=0.1, momentum=rho), want, rel_tol=1e-12, abs_tol=1e-12)
    for lr, mu in ((0.1, 0.01), (0.05, 1.0), (0.5, 0.3)):
        want = sum((1 - lr * mu) ** k for k in range(steps))
        assert math.isclose(normalizer(steps, lr=lr, prox_mu=mu), want, rel_tol=1e-12, abs_tol=1e-12)


def test_normalizer_is_the_step_weights_of_a_real_optimizer():
    """For a quadratic-free check: torch's SGD (momentum, dampening, Nesterov, a proximal pull to x0)
    on a parameter whose gradient is always 1 moves by exactly -lr * a."""
    for momentum, dampening, nesterov, mu in ((0.9, 0.0, False, 0.0), (0.5, 0.2, False, 0.1), (0.8, 0.0, True, 0.05)):
        lr, steps = 0.1, 9
        p = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([p], lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov)
        for _ in range(steps):
            p.grad = torch.ones((), dtype=torch.float64) + mu * p.detach()  # gradient 1 + the prox term
            opt.step()
        a = normalizer(steps, lr, momentum, mu, dampening, nesterov)
        assert math.isclose(-float(p.detach()) / lr, a, rel_tol=1e-12), (momentum, dampening, nesterov, mu)


# ------------------------------------------------------------------ the aggregate
@pytest.mark.parametrize("seed", range(5))
def test_equal_work_is_fedavg_to_float32_rounding(seed):
    x, deltas, weights = random_round(seed, 6)
    tau = random.Random(seed).choice([1.0, 3.0, 10.0, 7.3])
    got = nova(x, deltas, weights, [tau] * 6)
    want = weighted_average_step(x, deltas, weights, 1.0)
    assert within_one_ulp(got, want)


@pytest.mark.parametrize("seed", range(5))
def test_uneven_work_equals_the_float64_formula(seed):
    x, deltas, weights = random_round(seed, 7)
    rng = random.Random(seed)
    a = [normalizer(rng.randint(1, 30), 0.05, rng.choice([0.0, 0.9]), rng.choice([0.0, 0.1])) for _ in range(7)]
    got = nova(x, deltas, weights, a, server_lr=0.7)
    assert within_one_ulp(got, nova_float64(x, deltas, weights, a, server_lr=0.7))
    # not vacuous: FedAvg's mean of the same updates is another point
    avg = weighted_average_step(x, deltas, weights, 0.7)
    assert not within_one_ulp(got, avg)


def test_folds_merged_in_rank_order_equal_one_fold():
    x, deltas, weights = random_round(3, 8)
    a = [float(k) for k in (1, 4, 9, 2, 2, 30, 5, 11)]
    rule, hp = RULES["nova"], {"server_lr": 1.0}
    e = weight_exponent(weights)
    one = rule.begin(x, {}, hp, 8, 1, e)
    parts = [rule.begin(x, {}, hp, 8, 1, e) for _ in range(3)]
    for i, (d, w, ai) in enumerate(zip(deltas, weights, a)):
        one.add(d, w, {"nova_a": ai})
        parts[i % 3].add(d, w, {"nova_a": ai})
    parts[0].merge(parts[1:])
    assert parts[0].count == 8
    assert within_one_ulp(parts[0].finish()["x"], one.finish()["x"])
    assert within_one_ulp(one.finish()["x"], nova_float64(x, deltas, weights, a))


def test_a_bad_normalizer_is_refused_by_name():
    x, deltas, weights = random_round(0, 2)
    with pytest.raises(ValueError, match="a_i must be > 0"):
        nova(x, deltas, weights, [1.0, 0.0])
    with pytest.raises(ValueError, match="lr must be > 0"):
        normalizer(3, lr=0.0, momentum=0.9)


# ------------------------------------------------------------------ in the simulator
def tiny(algorithm: str, **kw) -> SimConfig:
    base: Dict[str, Any] = dict(
        algorithm=algorithm,
        dataset="synthetic",
        model="mlp",
        hidden=8,
        clients=12,
        holdout_fraction=0.0,
        clients_per_round=5,
        rounds=1,
        local_steps=3,
        batch_size=4,
        finetune_steps=0,
        backend="reference",
        device="cpu",
    )
    base.update(kw)
    return SimConfig(**base)


def test_fednova_with_equal_steps_is_fedavg_in_the_simulator():
    runs = {}
    for algorithm in ("fedavg", "fednova"):
        sim = Simulation(tiny(algorithm, momentum=0.9))
        sim.run_round(0)
        runs[algorithm] = [p.clone() for p in sim.global_params]
    assert within_one_ulp(runs["fednova"], runs["fedavg"])


@pytest.mark.parametrize("algorithm", ["fednova", "fednova-fedprox"])
def test_a_simulated_round_with_uneven_steps_is_the_formula_on_its_clients_updates(monkeypatch, algorithm):
    sim = Simulation(tiny(algorithm, local_steps_range=(1, 9), stragglers=0.4, momentum=0.5, lr=0.05))
    seen = []
    add = type(sim.strategy).add

    def record(self, fold, update):
        seen.append((update.weight, [d.clone() for d in update.delta], update.scalars["nova_a"]))
        add(self, fold, update)

    monkeypatch.setattr(type(sim.strategy), "add", record)
    x = [p.clone() for p in sim.global_params]
    rec = sim.run_round(0)
    steps = sim.work_plan.steps(0, rec["clients"])
    assert len(set(steps.values())) > 1 and rec["steps"]
    mu = sim.hp["prox_mu"]
    for (_, _, a), cid in zip(seen, rec["clients"], strict=True):
        assert a == normalizer(steps[cid], 0.05, 0.5, mu)
    want = nova_float64(x, [d for _, d, _ in seen], [w for w, _, _ in seen], [a for _, _, a in seen])
    assert within_one_ulp(sim.global_params, want)


def test_the_flower_strategy_names_its_backbones():
    pytest.importorskip("flwr")
    from fedopt_kernels.flower import FedNovaStrategy

    assert FedNovaStrategy().cfg.algorithm == "fednova"
    s = FedNovaStrategy(backbone="fedprox", prox_mu=0.1, local_steps_range=(2, 4))
    assert s.cfg.algorithm == "fednova-fedprox" and s.rule.scalars == ("nova_a",) and s._work.uneven
