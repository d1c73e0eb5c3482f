"""The two small models of the simulator: an MLP and a CNN for 8x8 images.

No BatchNorm: its running statistics would need their own aggregation rule, which is beside the
point here. The CNN's conv layers give FedNLR per-channel scales to exercise.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import nn

MODELS = ("mlp", "cnn")


class MLP(nn.Module):
    """Flatten -> Linear(hidden) -> ReLU -> Linear(hidden) -> ReLU -> Linear(classes)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv(8, 3x3) -> ReLU -> Conv(16, 3x3) -> ReLU -> MaxPool(2) -> Linear(classes); ~4k parameters on 8x8."""

    def __init__(self, in_shape: Tuple[int, int, int], num_classes: int, channels: Tuple[int, int] = (8, 16)):
        super().__init__()
        c, h, w = in_shape
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(c2 * (h // 2) * (w // 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def build_model(name: str, input_shape: Tuple[int, ...], num_classes: int) -> nn.Module:
    """``name`` in MODELS; the CNN needs image inputs ``[C, H, W]``."""
    if name == "mlp":
        return MLP(math.prod(input_shape), num_classes)
    if name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"model='cnn' needs image inputs [C, H, W]; this data set has inputs of shape "
                             f"{tuple(input_shape)} (use model='mlp')")
        return SmallCNN(tuple(input_shape), num_classes)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")
