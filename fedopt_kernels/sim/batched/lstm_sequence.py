"""One LSTM layer's recurrence over the whole sequence as one autograd node (``bmm-sequence``).

Per time step the forward is what ``bmm-fused`` computes: one batched matmul for all clients,
``z_t = gi_t + h_{t-1} W_hh^T`` (``gi``: the input part of every step, one matmul beforehand), then
the cell (``lstm_cell.cell_forward``). What differs is the backward. Autograd's recording of the
step-by-step forward differentiates each step's matmul on its own, so ``W_hh``'s gradient is made
as T partial ``[C, H, 4H]`` products, each added to the last: T passes over a tensor as large as
the clients' recurrent weights, for products of only B rows each. Here the backward walks the
steps in reverse with the cell's written-out backward (``lstm_cell.cell_backward``) and
``dh_{t-1} = dz_t W_hh``, keeps every ``dz_t``, and then forms the weight's gradient once::

    dW_hh^T = sum_t h_{t-1}^T dz_t = [h_0 .. h_{T-2}]^T [dz_1 .. dz_{T-1}]

one batched matmul of ``B * (T - 1)`` rows per client (as cuDNN's LSTM does). ``dgi = dz`` goes
back through the input matmul, which autograd differentiates once for all steps already. Saved:
the activations, the cell states and ``tanh(c)`` of every step, and the outputs ``h``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .lstm_cell import cell_backward, cell_forward
from .precision import autocast_inputs


def lstm_sequence(gi: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hs, h_T, c_T)`` of one layer from zero state: ``gi`` [C, B, T, 4H] the input part of every
    step's gates (biases included), ``w`` [C, H, 4H] each client's ``W_hh^T``; ``hs`` [C, B, T, H]."""
    cgi, cw = autocast_inputs(gi, w)  # bf16: forward and backward in one dtype
    return _LSTMSequence.apply(cgi, cw)


class _LSTMSequence(torch.autograd.Function):
    """The module docstring's recurrence, its backward written out."""

    @staticmethod
    def forward(ctx, gi, w):
        C, B, T, H4 = gi.shape
        H = H4 // 4
        # every step's tensors kept client-major, as gi: the weight's gradient then reads them as
        # [C, B * T, .] matrices without a copy
        acts = gi.new_empty(C, B, T, H4)
        cs = gi.new_empty(C, B, T + 1, H)  # cs[:, :, t]: the cell state before step t (zero at t = 0)
        tcs = gi.new_empty(C, B, T, H)
        hs = gi.new_empty(C, B, T, H)
        cs[:, :, 0].zero_()
        h = c = gi.new_zeros(C, B, H)
        for t in range(T):
            # at t = 0 the state is zero: the gates are the input's part alone
            z = gi[:, :, t] if t == 0 else torch.baddbmm(gi[:, :, t], h, w)
            act, c, tc = cell_forward(z, c)
            h = act[..., 3 * H :] * tc
            acts[:, :, t], cs[:, :, t + 1], tcs[:, :, t], hs[:, :, t] = act, c, tc, h
        ctx.save_for_backward(acts, cs, tcs, hs, w)
        return hs, h, c

    @staticmethod
    def backward(ctx, g_hs: Optional[torch.Tensor], g_h: Optional[torch.Tensor], g_c: Optional[torch.Tensor]):
        acts, cs, tcs, hs, w = ctx.saved_tensors
        C, B, T, H4 = acts.shape
        H = H4 // 4
        dz_all = torch.empty_like(acts)
        dh = g_h if g_h is not None else acts.new_zeros(C, B, H)
        dc = g_c if g_c is not None else acts.new_zeros(C, B, H)
        w_t = w.transpose(1, 2)
        for t in reversed(range(T)):
            gh = dh if g_hs is None else dh + g_hs[:, :, t]
            dz, dc = cell_backward(acts[:, :, t], cs[:, :, t], tcs[:, :, t], gh, dc)
            dz_all[:, :, t] = dz
            if t > 0:
                dh = torch.bmm(dz, w_t)
        dw = None
        if ctx.needs_input_grad[1]:
            if T > 1:
                h_prev = hs[:, :, :-1].reshape(C, B * (T - 1), H)
                dw = torch.bmm(h_prev.transpose(1, 2), dz_all[:, :, 1:].reshape(C, B * (T - 1), H4))
            else:
                dw = torch.zeros_like(w)
        return dz_all, dw
