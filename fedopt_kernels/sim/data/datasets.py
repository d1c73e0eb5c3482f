"""The simulator's data sets, all built offline: scikit-learn's digits and FedProx's Synthetic(alpha, beta).

Nothing here downloads anything: ``load_digits`` ships with scikit-learn and Synthetic is generated
from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np


@dataclass
class ArrayDataset:
    """Inputs ``x`` (float32, [n, ...]) and integer labels ``y`` ([n]) held as numpy arrays."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(self.x.shape[1:])


def load_digits_dataset() -> ArrayDataset:
    """The 1,797 8x8 handwritten digits of scikit-learn, as [n, 1, 8, 8] images scaled to [0, 1]."""
    # imported lazily: only the digits data set needs scikit-learn (the [sim] extra)
    from ...core.extras import require

    bunch = require("sklearn.datasets", "the digits data set (--dataset digits)").load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    return ArrayDataset(x=x, y=bunch.target.astype(np.int64), num_classes=10)


def synthetic_fedprox(
    alpha: float,
    beta: float,
    num_clients: int,
    rng: np.random.Generator,
    dim: int = 60,
    num_classes: int = 10,
    max_samples: int = 1000,
) -> List[ArrayDataset]:
    """Synthetic(alpha, beta) of the FedProx paper (Li et al. 2020, Sec. 5.1), one data set per client.

    Client k draws ``u_k ~ N(0, alpha)`` and ``B_k ~ N(0, beta)`` (variances); its model is
    ``W_k, b_k ~ N(u_k, 1)`` and its inputs ``x ~ N(v_k, Sigma)`` with ``v_k ~ N(B_k, 1)`` and
    ``Sigma = diag(j ** -1.2)``; labels are ``argmax(W_k x + b_k)``. ``alpha`` controls how much the
    client models differ, ``beta`` how much their inputs do. Sizes follow FedProx's power law,
    ``lognormal(4, 2) + 50``, capped at ``max_samples`` so that a simulation stays small.
    """
    if alpha < 0 or beta < 0:
        raise ValueError(f"synthetic alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    sizes = np.minimum(rng.lognormal(4.0, 2.0, num_clients).astype(np.int64) + 50, max_samples)
    cov_diag = np.arange(1, dim + 1, dtype=np.float64) ** -1.2
    out = []
    for n in sizes:
        u = rng.normal(0.0, np.sqrt(alpha))
        b_mean = rng.normal(0.0, np.sqrt(beta))
        w = rng.normal(u, 1.0, (num_classes, dim))
        b = rng.normal(u, 1.0, num_classes)
        v = rng.normal(b_mean, 1.0, dim)
        x = rng.normal(v, np.sqrt(cov_diag), (int(n), dim))
        y = np.argmax(x @ w.T + b, axis=1)  # argmax of the softmax = argmax of the logits
        out.append(ArrayDataset(x=x.astype(np.float32), y=y.astype(np.int64), num_classes=num_classes))
    return out
