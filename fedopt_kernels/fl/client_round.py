"""The client side of a round, written once for every engine: the simulator's sequential loop,
its client-batched engine and the Flower client each supply only where the steps run.

``ClientRound`` owns the protocol of one client's round on the run's algorithm (its descriptor,
``fedopt_kernels.fl.algorithm``, and its server rule, ``fedopt_kernels.fl.server_rules``)::

    K_i     = steps(i, t)                                  the one place a client's step count comes from
    inputs  = rule.client_inputs(sent, kept_i, x)          + the algorithm's calibration on the received
                                                             model (FedNLR's neuron scales)
    begin:    start_round(round_index=t, **inputs) (ClientOptimizers.start, for every engine: the
              optimizer decays its own lr by the round index, ``lr * round_decay ** t``)
    step:     g = grads(); clip; H = anchor grads (PAdaMFed-VR); Algorithm.local_step(opt, recompute)
              (FedSAM's closure recomputes g, clipped, at the moved parameters), K_i times
    finish:   end_round; delta = y - x; rule.client_finish -> new kept tensors, reply tensors, and
              per-client scalars for the server (``LocalResult``)
    initial_control: c_i = mean of K gradients at the initial model (PAdaMFed's initial round)

What an engine supplies: the forward/backward of a batch (``grads``), how gradients are clipped
where there are several clients at once (``clip``), and where what it sent, kept and received
lives. The sequential loop (``sim/strategy.py``) and the Flower client (``flower/client.py``) run
it on one model (``begin``, ``train``, ``finish``); the client-batched engine
(``sim/batched_round.py``) runs a chunk of stacked clients: their ``inputs`` stacked, one ``start``,
``take_step`` on the batched optimizer (also the step its CUDA-graph replay captures), ``end``
once, and ``finish`` for each client through a one-client view of the batched optimizer. A
per-client feature added here (a step count in ``steps``, a transform of the reply or a scalar in
``finish``) reaches all three.

ONE optimizer trains every client of a process in turn (``ClientOptimizers``), on the one model
object whose parameters the simulation overwrites with the global model before each client trains:
``start_round`` clears what a round keeps (momentum, anchors, controls) and takes the global round
index (every optimizer decays its lr by it), so what a client's optimizer holds never depends on the
clients before it, and the population costs no optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, cast

import torch
from torch import nn
from torch.nn import functional as F

from .algorithm import Algorithm, end_round
from .config import FLConfig
from .server_rules import RULES
from .work import WorkPlan

Optimizer = torch.optim.Optimizer
Tensors = List[torch.Tensor]


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

    def calibrate(self, client: Any) -> Dict[str, Any]:
        """Round inputs the client computes from the received model on its data (FedNLR's scales).

        ``client``: its training data (``train_x``, ``train_y``), or None where it has none to give."""
        data = None if client is None else [(client.train_x, client.train_y)]
        return self.algo.calibrate(self.model, data, self.cfg)

    def start(self, opt: Any, t: int, start: Optional[Callable[..., None]] = None, **round_inputs: Any) -> None:
        """Start round ``t`` on ``opt`` (one client's optimizer or a chunk's client-batched one):
        ``start_round(round_index=t, **round_inputs)`` (through ``start`` where the engine wraps it);
        the optimizer decays its lr by the round index itself (``round_decay``). Every engine starts a
        round here, and only here."""
        if start is None:
            advance_to_round(opt, t, **round_inputs)
        else:
            start(round_index=t, **round_inputs)

    def begin(self, cid: int, client: Any, t: int, **round_inputs: Any) -> Optimizer:
        """Start round ``t`` on client ``cid``'s optimizer (the model already holds the global weights):
        ``round_inputs`` plus the calibration on ``client``'s data (``calibrate``), then ``start``."""
        opt = self.get(cid)
        round_inputs.update(self.calibrate(client))
        self.start(opt, t, **round_inputs)
        return opt

    def clip(self) -> None:
        """Gradient clipping before the step where the algorithm has it (the SGD baselines with clip_norm)."""
        norm = self.algo.clip_norm(self.hp)
        if norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), norm)

    def lr_sum(self, opt: Optimizer, t: int, steps: int) -> float:
        """Sum of the nominal per-step learning rates of the round just trained (SCAFFOLD option II)."""
        return self.algo.lr_sum(opt, self.hp, t, steps)


def take_step(
    algo: Algorithm,
    opt: Any,
    grads: Callable[[], Any],
    clip: Callable[[], None],
    anchor_grads: Optional[Callable[[], Sequence[torch.Tensor]]] = None,
    **step_inputs: Any,
) -> Any:
    """One local step of ``opt`` as algorithm ``algo`` takes it, on any engine; returns the loss
    ``grads()`` returned.

    ``grads()``: the engine's forward/backward of the step's batch, gradients into ``p.grad``;
    ``clip()``: clips them where the algorithm clips (a no-op elsewhere); ``anchor_grads()``: the
    same batch's gradients at the round's starting model (PAdaMFed-VR's ``anchor_grads``);
    ``step_inputs``: the step's other keywords (a client-batched step's ``active``). A step that
    takes two gradients (FedSAM, ``Algorithm.closure_step``) calls ``grads`` again, clipped, at the
    parameters its first part moved to (``Algorithm.local_step``'s ``recompute``).
    """
    loss = grads()
    clip()
    if anchor_grads is not None:
        step_inputs["anchor_grads"] = list(anchor_grads())

    def recompute() -> Any:
        again = grads()
        clip()
        return again

    algo.local_step(opt, recompute, **step_inputs)
    return loss


@dataclass
class LocalResult:
    """What one client's round gives the server (``ClientRound.finish``).

    ``delta``: ``y_i - x``, its model minus the received one; ``reply``: the server rule's reply
    tensors (``"dc"``: the change of its control variate); ``new_kept``: what it keeps for its next
    round, stored only once the server accepts the update (None: nothing kept); ``scalars``:
    per-client numbers the server needs besides the tensors (the rule's ``scalars``: FedNova's
    ``nova_a``; the place for a reply's norm, FedExP's ``||delta||^2``).
    """

    delta: Tensors
    reply: Dict[str, Tensors]
    new_kept: Optional[Tensors]
    scalars: Dict[str, float] = field(default_factory=dict)


class ClientRound:
    """The client side of a round of the run's algorithm (module docstring), for every engine.

    ``cfg``, ``hp``: the run's settings and hyperparameters; ``model``: the one model the
    sequential and Flower engines train on (the client-batched engine calibrates on it);
    ``backend``: the optimizers' backend. ``opts`` (``ClientOptimizers``), ``rule`` (the server
    rule), ``algo`` (the algorithm's descriptor) and ``needs_anchor`` are read by the engines.
    """

    def __init__(self, cfg: FLConfig, hp: Dict[str, Any], model: nn.Module, backend: str):
        self.cfg, self.hp = cfg, hp
        self.opts = ClientOptimizers(cfg, hp, model, backend)
        self.algo = self.opts.algo
        self.rule = RULES[cfg.server_rule]
        self.needs_anchor = self.algo.needs_anchor(cfg.variant)
        self.work: Optional[WorkPlan] = None  # the run's plan of work (the simulator's; ``max_steps``)
        self._plan: Tuple[int, Dict[Optional[int], int]] = (-1, {})  # (round, each client's steps)

    # ------------------------------------------------------------------ how much work a client does
    def plan(self, t: int, steps: Mapping[Any, int]) -> None:
        """Round ``t``'s step count of each client (``fl/work.py``: the simulator's ``WorkPlan``, a
        Flower client's own count); ``steps`` reads it."""
        self._plan = (t, dict(steps))

    def steps(self, cid: Optional[int], t: int) -> int:
        """K_i: the local steps client ``cid`` takes in round ``t`` (``cid`` None: a Flower client that
        does not know its id). Every engine reads a client's step count here: the sequential loop
        and the Flower client take that many steps, the client-batched engine runs a chunk for its
        largest and would mask each client's later steps off with the per-step ``active`` mask
        where they differ; ``finish`` hands it to the server rule (SCAFFOLD's lr sum). The round's
        ``plan``, or ``cfg.local_steps`` for a client it does not name."""
        t_plan, steps = self._plan
        return steps.get(cid, self.cfg.local_steps) if t_plan == t else self.cfg.local_steps

    def initial_steps(self, cid: Optional[int]) -> int:
        """K of client ``cid``'s initial control (``initial_control``): ``cfg.local_steps``."""
        return self.cfg.local_steps

    @property
    def max_steps(self) -> int:
        """The most local steps any client takes in a round (what a client-batched trainer is sized for)."""
        return self.cfg.local_steps if self.work is None else self.work.most()

    @property
    def clip_norm(self) -> Optional[float]:
        """The gradient clipping norm before each step (``Algorithm.clip_norm``), or None."""
        return self.algo.clip_norm(self.hp)

    # ------------------------------------------------------------------ begin
    def inputs(self, got: Mapping[str, Tensors], kept: Optional[Tensors], x: Tensors, data: Any) -> Dict[str, Any]:
        """One client's ``start_round`` inputs: the rule's, from what the server sent (``got``, by
        state key), what the client kept (None before its first round) and the received model
        ``x``, plus the algorithm's calibration on ``data`` (``ClientOptimizers.calibrate``; the
        model must hold ``x``)."""
        inputs = dict(self.rule.client_inputs(got, kept, x))
        inputs.update(self.opts.calibrate(data))
        return inputs

    def begin(
        self,
        cid: int,
        t: int,
        got: Mapping[str, Tensors],
        kept: Optional[Tensors],
        x: Tensors,
        data: Any,
        anchor: Optional[nn.Module] = None,
    ) -> Optimizer:
        """Start round ``t`` of client ``cid`` on the one model (it holds ``x``): ``anchor`` (the copy
        of the model PAdaMFed-VR's anchor gradients are taken on) is set to ``x``, and the client's
        optimizer starts with its ``inputs`` (``ClientOptimizers.begin``); returns the optimizer."""
        if anchor is not None:
            with torch.no_grad():
                for a, g in zip(anchor.parameters(), x, strict=True):
                    a.copy_(g)
        return self.opts.begin(cid, data, t, **self.rule.client_inputs(got, kept, x))

    def start(self, opt: Any, t: int, inputs: Dict[str, Any], start: Optional[Callable[..., None]] = None) -> None:
        """Start round ``t`` on a chunk's client-batched optimizer with its stacked ``inputs``
        (``ClientOptimizers.start``; ``start``: the engine's wrapper of ``opt.start_round``)."""
        self.opts.start(opt, t, start, **inputs)

    # ------------------------------------------------------------------ local steps
    def step(
        self,
        opt: Any,
        grads: Callable[[], Any],
        anchor_grads: Optional[Callable[[], Sequence[torch.Tensor]]] = None,
        **step_inputs: Any,
    ) -> Any:
        """One local step on the one model (``take_step``, clipping its gradients as the algorithm
        says, ``ClientOptimizers.clip``); returns ``grads()``'s loss."""
        return take_step(self.algo, opt, grads, self.opts.clip, anchor_grads, **step_inputs)

    @staticmethod
    def train(step: Callable[[], torch.Tensor], steps: int, device: torch.device) -> float:
        """``steps`` local steps (``step()`` returns one step's loss); their mean loss, read once at the end."""
        total = torch.zeros((), device=device)
        for _ in range(steps):
            total += step()
        return float(total) / steps

    # ------------------------------------------------------------------ finish
    def end(self, opt: Any) -> Dict[str, Any]:
        """End the round on ``opt`` (``fl.algorithm.end_round``) and return its round outputs
        (``Algorithm.round_outputs``: PAdaMFed's ``local_control``, ...), by method name. The
        client-batched engine calls it once per chunk; ``finish`` ends a one-model round itself."""
        end_round(opt)
        return {name: getattr(opt, name)() for name in self.algo.round_outputs}

    @torch.no_grad()
    def finish(
        self,
        opt: Any,
        t: int,
        steps: int,
        params: Iterable[torch.Tensor],
        x: Tensors,
        got: Mapping[str, Tensors],
        kept: Optional[Tensors],
    ) -> LocalResult:
        """Client's result after ``steps`` local steps of round ``t``: ``opt`` (its optimizer, or a
        view of one client of a batched one) ends the round, ``delta = params - x``, and the rule's
        ``client_finish`` gives what it keeps and replies (``got``, ``kept``: as ``inputs`` had them).
        A per-client transform of the reply, or a scalar the server needs, belongs here."""
        end_round(opt)
        delta = [p.detach() - g for p, g in zip(params, x, strict=True)]
        new_kept, reply = self.rule.client_finish(opt, self.algo, self.hp, t, steps, got, kept, delta)
        scalars = {name: float(reply.pop(name)) for name in self.rule.scalars}  # FedNova's a_i
        return LocalResult(delta, dict(reply), new_kept, scalars)

    # ------------------------------------------------------------------ the initial round
    @torch.no_grad()
    def initial_control(self, grads: Callable[[], Any], params: Sequence[torch.Tensor], steps: int) -> Tensors:
        """A client's initial control ``c_i = (1/K) sum_k g_k``: the mean of ``steps`` stochastic
        gradients at the received model (PAdaMFed, "Problem-Parameter-Free Federated Learning",
        Alg. 1, line 1); ``grads()`` puts one mini-batch's gradients into ``params``' ``.grad``."""
        acc = [torch.zeros_like(p) for p in params]
        for _ in range(steps):
            with torch.enable_grad():
                grads()
            for a, p in zip(acc, params, strict=True):
                a.add_(cast(torch.Tensor, p.grad))  # backward() just gave every parameter one
        return [a / steps for a in acc]


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
