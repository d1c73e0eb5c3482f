"""From a config to the users of a simulation: partition, per-user train/val/test, new-user holdout.

Following the FedDecay papers' protocol (FedDecay paper, Sec. 4): ``holdout_fraction`` of the users are
new users who never train and are only evaluated (after fine-tuning); every user's data is split
into train, validation and test parts.

CIFAR's train and test images are pooled and then partitioned like digits, so every user has its own
test split from its own label mix; FEMNIST's users are ``clients`` writers drawn at random from the
folder. Image data sets keep uint8 pixels; ``input_spec`` tells the model how to turn them into inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from .config import SimConfig
from .data.cifar import CIFAR_STATS, load_cifar
from .data.clients import ClientData
from .data.datasets import ArrayDataset, load_digits_dataset, synthetic_fedprox
from .data.femnist import load_femnist
from .data.idx import load_idx_dataset
from .data.image_input import InputSpec
from .data.partition import class_partition, dirichlet_partition, iid_partition, shard_partition, split_train_val_test
from .data.shakespeare import load_shakespeare

# per-channel mean and std of the training images, in [0, 1] units (the usual normalisation)
IDX_STATS = {"mnist": ((0.1307,), (0.3081,)), "fmnist": ((0.2860,), (0.3530,))}


@dataclass
class FederatedData:
    """``train_clients`` take part in training (ids 0..N-1); ``new_clients`` are held out."""

    train_clients: List[ClientData]
    new_clients: List[ClientData]
    input_shape: Tuple[int, ...]
    num_classes: int
    input_spec: Optional[InputSpec] = None  # raw-pixel data sets: the model's input stage

    def to_dtype(self, dtype: torch.dtype) -> FederatedData:
        """The same users with floating-point inputs cast to ``dtype`` (raw uint8 pixels and labels as they are)."""

        def cast(c: ClientData) -> ClientData:
            return ClientData(
                c.client_id,
                *(
                    t.to(dtype) if t.is_floating_point() else t
                    for t in (c.train_x, c.train_y, c.val_x, c.val_y, c.test_x, c.test_y)
                ),
            )

        return FederatedData(
            [cast(c) for c in self.train_clients],
            [cast(c) for c in self.new_clients],
            self.input_shape,
            self.num_classes,
            self.input_spec,
        )


def _pooled(dsets: List[ArrayDataset]) -> ArrayDataset:
    return ArrayDataset(
        np.concatenate([d.x for d in dsets]), np.concatenate([d.y for d in dsets]), dsets[0].num_classes
    )


def _some_users(users: List, cfg: SimConfig, rng: np.random.Generator, what: str) -> List[ArrayDataset]:
    """``cfg.clients`` of a data set's natural users (``(id, data)`` pairs), drawn without replacement."""
    if cfg.clients > len(users):
        raise ValueError(f"clients={cfg.clients} is more than the {len(users)} {what} in data_dir {cfg.data_dir!r}")
    picked = np.sort(rng.choice(len(users), size=cfg.clients, replace=False))
    return [users[i][1] for i in picked]


def _femnist_users(cfg: SimConfig, rng: np.random.Generator) -> List[ArrayDataset]:
    return _some_users(load_femnist(cfg.data_dir), cfg, rng, "FEMNIST writers")


def _shakespeare_users(cfg: SimConfig, rng: np.random.Generator) -> List[ArrayDataset]:
    return _some_users(load_shakespeare(cfg.data_dir), cfg, rng, "Shakespeare users (play, role)")


def check_data(cfg: SimConfig) -> None:
    """Read ``cfg``'s data set files now (cached for the runs) and check that they fit ``cfg``.

    Raises the loaders' ValueError (which file, what was expected, how to get it): the CLI calls this
    before any run so that a bad folder exits with status 2 and a message, not a traceback.
    """
    if cfg.dataset == "femnist":
        n = len(load_femnist(cfg.data_dir))
        if cfg.clients > n:
            raise ValueError(f"clients={cfg.clients} is more than the {n} FEMNIST writers in data_dir {cfg.data_dir!r}")
    elif cfg.dataset == "shakespeare":
        n = len(load_shakespeare(cfg.data_dir))
        if cfg.clients > n:
            raise ValueError(
                f"clients={cfg.clients} is more than the {n} Shakespeare users (play, role) in data_dir "
                f"{cfg.data_dir!r}"
            )
    elif cfg.dataset in CIFAR_STATS or cfg.dataset in IDX_STATS:
        train, test = _train_test(cfg)
        n = len(train) + len(test)
        per_client = cfg.shards_per_client if cfg.resolved_partition == "shards" else 1
        if cfg.clients * per_client > n:
            raise ValueError(
                f"clients={cfg.clients} (x {per_client} shards) is more than the {n} images in "
                f"data_dir {cfg.data_dir!r}"
            )


def input_spec_for(cfg: SimConfig, users: List[ArrayDataset]) -> Optional[InputSpec]:
    """The input stage of ``cfg.dataset``: None for digits/synthetic (already float)."""
    if cfg.dataset in CIFAR_STATS or cfg.dataset in IDX_STATS:
        mean, std = {**CIFAR_STATS, **IDX_STATS}[cfg.dataset]
        return InputSpec(mean=mean if cfg.normalize else None, std=std if cfg.normalize else None, augment=cfg.augment)
    if cfg.dataset == "femnist":
        if not cfg.normalize:
            return InputSpec()
        # one grey channel: mean and std of the pixels of the writers in this run
        total = sum(u.x.size for u in users)
        s1 = sum(float(u.x.sum(dtype=np.float64)) for u in users) / 255.0
        s2 = sum(float(np.square(u.x, dtype=np.float64).sum()) for u in users) / 255.0**2
        grey_mean = s1 / total
        grey_std = max(float(np.sqrt(max(s2 / total - grey_mean * grey_mean, 0.0))), 1e-3)
        return InputSpec(mean=(grey_mean,), std=(grey_std,))
    return None


def _train_test(cfg: SimConfig) -> Tuple[ArrayDataset, ArrayDataset]:
    if cfg.dataset in IDX_STATS:
        return load_idx_dataset(cfg.dataset, cfg.data_dir)
    return load_cifar(cfg.dataset, cfg.data_dir, cfg.download)


def _user_datasets(cfg: SimConfig, rng: np.random.Generator) -> List[ArrayDataset]:
    if cfg.dataset == "synthetic":
        return synthetic_fedprox(cfg.synthetic_alpha, cfg.synthetic_beta, cfg.clients, rng)
    if cfg.dataset == "femnist":
        return _femnist_users(cfg, rng)
    if cfg.dataset == "shakespeare":
        return _shakespeare_users(cfg, rng)
    if cfg.dataset in CIFAR_STATS or cfg.dataset in IDX_STATS:
        full = _pooled(list(_train_test(cfg)))
    else:
        full = load_digits_dataset()
    part = cfg.resolved_partition
    if part == "dirichlet":
        parts = dirichlet_partition(full.y, cfg.clients, cfg.dirichlet_alpha, rng)
    elif part == "shards":
        parts = shard_partition(full.y, cfg.clients, cfg.shards_per_client, rng)
    elif part == "classes":
        parts = class_partition(full.y, cfg.clients, rng)
    else:
        parts = iid_partition(full.y, cfg.clients, rng)
    return [ArrayDataset(full.x[idx], full.y[idx], full.num_classes) for idx in parts]


def build_federated_data(cfg: SimConfig, rng: np.random.Generator, device: torch.device) -> FederatedData:
    """Users of ``cfg`` on ``device``; a pure function of ``rng``'s seed."""
    users: List[Optional[ArrayDataset]] = list(_user_datasets(cfg, rng))
    first = users[0]
    assert first is not None
    shape, classes, spec = tuple(first.x.shape[1:]), first.num_classes, input_spec_for(cfg, users)  # type: ignore[arg-type]

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    built = []
    for uid in range(len(users)):
        ds = users[uid]
        assert ds is not None
        users[uid] = None  # its samples now live in the splits below: one copy of the data at a time
        tr, va, te = split_train_val_test(np.arange(len(ds)), cfg.split, rng)
        built.append((uid, t(ds.x[tr]), t(ds.y[tr]), t(ds.x[va]), t(ds.y[va]), t(ds.x[te]), t(ds.y[te])))
    holdout = set(rng.choice(len(built), size=cfg.num_holdout, replace=False).tolist())
    train = [b for b in built if b[0] not in holdout]
    new = [b for b in built if b[0] in holdout]
    # training clients are renumbered 0..N-1 (their index in every per-client table)
    train_clients = [ClientData(i, *b[1:]) for i, b in enumerate(train)]
    new_clients = [ClientData(len(train) + i, *b[1:]) for i, b in enumerate(new)]
    return FederatedData(train_clients, new_clients, shape, classes, spec)
