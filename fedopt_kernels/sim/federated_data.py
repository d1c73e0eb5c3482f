"""From a config to the users of a simulation: partition, per-user train/val/test, new-user holdout.

Following the FedDecay papers' protocol (seed 000, Sec. 4): ``holdout_fraction`` of the users are
new users who never train and are only evaluated (after fine-tuning); every user's data is split
into train, validation and test parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
import torch

from .clients import ClientData
from .config import SimConfig
from .datasets import ArrayDataset, load_digits_dataset, synthetic_fedprox
from .partition import dirichlet_partition, iid_partition, shard_partition, split_train_val_test


@dataclass
class FederatedData:
    """``train_clients`` take part in training (ids 0..N-1); ``new_clients`` are held out."""

    train_clients: List[ClientData]
    new_clients: List[ClientData]
    input_shape: Tuple[int, ...]
    num_classes: int


def _user_datasets(cfg: SimConfig, rng: np.random.Generator) -> List[ArrayDataset]:
    if cfg.dataset == "synthetic":
        return synthetic_fedprox(cfg.synthetic_alpha, cfg.synthetic_beta, cfg.clients, rng)
    full = load_digits_dataset()
    part = cfg.resolved_partition
    if part == "dirichlet":
        parts = dirichlet_partition(full.y, cfg.clients, cfg.dirichlet_alpha, rng)
    elif part == "shards":
        parts = shard_partition(full.y, cfg.clients, cfg.shards_per_client, rng)
    else:
        parts = iid_partition(full.y, cfg.clients, rng)
    return [ArrayDataset(full.x[idx], full.y[idx], full.num_classes) for idx in parts]


def build_federated_data(cfg: SimConfig, rng: np.random.Generator, device: torch.device) -> FederatedData:
    """Users of ``cfg`` on ``device``; a pure function of ``rng``'s seed."""
    users = _user_datasets(cfg, rng)
    built = []
    for uid, ds in enumerate(users):
        tr, va, te = split_train_val_test(np.arange(len(ds)), cfg.split, rng)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        built.append((uid, t(ds.x[tr]), t(ds.y[tr]), t(ds.x[va]), t(ds.y[va]), t(ds.x[te]), t(ds.y[te])))
    holdout = set(rng.choice(len(built), size=cfg.num_holdout, replace=False).tolist())
    train = [b for b in built if b[0] not in holdout]
    new = [b for b in built if b[0] in holdout]
    # training clients are renumbered 0..N-1 (their index in every per-client table)
    train_clients = [ClientData(i, *b[1:]) for i, b in enumerate(train)]
    new_clients = [ClientData(len(train) + i, *b[1:]) for i, b in enumerate(new)]
    return FederatedData(train_clients, new_clients, tuple(users[0].x.shape[1:]), users[0].num_classes)
