"""Splitting one labelled data set among clients, and each client's share into train/val/test.

Every function takes a ``numpy.random.Generator`` so a partition is a pure function of its seed.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np


def _equal_sizes(n: int, num_clients: int) -> np.ndarray:
    sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
    sizes[: n % num_clients] += 1
    return sizes


def _check_clients(n: int, num_clients: int) -> None:
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"clients must be an integer >= 1, got {num_clients!r}")
    if num_clients > n:
        raise ValueError(f"clients={num_clients} is more than the {n} samples of the data set")


def iid_partition(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> List[np.ndarray]:
    """Shuffle and cut into ``num_clients`` near-equal parts."""
    _check_clients(len(labels), num_clients)
    perm = rng.permutation(len(labels))
    return [np.sort(part) for part in np.split(perm, np.cumsum(_equal_sizes(len(labels), num_clients))[:-1])]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> List[np.ndarray]:
    """Label skew of Hsu et al. (2019): client i's class mix is ``q_i ~ Dir(alpha * 1)``.

    Clients get near-equal sizes. Samples are dealt one per client in turn (round robin), each drawn
    from the classes in proportion to ``q_i`` restricted to classes that still have samples left, so
    that running out of a class late does not fall on the last clients only. Small ``alpha``: each
    client sees few classes; large ``alpha``: close to iid.
    """
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool)) or not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"dirichlet alpha must be a finite number > 0, got {alpha!r}")
    n = len(labels)
    _check_clients(n, num_clients)
    classes = np.unique(labels)
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in classes]
    q = rng.dirichlet(np.full(len(classes), float(alpha)), size=num_clients)
    sizes = _equal_sizes(n, num_clients)
    parts: List[List[int]] = [[] for _ in range(num_clients)]
    left = np.array([len(p) for p in pools], dtype=np.float64)
    for turn in range(int(sizes.max())):
        for i in range(num_clients):
            if turn >= sizes[i]:
                continue
            w = q[i] * (left > 0)
            if w.sum() <= 0:  # the client's classes are exhausted: fall back to what is left
                w = left.copy()
            c = rng.choice(len(classes), p=w / w.sum())
            parts[i].append(pools[c].pop())
            left[c] -= 1
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def shard_partition(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> List[np.ndarray]:
    """McMahan et al. (2017): sort by label, cut into ``num_clients * shards_per_client`` shards,
    give each client ``shards_per_client`` random shards (so each sees at most that many classes)."""
    if (
        isinstance(shards_per_client, bool)
        or not isinstance(shards_per_client, (int, np.integer))
        or shards_per_client < 1
    ):
        raise ValueError(f"shards_per_client must be an integer >= 1, got {shards_per_client!r}")
    n = len(labels)
    _check_clients(n, num_clients)
    num_shards = num_clients * shards_per_client
    if num_shards > n:
        raise ValueError(f"clients * shards_per_client = {num_shards} shards is more than the {n} samples")
    # stable sort on a shuffled order: ties inside a class come out in random order
    perm = rng.permutation(n)
    order = perm[np.argsort(labels[perm], kind="stable")]
    shards = np.split(order, np.cumsum(_equal_sizes(n, num_shards))[:-1])
    deal = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])) for row in deal]


def class_partition(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> List[np.ndarray]:
    """One class per client (the pathological split of FedNLR's verification experiment): client ``i``
    holds only class ``classes[i % num_classes]``; the clients of one class share its samples in
    near-equal random parts. With fewer clients than classes, the classes past ``num_clients`` go unused."""
    n = len(labels)
    _check_clients(n, num_clients)
    classes = np.unique(labels)
    parts: List[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for j, c in enumerate(classes[:num_clients]):
        owners = list(range(j, num_clients, len(classes)))
        pool = rng.permutation(np.flatnonzero(labels == c))
        if len(pool) < len(owners):
            raise ValueError(f"class {c} has {len(pool)} samples, fewer than its {len(owners)} clients")
        for i, part in zip(owners, np.split(pool, np.cumsum(_equal_sizes(len(pool), len(owners)))[:-1]), strict=True):
            parts[i] = np.sort(part)
    return parts


def split_train_val_test(
    indices: np.ndarray, fractions: Sequence[float], rng: np.random.Generator
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle a client's indices and cut them by ``fractions`` (train, val, test; summing to 1).

    Val and test sizes are rounded down, so train (fraction > 0) keeps at least one sample of a
    non-empty client.
    """
    if len(fractions) != 3 or fractions[0] <= 0 or min(fractions) < 0 or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(
            f"split fractions must be (train > 0, val >= 0, test >= 0) summing to 1, got {tuple(fractions)}"
        )
    perm = rng.permutation(indices)
    n = len(perm)
    n_val = int(np.floor(fractions[1] * n))
    n_test = int(np.floor(fractions[2] * n))
    n_train = n - n_val - n_test
    return perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]
