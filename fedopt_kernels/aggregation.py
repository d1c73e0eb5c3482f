"""Server rules as descriptors: what the server of an algorithm family keeps, sends and computes, and
what each client keeps between rounds.

A ``ServerRule`` is read by both front ends, the simulator's strategy and the Flower strategy, so
an algorithm's server is written once: its arithmetic is ``fedopt_kernels.server_rules`` (pure
functions on lists of tensors) and this module says how a round uses it:

* ``state``: server tensor lists besides the model (SCAFFOLD's ``c``), zero at the start unless
  the rule has an initial round (``init_controls``: PAdaMFed's clients compute their first
  controls before round 1, and the server averages them into ``c`` and ``m``);
* ``sent``: message record name -> state key, sent to the sampled clients with the model;
* ``keeps``: each client keeps one tensor list between rounds (SCAFFOLD's and PAdaMFed's ``c_i``,
  FedDyn's ``g_i``), zero (or None) before its first round;
* ``reply``: tensor lists a client's reply carries besides its model change ``delta`` ("dc": the
  change of its control).

Each rule registers itself by name (``RULES``); an algorithm's variants name the rule they use.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .server_rules import (padamfed_init, padamfed_step, scaffold_control_step, scaffold_local_control,
                           weighted_average_step)

Tensors = List[torch.Tensor]


class ServerRule:
    """FedAvg's server (the base every rule extends): ``x += server_lr * sum_i n_i delta_i / sum_i n_i``."""

    name = "avg"
    state: Tuple[str, ...] = ()
    sent: Mapping[str, str] = {}
    keeps = False
    reply: Tuple[str, ...] = ()
    init_controls = False

    def init_state(self, x: Sequence[torch.Tensor]) -> Dict[str, Tensors]:
        """The server tensors before the first round (before the initial round with ``init_controls``)."""
        return {key: [torch.zeros_like(v) for v in x] for key in self.state}

    def initial_state(self, controls: Sequence[Tensors], num_clients: int) -> Dict[str, Tensors]:
        """With ``init_controls``: the server state from the clients' first controls."""
        raise NotImplementedError

    # ------------------------------------------------------------------ client side
    def client_inputs(self, got: Mapping[str, Tensors], kept: Optional[Tensors], x: Tensors) -> Dict[str, Any]:
        """``start_round`` inputs from what the server sent (by state key), what the client kept (None
        before its first round) and the received model ``x``."""
        return {}

    def client_finish(self, opt: Any, algo: Any, hp: Mapping[str, Any], t: int, steps: int,
                      got: Mapping[str, Tensors], kept: Optional[Tensors],
                      delta: Tensors) -> Tuple[Optional[Tensors], Dict[str, Tensors]]:
        """After local training: the client's new kept tensors (None: nothing kept) and its reply tensors."""
        return None, {}

    # ------------------------------------------------------------------ server side
    def step(self, x: Tensors, state: Mapping[str, Tensors], deltas: Sequence[Tensors], weights: Sequence[float],
             replies: Sequence[Mapping[str, Tensors]], hp: Mapping[str, Any], num_clients: int,
             local_steps: int) -> Dict[str, Tensors]:
        """The new model ``"x"`` and server state from the accepted replies (in a fixed client order)."""
        return {"x": weighted_average_step(x, deltas, weights, hp["server_lr"])}


class Scaffold(ServerRule):
    """SCAFFOLD ("SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", Karimireddy,
    Kale, Mohri, Reddi, Stich, Suresh; ICML 2020), option II: the client trains with the correction
    ``c - c_i`` and sets ``c_i' = c_i - c + (x - y_i) / sum_k lr_k``; the server averages models like
    FedAvg and updates ``c += sum_i (c_i' - c_i) / N`` over all N clients."""

    name = "scaffold"
    state = ("c",)
    sent = {"control": "c"}
    keeps = True
    reply = ("dc",)

    def client_inputs(self, got, kept, x):
        c = got["c"]
        ci = kept if kept is not None else [torch.zeros_like(v) for v in c]
        return {"correction": [cj - cij for cj, cij in zip(c, ci)]}

    def client_finish(self, opt, algo, hp, t, steps, got, kept, delta):
        c = got["c"]
        ci = kept if kept is not None else [torch.zeros_like(v) for v in c]
        new_ci = scaffold_local_control(ci, c, delta, algo.lr_sum(opt, hp, t, steps))
        return new_ci, {"dc": [n - o for n, o in zip(new_ci, ci)]}

    def step(self, x, state, deltas, weights, replies, hp, num_clients, local_steps):
        out = super().step(x, state, deltas, weights, replies, hp, num_clients, local_steps)
        out["c"] = scaffold_control_step(state["c"], [r["dc"] for r in replies], num_clients)
        return out


class PAdaMFedRule(ServerRule):
    """PAdaMFed's server ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao; Alg. 1):
    global momentum ``m`` and control ``c`` (``server_rules.padamfed_step``); every client keeps its
    ``c_i`` and computes the first one before round 1 (``server_rules.padamfed_init``)."""

    name = "padamfed"
    state = ("c", "m")
    sent = {"control": "c", "momentum": "m"}
    keeps = True
    reply = ("dc",)
    init_controls = True

    def initial_state(self, controls: Sequence[Tensors], num_clients: int) -> Dict[str, Tensors]:
        """``c`` and ``m`` from the clients' first controls (the mean of K gradients at the initial model)."""
        c, m = padamfed_init(controls, num_clients)
        return {"c": c, "m": m}

    def client_inputs(self, got, kept, x):
        return {"global_control": got["c"], "local_control": kept, "momentum": got["m"]}

    def client_finish(self, opt, algo, hp, t, steps, got, kept, delta):
        new_ci = [v.to(d.dtype) for v, d in zip(opt.local_control(), delta)]
        ci = kept if kept is not None else [torch.zeros_like(d) for d in delta]
        return new_ci, {"dc": [n - o for n, o in zip(new_ci, ci)]}

    def step(self, x, state, deltas, weights, replies, hp, num_clients, local_steps):
        new_x, c, m = padamfed_step(x, state["c"], state["m"], deltas, [r["dc"] for r in replies],
                                    num_clients=num_clients, lr=hp["lr"], local_steps=local_steps,
                                    server_lr=hp["server_lr"], beta=hp["beta"])
        return {"x": new_x, "c": c, "m": m}


RULES: Dict[str, ServerRule] = {}


def register_rule(rule: ServerRule) -> ServerRule:
    """Add ``rule`` under ``rule.name`` (an algorithm's module registers a rule of its own with it)."""
    if rule.name in RULES:
        raise ValueError(f"server rule {rule.name!r} is registered twice")
    RULES[rule.name] = rule
    return rule


for _rule in (ServerRule(), Scaffold(), PAdaMFedRule()):
    register_rule(_rule)
