"""An FL algorithm on the round loop: its client round and its server rule, from their descriptors.

A round (``Simulation.run_round``): sample clients and ``begin_round`` (the server rule's fold,
``fedopt_kernels.fl.fold``); for each client, load the global model, ``begin`` the client's round,
take its steps with ``local_step``, ``finish`` into a ``ClientUpdate`` and ``add`` it to the fold
(its new kept state goes to the client-state store), then drop it; ``end_round`` puts the fold's
result into the global model and server state. A round's memory is the fold's sums, whatever its
number of clients. The client side is ``fedopt_kernels.fl.client_round.ClientRound``'s, the one
every engine runs (this module supplies the one model, the server state it sends and the store of
what clients keep); what differs between algorithms is in their descriptors
(``fedopt_kernels.fl.algorithm``, ``fedopt_kernels.fl.server_rules``), not here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, cast

import torch
from torch import nn
from torch.nn import functional as F

from ..fl.client_round import ClientRound
from ..fl.fold import Fold, weight_exponent
from ..fl.server_rules import RULES
from .batched.precision import autocast_scope, precision_scope
from .client_state import ClientState, Layout, entry_or_none
from .client_state_memory import MemoryClientState
from .config import SimConfig
from .data.clients import Batch, BatchStream, ClientData
from .round_result import not_finite
from .server_optimizer import build as build_server_step

Tensors = List[torch.Tensor]


class RoundHost(Protocol):
    """What a strategy (and the client-batched round) reads of the run that owns it: ``Simulation``
    is the one, and passes itself; named here by shape so that this module need not import it."""

    cfg: SimConfig
    hp: Dict[str, Any]
    device: torch.device
    backend: str
    model: nn.Module
    global_params: Tensors  # the server's model, one tensor per parameter
    strategy: Strategy

    @property
    def train_clients(self) -> List[ClientData]:
        """The training clients, by client id."""

    @property
    def streams(self) -> Mapping[int, BatchStream]:
        """Each training client's batches, by client id (``BatchStreams``)."""

    ranks: Any  # sim/ranks.py: the processes the run is split over

    @property
    def per_rank(self) -> int:
        """The most clients of a round one process trains."""

    def load_global(self) -> None:
        """Copy the global model into ``model``."""


@dataclass
class ClientUpdate:
    """What a client sends back: ``delta = y_i - x`` (its model minus the global one) and extras
    (the rule's reply tensors; ``"new_kept"``); ``scalars``: the per-client numbers of its
    ``LocalResult``."""

    client_id: int
    weight: float
    delta: Tensors
    extra: Dict[str, Any] = field(default_factory=dict)
    scalars: Dict[str, float] = field(default_factory=dict)


def zeros_like_all(tensors: Tensors) -> Tensors:
    return [torch.zeros_like(t) for t in tensors]


def clone_all(tensors: Tensors) -> Tensors:
    return [t.detach().clone() for t in tensors]


def copy_into(dst: Tensors, src: Tensors) -> None:
    """Overwrite ``dst``'s tensors in place: whoever holds them (the round loop, validation) sees the new values."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


class Strategy:
    """The round loop's algorithm: the run's client round (``ClientRound``, ``client``; its
    optimizers are ``opts``) and its server rule (``fedopt_kernels.fl.server_rules``).

    The server keeps the rule's state (SCAFFOLD's ``c``, PAdaMFed's ``c`` and ``m``, FedDyn's
    ``h``; readable as attributes, e.g. ``strategy.c``) and, for a rule whose clients keep tensors
    between rounds, each client's in the client-state store (``kept``, a mapping client id ->
    tensors; ``c_local`` is the same store; ``sim/client_state.py``): clients that never trained
    have none. With FedAvg's rule this is FedAvg, FedSGD, FedDecay, FedProx, FedNLR and FedNAR;
    with SCAFFOLD's, SCAFFOLD and FedNAR-SCAFFOLD; and so on for every registered variant. The
    model step is the run's server optimizer's (``server``, ``fl/server_step.py``; ``sgd``: the rule's).
    """

    def __init__(self, sim: RoundHost):
        self.sim = sim
        self.hp = sim.hp
        self.rule = RULES[sim.cfg.server_rule]
        self.client = ClientRound(sim.cfg, sim.hp, sim.model, sim.backend)
        self.opts = self.client.opts
        self.state: Dict[str, Tensors] = self.rule.init_state(sim.global_params)
        # the server optimizer on each round's aggregate (sgd: the rule's own step), over the global model
        self.server = build_server_step(sim.cfg, sim.global_params, sim.cfg.backend)
        # only clients that trained (or were initialised); Simulation may put a store in files here
        self.kept: ClientState = MemoryClientState(
            Layout(sim.global_params), sim.cfg.num_train_clients, sim.global_params[0].device
        )
        # steps that also take the same batch's gradient at the round's starting model (PAdaMFed-VR)
        self.anchor_model = copy.deepcopy(sim.model) if self.client.needs_anchor else None

    def __getattr__(self, name: str) -> Any:  # the rule's server tensors: strategy.c, strategy.m, ...
        state = self.__dict__.get("state", {})
        if name in state:
            return state[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def c_local(self) -> ClientState:
        return self.kept

    # ------------------------------------------------------------------ client side
    @torch.no_grad()
    def setup(self) -> None:
        """Once, before round 0, with the model holding the initial global weights."""
        ranks = self.sim.ranks
        if ranks.world == 1 or not self.rule.keeps:
            self.kept.start()
        else:  # one store for every rank: rank 0 starts it, the others join
            if ranks.main:
                self.kept.start()
            token = ranks.broadcast(getattr(self.kept, "token", None))
            if not ranks.main:
                cast(Any, self.kept).join(token)
        if self.rule.init_controls:
            # every training client: c_i from K stochastic gradients at the initial model (PAdaMFed
            # Alg. 1, line 1), into the store and the server's sum as it is computed; each rank a block
            n = self.sim.cfg.num_train_clients
            lo, hi = ranks.block(n)
            fold = self.rule.initial_fold(self.sim.global_params, n)
            for cid in range(lo, hi):
                ci = self._initial_control(cid)
                self.kept[cid] = ci
                fold.add(ci)
            if ranks.world > 1:
                others = [cid for cid in range(n) if not lo <= cid < hi]
                for cid in others:
                    self.sim.streams[cid].skip(self.client.initial_steps(cid))
                ranks.merge_initial(fold)
                self.kept.written_elsewhere(others)
            self.state = fold.finish()

    def _initial_control(self, cid: int) -> Tensors:
        stream = self.sim.streams[cid]
        params = list(self.sim.model.parameters())
        return self.client.initial_control(
            lambda: self.loss_and_grad(stream.next()), params, self.client.initial_steps(cid)
        )

    def _sent(self) -> Dict[str, Tensors]:
        return {key: self.state[key] for key in self.rule.sent.values()}

    def round_inputs(self, cid: int) -> Dict[str, Any]:
        """Client ``cid``'s ``start_round`` inputs (``ClientRound.inputs``) from the server state, what it
        kept and the global model (which the model holds: calibration reads it)."""
        return self.client.inputs(self._sent(), self._kept(cid), self.sim.global_params, self.sim.train_clients[cid])

    def begin(self, cid: int, t: int) -> torch.optim.Optimizer:
        """Start client ``cid``'s round ``t`` on the model (which holds the global weights); its optimizer."""
        sim = self.sim
        return self.client.begin(
            cid, t, self._sent(), self._kept(cid), sim.global_params, sim.train_clients[cid], self.anchor_model
        )

    def loss_and_grad(self, batch: Batch) -> torch.Tensor:
        """Forward/backward of one mini-batch on the local model, in the run's precision; returns the
        (detached) loss."""
        return self._forward_backward(self.sim.model, batch)

    def _forward_backward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x, y = batch
        precision, device = self.sim.cfg.precision, self.sim.device
        with precision_scope(precision, device):
            with autocast_scope(precision, device):  # the forward pass and the loss
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        return loss.detach()

    def _grads_at(self, model: nn.Module, batch: Batch) -> Tensors:
        self._forward_backward(model, batch)
        return [cast(torch.Tensor, p.grad) for p in model.parameters()]

    def local_step(self, cid: int, opt: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        """One local step of client ``cid`` on ``batch`` (``ClientRound.step``); returns its loss."""
        anchor = self.anchor_model
        # PAdaMFed-VR: the same batch's gradient at the round's starting model
        anchor_grads = None if anchor is None else (lambda: self._grads_at(anchor, batch))
        return self.client.step(opt, lambda: self.loss_and_grad(batch), anchor_grads)

    def train(self, cid: int, t: int) -> Tuple[ClientUpdate, float]:
        """Client ``cid``'s round ``t`` on the model: begin, its local steps, finish; the update and
        the mean loss."""
        opt = self.begin(cid, t)
        stream = self.sim.streams[cid]
        loss = self.client.train(
            lambda: self.local_step(cid, opt, stream.next()), self.client.steps(cid, t), self.sim.device
        )
        return self.finish(cid, opt, t), loss

    def finish(self, cid: int, opt: Any, t: int) -> ClientUpdate:
        """Client ``cid``'s update after round ``t`` (``ClientRound.finish``; the model holds its
        parameters); ``opt``: its optimizer, or what stands in for it (the client-batched round's
        view of one client of the batched optimizer)."""
        sim = self.sim
        steps = self.client.steps(cid, t)
        out = self.client.finish(
            opt, t, steps, sim.model.parameters(), sim.global_params, self._sent(), self._kept(cid)
        )
        update = ClientUpdate(cid, float(sim.train_clients[cid].size), out.delta, dict(out.reply), dict(out.scalars))
        if out.new_kept is not None:
            update.extra["new_kept"] = out.new_kept  # kept only if the server accepts the update
        return update

    def _kept(self, cid: int) -> Optional[Tensors]:
        """What client ``cid`` kept, on the run's device (None before its first round)."""
        return entry_or_none(self.kept, cid) if self.rule.keeps else None

    # ------------------------------------------------------------------ server side
    def server_state(self) -> Dict[str, Any]:
        """The server's tensors besides the global model (the rule's state, the server optimizer's as
        ``"server_optimizer"`` where the run has one, and a copy of what clients kept, ``{client id:
        tensors}``: every entry of the store read, for validation and tests)."""
        out: Dict[str, Any] = dict(self.state)
        if self.server.optimizer is not None:
            out["server_optimizer"] = self.server.tensors()
        if self.rule.keeps:
            out["kept"] = dict(self.kept.items())
        return out

    def load_server_state(self, state: Dict[str, Any]) -> None:
        """Overwrite the server state with (copies of) ``state`` from another run of the same config
        (after as many rounds)."""
        if self.server.optimizer is not None:
            self.server.load_tensors(state["server_optimizer"])
        self.state = {key: clone_all(state[key]) for key in self.state}
        if self.rule.keeps:
            self.kept.copy_from(state["kept"])

    def begin_round(self, sampled: Sequence[int], t: int) -> Fold:
        """Round ``t``'s fold over the ``sampled`` clients (in client-id order: deterministic sums)."""
        weights = [float(self.sim.train_clients[cid].size) for cid in sampled] or [1.0]  # none: Poisson
        fold = self.rule.begin(
            self.sim.global_params,
            self.state,
            self.hp,
            self.sim.cfg.num_train_clients,
            self.sim.cfg.local_steps,
            weight_exponent(weights),
        )
        return self.server.begin(fold)

    @torch.no_grad()
    def add(self, fold: Fold, update: ClientUpdate) -> None:
        """Fold an accepted update into the round; what the client keeps goes to the store now."""
        reply: Dict[str, Any] = dict(update.extra)
        reply.update(update.scalars)  # the rule's numbers (FedNova's a_i) beside its tensors
        fold.add(update.delta, update.weight, reply)
        self.keep(update)

    def keep(self, update: ClientUpdate) -> None:
        """What an accepted update's client keeps goes to the store now (``add``; the client-batched
        DP path, whose fold adds a chunk's sum at once)."""
        new_kept = update.extra.get("new_kept")
        if new_kept is not None:
            self.kept[update.client_id] = new_kept

    @torch.no_grad()
    def end_round(self, fold: Fold) -> Optional[str]:
        """The fold's new model and server state, in place (whoever holds the tensors sees them); the
        model through the server optimizer, which steps the global model's tensors themselves. When
        the result is not finite, nothing is changed (the server optimizer's state included) and the
        reason is returned (``round_result.py``)."""
        out = fold.finish()
        refused = not_finite(out)
        if refused is not None:
            return refused
        if self.server.optimizer is None:
            copy_into(self.sim.global_params, out.pop("x"))
        else:  # it steps in place: keep what a refused step must restore
            before = clone_all(self.sim.global_params), copy.deepcopy(self.server.state_dict())
            x = self.server.step(fold, out.pop("x"))
            if x is not self.server.x:
                copy_into(self.sim.global_params, x)
            refused = not_finite({"x": self.sim.global_params})
            if refused is not None:
                copy_into(self.sim.global_params, before[0])
                self.server.load_state_dict(before[1])
                return refused
        for key, value in out.items():
            copy_into(self.state[key], value)
        return None
