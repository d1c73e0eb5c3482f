"""The run's server optimizer, built from its settings (``--server-optimizer``; ``fl/server_step.py``).

One per run, over the global model's tensors, on the run's device: FedAvgM, FedAdam, FedYogi,
FedAdagrad or FedExP (the package's ``torch.optim`` classes), with the run's ``--backend``. Its state
(momentum, second moments, step count) lives beside the server rule's state: in the checkpoint
(``sim/resume.py``), in the ranks' agreement check (``sim/rank_round.py``) and in a Flower
strategy's checkpoint. ``sgd`` builds none: the rule's own ``x += server_lr * Δ``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..fl import server_step
from ..fl.server_step import ServerStep

CLASSES = {"avgm": "FedAvgM", "adam": "FedAdam", "yogi": "FedYogi", "adagrad": "FedAdagrad", "exp": "FedExP"}


def build(cfg: Any, x: Sequence[torch.Tensor], backend: str = "auto") -> ServerStep:
    """The server step of ``cfg`` (an ``FLConfig``) over the global model's tensors ``x`` (stepped in place)."""
    name = cfg.server_optimizer
    if name == "sgd":
        return ServerStep(name)
    from .. import __dict__ as package

    cls = package[CLASSES[name]]
    opt = cls(list(x), **server_step.optimizer_options(cfg), backend=backend)
    return ServerStep(name, opt, norms=name == "exp")
