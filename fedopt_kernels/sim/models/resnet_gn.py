"""ResNet-18 for 32x32 images with GroupNorm in place of BatchNorm, as federated papers train it.

The CIFAR variant of He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016): a 3x3
stem convolution (stride 1, no max-pool), four stages of two basic blocks with 64/128/256/512
channels (stride 2 from the second stage on), global average pooling and one linear layer; 11.2M
parameters for 10 classes. Every BatchNorm is a ``GroupNorm(2, C)``, as in the official code of
"FedNAR: Federated Optimization with Normalized Annealing Regularization" (Li, Li, Tian, Ho, Xing,
Wang; NeurIPS 2023). GroupNorm normalises each sample on its own, so the model has no running
statistics: no buffers to aggregate, and nothing updated in place, which lets the client-batched
path run it under ``torch.func.vmap``. Two groups (not the 32 of Wu & He's GroupNorm paper) is what
FedNAR's results were produced with; ``groups`` changes it.

One deliberate difference from FedNAR's code: it pools the final 4x4 map with ``avg_pool2d(out, 3)``
(a 3x3 window, so the last row and column are dropped); here the pooling is global, as in the
standard CIFAR ResNet.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn
from torch.nn import functional as F


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels)


class BasicBlockGN(nn.Module):
    """Two 3x3 convs with GroupNorm; ``relu(norm(conv(relu(norm(conv(x))))) + shortcut(x))``."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, in_ch: int, out_ch: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(out_ch, groups)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.norm2 = _norm(out_ch, groups)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:  # 1x1 projection where the shape changes
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), _norm(out_ch, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))  # out of place: safe under vmap and autograd


class ResNet18GN(nn.Module):
    """ResNet-18 (stages [2, 2, 2, 2]) with ``GroupNorm(groups, C)``; input [B, in_channels, H, W].

    Built for 32x32 (CIFAR) but any H, W >= 8 works (global pooling). BatchNorm-free and buffer-free.
    """

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, in_channels: int = 3, num_classes: int = 10, groups: int = 2):
        super().__init__()
        widths = (64, 128, 256, 512)
        if any(w % groups for w in widths):
            raise ValueError(f"groups must divide 64, got {groups!r}")
        self.stem = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.stem_norm = _norm(64, groups)
        stages: List[nn.Module] = []
        in_ch = 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlockGN(in_ch, w, stride, groups), BasicBlockGN(w, w, 1, groups)))
            in_ch = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.stem_norm(self.stem(x)))
        out = self.stages(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)
