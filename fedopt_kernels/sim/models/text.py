"""Next-character models for Shakespeare: input ``[B, T]`` character indices, output ``[B, vocab]`` logits
for the character after the window.

- ``CharLSTM``: LEAF's model (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018):
  Embedding(8) -> 2-layer LSTM(256) -> Linear(vocab) on the last step. ``nn.LSTM`` runs one fused
  kernel that ``torch.func.vmap`` cannot batch over client copies; the client-batched simulator's
  layers engine (``sim.batched.layers_engine``) trains it.
- ``CharGRU``: the same shape with a GRU written in plain tensor ops (one matmul per gate block and
  step): the client-batched simulator trains it.
- ``CharTransformer``: a small causal pre-LayerNorm transformer in plain ops (FedNAR's Shakespeare
  model, Li et al., "FedNAR: Federated Optimization with Normalized Annealing Regularization",
  NeurIPS 2023, has 6 layers, 128-d embeddings, hidden 512; the default here is 2 layers of 64-d
  so that a CPU can train it), read out at the last position; no dropout (random masks would
  differ between the sequential and the client-batched run).

None has BatchNorm or buffers (the causal mask is built in ``forward``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .lstm_call import lstm_call


class CharLSTM(nn.Module):
    """Embedding(embed) -> LSTM(hidden, layers) -> Linear(vocab) of the last step's output."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, vocab: int, embed: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = lstm_call(self.lstm, self.embed(x))  # bfloat16, not float16, under a bf16 autocast
        return self.head(out[:, -1])


class _GRULayer(nn.Module):
    """``h_t = (1 - z) * n + z * h_{t-1}`` with ``r, z = sigmoid(W x + U h)``, ``n = tanh(W_n x + r * (U_n h))``
    (torch's GRU equations), unrolled in plain ops."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, inp: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.w_ih = nn.Linear(inp, 3 * hidden)
        self.w_hh = nn.Linear(hidden, 3 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gi = self.w_ih(x)  # all steps' input projections in one matmul: [B, T, 3H]
        h = x.new_zeros(x.shape[0], self.hidden)
        outs = []
        for t in range(x.shape[1]):
            gh = self.w_hh(h)
            i_r, i_z, i_n = gi[:, t].chunk(3, dim=-1)
            h_r, h_z, h_n = gh.chunk(3, dim=-1)
            r = torch.sigmoid(i_r + h_r)
            z = torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h = (1 - z) * n + z * h
            outs.append(h)
        return torch.stack(outs, dim=1)


class CharGRU(nn.Module):
    """Embedding(embed) -> ``layers`` GRU layers (hidden) in plain ops -> Linear(vocab) of the last step."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, vocab: int, embed: int = 8, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.layers = nn.ModuleList([_GRULayer(embed if i == 0 else hidden, hidden) for i in range(layers)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h[:, -1])


class _Block(nn.Module):
    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(self, dim: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.heads)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.ln2(x))


class CharTransformer(nn.Module):
    """Token + learned position embeddings (dim) -> ``layers`` causal pre-LN blocks (``heads`` heads,
    feed-forward ``4 * dim``) -> LayerNorm -> Linear(vocab) at the last position.

    ``context``: read only the last ``context`` characters of each window (attention costs grow with
    its square; None: the whole window)."""

    sample_wise = True  # forward treats dim 0 as independent samples (batched/layers_engine.py)

    def __init__(
        self, vocab: int, seq_len: int, dim: int = 64, layers: int = 2, heads: int = 4, context: Optional[int] = None
    ):
        super().__init__()
        self.context = context
        seq_len = min(seq_len, context or seq_len)
        if dim % heads:
            raise ValueError(f"char-transformer: the width ({dim}) must be a multiple of the {heads} heads")
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList([_Block(dim, heads, 4 * dim) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            x = x[:, -self.context :]
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h[:, -1]))
