"""Grouped runs: a Sequential's ``grouped-nhwc`` convolutions and the per-channel modules between them
computed in the grouped layout, converted from and to the model's batch once per run.

The ``grouped-nhwc`` convolution computes all C clients as one grouped convolution on
``[B, C * Ch, H, W]`` in channels-last memory (``layers.to_grouped``), and alone it converts the
model's batch ``[N, Ch, H, W]`` to that layout and back around every call: two copies of an
activation forward and two backward, per convolution. A module that acts on each (sample, channel)
plane by itself (an element-wise activation, a 2-d pooling) computes the same on the grouped tensor,
whose planes are (sample b, client c, channel k). So ``GroupedSequential`` keeps the grouped layout
from a grouped convolution through the element-wise and pooling modules and grouped convolutions
after it, and converts back once, where the run ends. The pooling then also gets its gradient in
channels-last memory (``layers.from_grouped``), where its backward kernel is several times faster
than with the NCHW gradient a flatten hands back. docs/client_batched.md has the measurements.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layers import ClientConv2d, from_grouped, to_grouped

ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Hardtanh,
    nn.Hardswish,
)
POOLING_2D = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
# modules that compute every (sample, channel) plane of a 4-d input by itself
PER_CHANNEL = (nn.Identity,) + ELEMENTWISE + POOLING_2D


def per_channel(m: nn.Module) -> bool:
    """``m`` computes each plane of ``[N, Ch, H, W]`` alone and returns one tensor."""
    return type(m) in PER_CHANNEL and not getattr(m, "return_indices", False) and not _hooked(m)


def _hooked(m: nn.Module) -> bool:
    # a module with forward hooks is called as a module, on the model's batch: its hooks see what they
    # would without runs (the benchmark's per-layer timing records each layer's input this way)
    return bool(m._forward_pre_hooks or m._forward_hooks)


def _starts_run(m: ClientConv2d, x: torch.Tensor) -> bool:
    """The client convolution ``m`` starts a grouped run on the model's batch ``x``."""
    return not _hooked(m) and x.dim() == 4 and m.pick(x) == "grouped-nhwc"


def _pools_after_relu(m: nn.Module, nxt: nn.Module) -> bool:
    """``m`` is a ReLU and ``nxt`` a max-pooling of the run: pooling first, then the ReLU on the smaller
    pooled tensor, gives the same values and gradients. A window's maximum of ReLU(x) is ReLU of its
    maximum of x; where that is positive, both orders pick the same first maximal element (ReLU keeps
    the order of positive values, ties included) and pass the gradient through, and where it is not,
    the ReLU's derivative is 0 in both orders."""
    return type(m) is nn.ReLU and type(nxt) is nn.MaxPool2d and per_channel(nxt)


class GroupedSequential(nn.Sequential):
    """``nn.Sequential`` of a model on the layers engine, with grouped runs (module docstring)."""

    def forward(self, x):
        grouped: Optional[torch.Tensor] = None  # the run's tensor, None outside a run
        head: Optional[ClientConv2d] = None  # the run's first convolution (holds the clients)
        mods = list(self)
        i = 0
        while i < len(mods):
            m, i = mods[i], i + 1
            if grouped is not None:
                assert head is not None
                if isinstance(m, ClientConv2d) and not _hooked(m) and m.grouped_in_run(grouped):
                    grouped = m.grouped(grouped)
                    continue
                if per_channel(m):
                    if i < len(mods) and _pools_after_relu(m, mods[i]):
                        grouped, i = m(mods[i](grouped)), i + 1
                    else:
                        grouped = m(grouped)
                    continue
                x, grouped = from_grouped(grouped, head.ctx), None
            if isinstance(m, ClientConv2d) and _starts_run(m, x):
                head = m
                grouped = m.grouped(to_grouped(x, m.ctx))
                continue
            x = m(x)
        return x if grouped is None or head is None else from_grouped(grouped, head.ctx)
