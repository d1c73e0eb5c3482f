"""Client layers: one layer of C client models applied to all their samples at once (the layers engine).

The samples of all C clients (B each) flow through the model's own forward code as one batch of
``N = C * B`` samples; only the layers that hold parameters need to know which sample belongs to
which client. ``Clients`` says how the N samples are ordered: ``"client"`` (sample b of client c at
``c * B + b``) or ``"batch"`` (at ``b * C + c``, so that ``[N, Ch, H, W]`` *is* the
``[B, C * Ch, H, W]`` tensor a grouped convolution reads). Every parameter is stacked
``[C, *shape]``; client c's rows are its own copy.

Each layer has one or more *formulations*, the same mathematics computed by different kernels:

=============  ==================  ==========================================================
layer          formulation         computes
=============  ==================  ==========================================================
Conv2d         ``grouped``         one convolution with ``C * groups`` groups on
                                   ``[B, C * Cin, H, W]`` (NCHW)
               ``grouped-nhwc``    the same in channels-last memory (oneDNN's fast path for
                                   many small groups; a layout copy at each end of a grouped
                                   run, ``grouped_runs.py``)
               ``loop``            an ordinary convolution per client (for per-client work
                                   large enough to fill the machine on its own)
               ``loop-nhwc``       the same with every client's input and weight in
                                   channels-last memory (one copy of the input for all
                                   clients; the layout cuDNN's tensor-core kernels prefer)
               ``im2col``          every client's patches unfolded, then one batched matmul
                                   for all clients forward and two backward, the patch
                                   gradient folded back (``conv_im2col.py``; patches about
                                   ``kh * kw`` times the input)
Linear         ``bmm``             one batched matmul ``[C, M, I] x [C, I, O]``
               ``loop``            a matmul per client
LSTM           ``bmm``             the recurrence written out: per time step one batched
                                   matmul for all clients, then the gates
               ``bmm-fused``       the same matmul per step, then the cell's pointwise part
                                   as one autograd node with a written-out backward
                                   (``lstm_cell.py``)
               ``bmm-sequence``    the same forward; the whole sequence one autograd node
                                   whose backward forms ``W_hh``'s gradient in one batched
                                   matmul over all steps (``lstm_sequence.py``)
               ``loop``            the fused LSTM kernel once per client
GroupNorm,     (one)               normalise every sample (statistics are per sample), then
LayerNorm                          each client's affine
Embedding      (one)               a lookup in the ``[C * V, D]`` table, indices offset by
                                   ``c * V``
=============  ==================  ==========================================================

The LSTM's code is in ``lstm.py``, the convolution's ``im2col`` in ``conv_im2col.py``; which torch
layers have a client form, and in which configurations: ``layer_types.py``.

A layer's ``candidates(x)`` are the formulations that compute it on inputs like ``x`` (a
configuration a formulation does not support leaves it out, ``why_not`` says why); forcing another
one raises a ``ValueError`` naming the layer. Every candidate equals per-client autograd
(tests/test_sim_layers_engine.py, tests/test_sim_formulations.py): which one runs is a question of speed.

``docs/client_batched.md`` has the measurements behind the defaults (``default_formulation``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from .conv_im2col import im2col_conv2d, padding_sides
from .precision import autocast_inputs

ORDERS = ("client", "batch")
FORMULATIONS: Dict[str, Tuple[str, ...]] = {
    "Conv2d": ("grouped", "grouped-nhwc", "loop", "loop-nhwc", "im2col"),
    "Linear": ("bmm", "loop"),
    "LSTM": ("bmm", "loop", "bmm-fused", "bmm-sequence"),
    "GroupNorm": ("one",),
    "LayerNorm": ("one",),
    "Embedding": ("one",),
}
# CPU: a convolution whose per-client forward work reaches this many FLOPs runs client by client
# (oneDNN's ordinary convolution at the client's batch is then at its best; below it, one grouped
# channels-last call for all clients saves the per-call overhead). Measured on a 2-core AMD EPYC
# (python -m bench clients, layers alone): the FedAvg CNN's first layer, 12.5 MFLOP per client,
# 38 ms grouped-nhwc against 56 ms loop at C=20; its second, 200 MFLOP, loop 260 = grouped 250-260;
# ResNet-18's, 177-1,850 MFLOP, loop best or within noise (docs/client_batched.md).
CONV_LOOP_FLOPS = 32e6


@dataclass
class Clients:
    """How the N = ``count * batch`` samples of one call are laid out (module docstring)."""

    count: int
    batch: int
    order: str = "client"

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, *rest]`` -> ``[C, B, *rest]`` (a view)."""
        C, B = self.count, self.batch
        if self.order == "client":
            return x.unflatten(0, (C, B))
        return x.unflatten(0, (B, C)).transpose(0, 1)

    def merge(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``[..., C, B, *rest]`` (client axis at ``dim``) -> ``[..., N, *rest]`` (a view where the memory allows)."""
        if self.order == "batch":
            t = t.transpose(dim, dim + 1)
        return t.flatten(dim, dim + 1)

    def inputs(self, t: torch.Tensor) -> torch.Tensor:
        """A round's per-client tensor ``[C, B, ...]`` as the model's batch ``[N, ...]``."""
        return self.merge(t)


def stack_merge(ctx: Clients, parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Per-client outputs (``[B, ...]`` each, batch axis at ``dim``) as one ``[N, ...]`` tensor."""
    if ctx.order == "client":
        return torch.cat(list(parts), dim=dim)
    return torch.stack(list(parts), dim=dim + 1).flatten(dim, dim + 1)


class ClientLayer(nn.Module):
    """A parameterised layer of C clients. ``params`` (name -> ``[C, *shape]``) and ``ctx`` are
    set by the owning ``LayersNet`` before every call; ``formulation`` None: ``default_formulation``."""

    kind = ""

    def __init__(self, names: Sequence[str]):
        super().__init__()
        self.names = list(names)
        self.params: Dict[str, torch.Tensor] = {}
        self.ctx = Clients(1, 1)
        self.formulation: Optional[str] = None
        self.last_formulation = ""  # what the latest call ran (the benchmark reports it)
        self.path = ""  # the module path in its model (LayersNet sets it; error messages name it)

    def p(self, name: str) -> Optional[torch.Tensor]:
        return self.params.get(name)

    def why_not(self, form: str, x: Optional[torch.Tensor] = None) -> Optional[str]:
        """Why ``form`` cannot compute this layer (on inputs like ``x``; None: any input), or None if it can."""
        if form not in FORMULATIONS[self.kind]:
            return f"{self.kind} has {FORMULATIONS[self.kind]}"
        return None

    def candidates(self, x: torch.Tensor) -> Tuple[str, ...]:
        """The formulations that compute this layer on inputs like ``x`` (its shape, dtype and layout;
        a meta tensor will do): ``FORMULATIONS[kind]`` less those ``why_not`` refuses."""
        return tuple(f for f in FORMULATIONS[self.kind] if self.why_not(f, x) is None)

    def refuse(self, form: str, x: Optional[torch.Tensor] = None) -> None:
        """ValueError naming the layer if ``form`` is not one of its candidates."""
        why = self.why_not(form, x)
        if why is not None:
            raise ValueError(f"formulations: {self.path or self.kind} ({self.kind}) cannot run {form!r}: {why}")

    def pick(self, x: torch.Tensor) -> str:
        form = self.formulation
        if form is None:
            form = self.default_formulation(x)
        else:
            self.refuse(form, x)
        self.last_formulation = form
        return form

    def default_formulation(self, x: torch.Tensor) -> str:
        return FORMULATIONS[self.kind][0]


class ClientLinear(ClientLayer):
    kind = "Linear"

    def __init__(self, m: nn.Linear):
        super().__init__(["weight"] + (["bias"] if m.bias is not None else []))
        self.out_features = m.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, w, b = self.ctx, self.params["weight"], self.p("bias")
        if self.pick(x) == "loop":
            # unbind, not w[c]: the backward of C selects would write C zero-filled [C, ...] tensors
            ws, bs = w.unbind(0), [None] * ctx.count if b is None else b.unbind(0)
            return stack_merge(
                ctx, [F.linear(xc, wc, bc) for xc, wc, bc in zip(ctx.split(x).unbind(0), ws, bs, strict=True)]
            )
        C = ctx.count
        xs = ctx.split(x).reshape(C, -1, x.shape[-1])  # a view in client order
        out = _BatchedLinear.apply(xs, w, b)
        return ctx.merge(out.view(C, ctx.batch, *x.shape[1:-1], self.out_features))


class _BatchedLinear(torch.autograd.Function):
    """``x [C, M, I] @ w[C, O, I]^T + b[C, O]`` with the weight gradient computed as ``gy^T @ x``, in the
    weight's own layout: autograd's formula for the transposed weight gives it transposed, and the
    optimizer would then read (or copy) a [C, O, I] tensor against its strides."""

    @staticmethod
    def forward(ctx, x, w, b):
        x, w, b = autocast_inputs(x, w, b)  # bf16: forward and backward in one dtype
        wt = w.transpose(1, 2)
        out = torch.bmm(x, wt) if b is None else torch.baddbmm(b.unsqueeze(1), x, wt)
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return out

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = torch.bmm(gy, w) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(gy.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = gy.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class ClientConv2d(ClientLayer):
    kind = "Conv2d"

    def __init__(self, m: nn.Conv2d):
        super().__init__(["weight"] + (["bias"] if m.bias is not None else []))
        self.stride, self.padding, self.dilation, self.groups = m.stride, m.padding, m.dilation, m.groups
        self.kernel = m.kernel_size
        self.out_channels = m.out_channels

    def default_formulation(self, x: torch.Tensor) -> str:
        return self.choose(x.device, x.shape[1], x.shape[-2], x.shape[-1])

    def choose(self, device: torch.device, channels: int, H: int, W: int) -> str:
        """The default formulation for an input of ``channels`` x H x W per sample on ``device``."""
        if device.type != "cpu":
            return "grouped"
        out_px = math.ceil(H / self.stride[0]) * math.ceil(W / self.stride[1])
        cin = channels // self.groups
        per_client = 2 * self.ctx.batch * out_px * self.out_channels * cin * self.kernel[0] * self.kernel[1]
        return "loop" if per_client >= CONV_LOOP_FLOPS else "grouped-nhwc"

    def _conv(self, x, w, b, groups):
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, w, b = self.ctx, self.params["weight"], self.p("bias")
        C, B = ctx.count, ctx.batch
        form = self.pick(x)
        if form == "im2col":
            return im2col_conv2d(x, w, b, C, ctx.order, self.stride, self.padding, self.dilation, self.groups)
        if form == "loop-nhwc":
            # one copy puts every client's samples and weights in channels-last memory, each client's
            # slice contiguous in it (a no-op for a channels-last input in client order)
            xl = ctx.split(x).permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
            wl = w.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
            bl: Sequence[Optional[torch.Tensor]] = [None] * C if b is None else b.unbind(0)
            parts = [
                self._conv(xc, wc, bc, self.groups) for xc, wc, bc in zip(xl.unbind(0), wl.unbind(0), bl, strict=True)
            ]
            return stack_merge(ctx, parts)
        if form == "loop":
            ws, bs = w.unbind(0), [None] * C if b is None else b.unbind(0)
            parts = [
                self._conv(xc, wc, bc, self.groups) for xc, wc, bc in zip(ctx.split(x).unbind(0), ws, bs, strict=True)
            ]
            if x.device.type == "cpu" and x.shape[1] == 1:
                # a 1-channel input is NCHW and channels-last at once, and oneDNN answers in NCHW,
                # where the max-pooling after it runs 8x slower than in channels-last (FedAvg CNN);
                # otherwise the output keeps the input's layout, as in the model's own forward
                parts = [p.contiguous(memory_format=torch.channels_last) for p in parts]
            return stack_merge(ctx, parts)
        if form == "grouped":
            cin, H, W = x.shape[1:]
            wg = w.reshape(C * w.shape[1], *w.shape[2:])
            bg = None if b is None else b.reshape(-1)
            xg = ctx.split(x).transpose(0, 1).reshape(B, C * cin, H, W)  # a view in batch order
            y = self._conv(xg, wg, bg, C * self.groups)
            return ctx.merge(y.unflatten(1, (C, -1)).transpose(0, 1))
        return from_grouped(self.grouped(to_grouped(x, ctx)), ctx)

    def grouped_in_run(self, xg: torch.Tensor) -> bool:
        """Whether this convolution, met inside a grouped run with the grouped ``xg``, runs ``grouped-nhwc``."""
        form = self.formulation
        if form is None:
            form = self.choose(xg.device, xg.shape[1] // self.ctx.count, xg.shape[2], xg.shape[3])
        else:
            self.refuse(form)
        return form == "grouped-nhwc"

    def grouped(self, xg: torch.Tensor) -> torch.Tensor:
        """The ``grouped-nhwc`` convolution of a tensor already in the grouped layout (``to_grouped``)."""
        ctx, w, b = self.ctx, self.params["weight"], self.p("bias")
        self.last_formulation = "grouped-nhwc"
        padding = self.padding
        if padding == "same":
            top, bottom, left, right = padding_sides(padding, self.kernel, self.dilation)
            if top != bottom or left != right:  # an even kernel: the backward takes one padding for both sides
                xg, padding = F.pad(xg, (left, right, top, bottom)), (0, 0)
        return _GroupedConvNHWC.apply(xg, w, b, ctx.count, self.stride, padding, self.dilation, self.groups)


def _to_grouped_nhwc(x: torch.Tensor, ctx: Clients) -> torch.Tensor:
    """``[N, Ch, H, W]`` (any memory format) -> ``[B, C * Ch, H, W]`` in channels-last memory ([B, H, W, C, Ch])."""
    B, H, W = ctx.batch, x.shape[2], x.shape[3]
    t = ctx.split(x).permute(1, 3, 4, 0, 2).contiguous()
    return t.view(B, H, W, -1).permute(0, 3, 1, 2)


def _from_grouped_nhwc(y: torch.Tensor, ctx: Clients) -> torch.Tensor:
    """``[B, C * Ch, H, W]`` (any memory format) -> ``[N, Ch, H, W]`` with every sample channels-last."""
    y5 = y.permute(0, 2, 3, 1).unflatten(3, (ctx.count, -1))  # [B, Ho, Wo, C, Ch] (a view)
    return ctx.merge(y5.permute(3, 0, 1, 2, 4)).contiguous().permute(0, 3, 1, 2)


class _ToGrouped(torch.autograd.Function):
    """The model's batch ``[N, Ch, H, W]`` -> the grouped layout; the gradient returns in the input's format."""

    @staticmethod
    def forward(ctx, x, clients: Clients):
        ctx.clients = clients
        last = x.is_contiguous(memory_format=torch.channels_last)
        ctx.x_format = torch.channels_last if last else torch.contiguous_format
        return _to_grouped_nhwc(x, clients)

    @staticmethod
    def backward(ctx, g):
        return _from_grouped_nhwc(g, ctx.clients).contiguous(memory_format=ctx.x_format), None


class _FromGrouped(torch.autograd.Function):
    """The grouped layout -> the model's batch (channels-last samples); the gradient returns grouped, in
    channels-last memory whatever layout it arrives in (the pooling before it has its fast kernel there)."""

    @staticmethod
    def forward(ctx, y, clients: Clients):
        ctx.clients = clients
        return _from_grouped_nhwc(y, clients)

    @staticmethod
    def backward(ctx, g):
        return _to_grouped_nhwc(g, ctx.clients), None


def to_grouped(x: torch.Tensor, ctx: Clients) -> torch.Tensor:
    """``[N, Ch, H, W]`` -> ``[B, C * Ch, H, W]`` (channel ``c * Ch + k`` is client c's channel k) in
    channels-last memory: the input of oneDNN's grouped convolution for all clients, without copies."""
    return _ToGrouped.apply(x, ctx)


def from_grouped(y: torch.Tensor, ctx: Clients) -> torch.Tensor:
    """The inverse of ``to_grouped``: ``[N, Ch, H, W]`` with every sample channels-last."""
    return _FromGrouped.apply(y, ctx)


class _GroupedConvNHWC(torch.autograd.Function):
    """The ``grouped-nhwc`` convolution on grouped tensors, with its own backward, so that every gradient
    leaves in the memory format its tensor came in (element-wise backward kernels on mismatched layouts
    are slow) and the weight's in its own ``[C, ...]`` layout."""

    @staticmethod
    def forward(ctx, xg, w, b, C: int, stride, padding, dilation, groups):
        xg, w, b = autocast_inputs(xg, w, b)  # bf16: forward and backward in one dtype
        wg = w.reshape(C * w.shape[1], *w.shape[2:]).contiguous(memory_format=torch.channels_last)
        y = F.conv2d(xg, wg, None if b is None else b.reshape(-1), stride, padding, dilation, C * groups)
        ctx.save_for_backward(xg, wg)
        ctx.conv = (stride, padding, dilation, C * groups)
        ctx.w_shape, ctx.has_bias = w.shape, b is not None
        return y.contiguous(memory_format=torch.channels_last)

    @staticmethod
    def backward(ctx, gy):
        xg, wg = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        gy = gy.contiguous(memory_format=torch.channels_last)
        if isinstance(padding, str):  # convolution_backward takes numbers: what "same"/"valid" pad
            padding = _explicit_padding(padding, wg.shape[2:], dilation)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], False]
        gx, gw, _ = torch.ops.aten.convolution_backward(
            gy, xg, wg, None, stride, padding, dilation, False, [0, 0], groups, mask
        )
        if gw is not None:
            gw = gw.contiguous().view(ctx.w_shape)
        gb = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            # a plain sum: oneDNN's bias gradient in the same call costs 4-8x more (0.12 against 0.016 ms
            # alone for the small CNN's first layer at C=50)
            gb = gy.sum((0, 2, 3)).view(ctx.w_shape[0], -1)
        return gx, gw, gb, None, None, None, None, None


def _explicit_padding(padding: str, kernel, dilation) -> List[int]:
    if padding == "valid":
        return [0, 0]
    # "same" (stride 1): total padding d * (k - 1), split evenly (F.conv2d pads an odd total on the right,
    # which an explicit symmetric padding cannot say)
    total = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
    if any(t % 2 for t in total):
        raise ValueError("ClientConv2d: padding='same' with an even kernel needs an asymmetric padding")
    return [t // 2 for t in total]


class ClientGroupNorm(ClientLayer):
    kind = "GroupNorm"

    def __init__(self, m: nn.GroupNorm):
        super().__init__(["weight", "bias"] if m.affine else [])
        self.num_groups, self.eps = m.num_groups, m.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pick(x)
        y = F.group_norm(x, self.num_groups, None, None, self.eps)  # statistics per sample: no client needed
        if not self.names:
            return y
        ctx, w, b = self.ctx, self.params["weight"], self.params["bias"]
        C, ch = ctx.count, x.shape[1]
        # broadcast over the spatial dims in the tensor's own layout (a channels-last activation stays
        # channels-last: no copy here, and none in the next layer)
        shape = (C, 1, ch) + (1,) * (x.dim() - 2)
        out = torch.addcmul(b.view(shape), ctx.split(y), w.view(shape))
        return ctx.merge(out)


class ClientLayerNorm(ClientLayer):
    kind = "LayerNorm"

    def __init__(self, m: nn.LayerNorm):
        names = []
        if m.weight is not None:
            names.append("weight")
        if m.bias is not None:
            names.append("bias")
        super().__init__(names)
        self.shape, self.eps = tuple(m.normalized_shape), m.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pick(x)
        y = F.layer_norm(x, self.shape, None, None, self.eps)
        if not self.names:
            return y
        ctx, w, b = self.ctx, self.p("weight"), self.p("bias")
        C, f = ctx.count, math.prod(self.shape)
        ys = ctx.split(y.reshape(x.shape[0], -1, f))  # [C, B, M, F]
        if w is not None:
            ys = ys * w.view(C, 1, 1, f) if b is None else torch.addcmul(b.view(C, 1, 1, f), ys, w.view(C, 1, 1, f))
        else:
            ys = ys + b.view(C, 1, 1, f)  # type: ignore[union-attr]  # names holds "bias" when weight is None
        return ctx.merge(ys).reshape(x.shape)


class ClientEmbedding(ClientLayer):
    kind = "Embedding"

    def __init__(self, m: nn.Embedding):
        super().__init__(["weight"])
        self.vocab = m.num_embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.pick(idx)
        ctx, w = self.ctx, self.params["weight"]
        C = ctx.count
        client = ctx.merge(torch.arange(C, device=idx.device).view(C, 1).expand(C, ctx.batch))  # [N]
        offset = (client * self.vocab).view(-1, *([1] * (idx.dim() - 1)))
        return F.embedding(idx + offset, w.reshape(C * self.vocab, -1))
