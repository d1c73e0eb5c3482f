"""Clients that differ in their work (fl/work.py): the round's plan, its options' checks, and every
engine training each client for exactly its own steps (sequential, client-batched, resumed)."""

import math
from collections import Counter
from typing import Any, Dict

import pytest
import torch
from test_sim_batched import EXTRA, ROUNDING_RTOL, model_fn, tiny_config, tiny_images
from test_sim_resume import assert_same_run, make
from test_sim_resume import tiny_config as resume_config

from fedopt_kernels.fl.server_rules import RULES
from fedopt_kernels.fl.work import WorkPlan, histogram
from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import VARIANTS, SimConfig
from fedopt_kernels.sim.data.clients import ClientData
from fedopt_kernels.sim.federated_data import FederatedData
from fedopt_kernels.sim.simulation import Simulation
from fedopt_kernels.sim.strategy import Strategy
from fedopt_kernels.sim.validate import PARAM_RTOL, validate_client_batched

pytestmark = pytest.mark.usefixtures("one_thread")

UNEVEN = dict(local_steps_range=(1, 5), stragglers=0.25)


def plan(**kw) -> WorkPlan:
    base: Dict[str, Any] = dict(algorithm="fedavg", clients=40, holdout_fraction=0.0, local_steps=6, seed=3)
    base["batch_size"] = 4
    base.update(kw)
    cfg = SimConfig(**base).validate()
    return WorkPlan(cfg, [1 + (7 * i) % 23 for i in range(cfg.num_train_clients)])


# ------------------------------------------------------------------ the plan
def test_the_default_plan_is_local_steps_for_every_client():
    p = plan()
    assert not p.uneven
    assert p.steps(4, [1, 5, 9]) == {1: 6, 5: 6, 9: 6}


def test_a_range_draws_each_value_from_the_seed_and_round():
    p = plan(local_steps_range=(3, 7))
    sampled = list(range(40))
    draws = [p.steps(t, sampled) for t in range(20)]
    values = Counter(k for d in draws for k in d.values())
    assert set(values) == {3, 4, 5, 6, 7}  # every value of a..b, nothing outside
    assert min(values.values()) > 800 / 5 * 0.6  # roughly uniform (800 draws)
    assert p.steps(2, sampled) == draws[2]  # a function of (seed, round, sampled)
    assert draws[0] != draws[1]
    assert plan(local_steps_range=(3, 7), seed=4).steps(0, sampled) != draws[0]


def test_local_epochs_is_epochs_times_batches():
    p = plan(local_epochs=2)
    sizes = p.sizes
    assert p.steps(0, [0, 1, 2, 7]) == {c: 2 * math.ceil(sizes[c] / 4) for c in (0, 1, 2, 7)}


@pytest.mark.parametrize("f", [0.1, 0.25, 0.5, 0.9])
def test_stragglers_are_the_given_fraction_and_stop_early(f):
    p = plan(local_steps=8, stragglers=f)
    sampled = list(range(0, 40, 2))
    for t in range(10):
        steps = p.steps(t, sampled)
        late = [k for k in steps.values() if k < 8]
        assert len(late) == math.floor(f * 20 + 0.5)
        assert all(1 <= k < 8 for k in late)


def test_a_straggler_with_one_step_keeps_it():
    p = plan(local_steps=1, stragglers=0.5)
    assert set(p.steps(0, list(range(10))).values()) == {1}


def test_histogram_counts_clients_per_step_count():
    assert histogram([3, 1, 3, 10]) == {"1": 1, "3": 2, "10": 1}
    assert list(histogram([10, 9, 2])) == ["2", "9", "10"]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(local_steps_range=(5, 3)), "local_steps_range"),
        (dict(local_steps_range=(0, 3)), "local_steps_range"),
        (dict(local_steps_range=(2,)), "local_steps_range"),
        (dict(local_steps_range=(1.5, 3)), "local_steps_range"),
        (dict(local_epochs=0), "local_epochs"),
        (dict(local_epochs=-2), "local_epochs"),
        (dict(local_epochs=1.5), "local_epochs"),
        (dict(stragglers=1.0), "stragglers"),
        (dict(stragglers=-0.1), "stragglers"),
        (dict(stragglers=float("nan")), "stragglers"),
        (dict(local_epochs=1, local_steps_range=(1, 2)), "local_epochs"),
        (dict(algorithm="padamfed", stragglers=0.2), "stragglers"),
    ],
)
def test_bad_work_options_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        SimConfig(**kw).validate()


SHORT = ["--dataset", "synthetic", "--no-files", "--quiet", "--rounds", "1"]


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--local-steps-range", "5", "3"], "--local-steps-range"),
        (["--local-epochs", "0"], "--local-epochs"),
        (["--stragglers", "1"], "--stragglers"),
        (["--local-steps", "4", "--local-epochs", "1"], "--local-epochs"),
        (["--local-steps", "4", "--local-steps-range", "1", "2"], "--local-steps-range"),
    ],
)
def test_bad_work_options_exit_2_naming_the_option(args, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(SHORT + args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err, err


def test_a_client_without_data_under_local_epochs_is_refused_before_anything_starts():
    data = tiny_images()
    empty = ClientData(1, data.train_clients[1].train_x[:0], data.train_clients[1].train_y[:0], *[None] * 4)
    clients = [empty if c.client_id == 1 else c for c in data.train_clients]
    bad = FederatedData(clients, [], data.input_shape, data.num_classes)
    with pytest.raises(ValueError, match=r"local_epochs .* clients \[1\]"):
        Simulation(tiny_config("fedavg", local_epochs=1, client_batched=1), data=bad, model_fn=model_fn)


# ------------------------------------------------------------------ the engines
def test_the_sequential_engine_takes_each_clients_own_steps(monkeypatch):
    taken = Counter()
    step = Strategy.local_step

    def count(self, cid, opt, batch):
        taken[cid] += 1
        return step(self, cid, opt, batch)

    monkeypatch.setattr(Strategy, "local_step", count)
    sim = Simulation(tiny_config("fedavg", client_batched=1, **UNEVEN), data=tiny_images(), model_fn=model_fn)
    want = Counter()
    for t in range(3):
        rec = sim.run_round(t)
        steps = sim.work_plan.steps(t, rec["clients"])
        assert rec["steps"] == histogram(steps.values())
        want.update(steps)
    assert taken == want and len(set(want.values())) > 1


FAST = ("fedavg", "fednova", "scaffold", "feddyn")  # the others in the slow tier
UNEVEN_VARIANTS = [
    v if v in FAST else pytest.param(v, marks=pytest.mark.slow) for v, d in VARIANTS.items() if RULES[d.server].uneven
]


@pytest.mark.parametrize("algorithm", UNEVEN_VARIANTS)
def test_client_batched_uneven_steps_reproduce_the_sequential_run(algorithm):
    """Every variant that takes uneven work: clients with 1..5 steps and stragglers in chunks of 2,
    sorted by step count, equal the sequential run to rounding (float64 on the reference backend)."""
    cfg = tiny_config(algorithm, rounds=3, **{**EXTRA.get(algorithm, {}), **UNEVEN})
    v = validate_client_batched(cfg, data=tiny_images(), model_fn=model_fn)
    assert v.passed, v.report()
    assert v.max_rel <= (ROUNDING_RTOL if v.dtype == "float64" else PARAM_RTOL), v.report()


def test_validation_catches_a_client_trained_for_the_chunks_longest_count(monkeypatch):
    """Not vacuous: a chunk that runs every client for its largest count fails the comparison."""
    from fedopt_kernels.sim.batched.trainer import BatchedTrainer

    run = BatchedTrainer.run

    def every_step(self, *args, steps=None, **kwargs):
        return run(self, *args, **kwargs)

    monkeypatch.setattr(BatchedTrainer, "run", every_step)
    v = validate_client_batched(tiny_config("fedavg", **UNEVEN), data=tiny_images(), model_fn=model_fn)
    assert not v.passed, v.report()


def test_chunks_sorted_by_steps_idle_less_than_in_client_order():
    cfg = tiny_config("fedavg", clients_per_round=5, client_batched=2, local_steps_range=(1, 12), rounds=4)
    sim = Simulation(cfg, data=tiny_images(), model_fn=model_fn)
    idle_in_order = 0
    for t in range(cfg.rounds):
        rec = sim.run_round(t)
        ks = [sim.work_plan.steps(t, rec["clients"])[c] for c in rec["clients"]]
        idle_in_order += sum(2 * max(ks[i : i + 2]) for i in range(0, 5, 2)) - sum(ks)
    b = sim.batched
    assert b.client_steps == sum(sum(sim.work_plan.steps(t, h["clients"]).values()) for t, h in enumerate(sim.history))
    assert b.slot_steps - b.client_steps <= idle_in_order


@pytest.mark.parametrize("mode", [{}, {"client_batched": 2}])
@pytest.mark.parametrize("algorithm", ["fednova", "scaffold"])
def test_resumed_uneven_run_equals_uninterrupted(tmp_path, algorithm, mode):
    cfg = resume_config(algorithm, local_steps_range=(1, 4), stragglers=0.3, **mode)
    whole = make(cfg)
    want = whole.run()
    first = make(cfg, tmp_path)
    first.run_round(0)
    first.save_checkpoint()
    del first
    again = make(cfg, tmp_path)
    got = again.run(resume=True)
    assert again.resumed_from == 1
    assert_same_run(whole, want, again, got)
    assert all("steps" in r for r in got["history"])


def test_uneven_steps_change_the_run_and_defaults_draw_nothing():
    """The plan's stream is its own: a run with the options differs, one without them is the run it
    was (the same bits as a config that never heard of them)."""
    runs = {}
    for name, kw in {"default": {}, "explicit": dict(stragglers=0.0), "uneven": UNEVEN}.items():
        sim = Simulation(tiny_config("fedavg", client_batched=1, **kw), data=tiny_images(), model_fn=model_fn)
        sim.run_round(0)
        runs[name] = [p.clone() for p in sim.global_params]
    assert all(torch.equal(a, b) for a, b in zip(runs["default"], runs["explicit"]))
    assert not all(torch.equal(a, b) for a, b in zip(runs["default"], runs["uneven"]))


# ------------------------------------------------------------------ Flower
@pytest.mark.parametrize(
    "algorithm,work",
    [
        ("fednova", {"local-steps-range": [1, 5], "stragglers": 0.5}),
        ("scaffold", {"local-epochs": 1, "stragglers": 0.3, "batch-size": 8}),
    ],
)
def test_flower_clients_take_the_simulators_steps(algorithm, work):
    """A Flower run (in-process grid) whose clients differ in their work: each node gets its own
    step count (or fraction) in the round's config and ends where the simulator's client does."""
    pytest.importorskip("flwr")
    from test_flower_strategies import run_config

    from fedopt_kernels.flower.apps import client_app, run_algorithm
    from fedopt_kernels.flower.inprocess import InProcessGrid
    from fedopt_kernels.flower.runconfig import sim_configs
    from fedopt_kernels.sim.validate import param_divergence

    rc = run_config(algorithm, rounds=2, **work)
    cfg = sim_configs(rc)[0]
    out = run_algorithm(InProcessGrid(client_app(), cfg.num_train_clients, rc), cfg, tag="uneven")
    assert out["rejections"] == []
    sim = Simulation(cfg)
    for t in range(cfg.rounds):
        rec = sim.run_round(t)
        assert len(rec["steps"]) > 1  # the clients' steps differ
        assert param_divergence(sim.global_params, out["history"][t + 1]["params"])["rel"] <= PARAM_RTOL
