"""The parameter lists the benchmark steps over: three sizes that stress different limits.

- ``overhead``: 62 one-element tensors (ResNet-18's tensor count, no bytes to speak of): a step's
  time is its fixed per-step and per-tensor cost alone, host overhead included.
- ``small_cnn``: the simulator's CNN (``fedopt_kernels.sim.models.small.SmallCNN`` on 8x8 single-channel
  images, 10 classes): 6 tensors, 3,818 parameters. One step moves ~50 KB, so its time is launch
  and Python overhead, not bandwidth.
- ``resnet18``: the exact parameter shapes of torchvision's ``resnet18()`` (ImageNet head,
  BatchNorm weights and biases included): 62 tensors, 11,689,512 parameters.
- ``large``: a transformer-like list of 100M+ parameters, large enough that every backend is
  bound by memory bandwidth on any device (far beyond any cache).

Shapes are written here, not imported, so the benchmark never depends on torchvision or on the
simulator (which may change its model); tests check the totals.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

Shape = Tuple[int, ...]


def small_cnn_shapes(
    in_channels: int = 1, hw: int = 8, num_classes: int = 10, channels: Tuple[int, int] = (8, 16)
) -> List[Shape]:
    """conv(in->8, 3x3), conv(8->16, 3x3), maxpool(2), linear(16*(hw/2)^2 -> classes), with biases."""
    c1, c2 = channels
    return [
        (c1, in_channels, 3, 3),
        (c1,),
        (c2, c1, 3, 3),
        (c2,),
        (num_classes, c2 * (hw // 2) ** 2),
        (num_classes,),
    ]


def _bn(c: int) -> List[Shape]:
    return [(c,), (c,)]  # BatchNorm weight and bias (running stats are buffers, not parameters)


def _basic_block(c_in: int, c_out: int, downsample: bool) -> List[Shape]:
    shapes = [(c_out, c_in, 3, 3)] + _bn(c_out) + [(c_out, c_out, 3, 3)] + _bn(c_out)
    if downsample:
        shapes += [(c_out, c_in, 1, 1)] + _bn(c_out)
    return shapes


def resnet18_shapes(num_classes: int = 1000) -> List[Shape]:
    """torchvision ``resnet18`` parameter shapes in ``model.parameters()`` order."""
    shapes: List[Shape] = [(64, 3, 7, 7)] + _bn(64)
    c_in = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        shapes += _basic_block(c_in, c_out, downsample=stride != 1 or c_in != c_out)
        shapes += _basic_block(c_out, c_out, downsample=False)
        c_in = c_out
    shapes += [(num_classes, 512), (num_classes,)]
    return shapes


def large_shapes(blocks: int = 8, width: int = 1024, vocab: int = 8192) -> List[Shape]:
    """A GPT-like list: token embedding plus ``blocks`` transformer blocks (~109M parameters)."""
    shapes: List[Shape] = [(vocab, width)]
    for _ in range(blocks):
        shapes += [
            (width,),
            (width,),  # layer norm 1
            (3 * width, width),
            (3 * width,),  # qkv projection
            (width, width),
            (width,),  # attention output projection
            (width,),
            (width,),  # layer norm 2
            (4 * width, width),
            (4 * width,),  # MLP up
            (width, 4 * width),
            (width,),  # MLP down
        ]
    shapes += [(width,), (width,)]  # final layer norm
    return shapes


SIZES: Dict[str, List[Shape]] = {
    "overhead": [(1,)] * 62,
    "small_cnn": small_cnn_shapes(),
    "resnet18": resnet18_shapes(),
    "large": large_shapes(),
}


def numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def total_numel(shapes: List[Shape]) -> int:
    return sum(numel(s) for s in shapes)
