"""FEMNIST from tiny files in LEAF's JSON layout: writers as clients, writer subsampling, training, bad folders."""

import json

import numpy as np
import pytest
import torch
from sim_data_files import write_femnist

from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.femnist import count_writers, load_femnist
from fedopt_kernels.sim.federated_data import build_federated_data
from fedopt_kernels.sim.simulation import Simulation

# the simulator's tiny models: one torch thread (conftest.py), as fedopt-sim's --threads default
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def leaf(tmp_path_factory):
    root = tmp_path_factory.mktemp("femnist")
    return root, write_femnist(root, writers=8, files=3)


def test_writers_load_exactly(leaf):
    root, written = leaf
    writers = load_femnist(str(root))
    assert [u for u, _ in writers] == sorted(written) and count_writers(str(root)) == 8
    for uid, ds in writers:  # train then test samples of each writer, pixels exact as uint8
        x, y = written[uid]
        assert ds.x.dtype == np.uint8 and ds.x.shape == (len(y), 1, 28, 28) and ds.num_classes == 62
        assert np.array_equal(ds.x, x) and np.array_equal(ds.y, y)


def test_leaf_repository_layout_is_found(tmp_path):
    write_femnist(tmp_path / "femnist" / "data", writers=2, files=1)
    assert count_writers(str(tmp_path)) == 2  # --data-dir leaf/data


def test_natural_partition_one_client_per_writer(leaf):
    root, written = leaf
    cfg = SimConfig(dataset="femnist", data_dir=str(root), clients=5, model="fedavg-cnn")
    data = build_federated_data(cfg, np.random.default_rng(0), torch.device("cpu"))
    users = data.train_clients + data.new_clients
    assert len(data.train_clients) == 4 and len(data.new_clients) == 1 and data.input_shape == (1, 28, 28)
    sig = {uid: (len(y), int(x.astype(np.int64).sum())) for uid, (x, y) in written.items()}
    matched = []
    for c in users:  # each client holds exactly one writer's samples (count and pixel sum identify it)
        x = torch.cat([c.train_x, c.val_x, c.test_x])
        key = (x.shape[0], int(x.to(torch.int64).sum()))
        matched += [uid for uid, v in sig.items() if v == key]
        n = x.shape[0]  # 60/20/20 of the writer's own samples
        assert len(c.val_y) == int(0.2 * n) and len(c.test_y) == int(0.2 * n)
    assert len(matched) == 5 and len(set(matched)) == 5
    spec = data.input_spec
    assert spec is not None and len(spec.mean) == 1 and 0.3 < spec.mean[0] < 0.7 and not spec.augment


def test_training_run_and_writer_fraction_cli(leaf, capsys):
    root = str(leaf[0])
    res = Simulation(
        SimConfig(
            dataset="femnist",
            data_dir=root,
            clients=6,
            model="fedavg-cnn",
            rounds=2,
            local_steps=2,
            batch_size=4,
            clients_per_round=2,
            finetune_steps=1,
            backend="reference",
            device="cpu",
        )
    ).run()
    assert np.isfinite(res["history"][-1]["train_loss"]) and res["final"]["finetuned"]["new"]["users"] == 1
    rc = fedopt_sim.main(
        [
            "--dataset",
            "femnist",
            "--data-dir",
            root,
            "--writer-fraction",
            "0.5",
            "--rounds",
            "1",
            "--local-steps",
            "1",
            "--finetune-steps",
            "0",
            "--quiet",
            "--no-files",
        ]
    )
    assert rc == 0 and "fedavg on femnist (natural), 4 clients" in capsys.readouterr().out


# ------------------------------------------------------------------ bad input
def bad_folder(tmp_path, match):
    with pytest.raises(ValueError, match=match):
        load_femnist(str(tmp_path))


def test_missing_folders(tmp_path):
    with pytest.raises(ValueError, match=r"pass data_dir \(--data-dir DIR\).*preprocess.sh"):
        load_femnist(None)
    bad_folder(tmp_path / "nope", "does not exist")
    bad_folder(tmp_path, r"the FEMNIST folder train/ was not found .*femnist/data/train")
    (tmp_path / "train").mkdir()
    bad_folder(tmp_path, r"train' holds no \*.json files")


def _one_file(tmp_path, obj_or_text):
    (tmp_path / "train").mkdir()
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text)
    (tmp_path / "train" / "a.json").write_text(text)


def _user(x=None, y=None):
    return {"x": x if x is not None else [[0.5] * 784] * 2, "y": y if y is not None else [1, 2]}


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"users": ["u"], "num_samples": [2], "user_da', r"a.json': not valid JSON \(line 1, column \d+"),
        ([1, 2], r"expected an object with 'users', 'num_samples' and 'user_data', got list"),
        ({"users": ["u"], "num_samples": [2]}, r"got \['num_samples', 'users'\]"),
        ({"users": ["u", "v"], "num_samples": [2], "user_data": {}}, r"2 users but 1 entries"),
        ({"users": ["u"], "num_samples": [2], "user_data": {}}, r"user 'u' is listed in 'users' but has no"),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x=[[0.5] * 783] * 2)}},
            r"'x' has shape \(2, 783\) .* expected \[n, 784\]",
        ),
        ({"users": ["u"], "num_samples": [3], "user_data": {"u": _user()}}, r"num_samples says 3 but it has 2"),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(y=[1, 62])}},
            r"labels must be integers in 0..61",
        ),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x=[[255.0] * 784] * 2)}},
            r"pixel values must lie in \[0, 1\]",
        ),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x=[["a"] * 784] * 2)}},
            r"'x' must be a list of 784-number lists",
        ),
        # 'users' holding lists or objects (unhashable ids), numbers; counts that are not integers
        (
            {"users": [["u"]], "num_samples": [2], "user_data": {"u": _user()}},
            r"'users' must hold user ids .*position 0",
        ),
        ({"users": ["u", {"v": 1}], "num_samples": [2, 2], "user_data": {"u": _user()}}, r"'users' must hold user ids"),
        ({"users": [7], "num_samples": [2], "user_data": {"7": _user()}}, r"'users' must hold user ids"),
        ({"users": ["u"], "num_samples": ["2"], "user_data": {"u": _user()}}, r"'num_samples' must hold integers >= 0"),
        ({"users": ["u"], "num_samples": [[2]], "user_data": {"u": _user()}}, r"'num_samples' must hold integers >= 0"),
        ({"users": ["u"], "num_samples": [2.5], "user_data": {"u": _user()}}, r"'num_samples' must hold integers >= 0"),
        ({"users": ["u"], "num_samples": [2], "user_data": [_user()]}, r"'user_data' an object"),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": [_user()]}},
            r"user 'u' is listed in 'users' but has no",
        ),
        # x/y that do not pair up, pixels that are not numbers
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(y=[1])}},
            r"'x' has shape \(2, 784\) and 'y' \(1,\)",
        ),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(y=[[1], [2]])}},
            r"expected \[n, 784\] and \[n\]",
        ),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x=[[None] * 784] * 2)}},
            r"'x' must be a list of 784-number lists",
        ),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x=[[0.5] * 784, [0.5] * 10])}},
            r"'x' must be a list of 784-number lists",
        ),
        ({"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x={"a": 1})}}, r"'x' must be a list"),
        ({"users": ["u"], "num_samples": [2], "user_data": {"u": _user(y=["a", "b"])}}, r"'y' a list of integers"),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x=[[True] * 784] * 2)}},
            r"'x' must be a list of 784-number lists",
        ),
    ],
)
def test_malformed_json(tmp_path, content, match):
    _one_file(tmp_path, content)
    bad_folder(tmp_path, match)


def test_config_and_cli_errors(leaf, tmp_path, capsys):
    root = str(leaf[0])
    with pytest.raises(ValueError, match="partition='dirichlet' does not apply to dataset='femnist'"):
        SimConfig(dataset="femnist", data_dir=root, partition="dirichlet").validate()
    with pytest.raises(ValueError, match="download only applies to cifar10/cifar100.*LEAF"):
        SimConfig(dataset="femnist", data_dir=root, download=True).validate()
    with pytest.raises(ValueError, match="a mirrored handwritten character"):
        SimConfig(dataset="femnist", data_dir=root, augment=True).validate()
    for argv, msg in [
        (["--clients", "9"], "--clients 9 is more than the 8 FEMNIST writers"),
        (["--clients", "4", "--writer-fraction", "0.5"], "not both"),
        (["--writer-fraction", "1.5"], "--writer-fraction must be in (0, 1]"),
    ]:
        with pytest.raises(SystemExit) as exc:
            fedopt_sim.main(["--dataset", "femnist", "--data-dir", root, "--quiet", "--no-files"] + argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and msg in err and "Traceback" not in err, err
    _one_file(tmp_path, "{")
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(["--dataset", "femnist", "--data-dir", str(tmp_path), "--quiet", "--no-files"])
    assert exc.value.code == 2 and "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content",
    [
        {"users": [["u"]], "num_samples": [2], "user_data": {"u": _user()}},
        {"users": ["u"], "num_samples": [{"n": 2}], "user_data": {"u": _user()}},
        {"users": ["u"], "num_samples": [2], "user_data": {"u": _user(x=[[[0.5]] * 784] * 2)}},
    ],
)
def test_malformed_json_is_a_one_line_cli_error(tmp_path, capsys, content):
    _one_file(tmp_path, content)
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(["--dataset", "femnist", "--data-dir", str(tmp_path), "--quiet", "--no-files"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert err.startswith("fedopt-sim: error: ") and "a.json" in err, err
