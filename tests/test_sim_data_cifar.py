"""CIFAR-10/100 from tiny files in the official python-pickle layout: loading, partitions, training, bad folders."""

import pickle
import sys

import numpy as np
import pytest
import torch
from sim_data_files import write_cifar10, write_cifar100

from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.cifar import load_cifar
from fedopt_kernels.sim.federated_data import build_federated_data
from fedopt_kernels.sim.simulation import Simulation


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # tiny models: extra threads only fight over the shared cores
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SHORT = dict(
    rounds=2, local_steps=2, batch_size=4, clients_per_round=2, finetune_steps=1, backend="reference", device="cpu"
)


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    x, y = write_cifar10(root, per_batch=60, test=60)
    return root, x, y


def test_cifar10_loads_exactly_what_was_written(cifar_dir):
    root, x, y = cifar_dir
    train, test = load_cifar("cifar10", str(root))
    assert train.x.shape == (300, 3, 32, 32) and train.x.dtype == np.uint8 and test.x.shape == (60, 3, 32, 32)
    # channel-major rows: the first 1024 values of a row are the red plane
    assert np.array_equal(np.concatenate([train.x, test.x]), x)
    assert np.array_equal(np.concatenate([train.y, test.y]), y) and train.num_classes == 10


def test_cifar10_folder_itself_and_bytes_keys(tmp_path):
    x, y = write_cifar10(tmp_path, per_batch=5, test=5, bytes_keys=True)
    train, test = load_cifar("cifar10", str(tmp_path / "cifar-10-batches-py"))
    assert np.array_equal(np.concatenate([train.y, test.y]), y)


def test_cifar100_fine_labels(tmp_path):
    x, y = write_cifar100(tmp_path, train=30, test=10)
    train, test = load_cifar("cifar100", str(tmp_path))
    assert train.num_classes == 100 and np.array_equal(np.concatenate([train.x, test.x]), x)
    assert np.array_equal(np.concatenate([train.y, test.y]), y)


def classes_per_client(clients):
    return np.array([len(torch.unique(torch.cat([c.train_y, c.val_y, c.test_y]))) for c in clients])


def test_dirichlet_partition_on_cifar(cifar_dir):
    root = str(cifar_dir[0])
    cfg = SimConfig(dataset="cifar10", data_dir=root, clients=10, dirichlet_alpha=0.05, **SHORT)
    data = build_federated_data(cfg, np.random.default_rng(0), torch.device("cpu"))
    users = data.train_clients + data.new_clients
    sizes = [len(torch.cat([c.train_y, c.val_y, c.test_y])) for c in users]
    assert sum(sizes) == 360 and max(sizes) - min(sizes) <= 1  # all 360 images, near-equal sizes
    assert data.train_clients[0].train_x.dtype == torch.uint8 and data.input_shape == (3, 32, 32)
    assert data.input_spec is not None and data.input_spec.mean is not None and not data.input_spec.augment
    iid = build_federated_data(cfg.replace(partition="iid"), np.random.default_rng(0), torch.device("cpu"))
    # strong skew: far fewer classes per client than an iid split of the same sizes
    assert classes_per_client(users).mean() + 3 < classes_per_client(iid.train_clients + iid.new_clients).mean()


def test_shards_partition_on_cifar(cifar_dir):
    cfg = SimConfig(
        dataset="cifar10", data_dir=str(cifar_dir[0]), clients=10, partition="shards", shards_per_client=2, **SHORT
    )
    data = build_federated_data(cfg, np.random.default_rng(1), torch.device("cpu"))
    per = classes_per_client(data.train_clients + data.new_clients)
    # 20 shards of 18 images over classes of ~36: a shard spans at most 2 classes, a client at most 4
    assert per.max() <= 4 and per.mean() <= 3.5


def test_training_run_with_augmentation_is_seeded(cifar_dir):
    cfg = SimConfig(
        dataset="cifar10",
        data_dir=str(cifar_dir[0]),
        clients=6,
        model="fedavg-cnn",
        augment=True,
        **{**SHORT, "finetune_steps": 0},
    )
    a, b = Simulation(cfg).run(), Simulation(cfg).run()
    assert a["history"][-1]["train_loss"] == b["history"][-1]["train_loss"]  # same crops and flips
    assert np.isfinite(a["history"][-1]["train_loss"])
    c = Simulation(cfg.replace(augment=False)).run()
    assert c["history"][-1]["train_loss"] != a["history"][-1]["train_loss"]  # augmentation did act


def test_cli_runs_on_cifar(cifar_dir, capsys):
    rc = fedopt_sim.main(
        [
            "--dataset",
            "cifar10",
            "--data-dir",
            str(cifar_dir[0]),
            "--clients",
            "6",
            "--rounds",
            "1",
            "--local-steps",
            "1",
            "--clients-per-round",
            "2",
            "--finetune-steps",
            "0",
            "--no-normalize",
            "--quiet",
            "--no-files",
        ]
    )
    assert rc == 0 and "fedavg on cifar10 (dirichlet), 6 clients" in capsys.readouterr().out


# ------------------------------------------------------------------ bad folders: one clear ValueError each
def bad(root, match, name="cifar10"):
    with pytest.raises(ValueError, match=match):
        load_cifar(name, None if root is None else str(root))


def test_missing_data_dir_and_folder(tmp_path):
    bad(None, r"pass data_dir \(--data-dir DIR\)")
    bad(tmp_path / "nope", r"does not exist.*cifar-10-batches-py")
    bad(tmp_path, r"CIFAR-10 folder 'cifar-10-batches-py' not found.*torchvision.datasets.CIFAR10")
    bad(tmp_path, r"cifar-100-python.*CIFAR100", name="cifar100")


def test_missing_batch_file(tmp_path):
    write_cifar10(tmp_path, per_batch=2, test=2)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    bad(tmp_path, r"missing file '.*data_batch_3': expected a CIFAR-10 data batch")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:100]), r"could not read '.*data_batch_2' as a CIFAR-10 python pickle"),
        (lambda p: p.write_bytes(b"not a pickle"), r"could not read '.*data_batch_2'"),
        (lambda p: p.write_bytes(pickle.dumps([1, 2, 3], protocol=2)), r"holds a list, expected a dict"),
        (
            lambda p: p.write_bytes(pickle.dumps({"data": np.zeros((2, 3072), np.uint8)}, protocol=2)),
            r"has keys \['data'\], expected a dict with 'data' .* and 'labels'",
        ),
        (
            lambda p: p.write_bytes(pickle.dumps({"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]}, protocol=2)),
            r"'data' is a uint8 array of shape \(2, 100\)",
        ),
        (
            lambda p: p.write_bytes(
                pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [0, 10]}, protocol=2)
            ),
            r"labels span 0..10, expected 0..9",
        ),
        (
            lambda p: p.write_bytes(pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [0]}, protocol=2)),
            r"2 images but 1 labels",
        ),
    ],
)
def test_damaged_batch(tmp_path, damage, match):
    write_cifar10(tmp_path, per_batch=2, test=2)
    damage(tmp_path / "cifar-10-batches-py" / "data_batch_2")
    bad(tmp_path, match)


class _Evil:
    def __reduce__(self):
        return (sys.exit, (3,))


def test_pickle_cannot_run_code(tmp_path):
    write_cifar10(tmp_path, per_batch=2, test=2)
    (tmp_path / "cifar-10-batches-py" / "batches.meta").write_bytes(pickle.dumps({"label_names": _Evil()}))
    bad(tmp_path, r"refusing to load sys.exit")


def test_download_without_torchvision_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision -> ImportError
    with pytest.raises(ValueError, match=r"needs torchvision: pip install \"fedopt_kernels\[data\]\""):
        load_cifar("cifar10", str(tmp_path), download=True)


def test_config_and_cli_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="set data_dir"):
        SimConfig(dataset="cifar10").validate()
    with pytest.raises(ValueError, match="augment .* only applies to cifar10/cifar100"):
        SimConfig(augment=True).validate()
    with pytest.raises(ValueError, match="more than the 60000 CIFAR images"):
        SimConfig(dataset="cifar10", data_dir="x", clients=60001).validate()
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(["--dataset", "cifar100", "--data-dir", str(tmp_path), "--quiet", "--no-files"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "fedopt-sim: error: the CIFAR-100 folder 'cifar-100-python' not found" in err and "Traceback" not in err
