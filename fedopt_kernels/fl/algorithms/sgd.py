"""What the SGD-family descriptors share (FedDecaySGD, NeuronLRSGD, FedDyn, FedSAM): their client side."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..algorithm import Algorithm, Variant
from ..server_rules import RULES


class SGDAlgorithm(Algorithm):
    """The client side of the SGD-family algorithms: ``clip_norm`` clips gradients before the step
    (the round's lr, ``lr * round_decay ** t``, is the optimizer's own: ``make`` passes
    ``round_decay``)."""

    def clip_norm(self, hp: Mapping[str, Any]) -> Optional[float]:
        return hp["clip_norm"]

    def state_copies(self, cfg: Any, variant: Variant) -> int:
        # momentum buffer, a correction from what the client keeps (SCAFFOLD), FedProx anchor
        return int(cfg.momentum != 0) + int(RULES[variant.server].keeps) + int(variant.prox)
