"""C clients' local steps as one computation: stacked parameters, batched gradients, a batched optimizer.

``BatchedTrainer`` owns C copies of the model's parameters (``[C, *shape]`` each) and a
client-batched optimizer over them (``fedopt_kernels.batched``). A local step of every client::

    g_c, loss_c = grad of client c's mean loss on its batch, at its parameters   (loss.client_loss)
    clip g_c by its own norm (SGD algorithms with clip_norm, as clip_grad_norm_ does per client)
    H_c         = grad of the same batch at the round's starting model           (PAdaMFed-VR only)
    optimizer.step(anchor_grads=H, active=mask)                                   (one op for all clients)

The step is the one every engine takes (``fedopt_kernels.fl.client_round.take_step``, through the
optimizer's algorithm descriptor, ``Algorithm.local_step``): a step that takes two gradients
(FedSAM's, ``closure_step``) gets a closure that computes them again, clipped, at the parameters as
the step's first part left them (the views share the stacked parameters' storage).

``trainer_replay.TrainerReplay`` replays that step from a CUDA graph instead (``replay="cuda"``);
where the capture fails, the trainer takes that step and every later one eagerly.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence, Tuple, cast

import torch
from torch import nn

from ...core.optimizer import FedOptimizer
from ...fl import algorithm
from ...fl.client_round import take_step
from .trainer_replay import TrainerReplay

Tensors = List[torch.Tensor]
Grads = Tuple[Tuple[torch.Tensor, ...], torch.Tensor]


class GradientEngine(Protocol):
    """What the trainer needs of ``loss.client_loss``'s engines (``LayersLoss``, vmap's ``VmapLoss``)."""

    precision: str  # what its passes compute in (precision.PRECISIONS)

    def grads(self, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Grads: ...

    def grads_at(self, shared: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Grads: ...


@torch.no_grad()
def clip_per_client_(grads: Sequence[torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_(client c's gradients, max_norm)`` for every client c of stacked ``[C, ...]`` grads.

    The same arithmetic as torch's (per-tensor 2-norms, their 2-norm, ``max_norm / (norm + 1e-6)``
    clamped to 1), computed for all clients at once.
    """
    norms = torch.stack([torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for g in grads])
    coef = (max_norm / (torch.linalg.vector_norm(norms, dim=0) + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))


def _padded(t: torch.Tensor, clients: int) -> torch.Tensor:
    """``t`` [n, ...] with zeros after it up to ``clients`` rows (``t`` itself when n is all)."""
    if t.shape[0] == clients:
        return t
    out = t.new_zeros((clients, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


class BatchedTrainer:
    """C stacked clients of one model and their batched optimizer.

    ``make_optimizer(stacked_params)`` builds the client-batched optimizer; ``clip_norm``: clip each
    client's gradient first; ``anchor``: pass PAdaMFed-VR anchor gradients; ``replay``: None (eager),
    ``"cuda"`` (CUDA-graph replay) or ``"emulate"`` (the same bookkeeping without CUDA, for tests).
    ``algo``: the optimizer's algorithm descriptor, which takes each step (``Algorithm.local_step``).
    ``precision``: the engine's (``precision.py``); the update is float32 at every precision.
    """

    def __init__(
        self,
        loss: GradientEngine,
        like: Sequence[torch.Tensor],
        clients: int,
        make_optimizer: Callable[[List[nn.Parameter]], FedOptimizer],
        steps: int,
        clip_norm: Optional[float] = None,
        anchor: bool = False,
        replay: Optional[str] = None,
    ):
        if clients < 1:
            raise ValueError(f"clients must be >= 1, got {clients}")
        self.loss = loss
        self.precision = loss.precision
        self.clients = clients
        self.steps = steps
        self.clip_norm = clip_norm
        self.anchor = anchor
        self.stacked = [
            nn.Parameter(p.detach().unsqueeze(0).repeat(clients, *([1] * p.dim())).contiguous()) for p in like
        ]
        self.views = [p.detach() for p in self.stacked]  # same storage, no autograd history: the engine's inputs
        self.shared = [p.detach().clone() for p in like]  # the round's starting model (anchor gradients)
        self.opt = make_optimizer(self.stacked)
        self.algo = algorithm.of_optimizer(type(self.opt))
        self.replay = None if replay is None else TrainerReplay(self, mode=replay)

    @torch.no_grad()
    def load(self, params: Sequence[torch.Tensor]) -> None:
        """Every client starts from ``params`` (the global model)."""
        for s, sh, p in zip(self.stacked, self.shared, params, strict=True):
            s.copy_(p.unsqueeze(0).expand_as(s))
            sh.copy_(p)

    def start_round(self, **inputs) -> None:
        """``start_round`` of the batched optimizer (stacked round inputs, ``round_index``, ...)."""
        self.opt.start_round(**inputs)
        if self.replay is not None:
            self.replay.begin_round()

    def gradients(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, anchor_x: Optional[torch.Tensor]) -> tuple:
        """(per-client gradients, clipped; per-client loss [C]; anchor gradients or None)."""
        grads, loss = self.loss.grads(self.views, x, y, w)
        self._clip(grads)
        return grads, loss, self._anchors(x, y, w, anchor_x) if self.anchor else None

    def _clip(self, grads: Sequence[torch.Tensor]) -> None:
        if self.clip_norm is not None:
            clip_per_client_(grads, self.clip_norm)

    def _anchors(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, anchor_x: Optional[torch.Tensor]) -> tuple:
        return self.loss.grads_at(self.shared, x if anchor_x is None else anchor_x, y, w)[0]

    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        w: torch.Tensor,
        anchor_x: Optional[torch.Tensor] = None,
        active: Optional[torch.Tensor] = None,
        live: Optional[int] = None,
    ) -> torch.Tensor:
        """One local step of every (active) client on ``x`` [C, B, ...]; returns the losses [C].
        ``live``: the active clients are the first ``live`` (``gradients``), the rest inactive."""
        if self.replay is not None:
            replayed = self.replay.step(x, y, w, anchor_x, active)
            if replayed is not None:
                return replayed
            self.replay = None  # its capture failed (it warned, trainer_replay.py): eager from this step on
        # live: only the first n clients are active; the others' gradients are zeros, not computed
        n = self.clients if live is None else live
        if n < self.clients:
            x, y, w, anchor_x = x[:n], y[:n], w[:n], None if anchor_x is None else anchor_x[:n]
        views = self.views if n == self.clients else [v[:n] for v in self.views]

        def grads() -> torch.Tensor:
            g, loss = self.loss.grads(views, x, y, w)
            self._set_grads([_padded(t, self.clients) for t in g])
            return _padded(loss, self.clients)

        def clip() -> None:
            self._clip([cast(torch.Tensor, p.grad) for p in self.stacked])  # grads() just set every one

        def anchors() -> tuple:
            return tuple(_padded(h, self.clients) for h in self._anchors(x, y, w, anchor_x))

        # the step every engine takes (fl/client_round.py): a second gradient (FedSAM) comes from grads again
        return take_step(self.algo, self.opt, grads, clip, anchors if self.anchor else None, active=active)

    def _set_grads(self, grads: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self.stacked, grads, strict=True):
            p.grad = g

    def run(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        w: torch.Tensor,
        anchor_x: Optional[torch.Tensor] = None,
        active: Optional[torch.Tensor] = None,
        steps: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        """All ``x.shape[0]`` local steps (inputs ``[K, C, B, ...]``); returns each client's summed loss [C].

        ``steps`` (C integers): client c takes only its first ``steps[c]`` steps; in the later ones
        it is inactive (the optimizer's active mask), so it ends as after its own last step. Where
        they do not increase from slot to slot, a step's active clients are the first ones, and
        only theirs are computed (``step``'s ``live``; not under replay, whose graph is of C,
        nor through ``torch.compile``, which would compile each count anew)."""
        total = torch.zeros(self.clients, device=x.device)
        if steps is None:
            for k in range(x.shape[0]):
                loss = self.step(x[k], y[k], w[k], None if anchor_x is None else anchor_x[k], active)
                total += loss.detach()
            return total
        own = torch.tensor(list(steps), device=x.device)
        if active is not None:
            own = torch.where(active, own, 0)
        prefix = self.replay is None and getattr(self.loss, "engine", "") != "layers-compiled"
        prefix = prefix and all(a >= b for a, b in zip(steps, list(steps)[1:], strict=False))
        for k in range(x.shape[0]):
            mask = own > k
            live = sum(1 for s in steps if s > k) if prefix else None
            loss = self.step(x[k], y[k], w[k], None if anchor_x is None else anchor_x[k], mask, live)
            total += torch.where(mask, loss.detach(), 0.0)
        return total
