"""A model from its name (``--model``): ``MODELS``, and ``build_model`` over the small, text and ResNet models.

No model has BatchNorm or buffers: running statistics would need their own aggregation rule, and
buffer-free models without in-place state updates can be trained client-batched under
``torch.func.vmap``. On image data sets that keep raw pixels (CIFAR, FEMNIST) ``build_model`` puts
the data set's input stage (``data.image_input.ImageClassifier``: uint8 -> normalised float,
train-time augmentation) in front.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

from torch import nn

from ..data.image_input import ImageClassifier, InputSpec
from .resnet_gn import ResNet18GN
from .small import MLP, FedAvgCNN, OneHiddenMLP, SmallCNN
from .text import CharGRU, CharLSTM, CharTransformer

TEXT_MODELS = ("char-lstm", "char-gru", "char-transformer")  # Shakespeare: [B, T] character indices in
MODELS = ("mlp", "mlp1", "cnn", "fedavg-cnn", "resnet18-gn") + TEXT_MODELS


def _image_shape(name: str, input_shape: Tuple[int, ...], min_side: int) -> Tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < min_side:
        raise ValueError(
            f"model={name!r} needs image inputs [C, H, W] with H, W >= {min_side}; this data set "
            f"has inputs of shape {tuple(input_shape)} (use model='mlp')"
        )
    return tuple(input_shape)  # type: ignore[return-value]


def build_model(
    name: str,
    input_shape: Tuple[int, ...],
    num_classes: int,
    input_spec: Optional[InputSpec] = None,
    hidden: Optional[int] = None,
    context: Optional[int] = None,
) -> nn.Module:
    """``name`` in MODELS; the MLPs take any input, the CNNs images ``[C, H, W]``, the character models
    windows ``[T]`` of indices below ``num_classes``.

    ``input_spec`` (set by image data sets that keep raw pixels) wraps the network in its input stage;
    ``hidden``: the MLPs' width (default 64 for mlp, 25 for mlp1), the character models' state size
    (default 256 for char-lstm, 128 for char-gru, 64 for char-transformer); ``context``: the
    char-transformer reads only the last ``context`` characters of a window.
    """
    if name in TEXT_MODELS:
        if len(input_shape) != 1:
            raise ValueError(
                f"model={name!r} needs windows of character indices [T]; this data set has inputs "
                f"of shape {tuple(input_shape)}"
            )
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
