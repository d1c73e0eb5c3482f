"""The pointwise part of an LSTM time step, forward and backward written out (``bmm-fused`` and
``bmm-sequence``).

From the gate pre-activations ``z = x W_ih^T + h W_hh^T + b`` ([..., 4H], torch's order i, f, g, o)
and the previous cell state ``c'``::

    i, f, o = sigmoid(z_i), sigmoid(z_f), sigmoid(z_o)      g = tanh(z_g)
    c = f * c' + i * g                                      h = o * tanh(c)

Backward, from the gradients ``dh`` and ``dc`` reaching h and c, with the saved activations
(``sigmoid' = s (1 - s)``, ``tanh' = 1 - t^2``)::

    dc~  = dc + dh * o * (1 - tanh(c)^2)                    the gradient of c, both paths
    dz_i = dc~ * g * i (1 - i)        dz_f = dc~ * c' * f (1 - f)
    dz_g = dc~ * i * (1 - g^2)        dz_o = dh * tanh(c) * o (1 - o)
    dc'  = dc~ * f

Autograd's recording of the same step has about ten nodes (slices, two activations, products, sums),
each saving its own inputs; ``lstm_cell`` is one node that saves the four activations, ``c'`` and
``tanh(c)``. ``cell_forward`` and ``cell_backward`` are the two halves, shared with the whole
sequence's node (``lstm_sequence.py``).
"""

from __future__ import annotations

from typing import Tuple

import torch


def cell_forward(gates: torch.Tensor, c_prev: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(act, c, tanh(c))`` of one step: the activations ``[i, f, g, o]`` [..., 4H] and the new cell
    state; ``h = o * tanh(c)``."""
    H = c_prev.shape[-1]
    act = torch.sigmoid(gates)  # a new tensor: its g quarter is overwritten with tanh below
    act[..., 2 * H : 3 * H] = torch.tanh(gates[..., 2 * H : 3 * H])
    i, f, g, _ = act.split(H, dim=-1)
    c = torch.addcmul(f * c_prev, i, g)
    return act, c, torch.tanh(c)


def cell_backward(
    act: torch.Tensor, c_prev: torch.Tensor, tc: torch.Tensor, gh: torch.Tensor, gc: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dz, dc')`` of one step from the gradients ``gh``, ``gc`` reaching its h and c."""
    i, f, g, o = act.split(c_prev.shape[-1], dim=-1)
    dc = torch.addcmul(gc, gh * o, 1 - tc * tc)
    dz_i, dz_f = dc * g * i * (1 - i), dc * c_prev * f * (1 - f)
    dz = torch.cat((dz_i, dz_f, dc * i * (1 - g * g), gh * tc * o * (1 - o)), dim=-1)
    return dz, dc * f


def lstm_cell(gates: torch.Tensor, c_prev: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(h, c)`` of one step from the gate pre-activations ``gates`` [..., 4H] and ``c_prev`` [..., H]."""
    return _LSTMCell.apply(gates, c_prev)


class _LSTMCell(torch.autograd.Function):
    """The module docstring's step, its backward written out."""

    @staticmethod
    def forward(ctx, gates, c_prev):
        act, c, tc = cell_forward(gates, c_prev)
        ctx.save_for_backward(act, c_prev, tc)
        return act[..., 3 * c.shape[-1] :] * tc, c

    @staticmethod
    def backward(ctx, gh, gc):
        act, c_prev, tc = ctx.saved_tensors
        return cell_backward(act, c_prev, tc, gh, gc)
