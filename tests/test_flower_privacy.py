"""User-level differential privacy on Flower (``DPFedAvgStrategy``, docs/privacy.md), in-process
(``InProcessGrid``: no Ray):

* a Flower run under DP equals ``fedopt-sim``'s run of the same config bit for bit: the global model
  of every round, epsilon, the clip used and the next (adaptive), the train loss, for Poisson and
  fixed sampling, a rule with reply tensors (SCAFFOLD's, PAdaMFed's ``dc``), a server optimizer,
  and a round in which no client was sampled (the noise alone);
* with ``z = 0`` and a small C, each round moves FedAvg's model (server_lr 1) by at most C, which
  the same rounds without DP exceed;
* bad settings raise a ValueError naming the setting and leave the strategy as it was;
* a server stopped mid-run and restarted from its checkpoint ends exactly where an uninterrupted run
  ends (the clip and the rounds counted come back), and a checkpoint of other DP settings is refused.
"""

import math

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")
pytest.importorskip("dp_accounting", reason="dp-accounting is not installed: pip install -e '.[privacy]'")

import torch  # noqa: E402
from flwr.app import MetricRecord  # noqa: E402
from one_thread import one_thread  # noqa: E402,F401  (autouse: one torch thread per test)
from test_flower_resume import Stopped, StoppingGrid  # noqa: E402
from test_flower_resume import run_config as resume_config  # noqa: E402

from fedopt_kernels.fl.checkpoint import CheckpointError  # noqa: E402
from fedopt_kernels.fl.config import FLConfig  # noqa: E402
from fedopt_kernels.flower import DPFedAvgStrategy, strategy_for  # noqa: E402
from fedopt_kernels.flower.apps import client_app, run_algorithm  # noqa: E402
from fedopt_kernels.flower.inprocess import InProcessGrid  # noqa: E402
from fedopt_kernels.flower.records import from_record, to_record  # noqa: E402
from fedopt_kernels.flower.runconfig import sim_configs  # noqa: E402
from fedopt_kernels.flower.simdata import simulation_for  # noqa: E402
from fedopt_kernels.sim import Simulation  # noqa: E402

DP_METRICS = {"dp-epsilon": "dp_epsilon", "dp-clip": "dp_clip", "dp-next-clip": "dp_next_clip"}


def run_config(algorithm, **kw):
    """test_flower_resume's run (5 clients, 2 local steps, mlp), 3 rounds, without checkpoints, under DP."""
    dp = {"rounds": 3, "dp-clip": 0.05, "dp-noise-multiplier": 0.1, "dp-delta": 1e-3}
    return resume_config(algorithm, "", **{**dp, **kw})


def flower_run(rc, tag="dp", **kw):
    cfg = sim_configs(rc)[0]
    return cfg, run_algorithm(InProcessGrid(client_app(), cfg.num_train_clients, rc), cfg, tag=tag, **kw)


# --------------------------------------------------------------------------------------- agreement
@pytest.mark.parametrize(
    "algorithm, settings",
    [
        ("scaffold", {"sampling": "poisson", "dp-adaptive-quantile": 0.5}),
        ("padamfed", {"dp-adaptive-quantile": 0.5}),
        ("fedavg", {"server-optimizer": "adam", "dp-accountant": "rdp"}),
        # q = 0.2 of 5 clients: round 2 samples no one (asserted below) and is noise alone
        ("fedavg", {"sampling": "poisson", "sample-rate": 0.2, "dp-noise-multiplier": 0.7, "seed": 0}),
    ],
)
def test_flower_run_under_dp_equals_the_simulator_bitwise(algorithm, settings):
    cfg, out = flower_run(run_config(algorithm, **settings))
    assert out["rejections"] == []
    sim = Simulation(cfg)
    used = []
    for t in range(cfg.rounds):
        rec = sim.run_round(t)
        metrics = out["train_metrics"][t + 1]
        assert all(torch.equal(a, b) for a, b in zip(sim.global_params, out["history"][t + 1]["params"])), t + 1
        assert {k: metrics[k] for k in DP_METRICS} == {k: rec[v] for k, v in DP_METRICS.items()}
        assert metrics["clients-used"] == len(rec["clients"])
        if rec["clients"]:
            assert metrics["train-loss"] == rec["train_loss"]
        used.append(metrics["clients-used"])
    assert out["history"][-1]["val_acc"] == sim.history[-1]["val_acc"]
    if settings.get("sample-rate") == 0.2:
        assert 0 in used and any(used), used  # a round of noise alone, and rounds with clients
    if "dp-adaptive-quantile" in settings:  # the clip moved
        assert len({out["train_metrics"][r]["dp-clip"] for r in out["train_metrics"]}) == cfg.rounds


# ------------------------------------------------------------------------------------ the clip bound
def test_with_no_noise_each_round_moves_the_model_by_at_most_the_clip():
    """z = 0, C below the updates' norms, FedAvg with server_lr 1: ||x_{t+1} - x_t|| <= C. The wrapper is
    used as the docs show it (strategy_for, the wrapper's own fixed-size sampling, no client sampler)."""
    C, rounds = 1e-3, 3
    rc = run_config("fedavg", **{"server-lr": 1.0, "clients-per-round": 3, "rounds": rounds})
    cfg = sim_configs(rc)[0]
    sim = simulation_for(cfg)
    names = [n for n, _ in sim.model.named_parameters()]
    moves = {}
    for private in (True, False):
        strategy = strategy_for(cfg, num_clients=cfg.num_train_clients, seed=cfg.seed, state_tag=f"bound{private}")
        runner = DPFedAvgStrategy(strategy, dp_clip=C, dp_noise_multiplier=0.0, seed=1) if private else strategy
        params = []

        def keep(rnd, arrays, params=params):
            params.append(from_record(arrays, names, sim.global_params, "arrays"))
            return MetricRecord({})

        result = runner.start(
            InProcessGrid(client_app(), cfg.num_train_clients, rc),
            to_record(names, sim.global_params),
            num_rounds=rounds,
            evaluate_fn=keep,
        )
        steps = []
        for before, after in zip(params, params[1:]):
            moved = math.sqrt(math.fsum(float((a.double() - b.double()).square().sum()) for a, b in zip(after, before)))
            # x + a rounds once to float32: at most half a unit in the last place of each element
            n = sum(p.numel() for p in after)
            slack = math.sqrt(n) * max(float(p.abs().max()) for p in after) * 2**-24
            steps.append((moved, slack))
        moves[private] = steps
        if private:
            assert all(m["clients-used"] == 3 for m in result.train_metrics_clientapp.values())
            assert all(m["dp-epsilon"] == math.inf for m in result.train_metrics_clientapp.values())  # z = 0
    assert all(moved <= C * (1 + 1e-12) + slack for moved, slack in moves[True]), moves[True]
    assert all(moved > 10 * C for moved, _ in moves[False]), moves[False]  # the bound is the clip's


# -------------------------------------------------------------------------------------- bad settings
def strategy(algorithm="fedavg", **cfg_kw):
    return strategy_for(FLConfig(algorithm=algorithm, clients=10, holdout_fraction=0.0, **cfg_kw), num_clients=10)


@pytest.mark.parametrize(
    "make, kw, match",
    [
        (lambda: strategy("fednova"), {}, "dp_clip does not apply to algorithm='fednova'"),
        (lambda: strategy(server_optimizer="exp"), {}, "server_optimizer='exp'"),
        (strategy, {"dp_clip": 0.0}, "dp_clip"),
        (strategy, {"dp_clip": None}, "dp_clip"),
        (strategy, {"dp_noise_multiplier": -1.0}, "dp_noise_multiplier"),
        (strategy, {"dp_target_epsilon": 2.0}, "exactly one"),
        (strategy, {"dp_noise_multiplier": None, "dp_target_epsilon": 2.0}, "rounds"),
        (
            strategy,
            {"dp_noise_multiplier": None, "dp_target_epsilon": 1e-3, "rounds": 10, "dp_delta": 1e-3},
            "cannot be reached",
        ),
        (strategy, {"dp_delta": 1.0}, "dp_delta"),
        (strategy, {"dp_adaptive_quantile": 1.5}, "dp_adaptive_quantile"),
        (strategy, {"dp_clip_lr": 0.0}, "dp_clip_lr"),
        (strategy, {"dp_accountant": "pld"}, "poisson"),
        (strategy, {"sampling": "uniform"}, "sampling"),
        (strategy, {"seed": -1}, "seed"),
        (strategy, {"num_clients": 7}, "num_clients"),
        (lambda: strategy_for(FLConfig(clients=10, holdout_fraction=0.0)), {}, "num_clients"),
    ],
)
def test_bad_settings_name_the_setting_and_change_nothing(make, kw, match):
    inner = make()
    settings = {"dp_clip": 1.0, "dp_noise_multiplier": 1.0, **kw}
    with pytest.raises(ValueError, match=match):
        DPFedAvgStrategy(inner, **settings)
    assert inner.privacy is None
    assert inner.num_clients in (None, 10)


def test_wrapping_other_strategies_or_twice_is_refused():
    from flwr.serverapp.strategy import FedAvg

    with pytest.raises(TypeError, match="strategy must be one of fedopt_kernels.flower's strategies"):
        DPFedAvgStrategy(FedAvg(), dp_clip=1.0, dp_noise_multiplier=1.0)
    wrapped = DPFedAvgStrategy(strategy(), dp_clip=1.0, dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="already"):
        DPFedAvgStrategy(wrapped.strategy, dp_clip=1.0, dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="dp_max_epsilon"):
        DPFedAvgStrategy.from_config(strategy(), sim_configs(run_config("fedavg", **{"dp-max-epsilon": 5.0}))[0])


def test_a_server_step_under_dp_without_its_round_is_refused():
    """The round number names the round's noise: without it the step is refused before anything moves."""
    wrapped = DPFedAvgStrategy(strategy(), dp_clip=1.0, dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="server_round"):
        wrapped.strategy._server_step([])
    assert wrapped.dp.rounds == 0


def test_target_epsilon_is_met_after_the_planned_rounds():
    wrapped = DPFedAvgStrategy(
        strategy(clients_per_round=3), dp_clip=1.0, dp_target_epsilon=4.0, rounds=20, dp_delta=1e-3, sampling="poisson"
    )
    assert wrapped.dp.sampling.rate == pytest.approx(0.3) and wrapped.epsilon == 0.0
    assert wrapped.dp.epsilon_after(20) <= 4.0 < wrapped.dp.epsilon_after(21)


# ------------------------------------------------------------------------------------------- resume
def test_restarted_server_continues_exactly_and_other_settings_are_refused(tmp_path):
    rc = run_config("scaffold", sampling="poisson", rounds=4, **{"dp-adaptive-quantile": 0.5})
    _, want = flower_run(rc, tag="t")
    rc_ckpt = dict(rc, **{"checkpoint-dir": str(tmp_path)})

    trained = []  # the rounds whose training messages the last run sent

    def run(rc, stop=0):
        cfg = sim_configs(rc)[0]
        grid = StoppingGrid(client_app(), cfg.num_train_clients, rc, stop=stop)
        sent = grid.send_and_receive

        def counting(messages, *, timeout=None):
            messages = list(messages)
            trained.extend({int(m.metadata.group_id) for m in messages if m.metadata.message_type == "train"})
            return sent(messages, timeout=timeout)

        grid.send_and_receive = counting
        return run_algorithm(grid, cfg, tag="t", checkpoint_dir=rc["checkpoint-dir"])

    for stop in (2, 3):
        with pytest.raises(Stopped):
            run(rc_ckpt, stop=stop)
    trained.clear()
    got = run(rc_ckpt)
    assert trained == [3, 4]  # resumed after round 2's checkpoint
    for g, w in zip(got["history"], want["history"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g["params"], w["params"])), g["round"]
    assert got["train_metrics"] == want["train_metrics"]  # epsilon and the adaptive clip included
    with pytest.raises(CheckpointError, match="dp_clip"):
        run(dict(rc_ckpt, **{"dp-clip": 0.06}))
