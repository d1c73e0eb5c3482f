"""The model, each client's data and one client's local training as an FSDP2 job on ``ranks`` CPU processes.

``train_on_ranks`` is what a client's ``fit`` calls: it starts a gloo world of ``ranks`` processes
(``fedopt_kernels.fl.local_world``); each rank builds the model from the global weights, shards it
with ``fully_shard`` and trains its half of the client's batches with FedNAR, whose co-clipping
norm is the norm over the whole model (one all-reduce of one float64 per step). Rank 0 returns
the updated weights (gathered with ``full_tensor``) and the optimizer's full state_dict, which the
client keeps for its next round (FedNAR's round counter anneals the step size).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

IN, HIDDEN, CLASSES = 20, 64, 4


def make_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


def client_data(cid: int, n: int = 256) -> Tuple[torch.Tensor, torch.Tensor]:
    """Client ``cid``'s samples: a shared teacher labels inputs drawn around a client-specific mean."""
    teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(cid)
    x = torch.randn(n, IN, generator=g) + 0.5 * torch.randn(IN, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def get_weights(model: nn.Module) -> List[np.ndarray]:
    return [v.detach().cpu().numpy() for v in model.state_dict().values()]


def set_weights(model: nn.Module, weights: List[np.ndarray]) -> None:
    keys = list(model.state_dict())
    model.load_state_dict({k: torch.from_numpy(np.asarray(w)) for k, w in zip(keys, weights)})


def evaluate(weights: List[np.ndarray], cids: List[int]) -> Tuple[float, float]:
    model = make_model()
    set_weights(model, weights)
    xs, ys = zip(*(client_data(c) for c in cids))
    x, y = torch.cat(xs), torch.cat(ys)
    with torch.no_grad():
        out = model(x)
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def _rank_train(
    rank: int,
    ranks: int,
    weights: List[np.ndarray],
    cid: int,
    steps: int,
    batch: int,
    hp: Dict[str, float],
    opt_state: Optional[Dict[str, Any]],
) -> Optional[Tuple[Any, ...]]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    import fedopt_kernels as fk

    mesh = init_device_mesh("cpu", (ranks,))
    model = make_model()
    set_weights(model, weights)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fk.FedNAR(
        model.parameters(),
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        max_norm=hp["max_norm"],
        prox_mu=hp["prox_mu"],
        backend="cpu",
    )
    full = StateDictOptions(full_state_dict=True)
    if opt_state is not None:
        set_optimizer_state_dict(model, opt, opt_state, options=full)
    opt.start_round()
    x, y = client_data(cid)
    x, y = x[rank::ranks], y[rank::ranks]  # data parallel: each rank trains its share of the batches
    g = torch.Generator().manual_seed(cid * 1000 + opt.round_index)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    state = get_optimizer_state_dict(model, opt, options=full)
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank takes part
    if rank != 0:
        return None
    return [params[k].numpy() for k in params], state, opt.round_index


def train_on_ranks(
    weights: List[np.ndarray],
    cid: int,
    ranks: int,
    steps: int,
    batch: int,
    hp: Dict[str, float],
    opt_state: Optional[Dict[str, Any]],
) -> Tuple[List[np.ndarray], Dict[str, Any], int]:
    from fedopt_kernels.fl.local_world import run_local_world

    return run_local_world(_rank_train, ranks, weights, cid, steps, batch, hp, opt_state)[0]
