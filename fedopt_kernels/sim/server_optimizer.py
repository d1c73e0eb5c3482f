"""The run's server optimizer, built from its settings (``--server-optimizer``; ``fl/server_step.py``).

One per run, over the global model's tensors, on the run's device: FedAvgM, FedAdam, FedYogi,
FedAdagrad or FedExP (the package's ``torch.optim`` classes). It runs on the run's ``--backend``
where that backend has the server optimizer's op, else on what ``auto`` picks for it (a server
step is one pass over the model per round). Its state (momentum, second moments, step count)
lives beside the server rule's state: in the checkpoint (``sim/resume.py``), in the ranks'
agreement check (``sim/rank_round.py``) and in a Flower strategy's checkpoint. ``sgd`` builds
none: the rule's own ``x += server_lr * Δ``.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Type

import torch

from .. import FedAdagrad, FedAdam, FedAvgM, FedExP, FedYogi
from ..core import registry
from ..core.optimizer import FedOptimizer
from ..fl import server_step
from ..fl.server_step import ServerStep

CLASSES: Dict[str, Type[FedOptimizer]] = {
    "avgm": FedAvgM,
    "adam": FedAdam,
    "yogi": FedYogi,
    "adagrad": FedAdagrad,
    "exp": FedExP,
}


def server_backend(cls: Type[FedOptimizer], backend: str, device: torch.device) -> str:
    """``backend`` where it runs ``cls``'s op on ``device``, else ``"auto"``."""
    if backend == "auto" or registry.unavailable_reason(backend, device, cls.op_spec().name) is None:
        return backend
    return "auto"


def build(cfg: Any, x: Sequence[torch.Tensor], backend: str = "auto") -> ServerStep:
    """The server step of ``cfg`` (an ``FLConfig``) over the global model's tensors ``x`` (stepped in place)."""
    name = cfg.server_optimizer
    if name == "sgd":
        return ServerStep(name)
    cls = CLASSES[name]
    params = list(x)
    chosen = server_backend(cls, backend, params[0].device)
    opt = cls(params, **server_step.optimizer_options(cfg), backend=chosen)
    return ServerStep(name, opt, norms=name == "exp")
