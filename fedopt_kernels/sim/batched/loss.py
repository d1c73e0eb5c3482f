"""Per-client loss and gradients of many client models at once: the engines, and vmap's.

``client_loss`` picks the engine: the layers engine (``layers_engine.py``: the model's own code over
all clients' samples, client layers with per-layer formulations) where it computes the model, else
``VmapLoss`` below, ``torch.func`` over stacked parameters, which takes any functional model.

Client ``c`` holds its own copy of every parameter (row ``c`` of a ``[C, *shape]`` tensor) and its
own padded mini-batch ``x[c]`` (``[B, ...]``) with sample weights ``w[c]`` (``1/n_c`` on its ``n_c``
real samples, 0 on padding). ``torch.func.vmap(torch.func.grad_and_value(loss))`` then gives every
client's gradient of its mean cross-entropy over its real samples, in one computation::

    loss_c(theta_c) = sum_b w[c, b] * CE(f(theta_c; x[c, b]), y[c, b])

This needs a functional model: no BatchNorm (running statistics are state updated in place, and
their aggregation is another algorithm) and no buffers at all. The simulator's models qualify.
An input stage with randomness (``ImageClassifier``'s augmentation) stays outside: the network
after it is what gets vmapped, and the caller preprocesses the batches (``batches.py``).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F

from ..data.image_input import ImageClassifier
from .layers_engine import LayersLoss, UnsupportedModel
from .precision import autocast_scope, check_precision, precision_scope
from .trainable import check_trainable

Tensors = List[torch.Tensor]


def check_vmappable(model: nn.Module) -> None:
    """ValueError naming what stops ``model`` from being trained under ``torch.func.vmap`` (RNN kernels,
    BatchNorm, buffers)."""
    rnns = [
        f"{name or type(model).__name__} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, nn.RNNBase)
    ]
    if rnns:  # its fused kernel has no batching rule: vmap would not batch the clients
        raise ValueError(
            f"--client-batched cannot train {type(model).__name__}: torch.func.vmap cannot batch the fused "
            f"recurrent layer {', '.join(rnns[:4])} over client copies. Use a model written in plain tensor ops "
            f"(char-gru, char-transformer), nn.LSTM(batch_first=True) inside a model the layers engine "
            f"computes (char-lstm), or client_batched=1 (--client-batched 1, the sequential path)"
        )
    check_trainable(model)


class VmapLoss:
    """The loss of one client as a function of its parameters, and its vmapped gradient.

    ``model``'s parameters (in ``model.parameters()`` order) are what the functions take, as a
    tuple. For an ``ImageClassifier`` the vmapped function is its network; ``input_stage`` is
    then its ``preprocess`` (applied by the caller, outside vmap). ``precision``: what the passes
    compute in (``precision.py``; autocast wraps the loss, so the backward runs outside it).
    """

    engine = "vmap"

    def __init__(self, model: nn.Module, precision: str = "fp32"):
        self.precision = check_precision(precision)
        check_vmappable(model)
        self.model = model
        net = model.net if isinstance(model, ImageClassifier) else model
        self.net = net
        self.input_stage: Optional[Callable[[torch.Tensor, bool], torch.Tensor]] = (
            model.preprocess if isinstance(model, ImageClassifier) else None
        )
        named = list(net.named_parameters())
        if [id(p) for _, p in named] != [id(p) for p in model.parameters()]:
            raise ValueError(f"{type(model).__name__}: its parameters are not those of its network in the same order")
        self.names = [n for n, _ in named]
        # grad of client c's loss at its own parameters (in_dims 0) or at shared ones (None: the
        # PAdaMFed-VR anchor, every client's batch at the round's starting model)
        self.per_client = vmap(grad_and_value(self.loss), in_dims=(0, 0, 0, 0))
        self.at_shared = vmap(grad_and_value(self.loss), in_dims=(None, 0, 0, 0))

    def loss(self, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One client's weighted cross-entropy (``w``: 1/n on real samples, 0 on padding)."""
        with autocast_scope(self.precision, x.device):
            out = functional_call(self.net, dict(zip(self.names, params, strict=True)), (x,))
            return (F.cross_entropy(out, y, reduction="none") * w).sum()

    def grads(
        self, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
        """Every client's gradient (``[C, *shape]`` each) and loss (``[C]``)."""
        with precision_scope(self.precision, x.device):
            return self.per_client(tuple(params), x, y, w)

    def logits(self, params: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Client c's model on its samples: ``x`` [C, B, ...] -> [C, B, classes]."""
        with precision_scope(self.precision, x.device), autocast_scope(self.precision, x.device):
            return vmap(lambda ps, xx: functional_call(self.net, dict(zip(self.names, ps, strict=True)), (xx,)))(
                tuple(params), x
            )

    def grads_at(
        self, shared: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
        """Every client's gradient at the same (unstacked) parameters ``shared``."""
        with precision_scope(self.precision, x.device):
            return self.at_shared(tuple(shared), x, y, w)


ENGINES = ("auto", "layers", "vmap")
EARLIER_ENGINES = {"stacked": "layers"}  # earlier names, deprecated


def client_loss(
    model: nn.Module, engine: str = "auto", formulations: Optional[Dict[str, str]] = None, precision: str = "fp32"
):
    """The gradient engine for C stacked clients of ``model``: ``LayersLoss`` (``engine="layers"``) or
    ``VmapLoss`` (``engine="vmap"``).

    ``auto``: the layers engine (``layers_engine.py``) when it computes the model, else vmap; a model
    neither can batch is refused with both reasons (``"stacked"``, the layers engine's earlier name,
    still works, with a DeprecationWarning). ``formulations``: the layers engine's
    per-layer choices (``LayersNet.set_formulations``); ``precision``: what the engine's passes
    compute in (``precision.PRECISIONS``; the engine's ``precision`` attribute).
    """
    if engine in EARLIER_ENGINES:
        warnings.warn(f"engine={engine!r} is engine={EARLIER_ENGINES[engine]!r}", DeprecationWarning, stacklevel=2)
        engine = EARLIER_ENGINES[engine]
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    check_precision(precision)
    if engine == "vmap":
        return VmapLoss(model, precision)
    try:
        return LayersLoss(model, formulations, precision=precision)
    except UnsupportedModel as why:
        if engine == "layers":
            name = type(model).__name__
            raise ValueError(f"--client-batched: the layers engine cannot train {name}: {why}") from None
        try:
            return VmapLoss(model, precision)
        except ValueError as vmap_why:
            raise ValueError(f"{vmap_why} (the layers engine cannot either: {why})") from None
