"""The layers engine: C clients' losses and gradients from one forward and one backward pass.

Client c holds its own copy of every parameter (row c of a ``[C, *shape]`` tensor) and its own
padded mini-batch with sample weights (``1/n_c`` on its ``n_c`` real samples, 0 on padding). The
model's own forward code runs once on all ``N = C * B`` samples; only the parameterised layers
(``layers.py``) know which sample belongs to which client, and compute each sample with its
client's parameters. The total loss ``sum_c loss_c`` then has, for the rows of client c, exactly
the gradient of ``loss_c`` (no other client's loss depends on them), so one backward pass gives
every client's gradient::

    loss_c(theta_c) = sum_b w[c, b] * CE(f(theta_c; x[c, b]), y[c, b])

This is exact when everything outside those layers is *sample-wise*: it treats dim 0 as independent
samples, so running it on N samples is running it on each client's B. A module class declares that
with the class attribute ``sample_wise = True`` (the simulator's models do); torch's containers and
its parameter-free element-wise and pooling layers are known to be. A model with anything else (a
parameter outside the client layer types, tied weights, a module not known to be sample-wise, an
LSTM configuration the client layer lacks) is not for this engine: ``loss.client_loss`` then takes
``torch.func.vmap`` (``loss.VmapLoss``) where it can batch the model, or refuses with the reason.

Against vmap, this avoids the copies vmap makes to move the client dimension, lets every layer pick
the kernels that run best for C clients (``layers.py``, ``Clients``), and batches ``nn.LSTM``.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ..data.image_input import ImageClassifier
from .grouped_runs import PER_CHANNEL, GroupedSequential
from .layer_types import CLIENT_LAYER_TYPES, client_layer, unsupported_reason
from .layers import ClientLayer, Clients
from .precision import autocast_scope, check_precision, flags_now, precision_scope
from .trainable import check_trainable

# parameter-free modules whose forward treats dim 0 as independent samples, and torch's containers
KNOWN_SAMPLE_WISE = (
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
    nn.Flatten,
    nn.Unflatten,
    nn.MaxPool1d,
    nn.AvgPool1d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveMaxPool1d,
) + PER_CHANNEL


class UnsupportedModel(ValueError):
    """The layers engine cannot compute the model; the message says why."""


def is_sample_wise(m: nn.Module) -> bool:
    """Known (``KNOWN_SAMPLE_WISE``) or declared (``sample_wise = True`` on the module's own class)."""
    return type(m) in KNOWN_SAMPLE_WISE or vars(type(m)).get("sample_wise") is True


def why_unsupported(net: nn.Module) -> Optional[str]:
    """Why the layers engine cannot compute ``net`` (None: it can); see the module docstring."""
    all_params = list(net.named_parameters(remove_duplicate=False))
    if len(all_params) != len({id(p) for _, p in all_params}):
        return "it shares (ties) a parameter between layers"

    def visit(m: nn.Module, path: str) -> Optional[str]:
        where = path or type(net).__name__
        if type(m) in CLIENT_LAYER_TYPES:
            why = unsupported_reason(m)
            return None if why is None else f"{where}: {why}"
        if any(p is not None for p in m._parameters.values()):
            if not m._modules:
                kinds = ", ".join(t.__name__ for t in CLIENT_LAYER_TYPES)
                return f"{where} ({type(m).__name__}) is not a layer it computes ({kinds})"
            return f"{where} ({type(m).__name__}) holds parameters itself, outside the client layer types"
        if not is_sample_wise(m):
            return f"{where} ({type(m).__name__}) is not known to be sample-wise (set sample_wise = True on its class)"
        for name, child in m.named_children():
            why = visit(child, f"{path}.{name}" if path else name)
            if why is not None:
                return why
        return None

    return visit(net, "")


def _rebuild(m: nn.Module) -> nn.Module:
    """A copy of the module tree with every layer of a client layer type replaced by its client layer (no parameters)
    and every ``nn.Sequential`` by a ``GroupedSequential`` (the same modules, with grouped runs)."""
    layer = client_layer(m)
    if layer is not None:
        return layer
    new = copy.copy(m)
    if type(m) is nn.Sequential:
        new.__class__ = GroupedSequential  # a copy keeps the container's own attributes and hooks
    new._modules = {k: None if c is None else _rebuild(c) for k, c in m._modules.items()}
    return new


class LayersNet:
    """``net``'s forward code over C clients' stacked parameters (module docstring)."""

    def __init__(self, net: nn.Module):
        why = why_unsupported(net)
        if why is not None:
            raise UnsupportedModel(why)
        self.source = net
        self.net = _rebuild(net)
        self.slots: List[Tuple[ClientLayer, str]] = []
        for name, _ in net.named_parameters():
            path, _, attr = name.rpartition(".")
            layer = self.net.get_submodule(path)
            assert isinstance(layer, ClientLayer)  # why_unsupported: every parameter is a client layer's
            self.slots.append((layer, attr))
        self.layers: Dict[str, ClientLayer] = {n: m for n, m in self.net.named_modules() if isinstance(m, ClientLayer)}
        for n, m in self.layers.items():
            m.path = n

    def set_formulations(self, spec: Optional[Dict[str, str]]) -> None:
        """Force formulations: ``{layer type or module path: formulation}`` (``layers.FORMULATIONS``).

        A formulation a layer cannot run in its configuration (not among its ``candidates``) is refused
        here with a ``ValueError`` naming the layer, and nothing changes; one refused only for some
        inputs, when the layer meets one."""
        chosen: Dict[str, str] = {}
        for key, form in (spec or {}).items():
            hits = [n for n, m in self.layers.items() if key in (n, m.kind)]
            if not hits:
                raise ValueError(f"formulations: no client layer is named or of type {key!r}")
            for n in hits:
                self.layers[n].refuse(form)
                chosen[n] = form
        for n, layer in self.layers.items():
            layer.formulation = chosen.get(n)

    def __call__(self, params: Sequence[torch.Tensor], x: torch.Tensor, ctx: Clients) -> torch.Tensor:
        if self.net.training != self.source.training:  # the copy follows the model's train/eval mode
            self.net.train(self.source.training)
        for layer in self.layers.values():
            layer.ctx = ctx
        for (layer, attr), t in zip(self.slots, params, strict=True):
            layer.params[attr] = t
        try:
            return self.net(x)
        finally:
            for layer in self.layers.values():
                layer.params = {}

    def formulations(self) -> Dict[str, str]:
        """What each client layer ran in the latest call (module path -> formulation)."""
        return {n: m.last_formulation for n, m in self.layers.items()}


class LayersLoss:
    """The per-client weighted loss and its gradients for C stacked clients of ``model``.

    The interface of ``loss.VmapLoss`` (``grads``, ``grads_at``, ``input_stage``, ``precision``);
    ``order``: ``Clients.order`` (None: "client" on a CPU, "batch" elsewhere, where grouped
    convolutions read the batch order without a copy); ``formulations``:
    ``LayersNet.set_formulations``; ``precision``: what the passes compute in (``precision.py``).
    """

    engine = "layers"

    def __init__(
        self,
        model: nn.Module,
        formulations: Optional[Dict[str, str]] = None,
        order: Optional[str] = None,
        precision: str = "fp32",
    ):
        self.precision = check_precision(precision)
        check_trainable(model)
        net = model.net if isinstance(model, ImageClassifier) else model
        self.model, self.net = model, net
        self.input_stage = model.preprocess if isinstance(model, ImageClassifier) else None
        named = list(net.named_parameters())
        if [id(p) for _, p in named] != [id(p) for p in model.parameters()]:
            raise ValueError(f"{type(model).__name__}: its parameters are not those of its network in the same order")
        self.names = [n for n, _ in named]
        self.layers_net = LayersNet(net)
        self.layers_net.set_formulations(formulations)
        if order is not None and order not in ("client", "batch"):
            raise ValueError(f"order must be 'client' or 'batch', got {order!r}")
        self.order = order
        self.flags_seen: Optional[Dict[str, str]] = None  # the backend switches of its first gradient pass

    def context(self, clients: int, batch: int, device: torch.device) -> Clients:
        order = self.order or ("client" if device.type == "cpu" else "batch")
        return Clients(clients, batch, order)

    def logits(self, params: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Client c's model on its samples: ``x`` [C, B, ...] -> [C, B, classes]."""
        ctx = self.context(x.shape[0], x.shape[1], x.device)
        with precision_scope(self.precision, x.device), autocast_scope(self.precision, x.device):
            return ctx.split(self.layers_net(params, ctx.inputs(x), ctx))

    def _loss(self, params: Sequence[torch.Tensor], x, y, w) -> torch.Tensor:
        ctx = self.context(x.shape[0], x.shape[1], x.device)
        out = self.layers_net(params, ctx.inputs(x), ctx)
        per_sample = F.cross_entropy(out, ctx.inputs(y), reduction="none") * ctx.inputs(w)
        return ctx.split(per_sample).sum(1)  # [C]

    def grads(
        self, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
        """Every client's gradient (``[C, *shape]`` each) and loss (``[C]``) on ``x`` [C, B, ...]."""
        leaves = [p.detach().requires_grad_() for p in params]
        with torch.enable_grad(), precision_scope(self.precision, x.device):
            if self.flags_seen is None:
                self.flags_seen = flags_now(x.device)
            with autocast_scope(self.precision, x.device):
                loss = self._loss(leaves, x, y, w)
            grads = torch.autograd.grad(loss.sum(), leaves)
        return grads, loss.detach()

    def grads_at(
        self, shared: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
        """Every client's gradient at the same (unstacked) parameters ``shared``."""
        C = x.shape[0]
        with torch.enable_grad(), precision_scope(self.precision, x.device):
            base = [s.detach().requires_grad_() for s in shared]
            wide = [b.expand(C, *b.shape) for b in base]  # the gradient w.r.t. these is per client
            with autocast_scope(self.precision, x.device):
                loss = self._loss(wide, x, y, w)
            grads = torch.autograd.grad(loss.sum(), wide)
        return grads, loss.detach()
