"""The shared shape of an FL algorithm on the round loop, and its plainest instance: weighted averaging.

A round (``Simulation.run_round``): sample clients; for each, load the global model, ``begin`` the
client's round, take ``local_steps`` steps with ``local_step``, ``finish`` into a ``ClientUpdate``;
then ``aggregate`` the updates into the global model. Subclasses change only what differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List

import torch
from torch.nn import functional as F

from ..server_rules import weighted_average_step
from .clients import Batch
from .local import ClientOptimizers

if TYPE_CHECKING:  # pragma: no cover
    from .simulation import Simulation

Tensors = List[torch.Tensor]


@dataclass
class ClientUpdate:
    """What a client sends back: ``delta = y_i - x`` (its model minus the global one) and extras."""

    client_id: int
    weight: float
    delta: Tensors
    extra: Dict[str, Any] = field(default_factory=dict)


def zeros_like_all(tensors: Tensors) -> Tensors:
    return [torch.zeros_like(t) for t in tensors]


def clone_all(tensors: Tensors) -> Tensors:
    return [t.detach().clone() for t in tensors]


def copy_into(dst: Tensors, src: Tensors) -> None:
    """Overwrite ``dst``'s tensors in place: whoever holds them (the round loop, validation) sees the new values."""
    for d, s in zip(dst, src):
        d.copy_(s)


class AvgStrategy:
    """FedAvg's server: ``x += server_lr * sum_i n_i * delta_i / sum_i n_i`` over the sampled clients
    (``server_rules.weighted_average_step``, shared with the Flower strategies).

    With the client optimizer chosen by the algorithm this is FedAvg, FedSGD, FedDecay, FedProx,
    FedNLR and FedNAR (on FedAvg or FedProx).
    """

    def __init__(self, sim: "Simulation"):
        self.sim = sim
        self.hp = sim.hp
        self.opts = ClientOptimizers(sim.cfg, sim.hp, sim.model, sim.backend)

    # ------------------------------------------------------------------ client side
    def setup(self) -> None:
        """Once, before round 0, with the model holding the initial global weights."""

    def round_inputs(self, cid: int, t: int) -> Dict[str, Any]:
        """Extra ``start_round`` inputs for client ``cid`` (control variates, ...)."""
        return {}

    def begin(self, cid: int, t: int) -> torch.optim.Optimizer:
        return self.opts.begin(cid, self.sim.train_clients[cid], t, **self.round_inputs(cid, t))

    def loss_and_grad(self, batch: Batch) -> torch.Tensor:
        """Forward/backward of one mini-batch on the local model; returns the (detached) loss."""
        model = self.sim.model
        model.zero_grad(set_to_none=True)
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()

    def local_step(self, cid: int, opt: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        loss = self.loss_and_grad(batch)
        self.opts.clip()
        opt.step()
        return loss

    def finish(self, cid: int, opt: torch.optim.Optimizer, t: int) -> ClientUpdate:
        with torch.no_grad():
            delta = [p.detach() - g for p, g in zip(self.sim.model.parameters(), self.sim.global_params)]
        return ClientUpdate(cid, float(self.sim.train_clients[cid].size), delta)

    # ------------------------------------------------------------------ server side
    def server_state(self) -> Dict[str, Any]:
        """The server's tensors besides the global model (control variates, momentum, ...)."""
        return {}

    def load_server_state(self, state: Dict[str, Any]) -> None:
        """Overwrite the server state with (copies of) ``state`` from another run of the same config."""

    @torch.no_grad()
    def aggregate(self, updates: List[ClientUpdate], t: int) -> None:
        # updates come in sorted client-id order, so the sum is deterministic
        new_x = weighted_average_step(self.sim.global_params, [u.delta for u in updates],
                                      [u.weight for u in updates], self.hp["server_lr"])
        copy_into(self.sim.global_params, new_x)
