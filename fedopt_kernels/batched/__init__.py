"""Client-batched optimizers (docs/client_batched.md): many clients' local steps as one computation.

Every parameter is a stack of client copies ``[C, *shape]`` (``torch.func.stack_module_state``
makes them from C models); so are momentum buffers, corrections, controls and anchors, FedNLR
scales are ``[C, M]``, and the round index, a learning-rate scale and an active mask are per
client. FedNAR's co-norm and PAdaMFed's normalisation are per client. Client ``c``'s result is
what the package's per-client optimizer computes for client ``c`` alone::

    params = [torch.nn.Parameter(w) for w in stacked.values()]       # each [C, *shape]
    opt = BatchedFedNAR(params, lr=0.1, weight_decay=1e-3)
    opt.start_round(round_index=t, correction=[c - ci for c, ci in ...])   # [C, *shape] each
    for step in range(K):
        ... p.grad = per-client gradients [C, *shape] (e.g. torch.func.vmap(torch.func.grad(loss)))
        opt.step(active=steps_left > step)                              # clients with fewer steps sit out
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .._ops import BATCHED
from ..feddecay import FedDecaySGD
from ..fednar import FedNAR
from ..neuron_lr import NeuronLRSGD
from ..padamfed import PAdaMFed
from ._client_batched import ClientBatched


class BatchedFedDecaySGD(ClientBatched, FedDecaySGD):
    """FedDecaySGD for ``C`` stacked clients: ``lr_k = lr * lr_scale[c] * s(k_c // decay_every)``
    per client, then torch.optim.SGD's step per client (FedDecay; SCAFFOLD ``correction`` and
    FedProx ``prox_mu`` as in the per-client optimizer)."""

    _spec = BATCHED["sgd_batched"]

    def current_lr_factor(self) -> List[float]:
        """s(k_c // decay_every) of each client's next step."""
        return [self.schedule.factor(k) for k in self.round_step]


class BatchedNeuronLRSGD(ClientBatched, NeuronLRSGD):
    """NeuronLRSGD for ``C`` stacked clients; each client's per-neuron scales are one row of a
    ``[C, M]`` tensor (FedNLR: x[c, m, ...] -= lr * r[c, m] * buf[c, m, ...])."""

    _spec = BATCHED["sgd_batched"]

    def _scale_shape(self, p: torch.Tensor) -> Tuple[Optional[Tuple[int, ...]], str]:
        if p.dim() < 2:
            return None, "no scale (no output dimension)"
        return tuple(p.shape[:2]), f"shape {tuple(p.shape[:2])} ([clients, M])"


class BatchedFedNAR(ClientBatched, FedNAR):
    """FedNAR for ``C`` stacked clients: each client clips its own ``d`` by its own global norm
    (over all of that client's tensors), with ``l_t = lr * lr_scale[c] * round_decay ** t_c``."""

    _spec = BATCHED["fednar_batched"]


class BatchedPAdaMFed(ClientBatched, PAdaMFed):
    """PAdaMFed's client step for ``C`` stacked clients: every client's step moves its own
    parameters by exactly ``eta`` (per-client normalisation); ``local_control()`` is each
    client's ``acc / K_c``."""

    _spec = BATCHED["padamfed_batched"]

    @torch.no_grad()
    def local_control(self) -> List[torch.Tensor]:
        """Each client's new control ``acc / K_c`` (``K_c``: the steps client c took), stacked ``[C, ...]``."""
        if self._host_steps == 0:
            raise RuntimeError("local_control() needs at least one step() since start_round()")
        out = []
        for p in self._params_flat:
            acc = self.state[p]["acc"]
            k = self._k_dev.to(acc.dtype) if self._k_dev is not None else torch.tensor(self._k_host, dtype=acc.dtype)
            out.append(acc / k.view(-1, *([1] * (acc.dim() - 1))))
        return out


__all__ = ["BatchedFedDecaySGD", "BatchedNeuronLRSGD", "BatchedFedNAR", "BatchedPAdaMFed"]
