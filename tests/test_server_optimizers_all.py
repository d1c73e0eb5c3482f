"""Every client algorithm on every server optimizer, everywhere (slow tier; a fast share is
test_server_optimizers_sim.py).

* all 6 server optimizers x every algorithm ``fedopt-sim`` has run 3 rounds (PAdaMFed's own server
  step refuses every one but ``sgd``, naming the option), and each non-``sgd`` one steps exactly
  on the round's float64 aggregate;
* the client-batched round equals the sequential one (float64, test_sim_batched.py's tolerance);
* two torchrun ranks equal one process to rounding (test_sim_ranks.py's comparison), the ranks'
  hash check covering the server optimizer's state;
* ``fedopt-sim --server-optimizer adam`` killed with SIGKILL inside checkpoint writes resumes to
  the uninterrupted run's metrics, model and server optimizer state, bit for bit;
* on Flower: the strategies equal the simulator, a restarted server continues exactly, and
  Flower's own ``FedAdam`` strategy is the anchor: same inputs, same model after a round, up to
  its documented differences (below).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_server_optimizers_sim import (
    ROUNDING_RTOL,
    ROUNDS,
    make,
    mean_update,
    model_fn,
    recording,
    tiny_config,
    tiny_images,
)

from fedopt_kernels.fl.algorithm import VARIANTS
from fedopt_kernels.fl.server_rules import RULES, ServerRule
from fedopt_kernels.fl.server_step import NAMES, optimizer_options
from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.server_optimizer import CLASSES
from fedopt_kernels.sim.validate import PARAM_RTOL, param_divergence, validate_client_batched

EPS32 = torch.finfo(torch.float32).eps

pytestmark = pytest.mark.usefixtures("one_thread")


def takes(algorithm: str) -> bool:
    return RULES[VARIANTS[algorithm].server].takes_server_optimizer


@pytest.mark.parametrize("server", NAMES)
@pytest.mark.parametrize("algorithm", list(VARIANTS))
def test_every_algorithm_runs_three_rounds_on_every_server_optimizer(algorithm, server):
    cfg = tiny_config(algorithm, server)
    if server != "sgd" and not takes(algorithm):
        with pytest.raises(ValueError, match=f"server_optimizer='{server}' does not apply to algorithm="):
            cfg.validate()
        return
    sim = make(cfg)
    x0 = [p.clone() for p in sim.global_params]
    rounds = recording(sim)
    twin = None
    rule = RULES[VARIANTS[algorithm].server]
    # the twin steps on FedAvg's mean: not for a rule with an aggregate of its own (FedDyn's, FedNova's)
    if server not in ("sgd", "exp") and type(rule).aggregate is ServerRule.aggregate:
        twin = [p.clone() for p in x0]
        opt = CLASSES[server](twin, **optimizer_options(cfg), backend=cfg.backend)
    for t in range(ROUNDS):
        sim.run_round(t)
        if twin is not None:
            for p, d in zip(twin, mean_update(rounds[t])):
                p.grad = d.neg().float()
            opt.step()
            assert all(torch.equal(p, q) for p, q in zip(sim.global_params, twin)), f"round {t + 1}"
    assert len(sim.history) == ROUNDS and all(len(r) == 3 for r in rounds)
    assert all(torch.isfinite(p).all() for p in sim.global_params)
    assert any(not torch.equal(p, q) for p, q in zip(sim.global_params, x0))
    if server != "sgd":
        assert all(torch.isfinite(t).all() for t in sim.strategy.server.tensors())


@pytest.mark.parametrize("server", NAMES)
@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn", "fednar-fedprox"])
def test_the_client_batched_round_equals_the_sequential_one(algorithm, server):
    cfg = tiny_config(algorithm, server, rounds=2, client_batched=2, finetune_steps=0)
    v = validate_client_batched(cfg, data=tiny_images(), model_fn=model_fn)
    assert v.dtype == "float64"
    assert v.max_rel <= ROUNDING_RTOL, v.report()


# ---------------------------------------------------------------------------------------------- ranks
RANKED = ["fedavg:adam", "scaffold:exp", "feddyn:yogi", "fednar:avgm"]


def test_two_ranks_equal_one_process(tmp_path):
    from test_sim_ranks import HERE, TORCHRUN, _assert_same_to_rounding, _env, _torchrun

    if TORCHRUN is None:
        pytest.skip("torchrun is not installed")
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    _torchrun(["--standalone", str(HERE / "ranks_child.py"), str(two), *RANKED], tmp_path)
    subprocess.run([sys.executable, str(HERE / "ranks_child.py"), str(one), *RANKED], check=True, env=_env())
    for spec in RANKED:
        for mode in ("sequential", "client-batched"):
            a, b = (json.loads((d / f"{spec}-{mode}.json").read_text()) for d in (one, two))
            assert b["ranks"]["world_size"] == 2
            _assert_same_to_rounding(a, b, f"{spec}-{mode}")


# ---------------------------------------------------------------------------------------------- kill -9
def test_a_killed_run_with_fedadam_resumes_bitwise(tmp_path):
    from test_sim_resume_kill import COMMON, final_state, finish, kill, start, without_times
    from test_sim_resume_kill import ROUNDS as KILL_ROUNDS

    flags = ["--algorithm", "scaffold", "--server-optimizer", "adam", "--server-bias-correction"] + COMMON
    assert fedopt_sim.main(flags + ["--out", str(tmp_path / "whole")]) == 0
    out = ["--out", str(tmp_path / "killed")]
    ckpt = tmp_path / "killed" / "checkpoints" / "seed3"
    for point in ("2:payload", "4:commit", "anywhere"):
        kill(flags, out, tmp_path, ckpt, point)
    assert finish(start(flags + out + ["--resume"], tmp_path)) == 0
    want = json.loads((tmp_path / "whole" / "metrics_seed3.json").read_text())
    got = json.loads((tmp_path / "killed" / "metrics_seed3.json").read_text())
    assert without_times(got) == without_times(want)
    a = final_state(ckpt)
    b = final_state(tmp_path / "whole" / "checkpoints" / "seed3")
    assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"]))
    sa, sb = a["server_optimizer"]["state"], b["server_optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(a["global"])
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for key in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (i, key)
    # the rest of the state_dict: the groups and the step count (FedOptimizer keeps it beside the state)
    rest = {k: v for k, v in a["server_optimizer"].items() if k != "state"}
    assert rest == {k: v for k, v in b["server_optimizer"].items() if k != "state"}
    assert rest["fedopt_round"]["k"] == KILL_ROUNDS


# ---------------------------------------------------------------------------------------------- Flower
FLOWER_CASES = [("fedavg", s) for s in NAMES if s != "sgd"] + [("scaffold", "exp"), ("feddyn", "adam")]


@pytest.mark.parametrize("algorithm, server", FLOWER_CASES)
def test_the_flower_strategy_equals_the_simulator(algorithm, server):
    pytest.importorskip("flwr")
    from test_flower_strategies import run_config

    from fedopt_kernels.flower.apps import client_app, run_algorithm
    from fedopt_kernels.flower.inprocess import InProcessGrid
    from fedopt_kernels.flower.runconfig import sim_configs
    from fedopt_kernels.sim import Simulation

    rc = run_config(algorithm, rounds=3, **{"server-optimizer": server})
    cfg = sim_configs(rc)[0]
    out = run_algorithm(InProcessGrid(client_app(), cfg.num_train_clients, rc), cfg, tag="agree")
    assert out["rejections"] == []
    sim = Simulation(cfg)
    for t in range(cfg.rounds):
        sim.run_round(t)
        assert param_divergence(sim.global_params, out["history"][t + 1]["params"])["rel"] <= PARAM_RTOL


def test_a_restarted_flower_server_continues_its_server_optimizer_exactly(tmp_path):
    pytest.importorskip("flwr")
    from test_flower_resume import Stopped, assert_same, run, run_config

    extra = {"server-optimizer": "adam", "server-bias-correction": True}
    want = run(run_config("scaffold", "", **extra))
    rc = run_config("scaffold", tmp_path, **extra)
    for stop in (2, 3):
        with pytest.raises(Stopped):
            run(rc, stop=stop)
    assert_same(run(rc), want)
    from fedopt_kernels.fl.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="server_optimizer"):
        run(dict(rc, **{"server-optimizer": "yogi"}))


def test_flowers_fedadam_is_the_anchor():
    """Flower 1.42's ``FedAdam`` and ours on the same global model and client models, one round.

    Its documented differences, configured away or stated: it starts ``v`` at 0 (ours at
    ``initial_accumulator_value``, default tau**2: set to 0 here); it scales its step by
    ``sqrt(1 - beta2**t) / (1 - beta1**t)`` with ``t = server_round + 1`` (2 in its first round)
    and leaves tau unscaled (ours, with ``bias_correction``, divides m and v as torch.optim.Adam
    does, with t = 1 in the first round: so ours runs without it, its lr set to Flower's first
    step size); it averages and subtracts in the arrays' float32 (ours: float64, rounded once)."""
    pytest.importorskip("flwr")
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAdam

    from fedopt_kernels.fl.config import FLConfig
    from fedopt_kernels.flower import strategy_for
    from fedopt_kernels.flower.base import ClientResult
    from fedopt_kernels.flower.inprocess import InProcessGrid

    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    rng = np.random.default_rng(5)
    x = {"w": rng.standard_normal((9, 7)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    counts = [3, 11, 6]
    ys = [{k: v + (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in x.items()} for _ in counts]

    flower = FedAdam(eta=eta, beta_1=b1, beta_2=b2, tau=tau)
    flower.current_arrays = {k: v.copy() for k, v in x.items()}
    grid = InProcessGrid(lambda m, c: None, len(counts))
    replies = []
    for i, (y, n) in enumerate(zip(ys, counts)):
        sent = grid.create_message(RecordDict({"config": ConfigRecord({})}), "train", 2**63 - 2 + i, "1")
        content = {
            "arrays": ArrayRecord({k: Array(v) for k, v in y.items()}),
            "metrics": MetricRecord({"num-examples": n}),
        }
        replies.append(Message(RecordDict(content), reply_to=sent))
    theirs, _ = flower.aggregate_train(1, replies)

    first_step = eta * math.sqrt(1 - b2**2) / (1 - b1**2)  # Flower's round 1: t = 2
    cfg = FLConfig(
        algorithm="fedavg",
        server_optimizer="adam",
        server_lr=first_step,
        server_beta1=b1,
        server_beta2=b2,
        server_tau=tau,
        server_initial_accumulator=0.0,
        backend="reference",
    )
    ours = strategy_for(cfg, num_clients=len(counts))
    ours._load_global(ArrayRecord({k: Array(v) for k, v in x.items()}))
    results = [
        ClientResult(i, i, float(n), [torch.from_numpy(y[k] - x[k]) for k in ours.names])
        for i, (y, n) in enumerate(zip(ys, counts))
    ]
    # y - x in float32 as the client computes it; ours then averages in float64
    got = ours._server_step(results)["x"]
    k = len(counts)
    for name, mine in zip(ours.names, got):
        want = theirs[name].numpy().astype(np.float64)
        x0 = x[name].astype(np.float64)
        y_max = np.max([np.abs(y[name]) for y in ys], axis=0)
        # Flower's float32 average and subtraction err by at most (k + 3) eps32 (|y| + |x|); its step
        # m / (sqrt(v) + tau) moves by at most lr (1 - b1) / tau times that; each side rounds the result
        err_delta = (k + 3) * EPS32 * (y_max + np.abs(x0)) + (k + 3) * EPS32 * y_max
        tol = first_step * (1 - b1) / tau * err_delta + 8 * EPS32 * (np.abs(want) + first_step)
        diff = np.abs(mine.double().numpy() - want)
        assert (diff <= tol).all(), float(diff.max())
        # the round moved the model far more than the tolerance: a wrong sign, lr or moment shows
        assert np.median(np.abs(want - x0)) > 100 * tol.max()
