"""The ``im2col`` convolution of C clients: every client's patches unfolded, one batched matmul.

With ``g`` groups per client, ``L = Ho * Wo`` output positions per sample and ``K = Cin / g * kh * kw``
input values under the kernel of one group, client c's group j has a patch matrix ``P[c, j]``
``[B * L, K]`` (row: a sample's output position; ``F.unfold``) and a weight ``W[c, j]``
``[Cout / g, K]``, and for all ``C * g`` (client, group) pairs at once::

    y[c, j]  = P[c, j] @ W[c, j]^T + b[c, j]       one bmm: [C*g, B*L, K] x [C*g, K, Cout/g]
    dW[c, j] = dy[c, j]^T @ P[c, j]                one bmm (the weight's own layout)
    dP[c, j] = dy[c, j] @ W[c, j]                  one bmm, then dx = F.fold(dP)
    db[c, j] = sum over the B*L rows of dy[c, j]

C small convolutions become three large batched GEMMs (M = B * L rows per client). Building ``P``
is the one copy of the input side, in either sample order. In client order with ``g = 1`` the output
is the GEMM's result viewed as ``[N, Cout, Ho, Wo]`` (channels-last memory per sample), and a
channels-last output gradient is read as it is; in batch order each is copied once.

Memory: ``P`` holds ``kh * kw * Ho * Wo / (H * W)`` values per input value (about ``kh * kw / (sh * sw)``:
9x the input for a 3x3 kernel at stride 1) and is saved for the backward, which makes ``dP``, as
large again, before folding it: about ``2 * kh * kw / (sh * sw)`` times the input's bytes at the
peak of the backward, besides the output.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch.nn import functional as F

from .precision import autocast_inputs

Pair = Tuple[int, ...]  # (height, width)


def padding_sides(padding: Union[str, Pair], kernel: Pair, dilation: Pair) -> Tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` zero padding of ``F.conv2d``'s ``padding`` (numbers, 'same', 'valid').

    'same' pads ``d * (k - 1)`` in all, half before, the odd one after (as ``F.conv2d`` does)."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        sides = []
        for d, k in zip(dilation, kernel, strict=True):
            total = d * (k - 1)
            sides += [total // 2, total - total // 2]
        return (sides[0], sides[1], sides[2], sides[3])
    if isinstance(padding, str):
        raise ValueError(f"ClientConv2d: padding must be numbers, 'same' or 'valid', got {padding!r}")
    return (padding[0], padding[0], padding[1], padding[1])


def im2col_conv2d(
    x: torch.Tensor,
    w: torch.Tensor,
    b: Optional[torch.Tensor],
    clients: int,
    order: str,
    stride: Pair,
    padding: Union[str, Pair],
    dilation: Pair,
    groups: int,
) -> torch.Tensor:
    """Each client's convolution of its samples in ``x`` [C * B, Cin, H, W] (any memory format; sample order
    ``order``, ``layers.Clients``) with its ``w[c]`` ([C, Cout, Cin / groups, kh, kw]) and ``b[c]``:
    [C * B, Cout, Ho, Wo] in the same order."""
    kernel = (w.shape[-2], w.shape[-1])
    top, bottom, left, right = padding_sides(padding, kernel, dilation)
    if top != bottom or left != right:  # F.unfold pads symmetrically: pad the odd side first
        x = F.pad(x, (left, right, top, bottom))
        top = left = 0
    cx, cw, b = autocast_inputs(x, w, b)  # bf16: forward and backward in one dtype
    return _Im2colConv.apply(cx, cw, b, clients, order == "batch", stride, (top, left), dilation, groups)


def _client_major(t: torch.Tensor, C: int, B: int, batch_major: bool) -> torch.Tensor:
    """``[N, ...]`` -> ``[C, B, ...]`` (a view)."""
    return t.unflatten(0, (B, C)).transpose(0, 1) if batch_major else t.unflatten(0, (C, B))


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


class _Im2colConv(torch.autograd.Function):
    """The module docstring's three batched matmuls; saves the patches ``P``, not the input."""

    @staticmethod
    def forward(ctx, x, w, b, C: int, batch_major: bool, stride: Pair, padding: Pair, dilation: Pair, g: int):
        N, cin, H, W = x.shape
        B, cout, kh, kw = N // C, w.shape[1], w.shape[-2], w.shape[-1]
        sizes = zip((H, W), (kh, kw), stride, padding, dilation, strict=True)
        Ho, Wo = (_out_size(n, k, s, p, d) for n, k, s, p, d in sizes)
        L, K, co = Ho * Wo, cin // g * kh * kw, cout // g
        cols = F.unfold(x, (kh, kw), dilation, padding, stride)  # [N, g * K, L]
        # [C, B, g, K, L] -> [C*g, B*L, K]: the one copy, which also puts batch-major samples in client order
        P = _client_major(cols, C, B, batch_major).unflatten(2, (g, K)).permute(0, 2, 1, 4, 3).reshape(C * g, B * L, K)
        wm = w.reshape(C * g, co, K)
        wt = wm.transpose(1, 2)
        y = torch.bmm(P, wt) if b is None else torch.baddbmm(b.view(C * g, 1, co), P, wt)
        ctx.save_for_backward(P, w)
        ctx.conv = (C, B, batch_major, g, H, W, (kh, kw), stride, padding, dilation)
        ctx.has_bias = b is not None
        # [C*g, B*L, co] -> [C, B, g*co, Ho, Wo]: channels-last per sample, a view when g = 1 in client order
        y6 = y.view(C, g, B, Ho, Wo, co).permute(0, 2, 1, 5, 3, 4)
        return (y6.transpose(0, 1) if batch_major else y6).reshape(N, cout, Ho, Wo)

    @staticmethod
    def backward(ctx, gy):
        P, w = ctx.saved_tensors
        C, B, batch_major, g, H, W, kernel, stride, padding, dilation = ctx.conv
        cout, (Ho, Wo) = w.shape[1], gy.shape[-2:]
        L, K, co = Ho * Wo, P.shape[-1], w.shape[1] // g
        # [N, Cout, Ho, Wo] -> [C*g, B*L, co] (a view of a channels-last gradient when g = 1)
        gy5 = _client_major(gy.reshape(C * B, g, co, L), C, B, batch_major)
        g2 = gy5.permute(0, 2, 1, 4, 3).reshape(C * g, B * L, co)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gP = torch.bmm(g2, w.reshape(C * g, co, K))
            gc5 = gP.view(C, g, B, L, K).permute(0, 2, 1, 4, 3)  # [C, B, g, K, L]
            gcols = (gc5.transpose(0, 1) if batch_major else gc5).reshape(C * B, g * K, L)
            gx = F.fold(gcols, (H, W), kernel, dilation, padding, stride)
        if ctx.needs_input_grad[1]:
            gw = torch.bmm(g2.transpose(1, 2), P).view(w.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(1).view(C, cout)
        return gx, gw, gb, None, None, None, None, None, None
