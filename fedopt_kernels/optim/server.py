"""What the server optimizers share: a ``FedOptimizer`` without rounds, stepping on ``p.grad = -Delta``.

A server optimizer treats a round's aggregate ``Delta`` (the weighted mean of the clients' updates
``y_i - x``) as the pseudo-gradient ``g = -Delta`` and takes one step on the global model per round
(Reddi et al., "Adaptive Federated Optimization", ICLR 2021). The caller writes ``p.grad = x - mean(y_i)``
and calls ``step()``; ``torch.optim.SGD(lr=1.0)`` on the same gradients is FedAvg.

They run on the package's plan and op machinery (backends, schemas, no host sync), which counts the
steps ``k`` of one round; a server optimizer has exactly one round, started at construction, so its
``k`` counts every server step (the bias correction's ``t = k + 1``). ``start_round`` is refused.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, NoReturn

from ..core.optimizer import FedOptimizer


class ServerOptimizer(FedOptimizer):
    """Base of FedAvgM, FedAdam, FedYogi, FedAdagrad and FedExP: one endless round, no round inputs.

    The step count (``k``, the state_dict's round entry) survives ``state_dict`` / ``load_state_dict``
    and copies; a state_dict of another class is refused."""

    _accepts_correction = False
    _state_keys: tuple = ()

    def __init__(self, params: Iterable, defaults: Dict[str, Any], backend: str = "auto"):
        super().__init__(params, defaults, backend)
        self._t = 0  # the one round: step() never starts another (which would restart k)

    def start_round(self, **inputs: Any) -> NoReturn:
        """Refused: a server optimizer steps once per FL round on the round's pseudo-gradient and keeps
        its state (momentum, moments, step count) across rounds."""
        raise TypeError(
            f"{type(self).__name__} is a server optimizer and has no start_round(): set p.grad to the "
            f"round's pseudo-gradient (x - the aggregate of the clients' models) and call step()"
        )
