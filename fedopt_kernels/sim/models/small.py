"""The small models: two MLPs, a small CNN for 8x8 images and the FedAvg paper's CNN.

No BatchNorm and no buffers: running statistics would need their own aggregation rule, and
buffer-free models without in-place state updates can be trained client-batched under
``torch.func.vmap``. The conv layers give FedNLR per-channel scales to exercise.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten -> Linear(hidden) -> ReLU -> Linear(hidden) -> ReLU -> Linear(classes)."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class OneHiddenMLP(nn.Module):
    """Flatten -> Linear(hidden) -> ReLU -> Linear(classes): the 2-layer MLP of FedNLR's verification
    experiment (25 hidden neurons on MNIST; Zhao et al., "FedNLR: Federated Learning with Neuron-wise
    Learning Rates", KDD 2024, appendix A)."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, in_features: int, num_classes: int, hidden: int = 25):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv(8, 3x3) -> ReLU -> Conv(16, 3x3) -> ReLU -> MaxPool(2) -> Linear(classes); ~4k parameters on 8x8."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, in_shape: Tuple[int, int, int], num_classes: int, channels: Tuple[int, int] = (8, 16)):
        super().__init__()
        c, h, w = in_shape
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(c2 * (h // 2) * (w // 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class FedAvgCNN(nn.Module):
    """The CNN of McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
    Data" (AISTATS 2017): Conv(32, 5x5) -> ReLU -> MaxPool(2) -> Conv(64, 5x5) -> ReLU -> MaxPool(2) ->
    Linear(512) -> ReLU -> Linear(classes), 'same' padding.

    1,663,370 parameters on 28x28x1 with 10 classes as in the paper (1,690,046 for FEMNIST's 62);
    2,156,490 on CIFAR's 32x32x3. BatchNorm-free and buffer-free.
    """

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(
        self, in_shape: Tuple[int, int, int], num_classes: int, channels: Tuple[int, int] = (32, 64), hidden: int = 512
    ):
        super().__init__()
        c, h, w = in_shape
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Linear(c2 * (h // 4) * (w // 4), hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))
