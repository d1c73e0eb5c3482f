"""The torch layers the layers engine computes (``layers.py``, ``lstm.py``), and in which configurations."""

from __future__ import annotations

from typing import Optional

from torch import nn

from .layers import ClientConv2d, ClientEmbedding, ClientGroupNorm, ClientLayer, ClientLayerNorm, ClientLinear
from .lstm import ClientLSTM


def client_layer(m: nn.Module) -> Optional[ClientLayer]:
    """The client layer of ``m``, or None if ``m`` is not a layer the layers engine computes."""
    maker = _MAKERS.get(type(m))
    return None if maker is None else maker(m)


def unsupported_reason(m: nn.Module) -> Optional[str]:
    """Why a layer of a client layer type cannot be computed in this configuration (None: it can)."""
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
    nn.Linear: ClientLinear,
    nn.Conv2d: ClientConv2d,
    nn.GroupNorm: ClientGroupNorm,
    nn.LayerNorm: ClientLayerNorm,
    nn.Embedding: ClientEmbedding,
    nn.LSTM: ClientLSTM,
}
CLIENT_LAYER_TYPES = tuple(_MAKERS)
