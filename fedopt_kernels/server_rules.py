"""The server-side rules of the package's FL algorithms, as pure functions on lists of tensors.

One implementation of each rule, used by both front ends: the simulator's strategies
(``fedopt_kernels.sim``) and the Flower strategies (``fedopt_kernels.flower``). That is what lets
a Flower run reproduce a ``fedopt-sim`` run: the two differ in transport, never in arithmetic.

Every argument called ``x``, ``c``, ``m``, ``ci`` or an entry of ``deltas`` / ``dcs`` is a list
with one tensor per model parameter, in a fixed order. Nothing is modified in place: each function
returns new tensors. Client lists are summed in the order given, so a caller that sorts its clients
(the simulator sorts by client id) gets bit-reproducible results.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

Tensors = List[torch.Tensor]

__all__ = ["weighted_average_step", "scaffold_local_control", "scaffold_control_step", "padamfed_init",
           "padamfed_step"]


def _check_like(name: str, tensors: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> None:
    if len(tensors) != len(ref):
        raise ValueError(f"{name} has {len(tensors)} tensors, expected {len(ref)} (one per parameter)")
    for j, (t, r) in enumerate(zip(tensors, ref)):
        if tuple(t.shape) != tuple(r.shape):
            raise ValueError(f"{name}[{j}] has shape {tuple(t.shape)}, expected {tuple(r.shape)}")


def _check_updates(name: str, updates: Sequence[Sequence[torch.Tensor]], ref: Sequence[torch.Tensor]) -> None:
    if len(updates) == 0:
        raise ValueError(f"{name} is empty: a server step needs at least one client update")
    for i, u in enumerate(updates):
        _check_like(f"{name}[{i}]", u, ref)


@torch.no_grad()
def weighted_average_step(x: Sequence[torch.Tensor], deltas: Sequence[Sequence[torch.Tensor]],
                          weights: Sequence[float], server_lr: float) -> Tensors:
    """FedAvg's server step: ``x + server_lr * sum_i w_i * delta_i / sum_i w_i``.

    ``delta_i = y_i - x`` is client i's model minus the global one and ``w_i`` its weight (its
    number of training samples). With the matching client optimizer this is the server of FedAvg,
    FedSGD, FedDecay, FedProx, FedNLR, FedNAR and of SCAFFOLD's model update.
    """
    _check_updates("deltas", deltas, x)
    if len(weights) != len(deltas):
        raise ValueError(f"weights has {len(weights)} entries for {len(deltas)} deltas")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be finite and > 0, got {list(weights)}")
    total = sum(weights)
    if not math.isfinite(total):  # finite weights whose sum overflows: normalise by the largest first
        top = max(weights)
        weights = [w / top for w in weights]
        total = sum(weights)
    out = []
    for j, xj in enumerate(x):
        avg = torch.zeros_like(xj)
        for d, w in zip(deltas, weights):
            avg.add_(d[j], alpha=w / total)
        out.append(xj.clone().add_(avg, alpha=server_lr))
    return out


@torch.no_grad()
def scaffold_local_control(ci: Sequence[torch.Tensor], c: Sequence[torch.Tensor], delta: Sequence[torch.Tensor],
                           lr_sum: float) -> Tensors:
    """SCAFFOLD's new client control by option II of its control update: ``ci - c + (x - y_i) / lr_sum``.

    "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning" (Karimireddy, Kale, Mohri,
    Reddi, Stich, Suresh; ICML 2020).

    ``delta = y_i - x``; ``lr_sum`` is the sum of the round's per-step learning rates (the paper's
    ``K * lr``). With ``lr_sum <= 0`` nothing moved and option II is undefined: ``ci`` is kept.
    This runs on the client, but it is the rule the server's ``c`` update assumes, so it lives here.
    """
    _check_like("c", c, ci)
    _check_like("delta", delta, ci)
    if lr_sum > 0:
        return [c_i - cj - d / lr_sum for c_i, cj, d in zip(ci, c, delta)]
    return [c_i.clone() for c_i in ci]


@torch.no_grad()
def scaffold_control_step(c: Sequence[torch.Tensor], dcs: Sequence[Sequence[torch.Tensor]],
                          num_clients: int) -> Tensors:
    """SCAFFOLD's server control: ``c + sum_{i in S} (ci' - ci) / N`` with N all training clients.

    Dividing by N (not by the S sampled clients) keeps ``c`` the mean of every client's control
    under partial participation (clients that never trained count with ``ci = 0``).
    """
    _check_updates("dcs", dcs, c)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    out = [cj.clone() for cj in c]
    for dc in dcs:
        for cj, d in zip(out, dc):
            cj.add_(d, alpha=1.0 / num_clients)
    return out


@torch.no_grad()
def padamfed_init(local_controls: Sequence[Sequence[torch.Tensor]], num_clients: int) -> Tuple[Tensors, Tensors]:
    """PAdaMFed's initial server state from the clients' first controls: ``c = sum_i ci / N``, ``m = c``.

    Each ``ci`` is the mean of K stochastic gradients at the initial model ("Problem-Parameter-Free
    Federated Learning", Yan, Zhang, Wang, Cao: Alg. 1, line 1). A client missing from
    ``local_controls`` counts as ``ci = 0``.
    """
    if len(local_controls) == 0:
        raise ValueError("local_controls is empty: PAdaMFed's initialisation needs at least one client")
    ref = local_controls[0]
    _check_updates("local_controls", local_controls, ref)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    c = [torch.zeros_like(t) for t in ref]
    for ci in local_controls:
        for cj, t in zip(c, ci):
            cj.add_(t, alpha=1.0 / num_clients)
    return c, [cj.clone() for cj in c]


@torch.no_grad()
def padamfed_step(x: Sequence[torch.Tensor], c: Sequence[torch.Tensor], m: Sequence[torch.Tensor],
                  deltas: Sequence[Sequence[torch.Tensor]], dcs: Sequence[Sequence[torch.Tensor]],
                  num_clients: int, lr: float, local_steps: int, server_lr: float,
                  beta: float) -> Tuple[Tensors, Tensors, Tensors]:
    """PAdaMFed's server step ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao: Alg. 1).

    With S = len(deltas) clients, eta = ``lr``, K = ``local_steps``, gamma = ``server_lr``::

        x'  = x + gamma * mean_i(delta_i) / (eta * K)     (delta_i = y_i - x; the paper's
                                                       x - gamma * mean(x - y_i) / (eta K))
        dc  = sum_i (ci' - ci)
        m'  = beta * (dc / S + c) + (1 - beta) * m
        c'  = c + dc / N

    Returns ``(x', c', m')``. ``eta = 0`` leaves x unchanged (no client moved).
    """
    _check_updates("deltas", deltas, x)
    _check_updates("dcs", dcs, x)
    if len(dcs) != len(deltas):
        raise ValueError(f"dcs has {len(dcs)} entries for {len(deltas)} deltas")
    _check_like("c", c, x)
    _check_like("m", m, x)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    S = len(deltas)
    scale = server_lr / (lr * local_steps) if lr > 0 else 0.0
    x_out, c_out, m_out = [], [], []
    for j, xj in enumerate(x):
        mean_delta = torch.zeros_like(xj)
        dc = torch.zeros_like(xj)
        for d, dci in zip(deltas, dcs):  # the order given: deterministic sums
            mean_delta.add_(d[j], alpha=1.0 / S)
            dc.add_(dci[j])
        x_out.append(xj.clone().add_(mean_delta, alpha=scale))
        m_out.append(m[j].clone().mul_(1 - beta).add_(dc / S + c[j], alpha=beta))  # uses the old c
        c_out.append(c[j].clone().add_(dc, alpha=1.0 / num_clients))
    return x_out, c_out, m_out
