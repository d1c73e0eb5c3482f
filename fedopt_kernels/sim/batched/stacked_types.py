"""The torch layers the stacked engine computes (``layers.py``, ``lstm.py``), and in which configurations."""

from __future__ import annotations

from typing import Optional

from torch import nn

from .layers import StackedConv2d, StackedEmbedding, StackedGroupNorm, StackedLayer, StackedLayerNorm, StackedLinear
from .lstm import StackedLSTM


def stacked_layer(m: nn.Module) -> Optional[StackedLayer]:
    """The client-stacked form of ``m``, or None if ``m`` is not a layer this module stacks."""
    maker = _MAKERS.get(type(m))
    return None if maker is None else maker(m)


def unsupported_reason(m: nn.Module) -> Optional[str]:
    """Why a layer of a stacked type cannot be stacked in this configuration (None: it can)."""
    if isinstance(m, nn.Conv2d) and m.padding_mode != "zeros":
        return f"Conv2d with padding_mode={m.padding_mode!r}"
    if isinstance(m, nn.Embedding) and (
        m.padding_idx is not None or m.max_norm is not None or m.scale_grad_by_freq or m.sparse
    ):
        return "Embedding with padding_idx, max_norm, scale_grad_by_freq or sparse"
    if isinstance(m, nn.LSTM) and (not m.batch_first or m.bidirectional or m.proj_size or m.dropout):
        return "LSTM other than batch_first=True, unidirectional, proj_size=0, dropout=0"
    return None


_MAKERS = {
    nn.Linear: StackedLinear,
    nn.Conv2d: StackedConv2d,
    nn.GroupNorm: StackedGroupNorm,
    nn.LayerNorm: StackedLayerNorm,
    nn.Embedding: StackedEmbedding,
    nn.LSTM: StackedLSTM,
}
STACKED_TYPES = tuple(_MAKERS)
