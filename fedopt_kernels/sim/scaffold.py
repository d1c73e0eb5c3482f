"""SCAFFOLD (Karimireddy et al. 2020) with control variates updated by its option II.

Client i trains with the correction ``c - c_i`` added to every gradient (``start_round(correction=)``)
and afterwards sets

    c_i+ = c_i - c + (x - y_i) / sum_k lr_k

where ``sum_k lr_k`` is the sum of the round's per-step learning rates (the paper's ``K * lr``; the
sum keeps it exact under FedDecay's within-round decay: without momentum, ``c_i+`` is then exactly
the lr-weighted mean of the round's gradients). The server averages models like FedAvg
(weighted by client size, server lr) and updates ``c += sum_{i in S} (c_i+ - c_i) / N`` over all N
training clients, so ``c`` stays the mean of the ``c_i`` under partial participation. Clients that
never trained hold ``c_i = 0``, as does ``c`` at the start. FedNAR-SCAFFOLD is the same with FedNAR
steps (see ``ClientOptimizers.lr_sum`` for its step-size sum). Both control rules are
``fedopt_kernels.server_rules`` functions, shared with the Flower strategies.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from ..server_rules import scaffold_control_step, scaffold_local_control
from .strategy import AvgStrategy, ClientUpdate, Tensors, clone_all, copy_into, zeros_like_all


class ScaffoldStrategy(AvgStrategy):
    def __init__(self, sim):
        super().__init__(sim)
        self.c: Tensors = zeros_like_all(sim.global_params)
        self.c_local: Dict[int, Tensors] = {}  # only clients that trained; the others are zero

    def server_state(self) -> Dict[str, Any]:
        return {"c": self.c, "c_local": self.c_local}

    def load_server_state(self, state: Dict[str, Any]) -> None:
        self.c = clone_all(state["c"])
        self.c_local = {i: clone_all(ci) for i, ci in state["c_local"].items()}

    def local_control(self, cid: int) -> Tensors:
        ci = self.c_local.get(cid)
        return ci if ci is not None else zeros_like_all(self.c)

    def round_inputs(self, cid: int, t: int) -> Dict[str, Any]:
        ci = self.local_control(cid)
        return {"correction": [c - c_i for c, c_i in zip(self.c, ci)]}

    @torch.no_grad()
    def finish(self, cid: int, opt: torch.optim.Optimizer, t: int) -> ClientUpdate:
        update = super().finish(cid, opt, t)
        lr_sum = self.opts.lr_sum(opt, t, self.sim.cfg.local_steps)
        ci = self.local_control(cid)
        new_ci = scaffold_local_control(ci, self.c, update.delta, lr_sum)
        update.extra["dc"] = [n - o for n, o in zip(new_ci, ci)]
        update.extra["new_ci"] = new_ci
        return update

    @torch.no_grad()
    def aggregate(self, updates: List[ClientUpdate], t: int) -> None:
        super().aggregate(updates, t)
        copy_into(self.c, scaffold_control_step(self.c, [u.extra["dc"] for u in updates],
                                                self.sim.cfg.num_train_clients))
        for u in updates:
            self.c_local[u.client_id] = u.extra["new_ci"]
