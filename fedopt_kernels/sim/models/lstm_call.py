"""``nn.LSTM`` under a bfloat16 autocast in bfloat16, never float16 (``sim/batched/precision.py``, ``bf16``).

torch's autocast kernel for cuDNN's recurrent layers (``_cudnn_rnn``) casts the input, the state
and the weights to float16 whatever dtype the autocast was asked for, so under
``torch.autocast("cuda", dtype=torch.bfloat16)`` an ``nn.LSTM`` would compute in float16.
``lstm_call`` runs it with autocast off and its float32 input and weights cast to bfloat16 itself;
the casts are differentiable, so the gradients reach the float32 parameters as autocast's own
casts would deliver them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

# device types whose autocast casts cuDNN's recurrent layers to float16 whatever autocast's dtype
HALF_RNN_AUTOCAST: Tuple[str, ...] = ("cuda",)


def lstm_call(module: nn.Module, x: torch.Tensor, params: Optional[Dict[str, torch.Tensor]] = None) -> Any:
    """``module(x)`` for an ``nn.LSTM`` (with its own parameters, or ``params`` by name through
    ``torch.func.functional_call``): under a bfloat16 autocast on a device of ``HALF_RNN_AUTOCAST``,
    with autocast off and the float32 input and weights cast to bfloat16; elsewhere, and for a
    module that stands in for the LSTM (the client-batched engine's, which casts its own), plain."""
    kind = x.device.type
    cast = (
        isinstance(module, nn.RNNBase)
        and kind in HALF_RNN_AUTOCAST
        and torch.is_autocast_enabled(kind)
        and torch.get_autocast_dtype(kind) == torch.bfloat16
        and x.dtype == torch.float32
    )
    if not cast:
        return module(x) if params is None else functional_call(module, params, (x,))
    weights = dict(module.named_parameters()) if params is None else params
    with torch.autocast(kind, enabled=False):
        low = {n: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for n, t in weights.items()}
        return functional_call(module, low, (x.to(torch.bfloat16),))
