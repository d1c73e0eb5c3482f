"""Checkpoint and resume of the simulator: a resumed run ends bitwise where an uninterrupted one does.

In-process, for every registered algorithm variant, sequential and client-batched: a run stopped
after round k (its Simulation thrown away) and continued by a new Simulation from the checkpoint
gives the same per-round metrics, final model, server state and final evaluation, bit for bit.
Tiny image data on the simulator's CNN (as test_sim_batched.py), three rounds, so each run takes
well under a second. ``test_sim_resume_kill.py`` kills real ``fedopt-sim`` processes.
"""

import json
import math
from typing import Any, Dict

import pytest
import torch
from torch import nn

from fedopt_kernels.fl.checkpoint import MANIFEST, CheckpointDir, CheckpointError
from fedopt_kernels.fl.server_rules import RULES
from fedopt_kernels.sim.config import VARIANTS, SimConfig
from fedopt_kernels.sim.data.clients import ClientData
from fedopt_kernels.sim.federated_data import FederatedData
from fedopt_kernels.sim.models.small import SmallCNN
from fedopt_kernels.sim.simulation import Simulation

SIZES = (3, 9, 14, 6, 22)
SHAPE = (1, 8, 8)
ROUNDS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_images(sizes=SIZES, shift=0.0) -> FederatedData:
    g = torch.Generator().manual_seed(0)
    users = []
    for i, n in enumerate(list(sizes) + [5]):
        y = torch.randint(0, 4, (n + 2,), generator=g)
        x = torch.randn(n + 2, *SHAPE, generator=g) + y.view(-1, 1, 1, 1) * 0.5 + shift
        users.append(ClientData(i, x[:n], y[:n], x[n : n + 1], y[n : n + 1], x[n + 1 :], y[n + 1 :]))
    return FederatedData(users[: len(sizes)], users[len(sizes) :], SHAPE, 4)


def model_fn() -> nn.Module:
    return SmallCNN(SHAPE, 4, channels=(3, 4))


def tiny_config(algorithm: str, **kw) -> SimConfig:
    base: Dict[str, Any] = dict(
        algorithm=algorithm,
        clients=len(SIZES) + 1,
        holdout_fraction=1 / 6,
        clients_per_round=3,
        local_steps=2,
        batch_size=4,
        rounds=ROUNDS,
        lr=0.1,
        backend="auto",
        device="cpu",
        finetune_steps=1,
    )
    base.update(kw)
    return SimConfig(**base)


def make(cfg: SimConfig, folder=None, every: int = 1, data=None, store=None) -> Simulation:
    return Simulation(
        cfg,
        data=data or tiny_images(),
        model_fn=model_fn,
        checkpoint_dir=folder,
        checkpoint_every=every,
        client_state_dir=store,
    )


def comparable(result: dict) -> dict:
    """A result without its wall times (the only numbers a resumed run may change)."""
    hist = [{k: v for k, v in r.items() if k != "seconds"} for r in result["history"]]
    return {"history": hist, "final": result["final"]}


def same_floats(a, b) -> bool:
    """Equal as data, NaN equal to NaN (a round where every update was refused has loss NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_floats(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_floats(x, y) for x, y in zip(a, b))
    return a == b


def differences(a, b, path: str = "") -> list:
    """Where ``a`` and ``b`` differ as ``same_floats`` sees them: paths with both values."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if same_floats(a, b) else [(path, a, b)]


def assert_same_run(a: Simulation, ra: dict, b: Simulation, rb: dict) -> None:
    diff = differences(comparable(ra), comparable(rb))
    assert not diff, diff[:10]
    for x, y in zip(a.global_params, b.global_params):
        assert torch.equal(x, y)
    sa, sb = a.strategy.server_state(), b.strategy.server_state()
    assert sa.keys() == sb.keys()
    for key in sa:
        if key == "kept":
            assert sa[key].keys() == sb[key].keys()
            for cid in sa[key]:
                assert all(torch.equal(x, y) for x, y in zip(sa[key][cid], sb[key][cid]))
        else:
            assert all(torch.equal(x, y) for x, y in zip(sa[key], sb[key]))


MODES = {"sequential": {}, "client-batched": {"client_batched": 2}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("algorithm", list(VARIANTS))
def test_resumed_run_equals_uninterrupted(tmp_path, algorithm, mode):
    cfg = tiny_config(algorithm, **MODES[mode])
    whole = make(cfg)
    want = whole.run()
    # stopped after round 1: only its checkpoint survives the process
    first = make(cfg, tmp_path)
    first.run_round(0)
    first.save_checkpoint()
    del first
    again = make(cfg, tmp_path)
    got = again.run(resume=True)
    assert again.resumed_from == 1 and got["resumed_from_round"] == 1
    assert_same_run(whole, want, again, got)
    # the run checkpointed its last round: "resuming" the finished run changes nothing
    done = make(cfg, tmp_path)
    assert done.load_checkpoint() and len(done.history) == ROUNDS
    assert all(torch.equal(x, y) for x, y in zip(done.global_params, whole.global_params))


KEEPING = [v for v in VARIANTS if RULES[VARIANTS[v].server].keeps]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("algorithm", KEEPING)
def test_resumed_run_with_client_state_in_files_equals_uninterrupted(tmp_path, algorithm, mode):
    """The clients' state in files (``client_state_dir``): the same run as in memory, resumed bitwise,
    though the stopped run went on writing the store after its checkpoint."""
    cfg = tiny_config(algorithm, **MODES[mode])
    whole = make(cfg)
    want = whole.run()
    first = make(cfg, tmp_path / "ckpt", store=tmp_path / "state")
    first.run_round(0)
    first.save_checkpoint()
    first.run_round(1)  # writes the store past the checkpoint, then is lost
    del first
    again = make(cfg, tmp_path / "ckpt", store=tmp_path / "state")
    got = again.run(resume=True)
    assert again.resumed_from == 1
    assert_same_run(whole, want, again, got)
    assert len(again.strategy.kept) > 0 and (tmp_path / "state" / "store.json").is_file()
    # a checkpoint of the run in memory cannot continue in files, and the other way round
    with pytest.raises(ValueError, match="client-state folder"):
        make(cfg, tmp_path / "ckpt").load_checkpoint()


def test_every_n_rounds_and_the_last(tmp_path):
    cfg = tiny_config("scaffold", rounds=5)
    sim = make(cfg, tmp_path, every=2)
    saved = []

    def newest(record):
        manifest = tmp_path / MANIFEST
        saved.append(json.loads(manifest.read_text())["rounds"] if manifest.exists() else 0)

    sim.run(progress=newest)
    assert saved == [0, 2, 2, 4, 5]  # after rounds 2 and 4, and the last (5); none before round 2
    assert len(sim.checkpoint_stats) == 3 and all(s["bytes"] > 0 for s in sim.checkpoint_stats)
    assert len(list(tmp_path.glob("state-r*.pt"))) == 1  # older state files are removed


def test_resume_without_a_checkpoint_starts_at_round_one(tmp_path):
    cfg = tiny_config("fedavg")
    sim = make(cfg, tmp_path / "empty")
    assert not sim.load_checkpoint()
    assert sim.run(resume=True)["resumed_from_round"] == 0


@pytest.mark.parametrize(
    "change,named",
    [
        (dict(algorithm="fedprox"), "algorithm"),
        (dict(seed=1), "seed"),
        (dict(lr=0.2), "lr"),
        (dict(rounds=4), "rounds"),
        (dict(client_batched=2), "client_batched"),
        (dict(backend="reference"), "resolved backend"),
    ],
)
def test_checkpoint_of_other_settings_is_refused_naming_them(tmp_path, change, named):
    sim = make(tiny_config("fedavg"), tmp_path)
    sim.run_round(0)
    sim.save_checkpoint()
    other = make(tiny_config(**{"algorithm": "fedavg", **change}), tmp_path)
    before = [p.clone() for p in other.global_params]
    with pytest.raises(CheckpointError, match=rf"other settings.*{named}: "):
        other.run(resume=True)
    assert other.history == [] and all(torch.equal(p, q) for p, q in zip(before, other.global_params))


def test_other_data_or_model_is_refused(tmp_path):
    sim = make(tiny_config("fedavg"), tmp_path)
    sim.run_round(0)
    sim.save_checkpoint()
    with pytest.raises(CheckpointError, match="data sha256"):
        make(tiny_config("fedavg"), tmp_path, data=tiny_images(shift=1.0)).load_checkpoint()
    wider = Simulation(
        tiny_config("fedavg"),
        data=tiny_images(),
        checkpoint_dir=tmp_path,
        model_fn=lambda: SmallCNN(SHAPE, 4, channels=(3, 5)),
    )
    with pytest.raises(CheckpointError, match="model parameters"):
        wider.load_checkpoint()


def _saved(tmp_path):
    sim = make(tiny_config("scaffold"), tmp_path)
    sim.run_round(0)
    sim.save_checkpoint()
    return next(tmp_path.glob("state-r*.pt"))


def _refused(tmp_path, match):
    sim = make(tiny_config("scaffold"), tmp_path)
    before = [p.clone() for p in sim.global_params]
    with pytest.raises(CheckpointError, match=match):
        sim.load_checkpoint()
    assert sim.history == [] and sim.strategy.kept == {}
    assert all(torch.equal(p, q) for p, q in zip(before, sim.global_params))


def test_truncated_state_file_is_refused(tmp_path):
    state = _saved(tmp_path)
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    _refused(tmp_path, "damaged or truncated")


def test_flipped_byte_is_refused(tmp_path):
    state = _saved(tmp_path)
    data = bytearray(state.read_bytes())
    data[len(data) // 3] ^= 0x01
    state.write_bytes(bytes(data))
    _refused(tmp_path, "SHA-256 differs")


def test_damaged_manifest_is_refused(tmp_path):
    _saved(tmp_path)
    manifest = tmp_path / MANIFEST
    manifest.write_text(manifest.read_text()[:40])
    _refused(tmp_path, "manifest .* is damaged")


def test_missing_state_file_is_refused(tmp_path):
    _saved(tmp_path).unlink()
    _refused(tmp_path, "is missing")


def test_loading_runs_no_code_from_the_file(tmp_path):
    """A state file that would run code when unpickled (with a manifest that vouches for it) is refused
    by torch.load(weights_only=True) before anything runs."""
    import hashlib
    import os

    _saved(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    evil = tmp_path / manifest["state_file"]
    marker = tmp_path / "ran"
    torch.save({"x": _Boom(str(marker))}, evil)
    data = evil.read_bytes()
    manifest.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    _refused(tmp_path, "cannot be read")
    assert not os.path.exists(marker)


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# what checkpoints saved before the settings' renames hold instead of today's names
EARLIER_SETTINGS = {"client_batched": "client_parallel", "replay": "cuda_graph"}


def _as_saved_before_the_rename(folder) -> None:
    """Rewrite the checkpoint in ``folder`` as the code before the renames wrote it: the earlier
    settings' names in the manifest, the earlier key of the client-batched choice in the state."""
    import hashlib

    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["settings"] = {EARLIER_SETTINGS.get(k, k): v for k, v in manifest["settings"].items()}
    path = folder / manifest["state_file"]
    state = torch.load(path, weights_only=True)
    state["batched"] = {("parallel" if k == "at_once" else k): v for k, v in state["batched"].items()}
    torch.save(state, path)
    data = path.read_bytes()
    manifest.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_saved_before_the_renames_resumes(tmp_path):
    cfg = tiny_config("scaffold", client_batched=2)
    whole = make(cfg)
    want = whole.run()
    first = make(cfg, tmp_path)
    first.run_round(0)
    first.save_checkpoint()
    del first
    _as_saved_before_the_rename(tmp_path)
    assert set(EARLIER_SETTINGS.values()) <= set(json.loads((tmp_path / MANIFEST).read_text())["settings"])
    # the check can fail: read without the renames, the same checkpoint has other settings
    with pytest.raises(CheckpointError, match="client_parallel"):
        CheckpointDir(tmp_path, "fedopt-sim").check_settings(make(cfg).checkpoint_settings())
    again = make(cfg, tmp_path)
    got = again.run(resume=True)
    assert again.resumed_from == 1
    assert_same_run(whole, want, again, got)


def test_checkpoint_every_is_checked():
    with pytest.raises(ValueError, match="checkpoint_every"):
        make(tiny_config("fedavg"), every=0)


def test_checkpoint_dir_refuses_another_kind(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match="saved by 'fedopt-sim'"):
        CheckpointDir(tmp_path, "flower-server").manifest()


def _stop_and_resume(cfg, tmp_path, **kw):
    torch.manual_seed(0)  # the simulator does not seed torch's global generator; a user's script would
    whole = Simulation(cfg, **kw)
    want = whole.run()
    torch.manual_seed(0)
    first = Simulation(cfg, checkpoint_dir=tmp_path, **kw)
    first.run_round(0)
    first.save_checkpoint()
    first.run_round(1)  # a round whose work the kill loses
    del first
    torch.manual_seed(1)  # a new process starts with another global generator state
    again = Simulation(cfg, checkpoint_dir=tmp_path, **kw)
    got = again.run(resume=True)
    assert again.resumed_from == 1
    assert_same_run(whole, want, again, got)


def test_torch_global_generator_is_restored(tmp_path):
    """A user model with dropout draws from torch's global generator in every local step."""

    def dropout_model():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Dropout(0.5), nn.Linear(8, 4))

    _stop_and_resume(tiny_config("fedavg"), tmp_path, data=tiny_images(), model_fn=dropout_model)


@pytest.mark.parametrize("mode", list(MODES))
def test_augmentation_generators_are_restored(tmp_path, mode):
    """CIFAR with --augment: the model's random crops and PAdaMFed-VR's anchor copy's own stream."""
    from sim_data_files import write_cifar10

    write_cifar10(tmp_path / "data", per_batch=8, test=4)
    cfg = SimConfig(
        algorithm="padamfed-vr",
        dataset="cifar10",
        data_dir=str(tmp_path / "data"),
        model="cnn",
        augment=True,
        clients=6,
        holdout_fraction=0.0,
        rounds=3,
        local_steps=2,
        batch_size=3,
        clients_per_round=3,
        finetune_steps=1,
        backend="auto",
        device="cpu",
        **MODES[mode],
    )
    _stop_and_resume(cfg, tmp_path / "ckpt")


# ---------------------------------------------------------------- fedopt-sim's flags
CLI = [
    "--clients",
    "6",
    "--rounds",
    "2",
    "--local-steps",
    "1",
    "--clients-per-round",
    "2",
    "--finetune-steps",
    "1",
    "--model",
    "mlp",
    "--quiet",
    "--algorithm",
    "scaffold",
]


def _exit_code(argv, capsys):
    from fedopt_kernels.sim.cli import fedopt_sim

    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--checkpoint-every", "-1"], "--checkpoint-every"),
        (["--resume", "--overwrite"], "--overwrite"),
        (["--resume", "--checkpoint-every", "0"], "--checkpoint-every 0"),
        (["--resume", "--no-files"], "--checkpoint-dir"),
        (["--validate", "reference", "--resume"], "--validate"),
    ],
)
def test_cli_refuses_flag_combinations_naming_them(tmp_path, monkeypatch, capsys, extra, named):
    monkeypatch.chdir(tmp_path)
    code, err = _exit_code(CLI + extra, capsys)
    assert code == 2 and named in err, err


def test_cli_resume_and_refusals(tmp_path, monkeypatch, capsys):
    from fedopt_kernels.sim.cli import fedopt_sim

    monkeypatch.chdir(tmp_path)
    # a custom checkpoint folder, without --out files: written per seed
    assert fedopt_sim.main(CLI + ["--no-files", "--checkpoint-dir", "ck", "--seeds", "0", "1"]) == 0
    assert {p.name for p in (tmp_path / "ck").iterdir()} == {"seed0", "seed1"}
    # a new run may not replace them ...
    code, err = _exit_code(CLI + ["--no-files", "--checkpoint-dir", "ck"], capsys)
    assert code == 2 and "--resume" in err and "--overwrite" in err, err
    # ... nor resume them with other settings: exit 2 naming the setting
    code, err = _exit_code(CLI + ["--no-files", "--checkpoint-dir", "ck", "--resume", "--lr", "0.2"], capsys)
    assert code == 2 and "lr: " in err, err
    # the same settings resume (here: a finished run, so nothing is left to train, and it says so)
    capsys.readouterr()
    assert fedopt_sim.main(CLI + ["--no-files", "--checkpoint-dir", "ck", "--resume", "--seeds", "0", "1"]) == 0
    err = capsys.readouterr().err
    assert "seed 1: no round left to run (its checkpoint holds all 2)" in err and "0 rounds" not in err, err
    # --resume where there is no checkpoint (a mistyped --out) says so, --quiet or not
    assert fedopt_sim.main(CLI + ["--out", "mistyped", "--resume"]) == 0
    assert "seed 0: --resume found no checkpoint in " in capsys.readouterr().err
    # --checkpoint-every 0: no checkpoints beside the results
    assert fedopt_sim.main(CLI + ["--out", "plain", "--checkpoint-every", "0"]) == 0
    assert not (tmp_path / "plain" / "checkpoints").exists()
    # --resume without --out continues the default folder of a first run without --out
    assert fedopt_sim.main(CLI) == 0
    assert (tmp_path / "sim_runs" / "scaffold-digits" / "checkpoints" / "seed0" / MANIFEST).is_file()
    assert fedopt_sim.main(CLI + ["--resume"]) == 0
    assert not (tmp_path / "sim_runs" / "scaffold-digits-2").exists()
