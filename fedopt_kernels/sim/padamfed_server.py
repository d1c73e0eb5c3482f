"""PAdaMFed's server: control variates and global momentum (docs/algorithms.md; "Problem-Parameter-Free Federated
Learning", Yan, Zhang, Wang, Cao: Alg. 1).

With S clients sampled out of the N training clients, client lr ``eta`` and K local steps::

    x'  = x - gamma * mean_{i in S}(x - y_i) / (eta * K)      (plain mean: the paper's 1/S)
    dc  = sum_{i in S} (c_i' - c_i)
    m'  = beta * (dc / S + c) + (1 - beta) * m
    c'  = c + dc / N
    init: c_i = mean of K stochastic gradients at x0 (every training client), c = mean_i c_i, m = c

Each client starts its round with ``start_round(global_control=c, local_control=c_i, momentum=m)``
and returns ``c_i' = local_control()``. The VR variant also needs, at every step, the gradient of the
same mini-batch at the round's starting model (a second copy of the model holds it). The server
rules are ``server_rules.padamfed_init`` and ``padamfed_step``, shared with the Flower strategy.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
from torch.nn import functional as F

from .clients import Batch
from ..server_rules import padamfed_init, padamfed_step
from .strategy import AvgStrategy, ClientUpdate, Tensors, clone_all, copy_into


class PAdaMFedStrategy(AvgStrategy):
    def __init__(self, sim):
        super().__init__(sim)
        self.vr = sim.cfg.algorithm.endswith("-vr")
        self.anchor_model = copy.deepcopy(sim.model) if self.vr else None
        self.c: Tensors = []
        self.m: Tensors = []
        self.c_local: Dict[int, Tensors] = {}

    @torch.no_grad()
    def _mean_grad(self, cid: int) -> Tensors:
        stream = self.sim.streams[cid]
        acc = [torch.zeros_like(x) for x in self.sim.global_params]
        K = self.sim.cfg.local_steps
        for _ in range(K):
            with torch.enable_grad():
                self.loss_and_grad(stream.next())
            for a, p in zip(acc, self.sim.model.parameters()):
                a.add_(p.grad)
        return [a / K for a in acc]

    @torch.no_grad()
    def setup(self) -> None:
        # Alg. 1 line 1: c_i from K stochastic gradients at x0 for every client; c = mean; m = c
        n = self.sim.cfg.num_train_clients
        for cid in range(n):
            self.c_local[cid] = self._mean_grad(cid)
        self.c, self.m = padamfed_init([self.c_local[cid] for cid in range(n)], n)

    def server_state(self) -> Dict[str, Any]:
        return {"c": self.c, "m": self.m, "c_local": self.c_local}

    def load_server_state(self, state: Dict[str, Any]) -> None:
        self.c, self.m = clone_all(state["c"]), clone_all(state["m"])
        self.c_local = {i: clone_all(ci) for i, ci in state["c_local"].items()}

    def round_inputs(self, cid: int, t: int) -> Dict[str, Any]:
        if self.vr:
            with torch.no_grad():
                for a, g in zip(self.anchor_model.parameters(), self.sim.global_params):
                    a.copy_(g)
        return {"global_control": self.c, "local_control": self.c_local[cid], "momentum": self.m}

    def local_step(self, cid: int, opt: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        loss = self.loss_and_grad(batch)
        if not self.vr:
            opt.step()
            return loss
        self.anchor_model.zero_grad(set_to_none=True)
        x, y = batch
        F.cross_entropy(self.anchor_model(x), y).backward()
        opt.step(anchor_grads=[p.grad for p in self.anchor_model.parameters()])
        return loss

    @torch.no_grad()
    def finish(self, cid: int, opt: torch.optim.Optimizer, t: int) -> ClientUpdate:
        update = super().finish(cid, opt, t)
        new_ci = [c.to(x.dtype) for c, x in zip(opt.local_control(), self.sim.global_params)]
        update.extra["dc"] = [n - o for n, o in zip(new_ci, self.c_local[cid])]
        update.extra["new_ci"] = new_ci
        return update

    @torch.no_grad()
    def aggregate(self, updates: List[ClientUpdate], t: int) -> None:
        new_x, new_c, new_m = padamfed_step(
            self.sim.global_params, self.c, self.m, [u.delta for u in updates], [u.extra["dc"] for u in updates],
            num_clients=self.sim.cfg.num_train_clients, lr=self.hp["lr"], local_steps=self.sim.cfg.local_steps,
            server_lr=self.hp["server_lr"], beta=self.hp["beta"])
        copy_into(self.sim.global_params, new_x)
        copy_into(self.c, new_c)
        copy_into(self.m, new_m)
        for u in updates:
            self.c_local[u.client_id] = u.extra["new_ci"]
