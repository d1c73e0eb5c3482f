"""Simulator data: partitions (sizes, label skew, seeds), splits, Synthetic(alpha, beta), users and holdout."""

import numpy as np
import pytest
import torch

from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.datasets import load_digits_dataset, synthetic_fedprox
from fedopt_kernels.sim.data.partition import dirichlet_partition, iid_partition, shard_partition, split_train_val_test
from fedopt_kernels.sim.federated_data import build_federated_data


@pytest.fixture(scope="module")
def labels():
    return load_digits_dataset().y


def rng(seed=0):
    return np.random.default_rng(seed)


def assert_exact_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n and len(np.unique(allidx)) == n  # every sample once


def classes_per_client(parts, labels):
    return np.array([len(np.unique(labels[p])) for p in parts])


def test_digits_shape(labels):
    ds = load_digits_dataset()
    assert ds.x.shape == (1797, 1, 8, 8) and ds.x.dtype == np.float32
    assert 0.0 <= ds.x.min() and ds.x.max() <= 1.0 and ds.num_classes == 10


@pytest.mark.parametrize("n_clients", [1, 7, 50])
def test_dirichlet_sizes_and_cover(labels, n_clients):
    parts = dirichlet_partition(labels, n_clients, 0.5, rng())
    assert_exact_cover(parts, len(labels))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_label_skew_grows_as_alpha_shrinks(labels):
    def skew(alpha):
        parts = dirichlet_partition(labels, 30, alpha, rng(1))
        # mean share of a client's most frequent class
        return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])

    strong, mild, iid = skew(0.05), skew(1.0), skew(1000.0)
    # equal client sizes over a finite pool cap the skew (popular classes run out): 0.61 at alpha=0.05
    assert strong > 0.5 and strong > mild > iid
    assert iid < 0.25


def test_dirichlet_reproducible(labels):
    a = dirichlet_partition(labels, 20, 0.3, rng(5))
    b = dirichlet_partition(labels, 20, 0.3, rng(5))
    c = dirichlet_partition(labels, 20, 0.3, rng(6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_shards(labels):
    parts = shard_partition(labels, 50, 2, rng())
    assert_exact_cover(parts, len(labels))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 2
    # two shards of a label-sorted array: at most 2 classes each, unless a shard straddles a boundary
    assert classes_per_client(parts, labels).max() <= 4
    assert np.mean(classes_per_client(parts, labels)) < 3
    again = shard_partition(labels, 50, 2, rng())
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))


def test_iid(labels):
    parts = iid_partition(labels, 10, rng())
    assert_exact_cover(parts, len(labels))
    assert classes_per_client(parts, labels).min() == 10


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_dirichlet_rejects_bad_alpha(labels, bad):
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(labels, 10, bad, rng())


def test_partition_rejects_bad_clients(labels):
    with pytest.raises(ValueError, match="clients"):
        iid_partition(labels, 0, rng())
    with pytest.raises(ValueError, match="clients"):
        dirichlet_partition(labels[:5], 6, 1.0, rng())
    with pytest.raises(ValueError, match="shards"):
        shard_partition(labels[:10], 4, 3, rng())


def test_split_train_val_test():
    tr, va, te = split_train_val_test(np.arange(100, 110), (0.6, 0.2, 0.2), rng())
    assert (len(tr), len(va), len(te)) == (6, 2, 2)
    assert sorted(np.concatenate([tr, va, te]).tolist()) == list(range(100, 110))
    tr, va, te = split_train_val_test(np.arange(2), (0.6, 0.2, 0.2), rng())
    assert len(tr) == 2 and len(va) == len(te) == 0  # tiny client: all in train
    with pytest.raises(ValueError, match="fractions"):
        split_train_val_test(np.arange(5), (0.0, 0.5, 0.5), rng())


def test_synthetic_fedprox():
    users = synthetic_fedprox(1.0, 1.0, 12, rng(3))
    assert len(users) == 12
    assert all(u.x.shape[1] == 60 and 50 <= len(u) <= 1000 for u in users)
    assert len({len(u) for u in users}) > 1  # power-law sizes
    again = synthetic_fedprox(1.0, 1.0, 12, rng(3))
    assert all(np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) for a, b in zip(users, again))
    with pytest.raises(ValueError, match="alpha"):
        synthetic_fedprox(-1.0, 1.0, 3, rng())


def test_federated_data_holdout_and_splits():
    cfg = SimConfig(clients=20, holdout_fraction=0.2, seed=0)
    data = build_federated_data(cfg, rng(0), torch.device("cpu"))
    assert len(data.train_clients) == 16 and len(data.new_clients) == 4
    assert [c.client_id for c in data.train_clients] == list(range(16))
    total = sum(c.train_y.numel() + c.val_y.numel() + c.test_y.numel() for c in data.train_clients + data.new_clients)
    assert total == 1797
    for c in data.train_clients:
        n = c.train_y.numel() + c.val_y.numel() + c.test_y.numel()
        assert c.size == c.train_y.numel() and abs(c.train_y.numel() - 0.6 * n) <= 2
    again = build_federated_data(cfg, rng(0), torch.device("cpu"))
    assert all(torch.equal(a.train_x, b.train_x) for a, b in zip(data.train_clients, again.train_clients))
