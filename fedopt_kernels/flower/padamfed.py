"""PAdaMFed on Flower: global momentum and control variate on the server, ``c_i`` on each client.

Before the first round every client computes its initial control (the mean of K stochastic
gradients at the initial model) in a ``"train.padamfed_init"`` message and keeps it; the server
averages the replies into ``c`` and ``m`` (``server_rules.padamfed_init``). Each round sends
``c`` and ``m`` with the model; the server step is ``server_rules.padamfed_step``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from flwr.serverapp import Grid

from ..server_rules import padamfed_init, padamfed_step
from ..sim.config import SimConfig
from .base import ClientResult, FedOptStrategy, check_count
from .records import Tensors, from_record, get_record, logger, to_record

INIT_MESSAGE_TYPE = f"{MessageType.TRAIN}.padamfed_init"


class PAdaMFedStrategy(FedOptStrategy):
    """PAdaMFed's server ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao; Alg. 1).

    With S accepted clients of N (``num_clients``), client lr eta, K local steps, server step gamma::

        x' = x + gamma * mean_i(y_i - x) / (eta * K)
        m' = beta * (sum_i dc_i / S + c) + (1 - beta) * m
        c' = c + sum_i dc_i / N                        (dc_i = c_i' - c_i, sent by client i)

    Built from a simulator config (algorithm "padamfed" or "padamfed-vr"); ``PAdaMFed`` is the
    keyword constructor with the theory step sizes as defaults.
    """

    server_rules = ("padamfed",)

    def __init__(self, cfg: SimConfig, **strategy_kw: Any):
        super().__init__(cfg, **strategy_kw)
        self.c: Tensors = []
        self.m: Tensors = []

    def _setup(self, grid: Grid, nodes: List[int], server_round: int, config: ConfigRecord) -> None:
        # every node, as the simulator initialises every training client
        self._sent[("init", server_round)] = list(nodes)
        content = RecordDict({"arrays": to_record(self.names, self.global_params),
                              "config": self._config(config, server_round)})
        replies = grid.send_and_receive(self._messages(content, nodes, INIT_MESSAGE_TYPE, server_round),
                                        timeout=self.timeout)

        def parse(reply: RecordDict, node: int) -> Tensors:
            return from_record(get_record(reply, "control", ArrayRecord, "reply"), self.names, self.global_params,
                               "control")

        controls = self._check_replies(replies, server_round, "init", parse)
        if controls:
            self.c, self.m = padamfed_init(controls, self.num_clients)
        else:
            logger.error("PAdaMFed initialisation: no usable client control; starting from c = m = 0")
            self.c = [torch.zeros_like(x) for x in self.global_params]
            self.m = [torch.zeros_like(x) for x in self.global_params]
        logger.info("PAdaMFed initialisation: c and m from %d of %d clients", len(controls), len(nodes))

    def _round_records(self) -> Dict[str, ArrayRecord]:
        return {"control": to_record(self.names, self.c), "momentum": to_record(self.names, self.m)}

    def _server_step(self, results: List[ClientResult]) -> Dict[str, Tensors]:
        x, c, m = padamfed_step(self.global_params, self.c, self.m, [r.delta for r in results],
                                [r.dc for r in results], num_clients=self.num_clients, lr=self.hp["lr"],
                                local_steps=self.cfg.local_steps, server_lr=self.hp["server_lr"],
                                beta=self.hp["beta"])
        return {"x": x, "c": c, "m": m}

    def _commit(self, state: Dict[str, Tensors]) -> None:
        super()._commit(state)
        self.c, self.m = state["c"], state["m"]

    def server_state(self) -> Dict[str, Tensors]:
        return {"c": self.c, "m": self.m}


class PAdaMFed(PAdaMFedStrategy):
    """PAdaMFed with its theory step sizes: ``theory_hparams(clients_per_round, local_steps, num_rounds)``
    gives eta (client ``lr``), gamma (``server_lr``) and ``beta`` unless they are given.

    ``variance_reduction=True`` is PAdaMFed-VR (each client step also takes the same mini-batch's
    gradient at the round's starting model). ``clients_per_round`` is also the number sampled.
    """

    def __init__(self, *, num_rounds: int, clients_per_round: int, local_steps: int = 10,
                 variance_reduction: bool = False, lr: Optional[float] = None, server_lr: Optional[float] = None,
                 beta: Optional[float] = None, **strategy_kw: Any):
        check_count("num_rounds", num_rounds, optional=False)
        check_count("clients_per_round", clients_per_round, optional=False)
        if "fraction_train" in strategy_kw:
            raise ValueError("PAdaMFed samples clients_per_round clients; fraction_train does not apply")
        algorithm = "padamfed-vr" if variance_reduction else "padamfed"
        cfg = SimConfig(algorithm=algorithm, rounds=num_rounds, clients=clients_per_round, holdout_fraction=0.0,
                        clients_per_round=clients_per_round, local_steps=local_steps, lr=lr, server_lr=server_lr,
                        beta=beta)
        super().__init__(cfg, clients_per_round=clients_per_round, **strategy_kw)
