"""The simulator's check of client updates before aggregation: a bad one is a logged dropout.

The same rule as the Flower strategies' reply check: an update is aggregated only if its weight
(the client's number of training samples) is an integer in [1, 2**53] and every tensor it carries
(model delta, control changes) is finite and shaped like the model. Anything else is left out
like a client that dropped out, and said so: a diverging client never turns the global model into
NaN, and the rest of the round goes on.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from .strategy import ClientUpdate

logger = logging.getLogger("fedopt_kernels.sim")
MAX_EXAMPLES = 2**53


def refusal(update: ClientUpdate, like: Sequence[torch.Tensor]) -> str:
    """Why ``update`` cannot be aggregated ("" when it can)."""
    w = update.weight
    if (
        isinstance(w, bool)
        or not isinstance(w, (int, float))
        or not math.isfinite(w)
        or w != int(w)
        or not 1 <= w <= MAX_EXAMPLES
    ):
        return f"weight (number of examples) must be an integer in [1, 2**53], got {w!r}"
    for k, v in update.scalars.items():  # a number the rule reads (FedNova's a_i)
        if not (math.isfinite(v) and v > 0):
            return f"{k} must be a finite number > 0, got {v!r}"
    parts = [("delta", update.delta)] + [(k, v) for k, v in update.extra.items() if isinstance(v, list)]
    for name, tensors in parts:
        if len(tensors) != len(like):
            return f"{name} has {len(tensors)} tensors, the model {len(like)}"
        for j, (t, ref) in enumerate(zip(tensors, like, strict=True)):
            if t.shape != ref.shape:
                return f"{name}[{j}] has shape {tuple(t.shape)}, the model {tuple(ref.shape)}"
            if not bool(torch.isfinite(t).all()):
                return f"{name}[{j}] holds non-finite values (NaN or inf)"
    return ""


def screen(update: ClientUpdate, like: Sequence[torch.Tensor], t: int) -> str:
    """Why ``update`` is left out of round ``t``'s aggregate, logged as a warning ("" when it is not)."""
    why = refusal(update, like)
    if why:
        logger.warning("round %d: left client %d out of the aggregate (a dropout): %s", t + 1, update.client_id, why)
    return why
