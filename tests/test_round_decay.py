"""Round decay, one mechanism for every optimizer: round ``t``'s learning rate is ``lr * round_decay ** t``.

Every optimizer (and its client-batched form) takes ``round_decay``; ``start_round(round_index=t)``
picks the round. Its step must equal, bit for bit, the same optimizer built with the learning rate
``lr * round_decay ** t`` formed on the host in float64 (what the simulator used to write into the
param groups), on the reference backend and the compiled cpu one.
"""

from typing import List

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels.core import registry
from fedopt_kernels.fl import algorithm, catalogue

LR, DECAY, T = 0.1, 0.9, 3
BACKENDS = [b for b in ("reference", "cpu") if registry.unavailable_reason(b, torch.device("cpu"), "sgd") is None]


def _params(batched: bool):
    g = torch.Generator().manual_seed(1)
    shapes = [(5, 3), (3,), (2, 2, 2)]
    return [torch.randn(((2,) + s) if batched else s, generator=g) for s in shapes]


def _run(algo: str, backend: str, batched: bool, **kwargs):
    """Three steps of round ``T`` of ``algo``'s first option set with ``kwargs`` on seeded inputs."""
    entry = catalogue.ALGOS[algo]
    cfg = entry.options[next(iter(entry.options))]
    params: List[torch.Tensor] = [torch.nn.Parameter(t) for t in _params(batched)]
    cls = algorithm.of_optimizer(cfg.cls).batched if batched else cfg.cls
    opt = cls(params, backend=backend, **{**cfg.kwargs, **kwargs})
    if batched:
        clients = [[p[c] for p in params] for c in range(2)]
        opt.start_round(round_index=T, **cfg.batched_round_inputs(clients, params, T))
    else:
        opt.start_round(round_index=T, **cfg.round_inputs(params, T))
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        inputs = cfg.batched_step_inputs(clients, step, stacked=params) if batched else cfg.step_inputs(params, step)
        opt.step(**inputs)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_round_decay_is_the_host_lr_of_round_t(algo, backend, batched):
    lr = catalogue.ALGOS[algo].options[next(iter(catalogue.ALGOS[algo].options))].kwargs["lr"]
    decayed = _run(algo, backend, batched, round_decay=DECAY)
    by_hand = _run(algo, backend, batched, round_decay=1.0, lr=lr * DECAY**T)
    undecayed = _run(algo, backend, batched, round_decay=1.0)
    for a, b in zip(decayed, by_hand, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(decayed, undecayed, strict=True))  # the decay acts


@pytest.mark.parametrize("cls", [fk.FedDecaySGD, fk.NeuronLRSGD, fk.FedDyn, fk.FedSAM, fk.PAdaMFed, fk.FedNAR])
def test_every_optimizer_takes_round_decay(cls):
    p = torch.nn.Parameter(torch.ones(3))
    kw = {
        fk.FedDecaySGD: dict(beta=0.5),
        fk.NeuronLRSGD: {},
        fk.FedDyn: dict(alpha=0.1),
        fk.FedSAM: {},
        fk.PAdaMFed: dict(beta=0.5),
        fk.FedNAR: dict(weight_decay=0.0),
    }[cls]
    opt = cls([p], lr=0.1, **kw)
    assert opt.param_groups[0]["round_decay"] == (0.998 if cls is fk.FedNAR else 1.0)
    with pytest.raises(ValueError, match="round_decay"):
        cls([p], lr=0.1, round_decay=1.5, **kw)
    with pytest.raises(ValueError, match="round_decay"):
        cls([p], lr=0.1, round_decay=0.0, **kw)


def test_a_state_dict_without_round_decay_loads_with_none():
    """A state_dict saved before the SGD family took round_decay loads, with round_decay 1."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = fk.FedDecaySGD([p], lr=0.1, beta=0.5, round_decay=0.5)
    sd = fk.FedDecaySGD([p], lr=0.1, beta=0.5).state_dict()
    for group in sd["param_groups"]:
        del group["round_decay"]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["round_decay"] == 1.0


def test_the_simulator_sets_no_round_lr():
    """Every algorithm anneals in its optimizer: no descriptor, and not the client round, sets a
    per-round lr from outside (one mechanism)."""
    from fedopt_kernels.fl.client_round import ClientOptimizers

    for a in algorithm.ALGORITHMS.values():
        assert not hasattr(a, "round_lr"), a.name
    assert not hasattr(ClientOptimizers, "set_round_lr")
