"""The server-side rules several algorithms share (FedAvg's and SCAFFOLD's), as pure functions on
lists of tensors, and what every rule is (``ServerRule``). A rule that only one algorithm uses lives
with that algorithm's descriptor (``fl/algorithms/padamfed.py``, ``fl/algorithms/feddyn.py``) and
registers itself here.

One implementation of each rule, used by both front ends: the simulator's strategies
(``fedopt_kernels.sim``) and the Flower strategies (``fedopt_kernels.flower``). That is what lets
a Flower run reproduce a ``fedopt-sim`` run: the two differ in transport, never in arithmetic.

Every argument called ``x``, ``c``, ``m``, ``ci`` or an entry of ``deltas`` / ``dcs`` is a list
with one tensor per model parameter, in a fixed order. Nothing is modified in place: each function
returns new tensors. Client lists are summed in the order given, so a caller that sorts its clients
(the simulator sorts by client id) gets bit-reproducible results.

Beside each rule's arithmetic stands its descriptor, a ``ServerRule``: read by both front ends, so
an algorithm's server is written once, it says how a round uses the arithmetic:

* ``state``: server tensor lists besides the model (SCAFFOLD's ``c``), zero at the start unless
  the rule has an initial round (``init_controls``: PAdaMFed's clients compute their first
  controls before round 1, and the server averages them into ``c`` and ``m``);
* ``sent``: message record name -> state key, sent to the sampled clients with the model;
* ``keeps``: each client keeps one tensor list between rounds (SCAFFOLD's and PAdaMFed's ``c_i``,
  FedDyn's ``g_i``), zero (or None) before its first round;
* ``reply``: tensor lists a client's reply carries besides its model change ``delta`` ("dc": the
  change of its control); ``scalars``: numbers it carries (FedNova's ``nova_a``, ``fl/fednova.py``);
* ``takes_server_optimizer``: the model step may be a server optimizer's on the round's aggregate
  (``aggregate``, ``server_step.py``); False where the rule's server step is its own (PAdaMFed's).

Each rule is registered by name (``RULES``, ``register_rule``); an algorithm's variants name the rule they use.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .fold import Fold, finished, sum_dtype, weight_exponent

Tensors = List[torch.Tensor]

__all__ = [
    "weighted_average_step",
    "scaffold_local_control",
    "scaffold_control_step",
    "ServerRule",
    "ScaffoldRule",
    "RULES",
    "register_rule",
]


def check_like(name: str, tensors: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> None:
    if len(tensors) != len(ref):
        raise ValueError(f"{name} has {len(tensors)} tensors, expected {len(ref)} (one per parameter)")
    for j, (t, r) in enumerate(zip(tensors, ref, strict=True)):
        if tuple(t.shape) != tuple(r.shape):
            raise ValueError(f"{name}[{j}] has shape {tuple(t.shape)}, expected {tuple(r.shape)}")


def check_updates(name: str, updates: Sequence[Sequence[torch.Tensor]], ref: Sequence[torch.Tensor]) -> None:
    if len(updates) == 0:
        raise ValueError(f"{name} is empty: a server step needs at least one client update")
    for i, u in enumerate(updates):
        check_like(f"{name}[{i}]", u, ref)


@torch.no_grad()
def weighted_average_step(
    x: Sequence[torch.Tensor], deltas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], server_lr: float
) -> Tensors:
    """FedAvg's server step: ``x + server_lr * sum_i w_i * delta_i / sum_i w_i``.

    ``delta_i = y_i - x`` is client i's model minus the global one and ``w_i`` its weight (its
    number of training samples). With the matching client optimizer this is the server of FedAvg,
    FedSGD, FedDecay, FedProx, FedNLR, FedNAR and of SCAFFOLD's model update. The list form of
    ``ServerRule``'s fold (``fold.py``): the same operations, in the same order.
    """
    check_updates("deltas", deltas, x)
    if len(weights) != len(deltas):
        raise ValueError(f"weights has {len(weights)} entries for {len(deltas)} deltas")
    hp = {"server_lr": server_lr}
    fold = RULES["avg"].begin(list(x), {}, hp, len(deltas), 1, weight_exponent(weights))
    for d, w in zip(deltas, weights, strict=True):
        fold.add(d, w)
    return fold.finish()["x"]


@torch.no_grad()
def scaffold_local_control(
    ci: Sequence[torch.Tensor], c: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], lr_sum: float
) -> Tensors:
    """SCAFFOLD's new client control by option II of its control update: ``ci - c + (x - y_i) / lr_sum``.

    "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning" (Karimireddy, Kale, Mohri,
    Reddi, Stich, Suresh; ICML 2020).

    ``delta = y_i - x``; ``lr_sum`` is the sum of the round's per-step learning rates (the paper's
    ``K * lr``). With ``lr_sum <= 0`` nothing moved and option II is undefined: ``ci`` is kept.
    This runs on the client, but it is the rule the server's ``c`` update assumes, so it lives here.
    """
    check_like("c", c, ci)
    check_like("delta", delta, ci)
    if lr_sum > 0:
        return [c_i - cj - d / lr_sum for c_i, cj, d in zip(ci, c, delta, strict=True)]
    return [c_i.clone() for c_i in ci]


@torch.no_grad()
def scaffold_control_step(
    c: Sequence[torch.Tensor], dcs: Sequence[Sequence[torch.Tensor]], num_clients: int
) -> Tensors:
    """SCAFFOLD's server control: ``c + sum_{i in S} (ci' - ci) / N`` with N all training clients.

    Dividing by N (not by the S sampled clients) keeps ``c`` the mean of every client's control
    under partial participation (clients that never trained count with ``ci = 0``). The sum is
    formed first, then added to ``c`` (as ``ScaffoldRule``'s fold does).
    """
    check_updates("dcs", dcs, c)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    total = [torch.zeros_like(cj, dtype=sum_dtype(cj)) for cj in c]  # float64, rounded once (fold.py)
    for dc in dcs:
        for s, d in zip(total, dc, strict=True):
            s.add_(d, alpha=1.0 / num_clients)
    return _plus(c, total)  # added into a clone of c: the one rounding, into c's dtype


def _plus(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tensors:
    return [x.clone().add_(y) for x, y in zip(a, b, strict=True)]


# ---------------------------------------------------------------------------------------------- the rules
class ServerRule:
    """FedAvg's server (the base every rule extends): ``x += server_lr * sum_i n_i delta_i / sum_i n_i``."""

    name = "avg"
    state: Tuple[str, ...] = ()
    sent: Mapping[str, str] = {}
    keeps = False
    reply: Tuple[str, ...] = ()
    scalars: Tuple[str, ...] = ()  # numbers > 0 a client's reply carries besides its tensors (FedNova's a_i)
    init_controls = False
    takes_server_optimizer = True
    uneven = True  # takes clients whose local step counts differ (False: its step reads the one K)

    def init_state(self, x: Sequence[torch.Tensor]) -> Dict[str, Tensors]:
        """The server tensors before the first round (before the initial round with ``init_controls``)."""
        return {key: [torch.zeros_like(v) for v in x] for key in self.state}

    def initial_state(self, controls: Sequence[Tensors], num_clients: int) -> Dict[str, Tensors]:
        """With ``init_controls``: the server state from a list of the clients' first controls (the
        list form of ``initial_fold``)."""
        if len(controls) == 0:
            raise ValueError("controls is empty: the initial round needs at least one client")
        check_updates("controls", controls, controls[0])
        fold = self.initial_fold(list(controls[0]), num_clients)
        for ci in controls:
            fold.add(ci)
        return fold.finish()

    # ------------------------------------------------------------------ client side
    def client_inputs(self, got: Mapping[str, Tensors], kept: Optional[Tensors], x: Tensors) -> Dict[str, Any]:
        """``start_round`` inputs from what the server sent (by state key), what the client kept (None
        before its first round) and the received model ``x``."""
        return {}

    def client_finish(
        self,
        opt: Any,
        algo: Any,
        hp: Mapping[str, Any],
        t: int,
        steps: int,
        got: Mapping[str, Tensors],
        kept: Optional[Tensors],
        delta: Tensors,
    ) -> Tuple[Optional[Tensors], Dict[str, Any]]:
        """After local training: the client's new kept tensors (None: nothing kept) and its reply: tensor
        lists (``reply``) and numbers (``scalars``)."""
        return None, {}

    # ------------------------------------------------------------------ server side: a fold (fold.py)
    sums: Tuple[str, ...] = ("delta",)  # the running sums a round keeps, each shaped like the model

    def begin(
        self,
        x: Tensors,
        state: Mapping[str, Tensors],
        hp: Mapping[str, Any],
        num_clients: int,
        local_steps: int,
        exponent: int = 0,
    ) -> Fold:
        """A round's fold: zero sums, the model and state the round started from, the power of two
        its weights are divided by (``fold.weight_exponent`` of the round's weights)."""
        return Fold(self, x, state, hp, num_clients, local_steps, exponent)

    def add(self, fold: Fold, delta: Sequence[torch.Tensor], weight: float, reply: Mapping[str, Tensors]) -> None:
        """Add one accepted update to ``fold``'s sums (``Fold.add`` counts it)."""
        fold.accumulate("delta", delta, fold.scaled(weight))

    def finish(self, fold: Fold) -> Dict[str, Tensors]:
        """The new model ``"x"`` and server state from a fold's sums."""
        alpha = fold.hp["server_lr"] / fold.weight  # x + server_lr * (sum_i w_i delta_i) / sum_i w_i
        return {"x": [xj.clone().add_(s, alpha=alpha) for xj, s in zip(fold.x, fold.sums["delta"], strict=True)]}

    def aggregate(self, fold: Fold, new_x: Tensors) -> Tensors:
        """The round's aggregate ``Δ`` that a server optimizer steps on as ``g = -Δ`` (``server_step.py``),
        in the sums' dtype (unrounded): FedAvg's ``sum_i w_i delta_i / sum_i w_i``. ``new_x`` is what
        ``finish`` gave; a rule whose ``finish`` moves the model otherwise overrides this (FedDyn:
        ``new_x - x``)."""
        return [s / fold.weight for s in fold.sums["delta"]]

    def step(
        self,
        x: Tensors,
        state: Mapping[str, Tensors],
        deltas: Sequence[Tensors],
        weights: Sequence[float],
        replies: Sequence[Mapping[str, Any]],
        hp: Mapping[str, Any],
        num_clients: int,
        local_steps: int,
    ) -> Dict[str, Tensors]:
        """The fold over a list: the new model ``"x"`` and server state from the accepted replies (in
        a fixed client order)."""
        check_updates("deltas", deltas, x)
        if not len(weights) == len(replies) == len(deltas):
            raise ValueError(f"{len(deltas)} deltas, {len(weights)} weights and {len(replies)} replies")
        fold = self.begin(x, state, hp, num_clients, local_steps, weight_exponent(weights))
        for d, w, r in zip(deltas, weights, replies, strict=True):
            fold.add(d, w, r)
        return fold.finish()

    # the initial round (``init_controls``): every client's first control, folded as it is computed
    def initial_fold(self, x: Tensors, num_clients: int) -> InitialFold:
        return InitialFold(self, x, num_clients)

    def initial_finish(self, fold: InitialFold) -> Dict[str, Tensors]:
        """With ``init_controls``: the server state from the folded first controls."""
        raise NotImplementedError


class InitialFold:
    """The sum ``sum_i ci / N`` of the clients' first controls, added one by one as they are computed
    (client order); ``finish`` gives the server state (``ServerRule.initial_finish``)."""

    def __init__(self, rule: ServerRule, x: Tensors, num_clients: int):
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.rule, self.num_clients, self.x = rule, num_clients, x
        self.total = [torch.zeros_like(v, dtype=sum_dtype(v)) for v in x]  # rounded once, by finish
        self.count = 0

    def add(self, control: Sequence[torch.Tensor]) -> None:
        for s, t in zip(self.total, control, strict=True):
            s.add_(t, alpha=1.0 / self.num_clients)
        self.count += 1

    def merge(self, others: Sequence[InitialFold]) -> None:
        """Add other folds' sums in the order given (the ranks of one run)."""
        for other in others:
            for s, t in zip(self.total, other.total, strict=True):
                s.add_(t)
            self.count += other.count

    def finish(self) -> Dict[str, Tensors]:
        out = self.rule.initial_finish(self)
        return finished(out, {name: self.x for name in out})  # the server state is shaped like the model


class ScaffoldRule(ServerRule):
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
        return {"correction": [cj - cij for cj, cij in zip(c, ci, strict=True)]}

    def client_finish(self, opt, algo, hp, t, steps, got, kept, delta):
        c = got["c"]
        ci = kept if kept is not None else [torch.zeros_like(v) for v in c]
        new_ci = scaffold_local_control(ci, c, delta, algo.lr_sum(opt, hp, t, steps))
        return new_ci, {"dc": [n - o for n, o in zip(new_ci, ci, strict=True)]}

    sums = ("delta", "dc")

    def add(self, fold, delta, weight, reply):
        super().add(fold, delta, weight, reply)
        fold.accumulate("dc", reply["dc"], 1.0 / fold.num_clients)

    def finish(self, fold):
        out = super().finish(fold)
        out["c"] = _plus(fold.state["c"], fold.sums["dc"])  # scaffold_control_step's order
        return out


RULES: Dict[str, ServerRule] = {}


def register_rule(rule: ServerRule) -> ServerRule:
    """Add ``rule`` under ``rule.name`` (an algorithm's descriptor module registers a rule of its own with it)."""
    if rule.name in RULES:
        raise ValueError(f"server rule {rule.name!r} is registered twice")
    RULES[rule.name] = rule
    return rule


for _rule in (ServerRule(), ScaffoldRule()):
    register_rule(_rule)
