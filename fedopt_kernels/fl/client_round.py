"""The client side of a round, shared by the simulator and the Flower clients: which optimizer a
client trains with, how its round starts, and how a model is scored.

ONE optimizer trains every client of a process in turn (``ClientOptimizers``), on the one model
object whose parameters the simulation overwrites with the global model before each client trains:
``start_round`` clears what a round keeps (momentum, anchors, controls) and takes the global round
index (FedNAR anneals its lr by it), so what a client's optimizer holds never depends on the
clients before it, and the population costs no optimizer state.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from .config import FLConfig

Optimizer = torch.optim.Optimizer


def advance_to_round(opt: Any, t: int, **round_inputs: Any) -> None:
    """Call ``start_round`` so that the round it starts has index ``t`` (the global round)."""
    opt.start_round(round_index=t, **round_inputs)


class ClientOptimizers:
    """Builds each client's optimizer on first use and starts its rounds, as the run's algorithm
    descriptor (``cfg.algo``, ``fedopt_kernels.fl.algorithm``) says."""

    def __init__(self, cfg: FLConfig, hp: Dict[str, Any], model: nn.Module, backend: str):
        self.cfg, self.hp, self.model, self.backend = cfg, hp, model, backend
        self.algo, self.variant = cfg.algo, cfg.variant
        self._opt: Optional[Optimizer] = None

    def get(self, cid: int) -> Optimizer:
        """The optimizer client ``cid`` trains with: the one every client shares (module docstring)."""
        if self._opt is None:
            self._opt = self._build()
        return self._opt

    def _build(self) -> Optimizer:
        return self.build_on(list(self.model.parameters()))

    def build_on(self, params: Sequence[torch.Tensor], batched: bool = False) -> Optimizer:
        """This run's client optimizer on ``params`` (its client-batched form with ``batched``)."""
        return self.algo.make(params, self.cfg, self.variant, self.hp, self.backend, batched=batched)

    def round_lr(self, t: int) -> Optional[float]:
        """The lr of round ``t`` the run sets on the optimizer (None: it anneals by itself)."""
        return self.algo.round_lr(self.hp, t)

    def set_round_lr(self, opt: Any, t: int) -> None:
        lr = self.round_lr(t)
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr

    def calibrate(self, client: Any) -> Dict[str, Any]:
        """Round inputs the client computes from the received model on its data (FedNLR's scales).

        ``client``: its training data (``train_x``, ``train_y``), or None where it has none to give."""
        data = None if client is None else [(client.train_x, client.train_y)]
        return self.algo.calibrate(self.model, data, self.cfg)

    def begin(self, cid: int, client: Any, t: int, **round_inputs: Any) -> Optimizer:
        """Start round ``t`` on client ``cid``'s optimizer (the model already holds the global weights)."""
        opt = self.get(cid)
        self.set_round_lr(opt, t)
        round_inputs.update(self.calibrate(client))
        advance_to_round(opt, t, **round_inputs)
        return opt

    def step(self, opt: Optimizer, recompute: Callable[[], Any], **step_inputs: Any) -> None:
        """One local step of ``opt`` as the algorithm takes it (``Algorithm.local_step``): ``recompute()``
        computes the loss and gradients again on the same batch (the closure of a step that takes
        two gradients), clipped like the first ones; ``step_inputs``: the step's keywords
        (PAdaMFed-VR's ``anchor_grads``)."""

        def again() -> Any:
            loss = recompute()
            self.clip()
            return loss

        self.algo.local_step(opt, again, **step_inputs)

    def clip(self) -> None:
        """Gradient clipping before the step where the algorithm has it (the SGD baselines with clip_norm)."""
        norm = self.algo.clip_norm(self.hp)
        if norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), norm)

    def lr_sum(self, opt: Optimizer, t: int, steps: int) -> float:
        """Sum of the nominal per-step learning rates of the round just trained (SCAFFOLD option II)."""
        return self.algo.lr_sum(opt, self.hp, t, steps)


_EVAL_CHUNK = 4096  # samples per forward pass when scoring (bounds memory on big splits)


@torch.no_grad()
def loss_and_correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, int]:
    """Summed cross-entropy and number of correct predictions of ``model`` on (x, y)."""
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, y.shape[0], _EVAL_CHUNK):
        out = model(x[i : i + _EVAL_CHUNK])
        yy = y[i : i + _EVAL_CHUNK]
        loss += float(F.cross_entropy(out, yy, reduction="sum"))
        correct += int((out.argmax(dim=1) == yy).sum())
    model.train(was_training)
    return loss, correct
