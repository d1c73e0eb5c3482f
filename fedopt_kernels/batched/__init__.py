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

from typing import Any, Dict, List, Optional, Tuple

import torch

from .._base import state_dtype
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
    client's ``acc / K_c``, or for a client that took no step the local control it was given."""

    _spec = BATCHED["padamfed_batched"]
    # the local control given to start_round: what a client without a step this round keeps
    _float32_state = PAdaMFed._float32_state + ("local_control",)
    _state_keys = PAdaMFed._state_keys + ("local_control",)

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        super()._apply_round_inputs(inputs)
        ci = inputs["local_control"]
        for i, p in enumerate(self._params_flat):
            if ci is None:
                self.state[p].pop("local_control", None)
            else:
                self.state[p]["local_control"] = ci[i].detach().to(state_dtype(p)).clone(
                    memory_format=torch.contiguous_format)

    @torch.no_grad()
    def local_control(self) -> List[torch.Tensor]:
        """Each client's new control ``acc / K_c`` (``K_c``: the steps client c took), stacked ``[C, ...]``;
        a client with ``K_c = 0`` keeps the local control it was given at start_round (zeros if none)."""
        out = []
        for p in self._params_flat:
            st = self.state[p]
            acc = st["acc"]
            k = self._k_dev.to(acc.dtype) if self._k_dev is not None else torch.tensor(self.round_step, dtype=acc.dtype)
            k = k.to(acc.device).view(-1, *([1] * (acc.dim() - 1)))
            given = st.get("local_control")
            kept = given if given is not None else torch.zeros_like(acc)
            # no host sync: the choice is made on the device, per client
            out.append(torch.where(k > 0, acc / k.clamp(min=1), kept))
        return out


__all__ = ["BatchedFedDecaySGD", "BatchedNeuronLRSGD", "BatchedFedNAR", "BatchedPAdaMFed"]
