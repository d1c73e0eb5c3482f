"""The simulator's models: an MLP, a small CNN for 8x8 images, the FedAvg paper's CNN, ResNet-18 (GroupNorm).

No BatchNorm and no buffers anywhere: running statistics would need their own aggregation rule, and
buffer-free models without in-place state updates can be trained client-batched under
``torch.func.vmap``. The conv layers give FedNLR per-channel scales to exercise. On image data sets
that keep raw pixels (CIFAR, FEMNIST) ``build_model`` puts the data set's input stage
(``data.image_input.ImageClassifier``: uint8 -> normalised float, train-time augmentation) in front.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from ..data.image_input import ImageClassifier, InputSpec
from .resnet_gn import ResNet18GN
from .text import CharGRU, CharLSTM, CharTransformer

TEXT_MODELS = ("char-lstm", "char-gru", "char-transformer")  # Shakespeare: [B, T] character indices in
MODELS = ("mlp", "mlp1", "cnn", "fedavg-cnn", "resnet18-gn") + TEXT_MODELS


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


class OneHiddenMLP(nn.Module):
    """Flatten -> Linear(hidden) -> ReLU -> Linear(classes): the 2-layer MLP of FedNLR's verification
    experiment (25 hidden neurons on MNIST; Zhao et al., "FedNLR: Federated Learning with Neuron-wise
    Learning Rates", KDD 2024, appendix A)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 25):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

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


class FedAvgCNN(nn.Module):
    """The CNN of McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
    Data" (AISTATS 2017): Conv(32, 5x5) -> ReLU -> MaxPool(2) -> Conv(64, 5x5) -> ReLU -> MaxPool(2) ->
    Linear(512) -> ReLU -> Linear(classes), 'same' padding.

    1,663,370 parameters on 28x28x1 with 10 classes as in the paper (1,690,046 for FEMNIST's 62);
    2,156,490 on CIFAR's 32x32x3. BatchNorm-free and buffer-free.
    """

    def __init__(self, in_shape: Tuple[int, int, int], num_classes: int, channels: Tuple[int, int] = (32, 64),
                 hidden: int = 512):
        super().__init__()
        c, h, w = in_shape
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Linear(c2 * (h // 4) * (w // 4), hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def _image_shape(name: str, input_shape: Tuple[int, ...], min_side: int) -> Tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < min_side:
        raise ValueError(f"model={name!r} needs image inputs [C, H, W] with H, W >= {min_side}; this data set "
                         f"has inputs of shape {tuple(input_shape)} (use model='mlp')")
    return tuple(input_shape)  # type: ignore[return-value]


def build_model(name: str, input_shape: Tuple[int, ...], num_classes: int,
                input_spec: Optional[InputSpec] = None, hidden: Optional[int] = None,
                context: Optional[int] = None) -> nn.Module:
    """``name`` in MODELS; the MLPs take any input, the CNNs images ``[C, H, W]``, the character models
    windows ``[T]`` of indices below ``num_classes``.

    ``input_spec`` (set by image data sets that keep raw pixels) wraps the network in its input stage;
    ``hidden``: the MLPs' width (default 64 for mlp, 25 for mlp1), the character models' state size
    (default 256 for char-lstm, 128 for char-gru, 64 for char-transformer); ``context``: the
    char-transformer reads only the last ``context`` characters of a window.
    """
    if name in TEXT_MODELS:
        if len(input_shape) != 1:
            raise ValueError(f"model={name!r} needs windows of character indices [T]; this data set has inputs "
                             f"of shape {tuple(input_shape)}")
        if name == "char-lstm":
            return CharLSTM(num_classes, hidden=hidden or 256)
        if name == "char-gru":
            return CharGRU(num_classes, hidden=hidden or 128)
        return CharTransformer(num_classes, input_shape[0], dim=hidden or 64, context=context)
    if name == "mlp":
        net: nn.Module = MLP(math.prod(input_shape), num_classes, hidden=hidden or 64)
    elif name == "mlp1":
        net = OneHiddenMLP(math.prod(input_shape), num_classes, hidden=hidden or 25)
    elif name == "cnn":
        net = SmallCNN(_image_shape(name, input_shape, 2), num_classes)
    elif name == "fedavg-cnn":
        net = FedAvgCNN(_image_shape(name, input_shape, 4), num_classes)
    elif name == "resnet18-gn":
        net = ResNet18GN(_image_shape(name, input_shape, 8)[0], num_classes)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return net if input_spec is None else ImageClassifier(net, input_spec)
