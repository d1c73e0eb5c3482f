"""The Flower strategies and client helpers, driven in-process (InProcessGrid: no Ray, no sockets).

* agreement: a Flower run of FedNAR-SCAFFOLD and PAdaMFed(-VR) equals the simulator's run of the
  same config (same data partition, initial model and mini-batches) within --validate's tolerance;
* bad input: a client that returns non-finite arrays, wrong shapes, or drops out mid-round (no
  reply, or an error reply) is left out of the aggregate and logged by node and client id with the
  reason; the global model and server state stay finite and equal the rule applied to the other
  clients' replies;
* constructors name a bad parameter; the package without Flower says what to install.

Flower's own engines (Ray simulation, SuperLink + SuperNodes) are in test_flower_engine.py.
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")

import torch  # noqa: E402
from flwr.app import Array, ConfigRecord, MessageType  # noqa: E402
from one_thread import one_thread  # noqa: E402,F401  (autouse: one torch thread per test)

from fedopt_kernels.fl.algorithm import VARIANTS  # noqa: E402
from fedopt_kernels.fl.algorithms.padamfed import padamfed_init, padamfed_step  # noqa: E402
from fedopt_kernels.fl.server_rules import (  # noqa: E402
    RULES,
    scaffold_control_step,
    weighted_average_step,
)
from fedopt_kernels.flower import (  # noqa: E402
    FedDecayStrategy,
    FedNARStrategy,
    FedNLRStrategy,
    PAdaMFedStrategy,
    ScaffoldStrategy,
    strategy_for,
)
from fedopt_kernels.flower.apps import client_app, run_algorithm  # noqa: E402
from fedopt_kernels.flower.inprocess import InProcessGrid  # noqa: E402
from fedopt_kernels.flower.records import from_record, to_record  # noqa: E402
from fedopt_kernels.flower.runconfig import sim_configs  # noqa: E402
from fedopt_kernels.flower.simdata import simulation_for  # noqa: E402
from fedopt_kernels.sim import Simulation  # noqa: E402
from fedopt_kernels.sim.validate import PARAM_RTOL, param_divergence  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_config(algorithm, **kw):
    rc = {
        "algorithm": algorithm,
        "clients": 4,
        "holdout-fraction": 0.0,
        "rounds": 2,
        "local-steps": 3,
        "model": "mlp",
        "sample-rate": 1.0,
        "seed": 3,
        "backend": "reference",
        "device": "cpu",
    }
    rc.update(kw)
    return rc


# ---------------------------------------------------------------------------------------------- agreement
# every registered variant with everyone training, and partial participation for each rule with server state
@pytest.mark.parametrize(
    "algorithm, sample_rate",
    [(v, 1.0) for v in VARIANTS] + [(v.name, 0.5) for v in VARIANTS.values() if RULES[v.server].state],
)
def test_flower_run_equals_the_simulator(algorithm, sample_rate):
    # sample_rate 0.5: the app's strategy trains the clients fedopt-sim samples (a twin simulator draws them)
    rc = run_config(algorithm, rounds=3, **{"sample-rate": sample_rate})
    cfg = sim_configs(rc)[0]
    out = run_algorithm(InProcessGrid(client_app(), cfg.num_train_clients, rc), cfg, tag="agree")
    assert out["rejections"] == []
    sim = Simulation(cfg)
    for t in range(cfg.rounds):
        sim.run_round(t)
        flower_params = out["history"][t + 1]["params"]
        assert param_divergence(sim.global_params, flower_params)["rel"] <= PARAM_RTOL, f"round {t + 1}"
    assert out["history"][-1]["val_acc"] == pytest.approx(sim.history[-1]["val_acc"], abs=1e-9)


@pytest.mark.parametrize("algorithm", [v.name for v in VARIANTS.values() if RULES[v.server].keeps])
def test_client_keeps_its_control_and_never_sends_it(algorithm):
    rc = run_config(algorithm, rounds=1)
    cfg = sim_configs(rc)[0]
    sent = []

    def spy(msg, ctx):
        reply = client_app()(msg, ctx)
        if msg.metadata.message_type == MessageType.TRAIN:
            sent.append(set(reply.content.keys()))
        return reply

    grid = InProcessGrid(spy, cfg.num_train_clients, rc)
    run_algorithm(grid, cfg, tag="spy")
    expected = {"delta", "metrics", *RULES[cfg.server_rule].reply}
    assert sent and all(keys == expected for keys in sent)
    for ctx in grid.contexts.values():
        assert "spy.control" in ctx.state and "spy.batches" in ctx.state


def test_federated_evaluation_matches_the_servers_pooled_accuracy():
    rc = run_config("fednlr", rounds=2)
    cfg = sim_configs(rc)[0]
    out = run_algorithm(InProcessGrid(client_app(), cfg.num_train_clients, rc), cfg, tag="eval", fraction_evaluate=1.0)
    # every client evaluates on its validation split; the n-weighted mean is the pooled accuracy
    for h in out["history"][1:]:
        fed = out["evaluate_metrics"][h["round"]]
        assert fed["eval-acc"] == pytest.approx(h["val_acc"], abs=1e-12)
        assert fed["eval-loss"] == pytest.approx(h["val_loss"], rel=1e-6)


def test_sampling_is_seeded_and_sized():
    rc = run_config("feddecay", clients=6)
    cfg = sim_configs(rc)[0]
    sim = simulation_for(cfg)
    arrays = to_record([n for n, _ in sim.model.named_parameters()], sim.global_params)
    grid = InProcessGrid(lambda m, c: None, cfg.num_train_clients, rc)

    def picked(seed):
        s = strategy_for(cfg, clients_per_round=2, seed=seed)
        return [m.metadata.dst_node_id for m in s.configure_train(1, arrays, ConfigRecord(), grid)]

    assert len(picked(0)) == 2 and picked(0) == picked(0)
    # Flower's node ids are unsigned 64-bit (the grid's straddle 2**63): sampling must return them exactly
    assert all(set(picked(s)) <= set(grid.get_node_ids()) for s in range(6))
    assert len({tuple(picked(s)) for s in range(6)}) > 1


def test_client_sampler_maps_client_ids_to_nodes(caplog):
    rc = run_config("fedavg", clients=4)
    cfg = sim_configs(rc)[0]
    sim = simulation_for(cfg)
    app = client_app()

    def silent_client_3(msg, ctx):  # client 3 never says who it is
        if ctx.node_config["partition-id"] == 3 and msg.metadata.message_type == "query.client_id":
            return None
        return app(msg, ctx)

    grid = InProcessGrid(silent_client_3, cfg.num_train_clients, rc)
    node_of = {ctx.node_config["partition-id"]: n for n, ctx in grid.contexts.items()}
    strategy = strategy_for(cfg, client_sampler=lambda: [3, 0, 2])
    arrays = to_record([n for n, _ in sim.model.named_parameters()], sim.global_params)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        msgs = strategy.configure_train(1, arrays, ConfigRecord(), grid)
    assert [m.metadata.dst_node_id for m in msgs] == sorted([node_of[0], node_of[2]])
    (rej,) = strategy.rejections
    assert rej.client_id == 3 and "no node serves" in rej.reason
    assert any("client 3 was sampled but no node serves it" in r.getMessage() for r in caplog.records)

    # everyone sampled: every node trains, and nobody is asked who they are
    queries = []
    counting = InProcessGrid(
        lambda m, c: queries.append(m.metadata.message_type) or app(m, c), cfg.num_train_clients, rc
    )
    everyone = strategy_for(cfg, client_sampler=lambda: [2, 0, 3, 1])
    msgs = everyone.configure_train(1, arrays, ConfigRecord(), counting)
    assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(counting.get_node_ids()) and queries == []


# ---------------------------------------------------------------------------------------------- bad input
class FaultyClient:
    """The digits ClientApp, except that client ``bad`` misbehaves in train round ``bad_round``."""

    def __init__(self, rc, bad, fault, bad_round=1, phase=MessageType.TRAIN):
        self.app, self.bad, self.fault, self.bad_round, self.phase = client_app(), bad, fault, bad_round, phase
        self.replies = {}  # (message type, server round, client id) -> reply content as sent
        self.messages = {}  # the same keys -> reply message as sent

    def __call__(self, msg, ctx):
        cid = ctx.node_config["partition-id"]
        rnd = int(msg.content["config"]["server-round"])
        bad = self.bad if isinstance(self.bad, tuple) else (self.bad,)
        hit = cid in bad and rnd == self.bad_round and msg.metadata.message_type == self.phase
        if hit and self.fault == "dropout":
            return None
        if hit and self.fault == "crash":
            raise RuntimeError("simulated crash in the middle of local training")
        if hit and self.fault == "stale":  # its reply to the previous round's instruction, delivered late
            return self.messages[(msg.metadata.message_type, rnd - 1, cid)]
        reply = self.app(msg, ctx)
        if hit and self.fault.startswith("count="):
            reply.content["metrics"]["num-examples"] = eval(self.fault[len("count=") :])
        key = "control" if "control" in reply.content and "delta" not in reply.content else "delta"
        if hit and self.fault in ("nan", "shape"):
            rec = reply.content[key]
            name = next(iter(rec.keys()))
            arr = rec[name].numpy()
            rec[name] = Array(
                np.full(arr.shape, np.nan, arr.dtype)
                if self.fault == "nan"
                else np.zeros(arr.shape[:-1] + (arr.shape[-1] + 1,), arr.dtype)
            )
        if hit and self.fault == "nan-dc":
            rec = reply.content["dc"]
            name = next(iter(rec.keys()))
            rec[name] = Array(np.full(rec[name].numpy().shape, np.inf, np.float32))
        self.replies[(msg.metadata.message_type, rnd, cid)] = reply.content
        self.messages[(msg.metadata.message_type, rnd, cid)] = reply
        return reply


def tensors_of(record, names):
    return [torch.from_numpy(np.array(record[n].numpy())) for n in names]


FAULTS = {
    "nan": "non-finite",
    "shape": "has shape",
    "dropout": "no reply",
    "crash": "simulated crash",
    "nan-dc": "non-finite",
}


def drive_round(strategy, grid, server_round, arrays):
    msgs = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
    return strategy.aggregate_train(server_round, grid.send_and_receive(msgs))


@pytest.mark.parametrize("algorithm", ["fednar", "fednar-scaffold", "padamfed"])
@pytest.mark.parametrize("fault", ["nan", "shape", "dropout", "crash", "nan-dc"])
def test_a_bad_client_is_left_out_and_logged(algorithm, fault, caplog):
    if fault == "nan-dc" and algorithm == "fednar":
        pytest.skip("FedNAR on FedAvg sends no control change")
    rc = run_config(algorithm)
    cfg = sim_configs(rc)[0]
    sim = simulation_for(cfg)
    names = [n for n, _ in sim.model.named_parameters()]
    bad = 2
    client = FaultyClient(rc, bad, fault)
    grid = InProcessGrid(client, cfg.num_train_clients, rc)
    strategy = strategy_for(cfg, state_tag=f"t-{algorithm}-{fault}")
    arrays = to_record(names, sim.global_params)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        # round 1 has the fault; capture the server state it starts from (after PAdaMFed's init)
        msgs = strategy.configure_train(1, arrays, ConfigRecord(), grid)
        x0 = [t.clone() for t in strategy.global_params]
        state0 = {k: [t.clone() for t in v] for k, v in strategy.server_state().items()}
        arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(msgs))

    # left out, and said so: which node, which client, why
    (rej,) = strategy.rejections
    assert (rej.server_round, rej.phase, rej.reason.count(FAULTS[fault]) > 0) == (1, "train", True), rej
    node = next(n for n, ctx in grid.contexts.items() if ctx.node_config["partition-id"] == bad)
    assert rej.node_id == node and rej.client_id in (bad, None)
    logged = [r.getMessage() for r in caplog.records if "left node" in r.getMessage()]
    assert len(logged) == 1 and f"node {node}" in logged[0] and FAULTS[fault] in logged[0]
    if fault in ("nan", "shape", "nan-dc"):  # the reply arrived, so it names its client too
        assert f"(client {bad})" in logged[0]

    # the aggregate is the rule applied to the good clients alone, and everything is finite
    good = [client.replies[(MessageType.TRAIN, 1, c)] for c in range(cfg.num_train_clients) if c != bad]
    deltas = [tensors_of(r["delta"], names) for r in good]
    weights = [float(r["metrics"]["num-examples"]) for r in good]
    if cfg.server_rule == "padamfed":
        dcs = [tensors_of(r["dc"], names) for r in good]
        ex, ec, em = padamfed_step(
            x0,
            state0["c"],
            state0["m"],
            deltas,
            dcs,
            num_clients=cfg.num_train_clients,
            lr=strategy.hp["lr"],
            local_steps=cfg.local_steps,
            server_lr=strategy.hp["server_lr"],
            beta=strategy.hp["beta"],
        )
        expected = {"x": ex, "c": ec, "m": em}
    else:
        expected = {"x": weighted_average_step(x0, deltas, weights, strategy.hp["server_lr"])}
        if cfg.server_rule == "scaffold":
            expected["c"] = scaffold_control_step(
                state0["c"], [tensors_of(r["dc"], names) for r in good], cfg.num_train_clients
            )
    got = {"x": strategy.global_params, **strategy.server_state()}
    assert set(got) == set(expected)
    for k in expected:
        for a, b in zip(got[k], expected[k]):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    # the next round (everyone well again) runs normally from there
    _, metrics = drive_round(strategy, grid, 2, arrays)
    assert metrics["clients-used"] == cfg.num_train_clients and len(strategy.rejections) == 1
    assert all(torch.isfinite(t).all() for v in [strategy.global_params, *strategy.server_state().values()] for t in v)


@pytest.mark.parametrize("fault", ["nan", "dropout"])
def test_padamfed_initialisation_leaves_a_bad_client_out(fault, caplog):
    rc = run_config("padamfed")
    cfg = sim_configs(rc)[0]
    sim = simulation_for(cfg)
    names = [n for n, _ in sim.model.named_parameters()]
    client = FaultyClient(rc, 1, fault, phase="train.init_controls")
    grid = InProcessGrid(client, cfg.num_train_clients, rc)
    strategy = strategy_for(cfg, state_tag=f"init-{fault}")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        drive_round(strategy, grid, 1, to_record(names, sim.global_params))
    (rej,) = strategy.rejections
    assert rej.phase == "init" and FAULTS[fault] in rej.reason
    good = [
        tensors_of(client.replies[("train.init_controls", 1, c)]["control"], names)
        for c in range(cfg.num_train_clients)
        if c != 1
    ]
    c0, _ = padamfed_init(good, cfg.num_train_clients)
    assert all(torch.isfinite(t).all() for v in strategy.server_state().values() for t in v)
    # c after round 1 = c0 + sum(dc) / N: recover c0 from the round's replies and compare
    dcs = [tensors_of(client.replies[(MessageType.TRAIN, 1, c)]["dc"], names) for c in range(cfg.num_train_clients)]
    recovered = [c - sum(d[j] for d in dcs) / cfg.num_train_clients for j, c in enumerate(strategy.c)]
    for a, b in zip(recovered, c0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["fednar-scaffold", "padamfed"])
@pytest.mark.parametrize(
    "fault,bad,reason",
    [
        ("count=1e308", (1, 3), "num-examples"),  # two such counts overflowed the weight sum: model frozen
        ("count=2.5", (2,), "num-examples"),
        ("count=2**53 + 2", (0,), "num-examples"),
        ("count=0", (2,), "num-examples"),
        ("count=-4", (2,), "num-examples"),
        ("stale", (1,), "round"),  # a node asked in round 2 answers with its round-1 reply
    ],
)
def test_a_bad_count_or_a_stale_reply_is_a_logged_dropout(algorithm, fault, bad, reason, caplog):
    rc = run_config(algorithm)
    cfg = sim_configs(rc)[0]
    sim = simulation_for(cfg)
    names = [n for n, _ in sim.model.named_parameters()]
    client = FaultyClient(rc, bad, fault, bad_round=2)
    grid = InProcessGrid(client, cfg.num_train_clients, rc)
    strategy = strategy_for(cfg, state_tag=f"c-{algorithm}-{len(bad)}")
    arrays, _ = drive_round(strategy, grid, 1, to_record(names, sim.global_params))
    assert strategy.rejections == []
    msgs = strategy.configure_train(2, arrays, ConfigRecord(), grid)
    x0 = [t.clone() for t in strategy.global_params]
    state0 = {k: [t.clone() for t in v] for k, v in strategy.server_state().items()}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = strategy.aggregate_train(2, grid.send_and_receive(msgs))
    assert metrics["clients-used"] == cfg.num_train_clients - len(bad)
    assert len(strategy.rejections) == len(bad)
    assert all(r.server_round == 2 and reason in r.reason for r in strategy.rejections), strategy.rejections
    assert sum("left node" in r.getMessage() and reason in r.getMessage() for r in caplog.records) == len(bad)
    good = [client.replies[(MessageType.TRAIN, 2, c)] for c in range(cfg.num_train_clients) if c not in bad]
    deltas = [tensors_of(r["delta"], names) for r in good]
    if cfg.server_rule == "padamfed":
        expect, _, _ = padamfed_step(
            x0,
            state0["c"],
            state0["m"],
            deltas,
            [tensors_of(r["dc"], names) for r in good],
            num_clients=cfg.num_train_clients,
            lr=strategy.hp["lr"],
            local_steps=cfg.local_steps,
            server_lr=strategy.hp["server_lr"],
            beta=strategy.hp["beta"],
        )
    else:
        expect = weighted_average_step(
            x0, deltas, [float(r["metrics"]["num-examples"]) for r in good], strategy.hp["server_lr"]
        )
    for a, b, _before in zip(strategy.global_params, expect, x0):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(strategy.global_params, x0))  # not frozen


def test_a_round_without_usable_replies_keeps_the_model(caplog):
    rc = run_config("fednar-scaffold")
    cfg = sim_configs(rc)[0]
    sim = simulation_for(cfg)
    names = [n for n, _ in sim.model.named_parameters()]
    grid = InProcessGrid(lambda m, c: None, cfg.num_train_clients, rc)
    strategy = strategy_for(cfg)
    arrays = to_record(names, sim.global_params)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        out, metrics = drive_round(strategy, grid, 1, arrays)
    assert metrics["clients-used"] == 0 and len(strategy.rejections) == cfg.num_train_clients
    assert all(torch.equal(a, b) for a, b in zip(strategy.global_params, sim.global_params))
    assert all(torch.equal(c, torch.zeros_like(c)) for c in strategy.c)


def test_own_model_and_data_as_in_the_docs():
    """docs/flower.md's recipe: a ClientApp around train_round, a keyword strategy, Strategy.start."""
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    from fedopt_kernels.flower import init_controls_round, train_round

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def data(cid):
        g = torch.Generator().manual_seed(cid)
        x = torch.randn(40, 6, generator=g)
        return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()

    def batches(cid, context):
        x, y = data(cid)
        while True:
            for i in range(0, 40, 8):
                yield x[i : i + 8], y[i : i + 8]

    app = ClientApp()

    @app.train()
    def train(msg, context):
        cid = context.node_config["partition-id"]
        it = batches(cid, context)
        content = train_round(
            make_model(),
            lambda: next(it),
            msg.content,
            context.state,
            num_examples=40,
            calibration=data(cid),
            backend="reference",
        )
        return Message(content, reply_to=msg)

    @app.train("init_controls")
    def init(msg, context):
        it = batches(context.node_config["partition-id"], context)
        return Message(
            init_controls_round(make_model(), lambda: next(it), msg.content, context.state, num_examples=40),
            reply_to=msg,
        )

    def loss_of(arrays):
        model = make_model()
        names = [n for n, _ in model.named_parameters()]
        with torch.no_grad():
            for p, v in zip(model.parameters(), from_record(arrays, names, list(model.parameters()), "x")):
                p.copy_(v)
            return sum(float(torch.nn.functional.cross_entropy(model(data(c)[0]), data(c)[1])) for c in range(3))

    model = make_model()
    names, params = zip(*model.named_parameters())
    start = loss_of(to_record(names, params))
    for strategy in (
        FedNARStrategy(backbone="scaffold", lr=0.1, weight_decay=1e-3, local_steps=5),
        FedNLRStrategy(lr=0.1, local_steps=5),
        PAdaMFedStrategy(num_rounds=5, clients_per_round=3, local_steps=5),
    ):
        result = strategy.start(InProcessGrid(app, 3), to_record(names, params), num_rounds=5)
        assert strategy.rejections == []
        assert loss_of(result.arrays) < start, type(strategy).__name__


# ---------------------------------------------------------------------------------------------- constructors
@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: FedDecayStrategy(beta=1.5), "beta"),
        (lambda: FedDecayStrategy(beta=0.5, lr=-1.0), "lr"),
        (lambda: FedNARStrategy(backbone="fedadam"), "backbone"),
        (lambda: FedNARStrategy(max_norm=0.0), "clip_norm"),
        (lambda: FedNLRStrategy(fraction_train=0.0), "fraction_train"),
        (lambda: ScaffoldStrategy(clients_per_round=0), "clients_per_round"),
        (lambda: ScaffoldStrategy(fraction_evaluate=2.0), "fraction_evaluate"),
        (lambda: PAdaMFedStrategy(num_rounds=0, clients_per_round=5), "num_rounds"),
        (lambda: PAdaMFedStrategy(num_rounds=10, clients_per_round=5, fraction_train=0.5), "fraction_train"),
    ],
)
def test_constructors_name_the_bad_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_keyword_constructors_resolve_the_simulators_defaults():
    s = PAdaMFedStrategy(num_rounds=100, clients_per_round=10, local_steps=5)
    from fedopt_kernels import theory_hparams

    eta, gamma, beta = theory_hparams(10, 5, 100)
    assert (s.hp["lr"], s.hp["server_lr"], s.hp["beta"]) == (eta, gamma, beta)
    assert FedNARStrategy(backbone="scaffold").cfg.algorithm == "fednar-scaffold"
    assert FedNARStrategy().hp["clip_norm"] == 10.0 and FedNARStrategy().hp["round_decay"] == 0.998
    with pytest.raises(TypeError, match="cfg"):
        strategy_for({"algorithm": "fedavg"})


def test_importing_without_flower_says_what_to_install():
    code = "import sys; sys.modules['flwr'] = None; import fedopt_kernels.flower"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert 'pip install "fedopt_kernels[flower]"' in res.stderr


@pytest.mark.parametrize(
    "old, new",
    [
        ("FedDecay", "FedDecayStrategy"),
        ("FedNLR", "FedNLRStrategy"),
        ("FedNAR", "FedNARStrategy"),
        ("Scaffold", "ScaffoldStrategy"),
        ("PAdaMFed", "PAdaMFedStrategy"),
        ("padamfed_init_round", "init_controls_round"),
    ],
)
def test_earlier_flower_names_import_with_a_warning(old, new):
    import fedopt_kernels.flower as fl

    with pytest.warns(DeprecationWarning, match=new):
        assert getattr(fl, old) is getattr(fl, new)
    assert old not in fl.__all__
    with pytest.raises(AttributeError):
        _ = fl.NoSuchStrategy
