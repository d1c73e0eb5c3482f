"""Evaluation: pooled loss/accuracy, and the FedDecay papers' per-user protocol (FedDecay paper,
Sec. 4.1-4.2; docs/algorithms.md lists the papers).

After training, every user (new and existing) fine-tunes the global model on its own train split
(``finetune_steps`` SGD steps of lr ``finetune_lr`` on its mini-batches) and is tested on its test
split. Across users we report the mean accuracy, the bottom-10% accuracy (the 10th percentile of the
per-user accuracies: 90% of users do at least this well) and the standard deviation; users count
equally, whatever their size. The global model's accuracy before fine-tuning is reported the same way.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..fl.client_round import loss_and_correct
from .data.clients import BatchStream, ClientData


def pooled_metrics(model: nn.Module, clients: Sequence[ClientData], split: str) -> Dict[str, float]:
    """Loss and accuracy over the union of the clients' ``split`` ("val" or "test") data."""
    loss, correct, n = 0.0, 0, 0
    for c in clients:
        x, y = getattr(c, f"{split}_x"), getattr(c, f"{split}_y")
        if y.shape[0] == 0:
            continue
        batch_loss, k = loss_and_correct(model, x, y)
        loss, correct, n = loss + batch_loss, correct + k, n + y.shape[0]
    return {"loss": loss / max(n, 1), "acc": correct / max(n, 1)}


def user_summary(accs: Sequence[float]) -> Dict[str, float]:
    """Mean, bottom-10% (10th percentile, linear interpolation) and population std of per-user accuracies."""
    if len(accs) == 0:
        return {"mean": float("nan"), "bottom10": float("nan"), "std": float("nan"), "users": 0}
    a = np.asarray(accs, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "bottom10": float(np.quantile(a, 0.1)),
        "std": float(a.std()),
        "users": int(a.size),
    }


def user_accuracy(model: nn.Module, client: ClientData) -> float:
    _, k = loss_and_correct(model, client.test_x, client.test_y)
    return k / client.test_y.shape[0]


def finetune(model: nn.Module, client: ClientData, steps: int, lr: float, stream: BatchStream) -> None:
    """``steps`` plain SGD steps on the client's train mini-batches (not part of the FL algorithm)."""
    if steps == 0:
        return
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        x, y = stream.next()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()


def evaluate_users(
    model: nn.Module,
    global_params: List[torch.Tensor],
    groups: Dict[str, Sequence[ClientData]],
    steps: int,
    lr: float,
    make_stream: Callable[[ClientData], BatchStream],
) -> Dict[str, Dict]:
    """The per-user protocol for each group of users ("existing", "new").

    Returns ``{"global": {group: summary}, "finetuned": {group: summary}}``. ``model`` is used as
    scratch space and is left holding ``global_params``.
    """

    def load() -> None:
        with torch.no_grad():
            for p, g in zip(model.parameters(), global_params, strict=True):
                p.copy_(g)

    out: Dict[str, Dict] = {"global": {}, "finetuned": {}}
    for name, users in groups.items():
        users = [u for u in users if u.test_y.shape[0] > 0]
        load()
        before = [user_accuracy(model, u) for u in users]
        after = []
        for u in users:
            load()
            finetune(model, u, steps, lr, make_stream(u))
            after.append(user_accuracy(model, u))
        out["global"][name] = user_summary(before)
        out["finetuned"][name] = user_summary(after)
    load()
    return out
