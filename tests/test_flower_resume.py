"""The ready-made Flower app with ``checkpoint-dir``: a server stopped after round k and started again
continues with round k+1 and ends exactly where an uninterrupted run ends.

In-process (``InProcessGrid``: no Ray) for every registered algorithm: the run is stopped when the
server sends round 2's training messages (after round 1's checkpoint) and again at round 3; each
restart gets fresh nodes (new ``context.state``, as a new Flower run would), so the clients' kept
state (control variates, FedDyn's g_i, batch positions) must come back from their files. The
global model of every round, the server's metrics and the replies left out must equal those of an
uninterrupted run bit for bit. Flower's simulation engine (Ray) runs the same for one algorithm.
"""

import json

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")

import torch  # noqa: E402
from one_thread import one_thread  # noqa: E402,F401  (autouse: one torch thread per test)

from fedopt_kernels.fl.algorithm import VARIANTS  # noqa: E402
from fedopt_kernels.fl.checkpoint import MANIFEST, CheckpointError  # noqa: E402
from fedopt_kernels.flower.apps import client_app, run_algorithm  # noqa: E402
from fedopt_kernels.flower.inprocess import InProcessGrid  # noqa: E402
from fedopt_kernels.flower.runconfig import sim_configs  # noqa: E402

ROUNDS = 4


class Stopped(Exception):
    """The server 'dies' here."""


class StoppingGrid(InProcessGrid):
    """An InProcessGrid whose server stops when it sends the training messages of round ``stop``."""

    def __init__(self, *args, stop: int = 0, **kw):
        super().__init__(*args, **kw)
        self.stop = stop

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if any(m.metadata.message_type == "train" and m.metadata.group_id == str(self.stop) for m in messages):
            raise Stopped
        return super().send_and_receive(messages, timeout=timeout)


def run_config(algorithm, folder, **kw):
    rc = {
        "algorithm": algorithm,
        "clients": 5,
        "holdout-fraction": 0.0,
        "rounds": ROUNDS,
        "local-steps": 2,
        "model": "mlp",
        "sample-rate": 0.6,
        "seed": 3,
        "backend": "reference",
        "device": "cpu",
        "checkpoint-dir": str(folder),
    }
    rc.update(kw)
    return rc


def run(rc, stop=0, tag="t", every=1):
    cfg = sim_configs(rc)[0]
    grid = StoppingGrid(client_app(), cfg.num_train_clients, rc, stop=stop)
    return run_algorithm(grid, cfg, tag=tag, checkpoint_dir=rc["checkpoint-dir"], checkpoint_every=every)


def assert_same(got, want):
    assert [h["round"] for h in got["history"]] == [h["round"] for h in want["history"]]
    for g, w in zip(got["history"], want["history"]):
        assert g["val_acc"] == w["val_acc"] and g["val_loss"] == w["val_loss"]
        assert all(torch.equal(a, b) for a, b in zip(g["params"], w["params"])), f"round {g['round']}"
    assert got["train_metrics"] == want["train_metrics"]
    assert got["rejections"] == want["rejections"]


@pytest.mark.parametrize("algorithm", list(VARIANTS))
def test_restarted_server_and_clients_continue_exactly(tmp_path, algorithm):
    want = run(run_config(algorithm, ""))  # no checkpoints
    rc = run_config(algorithm, tmp_path)
    for stop in (2, 3):
        with pytest.raises(Stopped):
            run(rc, stop=stop)
    assert (tmp_path / "t" / "server" / MANIFEST).is_file()
    got = run(rc)
    assert_same(got, want)


def test_checkpoint_every_two_rounds_redoes_the_rest(tmp_path):
    """With checkpoint-every 2 a server stopped in round 4 goes back to round 2's checkpoint: round 3
    is trained again, and the clients must take their state of round 2, not their newer files."""
    want = run(run_config("scaffold", ""))
    rc = run_config("scaffold", tmp_path, **{"checkpoint-every": 2})
    with pytest.raises(Stopped):
        run(rc, stop=4, every=2)
    clients = tmp_path / "t" / "clients"
    assert any(p.name == "r3.pt" for p in clients.rglob("r*.pt"))  # files of round 3 exist ...
    got = run(rc, every=2)
    assert_same(got, want)  # ... and were not used


def test_other_settings_are_refused(tmp_path):
    rc = run_config("scaffold", tmp_path)
    with pytest.raises(Stopped):
        run(rc, stop=2)
    with pytest.raises(CheckpointError, match="lr: "):
        run(dict(rc, lr=0.2))


# ---------------------------------------------------------------------------------------------- Ray engine
def test_simulation_engine_server_restart(tmp_path, monkeypatch):
    """Flower's simulation engine (Ray): the ServerApp stops in round 3 (after round 2's checkpoint);
    a new simulation of the same app continues with round 3 on fresh nodes and ends where the
    uninterrupted in-process run ends, bit for bit (one thread per client on both sides)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install -e '.[flower]'")
    from flwr.simulation import run_simulation

    from fedopt_kernels.flower.apps import server_app
    from fedopt_kernels.flower.base import FedOptStrategy

    algorithm = "scaffold"
    want = run(run_config(algorithm, ""), tag=f"0.{algorithm}")
    rc = run_config(algorithm, tmp_path / "ckpt", out=str(tmp_path / "result.pt"))
    configure_train = FedOptStrategy.configure_train

    def stopping(self, server_round, *args, **kw):
        if server_round == 3:
            raise Stopped("the server stops in round 3")
        return configure_train(self, server_round, *args, **kw)

    def simulate():
        run_simulation(
            server_app(rc),
            client_app(rc),
            num_supernodes=5,
            backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
        )

    monkeypatch.setattr(FedOptStrategy, "configure_train", stopping)
    with pytest.raises(Stopped):  # the engine re-raises what stopped the ServerApp
        simulate()
    assert not (tmp_path / "result.pt").exists(), "the stopped server should not have finished"
    server = tmp_path / "ckpt" / f"0.{algorithm}" / "server"
    assert json.loads((server / MANIFEST).read_text())["rounds"] == 2
    monkeypatch.setattr(FedOptStrategy, "configure_train", configure_train)
    simulate()
    got = torch.load(tmp_path / "result.pt", weights_only=False)[algorithm]
    assert_same(got, want)
