"""A client-batched benchmark's workload and its rounds: the data and global model of C clients, a round
one client after another, with the update in plain torch on stacked tensors, through the stacked
engine's trainer (all at once, or in chunks), and the model FLOPs of one client-step."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from fedopt_kernels import FedNAR
from fedopt_kernels.batched import BatchedFedNAR
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.precision import autocast_scope, precision_scope
from fedopt_kernels.sim.batched.trainer import BatchedTrainer
from fedopt_kernels.sim.batched_round import _pad_clients
from fedopt_kernels.sim.models.build import build_model

from .settings import HP, ModelSetting


class Workload:
    """A round's data and global model for C clients (random, seeded; the same for every mode), and the
    precision its passes compute in."""

    def __init__(
        self,
        setting: ModelSetting,
        clients: int,
        steps: int,
        batch: int,
        device: torch.device,
        seed: int = 0,
        precision: str = "fp32",
    ):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = build_model(setting.model, setting.shape, setting.classes, **setting.kwargs).to(device)
        with torch.no_grad():
            for p in self.model.parameters():  # distinct non-trivial weights, the same in every mode
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(1, p[0].numel()) ** 0.5 if p.dim() > 1 else 0.1))
        self.glob = [p.detach().clone() for p in self.model.parameters()]
        if len(setting.shape) == 1:  # character windows
            self.x = torch.randint(0, setting.classes, (steps, clients, batch, *setting.shape), generator=g).to(device)
        else:
            self.x = torch.randn(steps, clients, batch, *setting.shape, generator=g).to(device)
        self.y = torch.randint(0, setting.classes, (steps, clients, batch), generator=g).to(device)
        self.w = torch.full((steps, clients, batch), 1.0 / batch, device=device)
        self.clients, self.steps, self.device, self.precision = clients, steps, device, precision


def plain_fednar_(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    lr: float,
    weight_decay: float,
    max_norm: float,
    eps: float = 1e-6,
) -> None:
    """FedNAR on stacked [C, ...] tensors in plain torch, per client: d = g + wd x, x -= lr min(1, M/(|d|+eps)) d."""
    d = torch._foreach_add(grads, params, alpha=weight_decay)
    sq = torch.stack([t.reshape(t.shape[0], -1).square().sum(1) for t in d]).sum(0)
    coef = (max_norm / (sq.sqrt() + eps)).clamp(max=1.0) * lr
    for p, t in zip(params, d):
        p.sub_(t * coef.view(-1, *([1] * (t.dim() - 1))))


def sequential_round(wl: Workload, opt: FedNAR) -> None:
    model = wl.model
    params = list(model.parameters())
    for c in range(wl.clients):
        with torch.no_grad():
            for p, g in zip(params, wl.glob):
                p.copy_(g)
        opt.start_round()
        for k in range(wl.steps):
            model.zero_grad(set_to_none=True)
            with precision_scope(wl.precision, wl.device):
                with autocast_scope(wl.precision, wl.device):
                    loss = F.cross_entropy(model(wl.x[k, c]), wl.y[k, c])
                loss.backward()
            opt.step()


def plain_round(wl: Workload, loss, stacked: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for s, g in zip(stacked, wl.glob):
            s.copy_(g.unsqueeze(0).expand_as(s))
    for k in range(wl.steps):
        grads, _ = loss.grads(stacked, wl.x[k], wl.y[k], wl.w[k])
        with torch.no_grad():
            plain_fednar_(stacked, list(grads), **HP)


def fused_trainer(wl: Workload, loss, replay: Optional[str], clients: Optional[int] = None) -> BatchedTrainer:
    return BatchedTrainer(
        loss, wl.glob, clients or wl.clients, lambda ps: BatchedFedNAR(ps, **HP), steps=wl.steps, replay=replay
    )


def fused_round(wl: Workload, tr: BatchedTrainer) -> None:
    tr.load(wl.glob)
    tr.start_round(round_index=0)
    for k in range(wl.steps):
        tr.step(wl.x[k], wl.y[k], wl.w[k])


def chunked_round(wl: Workload, tr: BatchedTrainer) -> None:
    """The simulator's ``--client-batched N`` with N < C: equal chunks of ``tr.clients``, one trainer."""
    n = tr.clients
    for i in range(0, wl.clients, n):
        m = min(n, wl.clients - i)
        active = torch.arange(n, device=wl.device) < m if m < n or tr.replay is not None else None
        tr.load(wl.glob)
        tr.start_round(round_index=0)
        for k in range(wl.steps):
            x, y, w = (_pad_clients(t[k : k + 1, i : i + m], n)[0] for t in (wl.x, wl.y, wl.w))
            tr.step(x, y, w, active=active)


# ------------------------------------------------------------------ counting
def client_step_flops(setting: ModelSetting, batch: int, device: torch.device) -> float:
    """Model FLOPs of one client's local step (forward + backward) at ``batch``: the layers engine
    with one client, the LSTM written out (torch's fused LSTM kernel is invisible to the counter)."""
    wl = Workload(setting, 1, 1, batch, device)
    engine = LayersLoss(wl.model, formulations={"LSTM": "bmm"} if setting.model == "char-lstm" else None)
    stacked = [g.unsqueeze(0) for g in wl.glob]
    with FlopCounterMode(display=False) as counter:
        engine.grads(stacked, wl.x[0], wl.y[0], wl.w[0])
    return float(counter.get_total_flops())


def fused_backend(device: torch.device) -> str:
    """The backend the batched modes' FedNAR runs on (``auto``)."""
    return _registry.auto_backend(device, "fednar_batched")


def sequential_backend(device: torch.device) -> str:
    """The backend the sequential mode's FedNAR runs on (``auto``)."""
    return _registry.auto_backend(device, "fednar")
