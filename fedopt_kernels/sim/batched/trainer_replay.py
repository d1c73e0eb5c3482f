"""The batched local step captured once in a CUDA graph and replayed for every later step and round.

Eager, a client-batched step at small C is host-bound: the batched forward and backward plus the
optimizer launch hundreds of small kernels, and the CPU, not the GPU, sets the pace. A CUDA graph
replays the whole step (forward, backward, clipping, anchor gradients, the fused batched update)
in one launch. Replaying is correct only if every tensor the step reads or writes stays at the
address it had during capture and holds this step's values:

* inputs: static ``x``/``y``/``w`` (and anchor ``x``) buffers, copied into before each replay;
* gradients: static ``p.grad`` tensors the engine's gradients are copied into, inside the graph;
* parameters: the trainer's stacked parameters (loaded in place every round);
* optimizer state: ``start_round`` makes new state tensors (momentum cleared, FedProx anchor,
  SCAFFOLD correction, FedNLR scales, PAdaMFed's D/acc); ``begin_round`` copies their values into
  the tensors the graph was captured with and puts those back into the optimizer's state, and
  momentum buffers are inserted zeroed (with the batched SGD's first-step rule, ``k == 0`` in a
  round whose buffers are new, the first step is then ``buf = d``, as eagerly);
* hyperparameters: the captured step plan's hp tensor gets the new round's rows (FedNAR's
  annealed lr, the per-round SGD lr) copied in; step counters are zeroed in place by start_round.

The first ``warmup`` steps of the first rounds run eagerly on a side stream (lazy initialisation,
the optimizer's plan and device counters are built there, as torch's CUDA-graph notes ask), the
next step whose plans exist (not a round's first, whose round start dropped them) is captured, and
from then on every step is a replay. The optimizer's host-side step
count, which replays do not advance, is advanced here (PAdaMFed's ``local_control`` checks it).

A step that takes two gradients (FedSAM: ``Algorithm.closure_step``) is captured whole: the first
gradients, the ascent, the second gradients at the moved parameters (the step's closure, writing
into the same static buffers), the restore and the descent; its loss is the first gradients'.

``mode="emulate"`` does the same bookkeeping without CUDA: "capture" records the optimizer's
launches (each ``fn`` of ``FedOptimizer.step_plans``, in order, and whether the closure had run),
and a "replay" recomputes the gradients into the static buffers and repeats those recorded calls
with the same tensors, so the state and hp handling above is tested on a CPU.

It keeps the plans the capture read and tells the optimizer about replays through
``FedOptimizer.step_plans``, ``reinstate_plans`` and ``note_replayed_steps``.

A capture that fails (a torch or driver that refuses it, an illegal call inside it) never reaches
the caller: ``core/replay.capture`` leaves no capture open and no pool behind, the replay is off
for the run (``off_reason``, with one warning, ``core/fallbacks.py``), and ``step`` returns None for
that step, which a CUDA capture did not take (it records kernels, it runs none): the trainer then
takes it, and every later one, eagerly. The optimizer's host-side step count then counts that step
twice, which it may: it is an upper bound of the within-round step (the stepper's ``k_bound``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ...core import fallbacks, graph_pools
from ...core.optimizer import FedOptimizer
from ...core.plan import StepPlan
from ...core.replay import capture
from ...fl.algorithm import Algorithm
from ...fl.client_round import take_step
from ...optim.sgd import SGDFamily

MODES = ("cuda", "emulate")


class Trainer(Protocol):
    """What a trainer's replay uses of its trainer (``trainer.BatchedTrainer``)."""

    opt: FedOptimizer
    algo: Algorithm  # the optimizer's descriptor: it takes the step (Algorithm.local_step)
    clients: int
    steps: int
    anchor: bool

    @property
    def stacked(self) -> Sequence[torch.Tensor]: ...  # read only here (a list of Parameters is one)

    def gradients(
        self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, anchor_x: Optional[torch.Tensor]
    ) -> tuple: ...


def _clipped() -> None:
    """Nothing: ``_gradients`` clips as it computes (``BatchedTrainer.gradients``)."""


class TrainerReplay:
    """``BatchedTrainer(replay=mode)``'s local step, captured once and replayed (module docstring);
    ``mode``: ``"cuda"`` or ``"emulate"``, ``warmup``: eager steps before the capture."""

    def __init__(self, trainer: Trainer, mode: str = "cuda", warmup: int = 2):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        device = trainer.stacked[0].device
        if mode == "cuda" and device.type != "cuda":
            raise ValueError(f"a CUDA graph needs CUDA parameters, got {device}")
        self.tr = trainer
        self.mode = mode
        self.device = device
        self.warmup = warmup
        self.eager_steps = 0
        self.off_reason: Optional[str] = None  # why the capture failed (then no replay in this run)
        self.graph: Optional[Any] = None
        self.plan: Optional[StepPlan] = None  # the optimizer's step plan the graph was captured with
        self.plans: Tuple[Any, ...] = ()  # everything the captured step launched (FedOptimizer.step_plans)
        # emulate: the captured step's launches, (after the closure?, fn, args, kwargs) each
        self.recorded: Optional[List[Tuple[bool, Any, tuple, dict]]] = None
        self._in_closure = False
        self._body_done = False  # an emulated capture ran its step (and so took it)
        self.state: Dict[Tuple[int, str], torch.Tensor] = {}
        opt = trainer.opt
        # static gradients: the optimizer sees the same tensors every step
        self.grads: List[torch.Tensor] = []
        for p in trainer.stacked:
            p.grad = torch.zeros_like(p)
            self.grads.append(p.grad)
        self.anchors = [torch.zeros_like(p) for p in trainer.stacked] if trainer.anchor else None
        self.active = torch.ones(trainer.clients, dtype=torch.bool, device=device)
        self.inputs: Optional[List[torch.Tensor]] = None  # x, y, w, anchor x: allocated at the first step
        self.loss = torch.zeros(trainer.clients, device=device)
        self._momentum = [
            isinstance(opt, SGDFamily) and g["momentum"] != 0 for g in opt.param_groups for _ in g["params"]
        ]

    # ------------------------------------------------------------------ rounds
    @torch.no_grad()
    def begin_round(self) -> None:
        """After ``opt.start_round``: state back at the captured addresses, this round's hp in place."""
        opt = self.tr.opt
        params = [p for g in opt.param_groups for p in g["params"]]
        for p, momentum in zip(params, self._momentum, strict=True):
            st = opt.state[p]
            if momentum and "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p)  # adopted below (or zeroed into the static one)
            for key, value in list(st.items()):
                static = self.state.get((id(p), key))
                if static is None:
                    self.state[(id(p), key)] = value
                elif static is not value:
                    static.copy_(value)
                    st[key] = static
        if self.plans:
            opt.reinstate_plans(self.plans)  # their hp rows rewritten in place: the graph reads those tensors

    # ------------------------------------------------------------------ steps
    def _set_inputs(self, x, y, w, anchor_x, active) -> None:
        new = [x, y, w] + ([anchor_x if anchor_x is not None else x] if self.tr.anchor else [])
        if self.inputs is None:
            self.inputs = [t.clone() for t in new]
        else:
            for s, t in zip(self.inputs, new, strict=True):
                s.copy_(t)
        if active is None:
            self.active.fill_(True)
        else:
            self.active.copy_(active)

    def _gradients(self, second: bool = False) -> None:
        """Everything of a step before the optimizer's op, into the static buffers; ``second``: the
        closure's gradients at the parameters the step moved to (the loss stays the first's)."""
        inputs = self.inputs
        assert inputs is not None  # step() copied this step's inputs in first
        x, y, w = inputs[:3]
        grads, loss, anchors = self.tr.gradients(x, y, w, inputs[3] if self.tr.anchor else None)
        for s, g in zip(self.grads, grads, strict=True):
            s.copy_(g)
        if second:
            return
        self.loss.copy_(loss)
        if anchors is not None:
            assert self.anchors is not None  # both exist when the trainer passes anchor gradients
            for s, g in zip(self.anchors, anchors, strict=True):
                s.copy_(g)

    def _closure(self) -> None:
        self._in_closure = True
        self._gradients(second=True)

    def _body(self) -> None:
        """The step every engine takes (``client_round.take_step``), on the static buffers: its first
        gradients call ``_gradients`` (clipped, anchors too), a second one (FedSAM's) the closure's."""
        self._in_closure = False
        first = True

        def grads() -> None:
            nonlocal first
            if first:
                first = False
                self._gradients()
            else:
                self._closure()

        anchors = self.anchors
        take_step(
            self.tr.algo, self.tr.opt, grads, _clipped, None if anchors is None else lambda: anchors, active=self.active
        )

    def step(self, x, y, w, anchor_x=None, active=None) -> Optional[torch.Tensor]:
        """The step's losses [C] (a buffer every step rewrites), or None when the capture failed and
        did not take this step (the module docstring): the caller takes it eagerly."""
        if self.off_reason is not None:
            return None
        self._set_inputs(x, y, w, anchor_x, active)
        opt = self.tr.opt
        if self.plan is None:
            # a round's first step rebuilds the plans its round start dropped: a capture records
            # only a step whose plans exist (building one copies from the host, refused in a capture)
            if self.eager_steps < self.warmup or not opt.step_plans:
                self._eager()
                return self.loss
            return self.loss if self._try_capture() else None
        if self.mode == "cuda":
            assert self.graph is not None  # captured along with the plan
            self.graph.replay()
        else:
            assert self.recorded is not None  # recorded along with the plans
            self._gradients()
            second = False
            with torch.no_grad():  # as inside step()
                for after_closure, fn, args, kwargs in self.recorded:
                    if after_closure and not second:
                        second = True
                        self._gradients(second=True)
                    fn(*args, **kwargs)
        opt.note_replayed_steps(1)  # what step() counts on the host; a replay does not run it
        return self.loss

    def _eager(self) -> None:
        if self.device.type == "cuda":
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            self._body()
        self.eager_steps += 1

    def _try_capture(self) -> bool:
        """``_capture``, or on its failure replay off for the run (one warning): whether it took the step."""
        self._body_done = False
        try:
            self._capture()
        except Exception as exc:  # noqa: BLE001 - a refused capture is a fallback, never the caller's error
            self.off_reason = fallbacks.fall_back(
                "the client-batched step captured in a CUDA graph", exc, "eager steps", stacklevel=5
            ).error
            self.graph, self.recorded = None, None
            exc.__traceback__ = None  # its frames hold the step's tensors
            # a CUDA capture runs no kernel: the step is still to take; an emulated one ran it
            return self.mode == "emulate" and self._body_done
        return True

    def _capture(self) -> None:
        opt = self.tr.opt
        opt.prepare_capture(self.tr.steps + 1)  # a decay table must cover every step of a round before capture
        if self.mode == "cuda":
            self.graph, failure = capture_graph(self.device, self._body)
            if failure is not None:
                raise failure
            self.plan, self.plans = opt.step_plan, opt.step_plans
            self.graph.replay()  # capture records; this replay takes the step
            return
        plans = opt.step_plans
        assert plans, "the warm-up steps build the optimizer's plans"
        recorded: List[Tuple[bool, Any, tuple, dict]] = []

        def recorder(fn):
            def record(*args, **kwargs):
                recorded.append((self._in_closure, fn, args, kwargs))
                return fn(*args, **kwargs)

            return record

        fns = [p.fn for p in plans]
        for p, fn in zip(plans, fns, strict=True):
            p.fn = recorder(fn)
        try:
            self._body()
            self._body_done = True
        finally:
            for p, fn in zip(plans, fns, strict=True):
                p.fn = fn
        now = opt.step_plans
        same = len(now) == len(plans) and all(a is b for a, b in zip(now, plans, strict=True))
        if len(recorded) != len(plans) or not same:
            raise RuntimeError("the optimizer rebuilt its step plans during capture; take more warm-up steps")
        self.recorded, self.plan, self.plans = recorded, opt.step_plan, plans


def capture_graph(device: torch.device, body: Callable[[], None]) -> Tuple[Any, Optional[BaseException]]:
    """``body()`` captured in a new CUDA graph on a side stream of ``device``, its memory in a pool of
    its own (``core/replay.capture``: on a failure no capture is left open, no pool behind); the
    graph and None, or what went wrong."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    index = device.index if device.index is not None else torch.cuda.current_device()
    side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        failure = capture(graph, graph_pools.new_pool(), index, body, torch.cuda.is_current_stream_capturing)
    current.wait_stream(side)
    return graph, failure
