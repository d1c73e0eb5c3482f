"""Server optimizers in the simulator (``--server-optimizer``; fl/server_step.py): a representative share.

* each server optimizer steps on exactly the round's float64 aggregate: the model after every round
  equals, bit for bit, a fresh optimizer of the same class stepped on the mean of the recorded
  client updates (FedAvg, SCAFFOLD, FedNAR; its state carried over three rounds); FedExP's model
  equals a float64 computation from the clients' updates within the rounding its float32 step has;
* every rule's aggregate is its own model step (FedDyn's: the new model minus the old);
* the fold's sum of squared update norms is a float64 computation, and ranks' partial folds merge to it;
* resumed runs end bitwise where uninterrupted ones do; a checkpoint of another server optimizer
  is refused naming the setting; the client-batched round equals the sequential one;
* bad settings name the option, and nothing starts.

All 6 x every algorithm, ranks, kills and Flower: test_server_optimizers_all.py (slow tier).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import fedopt_kernels
from fedopt_kernels.fl.checkpoint import CheckpointError
from fedopt_kernels.fl.config import FLConfig
from fedopt_kernels.fl.fold import weight_exponent
from fedopt_kernels.fl.server_rules import RULES
from fedopt_kernels.fl.server_step import INDEX, NAMES, optimizer_options
from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.clients import ClientData
from fedopt_kernels.sim.federated_data import FederatedData
from fedopt_kernels.sim.models.small import SmallCNN
from fedopt_kernels.sim.rank_round import check_ranks_agree
from fedopt_kernels.sim.server_optimizer import CLASSES
from fedopt_kernels.sim.simulation import Simulation
from fedopt_kernels.sim.validate import validate_client_batched

SIZES = (3, 9, 14, 6, 22)
SHAPE = (1, 8, 8)
ROUNDS = 3
EPS32 = torch.finfo(torch.float32).eps
ROUNDING_RTOL = 1e6 * torch.finfo(torch.float64).eps  # test_sim_batched.py's: float64 runs, rounding only

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_images(sizes=SIZES) -> FederatedData:
    g = torch.Generator().manual_seed(0)
    users = []
    for i, n in enumerate(list(sizes) + [5]):
        y = torch.randint(0, 4, (n + 2,), generator=g)
        x = torch.randn(n + 2, *SHAPE, generator=g) + y.view(-1, 1, 1, 1) * 0.5
        users.append(ClientData(i, x[:n], y[:n], x[n : n + 1], y[n : n + 1], x[n + 1 :], y[n + 1 :]))
    return FederatedData(users[: len(sizes)], users[len(sizes) :], SHAPE, 4)


def model_fn() -> nn.Module:
    return SmallCNN(SHAPE, 4, channels=(3, 4))


def tiny_config(algorithm: str, server: str, **kw: Any) -> SimConfig:
    base: Dict[str, Any] = dict(
        algorithm=algorithm,
        server_optimizer=server,
        clients=len(SIZES) + 1,
        holdout_fraction=1 / 6,
        clients_per_round=3,
        local_steps=2,
        batch_size=4,
        rounds=ROUNDS,
        lr=0.1,
        backend="reference",
        device="cpu",
        finetune_steps=1,
    )
    base.update(kw)
    return SimConfig(**base)


def make(cfg: SimConfig, **kw: Any) -> Simulation:
    return Simulation(cfg, data=tiny_images(), model_fn=model_fn, **kw)


def recording(sim: Simulation) -> List[List[Any]]:
    """Each round's accepted updates ``(weight, delta)``, in the order the fold added them."""
    rounds: List[List[Any]] = []
    begin, add = sim.strategy.begin_round, sim.strategy.add

    def begin_round(sampled, t):
        rounds.append([])
        return begin(sampled, t)

    def take(fold, update):
        rounds[-1].append((update.weight, [d.clone() for d in update.delta]))
        add(fold, update)

    sim.strategy.begin_round, sim.strategy.add = begin_round, take  # type: ignore[method-assign]
    return rounds


def mean_update(updates) -> List[torch.Tensor]:
    """``sum_i w_i delta_i / sum_i w_i`` in float64, the updates added in the order given."""
    total = sum(w for w, _ in updates)
    sums = [torch.zeros_like(d, dtype=torch.float64) for d in updates[0][1]]
    for w, delta in updates:
        for s, d in zip(sums, delta):
            s.add_(d.double() * w)
    return [s / total for s in sums]


# each optimizer on one of three client sides (every pairing: test_server_optimizers_all.py)
CASES = [("fedavg", "avgm"), ("scaffold", "yogi"), ("fednar", "adam"), ("fednar", "adagrad"), ("feddecay", "adam")]


@pytest.mark.parametrize("algorithm, server", CASES)
def test_each_round_steps_the_optimizer_on_the_float64_aggregate(algorithm, server):
    # backend auto: the fused cpu kernels where they are built (the twin's the same)
    cfg = tiny_config(algorithm, server, server_lr=0.05 if server != "avgm" else 0.7, backend="auto")
    sim = make(cfg)
    x0 = [p.clone() for p in sim.global_params]
    rounds = recording(sim)
    twin = [p.clone() for p in x0]
    opt = CLASSES[server](twin, **optimizer_options(cfg), backend="auto")
    for t in range(ROUNDS):
        sim.run_round(t)
        for p, d in zip(twin, mean_update(rounds[t])):
            p.grad = d.neg().float()
        opt.step()
        for p, q in zip(sim.global_params, twin):
            assert torch.equal(p, q), f"round {t + 1}"
    assert any(not torch.equal(p, q) for p, q in zip(sim.global_params, x0))


def test_fedexp_is_a_float64_computation_of_the_clients_updates():
    eps = 1e-3
    sim = make(tiny_config("fednar", "exp", server_eps=eps))
    rounds = recording(sim)
    for t in range(ROUNDS):
        x = [p.double() for p in sim.global_params]
        sim.run_round(t)
        updates = rounds[t]
        total = sum(w for w, _ in updates)
        mean_sq = sum(w * sum(float(d.double().square().sum()) for d in delta) for w, delta in updates) / total
        delta = mean_update(updates)
        sq = sum(float(d.square().sum()) for d in delta)
        eta = max(1.0, mean_sq / (2 * (sq + eps)))
        n = sum(d.numel() for d in delta)
        for got, xj, dj in zip(sim.global_params, x, delta):
            want = xj + eta * dj
            # float32: the rounding of x + eta*delta and of g = -delta, and eta from n float32 squares
            tol = EPS32 * (2 * xj.abs() + (n + 8) * eta * dj.abs()) + 1e-30
            assert ((got.double() - want).abs() <= tol).all(), f"round {t + 1}"
        assert eta >= 1.0


@pytest.mark.parametrize("rule", [name for name, r in RULES.items() if r.takes_server_optimizer])
def test_every_rules_aggregate_is_its_own_model_step(rule):
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g)]
    r = RULES[rule]
    state = {k: [torch.randn(v.shape, generator=g) for v in x] for k in r.state}
    hp = {"server_lr": 1.0, "dyn_alpha": 0.1, "lr": 0.1, "beta": 0.5}
    weights = [3.0, 11.0, 6.0]
    fold = r.begin(x, state, hp, 9, 2, weight_exponent(weights))
    for w in weights:
        numbers = {name: 1.0 + 9.0 * float(torch.rand((), generator=g)) for name in r.scalars}  # FedNova's a_i
        fold.add(
            [torch.randn(v.shape, generator=g) for v in x],
            w,
            {"dc": [torch.randn(v.shape, generator=g) for v in x], **numbers},
        )
    new_x = fold.finish()["x"]
    for a, n, o in zip(r.aggregate(fold, new_x), new_x, x):
        assert a.dtype == torch.float64
        # new_x is x + aggregate rounded once to float32: half a unit of |new_x|, and the subtraction's
        assert ((a - (n.double() - o.double())).abs() <= EPS32 * n.double().abs() + 1e-12).all()


def test_the_fold_sums_the_weighted_squared_norms_in_float64_and_ranks_merge_to_it():
    g = torch.Generator().manual_seed(2)
    x = [torch.randn(6, 4, generator=g), torch.randn(4, generator=g)]
    updates = [(w, [torch.randn(v.shape, generator=g) for v in x]) for w in (2.0, 7.0, 5.0, 1.0)]
    e = weight_exponent([w for w, _ in updates])
    one = RULES["avg"].begin(x, {}, {"server_lr": 1.0}, 4, 1, e)
    parts = [RULES["avg"].begin(x, {}, {"server_lr": 1.0}, 4, 1, e) for _ in range(2)]
    for f in [one, *parts]:
        f.keep_sq_norms()
    for i, (w, d) in enumerate(updates):
        one.add(d, w)
        parts[i // 2].add(d, w)
    parts[0].merge(parts[1:])
    want = sum(w * sum(float(t.double().square().sum()) for t in d) for w, d in updates) / sum(w for w, _ in updates)
    for f in (one, parts[0]):
        got = float(f.sums["sq_norm"][0] / f.weight)
        assert f.sums["sq_norm"][0].dtype == torch.float64
        assert math.isclose(got, want, rel_tol=64 * torch.finfo(torch.float64).eps)


@pytest.mark.parametrize("mode", [{}, {"client_batched": 2}])
def test_a_resumed_run_with_a_server_optimizer_ends_bitwise_where_the_whole_run_does(tmp_path, mode):
    cfg = tiny_config("scaffold", "adam", **mode)
    whole = make(cfg)
    result = whole.run()
    first = make(cfg, checkpoint_dir=tmp_path)  # stopped after round 1: only its checkpoint survives
    first.run_round(0)
    first.save_checkpoint()
    del first
    resumed = make(cfg, checkpoint_dir=tmp_path)
    got = resumed.run(resume=True)
    assert resumed.resumed_from == 1
    assert [r["train_loss"] for r in got["history"]] == [r["train_loss"] for r in result["history"]]
    assert all(torch.equal(a, b) for a, b in zip(resumed.global_params, whole.global_params))
    mine, theirs = resumed.strategy.server_state(), whole.strategy.server_state()
    assert len(mine["server_optimizer"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(mine["server_optimizer"], theirs["server_optimizer"]))


def test_a_checkpoint_of_another_server_optimizer_is_refused_naming_it(tmp_path):
    first = make(tiny_config("fedavg", "adam"), checkpoint_dir=tmp_path)
    first.run_round(0)
    first.save_checkpoint()
    other = make(tiny_config("fedavg", "yogi"), checkpoint_dir=tmp_path)
    before = [p.clone() for p in other.global_params]
    with pytest.raises(CheckpointError, match="server_optimizer"):
        other.load_checkpoint()
    assert all(torch.equal(a, b) for a, b in zip(other.global_params, before))


@pytest.mark.parametrize("server", ["adam", "exp"])
def test_the_client_batched_round_equals_the_sequential_one(server):
    v = validate_client_batched(
        tiny_config("fedavg", server, rounds=2, client_batched=2, finetune_steps=0),
        data=tiny_images(),
        model_fn=model_fn,
    )
    assert v.dtype == "float64"
    assert v.max_rel <= ROUNDING_RTOL, v.report()


def test_the_ranks_check_covers_the_server_optimizers_state():
    sim = make(tiny_config("fedavg", "adam"))
    sim.run_round(0)
    seen = []

    class Ranks:
        def check_same(self, parts, what):
            seen.append(dict(parts))

    sim.ranks = Ranks()
    check_ranks_agree(sim, 0)
    state = sim.strategy.server.tensors()
    assert state
    with torch.no_grad():
        state[0].add_(1.0)  # one moment of the server optimizer differs: the digest must see it
    check_ranks_agree(sim, 0)
    key = "the global model and server state"
    assert seen[0][key] != seen[1][key]


BAD = [
    (["--server-optimizer", "sgdm"], "--server-optimizer"),
    (["--server-lr", "-0.1"], "--server-lr"),
    (["--server-optimizer", "adam", "--server-beta1", "1"], "--server-beta1"),
    (["--server-optimizer", "yogi", "--server-beta2", "-0.5"], "--server-beta2"),
    (["--server-optimizer", "adam", "--server-tau", "0"], "--server-tau"),
    (["--server-optimizer", "adagrad", "--server-tau", "-1"], "--server-tau"),
    (["--server-optimizer", "adam", "--algorithm", "padamfed"], "--server-optimizer"),
    (["--server-optimizer", "exp", "--server-lr", "0.5"], "--server-lr"),
    (["--server-optimizer", "adagrad", "--server-beta2", "0.9"], "--server-beta2"),
    (["--server-momentum", "0.9"], "--server-momentum"),
]


@pytest.mark.parametrize("flags, named", BAD)
def test_bad_settings_name_the_option_and_nothing_starts(tmp_path, capsys, flags, named):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as err:
        fedopt_sim.main(flags + ["--dataset", "synthetic", "--quiet", "--out", str(out)])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert named in message, message
    assert not out.exists()


def test_the_python_settings_name_the_field():
    with pytest.raises(ValueError, match="server_optimizer='adam' does not apply to algorithm='padamfed-vr'"):
        FLConfig(algorithm="padamfed-vr", server_optimizer="adam").validate()
    with pytest.raises(ValueError, match="server_bias_correction must be True or False"):
        FLConfig(server_optimizer="adam", server_bias_correction=1).validate()
    assert FLConfig(server_optimizer="adam").hparams()["server_lr"] == 1e-2
    assert FLConfig().hparams()["server_lr"] == 1.0
    assert set(NAMES) == {"sgd", *CLASSES}
    for name, cls in CLASSES.items():  # the docs' table names the classes the package exports
        assert getattr(fedopt_kernels, INDEX[name][0]) is cls


def test_the_documented_commands_are_ones_fedopt_sim_accepts():
    """docs/algorithms.md's server optimizers (the FedNAR paper's six backbones) and docs/simulator.md's."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "algorithms.md").read_text()
    algorithms = text.split("## Server optimizers in a run", 1)[1].split("\n## ", 1)[0]
    simulator = (root / "docs" / "simulator.md").read_text()
    lines = re.findall(r"^fedopt-sim .*$", algorithms, re.M)
    assert sum("--algorithm fednar" in line for line in lines) == 6
    lines += re.findall(r"^fedopt-sim .*--server-optimizer.*$", simulator, re.M)
    for line in lines:
        args = fedopt_sim.build_parser().parse_args(shlex.split(line)[1:])
        cfg = fedopt_sim.config_from_args(args, 0)  # validates every setting
        assert cfg.server_optimizer in NAMES
    assert {"exp", "adam", "avgm"} <= {
        fedopt_sim.build_parser().parse_args(shlex.split(x)[1:]).server_optimizer for x in lines
    }
