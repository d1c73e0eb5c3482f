"""The client layer of ``nn.LSTM``: its formulations (``layers.py``'s table).

``loop`` runs torch's fused LSTM kernel once per client with that client's weights (under a bfloat16
autocast in bfloat16: ``models/lstm_call.py``). ``bmm``,
``bmm-fused`` and ``bmm-sequence`` write torch's equations out for all clients at once: per layer
one batched matmul computes every time step's input part of the gates ``x_t W_ih^T + b_ih + b_hh``;
per time step one batched matmul adds ``h_{t-1} W_hh^T``, then the cell computes ``c_t`` and
``h_t``, as autograd's recording of the pointwise operations (``bmm``), as one autograd node per
step with a written-out backward (``bmm-fused``, ``lstm_cell.py``), or as one node for the whole
sequence whose backward forms ``W_hh``'s gradient in one batched matmul over all steps
(``bmm-sequence``, ``lstm_sequence.py``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from ..models.lstm_call import lstm_call
from .layers import ClientLayer, stack_merge
from .lstm_cell import lstm_cell
from .lstm_sequence import lstm_sequence


class ClientLSTM(ClientLayer):
    """``nn.LSTM(batch_first=True)``, unidirectional, no projection, no dropout between layers."""

    kind = "LSTM"

    def __init__(self, m: nn.LSTM):
        names = []
        for k in range(m.num_layers):
            names += [f"weight_ih_l{k}", f"weight_hh_l{k}"] + ([f"bias_ih_l{k}", f"bias_hh_l{k}"] if m.bias else [])
        super().__init__(names)
        self.layers, self.hidden, self.bias = m.num_layers, m.hidden_size, m.bias
        # the loop formulation runs its fused kernel with each client's weights (a list: not a submodule,
        # so its own parameters are not the client layer's)
        self.module = [m]

    def default_formulation(self, x: torch.Tensor) -> str:
        # CPU: one client's weights stay in cache across the time steps of its fused kernel
        return "loop" if x.device.type == "cpu" else "bmm"

    def forward(self, x: torch.Tensor, hx: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        if hx is not None:
            raise ValueError("ClientLSTM: an initial state (hx) is not supported; it starts from zeros")
        ctx = self.ctx
        if self.pick(x) == "loop":
            xs = ctx.split(x).unbind(0)
            per_client = zip(*[self.params[n].unbind(0) for n in self.names], strict=True)
            outs, hs, cs = [], [], []
            for xc, ps in zip(xs, per_client, strict=True):
                out, (h, cell) = lstm_call(self.module[0], xc, dict(zip(self.names, ps, strict=True)))
                outs.append(out)
                hs.append(h)
                cs.append(cell)
            return stack_merge(ctx, outs), (stack_merge(ctx, hs, 1), stack_merge(ctx, cs, 1))
        return self._recurrence(ctx.split(x), self.last_formulation)

    def _recurrence(self, seq: torch.Tensor, form: str):
        """``seq`` [C, B, T, I]: torch's LSTM equations (gates i, f, g, o), all clients per matmul; the
        cell's pointwise part written out (``bmm``), one autograd node per step (``bmm-fused``) or the
        whole sequence one node (``bmm-sequence``)."""
        ctx, H = self.ctx, self.hidden
        C, B, T = seq.shape[:3]
        h_last: List[torch.Tensor] = []
        c_last: List[torch.Tensor] = []
        for k in range(self.layers):
            w_ih, w_hh = self.params[f"weight_ih_l{k}"], self.params[f"weight_hh_l{k}"]
            flat = seq.reshape(C, B * T, -1)
            if self.bias:
                bias = (self.params[f"bias_ih_l{k}"] + self.params[f"bias_hh_l{k}"]).unsqueeze(1)
                gi = torch.baddbmm(bias, flat, w_ih.transpose(1, 2))
            else:
                gi = torch.bmm(flat, w_ih.transpose(1, 2))
            if form == "bmm-sequence":
                seq, h, cell = lstm_sequence(gi.view(C, B, T, 4 * H), w_hh.transpose(1, 2))
                h_last.append(h)
                c_last.append(cell)
                continue
            # unbind: one autograd node whose backward stacks the T step gradients (indexing gi[:, :, t]
            # would give each step's gradient as a zero-filled tensor of gi's full size, T of them)
            gis = gi.view(C, B, T, 4 * H).unbind(2)
            w_hh_t = w_hh.transpose(1, 2)
            h = seq.new_zeros(C, B, H)
            cell = seq.new_zeros(C, B, H)
            outs = []
            for t in range(T):
                if form == "bmm-fused":
                    # at t = 0 the state is zero: the gates are the input's part alone
                    h, cell = lstm_cell(gis[t] if t == 0 else torch.baddbmm(gis[t], h, w_hh_t), cell)
                    outs.append(h)
                    continue
                gates = torch.baddbmm(gis[t], h, w_hh_t)
                s = torch.sigmoid(gates)
                i, f, o = s[..., :H], s[..., H : 2 * H], s[..., 3 * H :]
                cell = torch.addcmul(f * cell, i, torch.tanh(gates[..., 2 * H : 3 * H]))
                h = o * torch.tanh(cell)
                outs.append(h)
            seq = torch.stack(outs, dim=2)
            h_last.append(h)
            c_last.append(cell)
        state = (torch.stack([ctx.merge(h) for h in h_last]), torch.stack([ctx.merge(c) for c in c_last]))
        return ctx.merge(seq), state
