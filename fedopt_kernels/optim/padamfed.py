"""PAdaMFed: normalized momentum with control variates and parameter-free step sizes (docs/algorithms.md)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..batched.mixin import ClientBatched
from ..core import dtensor as _dtensor
from ..core.ops import BATCHED, PADAMFED
from ..core.optimizer import FedOptimizer, check_number, check_tensor_list, state_dtype


class PAdaMFed(FedOptimizer):
    r"""Normalized momentum with control variates, parameter-free step sizes (PAdaMFed).

    The client optimizer of "Problem-Parameter-Free Federated Learning" (Wenjing Yan, Kai Zhang,
    Xiaolu Wang, Xuanyu Cao), Alg. 1 and Thm. 1-2.

    Per round the client receives the global control ``c``, the global momentum ``m`` and keeps its
    own control ``c_i``: ``start_round(global_control=c, local_control=c_i, momentum=m)`` (missing
    lists count as zeros). With ``D = beta * (c - c_i) + (1 - beta) * m``, step k with raw gradient
    ``G``::

        v    = beta * G + D                    (variance_reduction: v = G + D - (1 - beta) * H)
        x   -= eta * v / max(||v||_2, eps)     (norm over all parameters, squares summed in float64:
                                               each step moves x by exactly eta)
        acc += G

    ``H`` is the gradient of the same mini-batch at the round's starting model, passed as
    ``step(anchor_grads=[...])``. After the round, ``local_control()`` returns ``acc / K``, the
    client's new ``c_i``. ``lr`` is ``eta`` (round ``t``'s: ``lr * round_decay ** t``, default
    ``round_decay`` 1); ``theory_hparams`` gives eta, gamma and beta.
    D and acc are kept in float32 (float64 for float64 parameters).
    """

    _spec = PADAMFED
    _accepts_correction = False
    _float32_state: Tuple[str, ...] = ("D", "acc")
    _state_keys: Tuple[str, ...] = ("D", "acc")
    _step_input = "anchor_grads"

    def __init__(
        self,
        params: Iterable,
        lr: float,
        beta: float,
        variance_reduction: bool = False,
        eps: float = 1e-12,
        round_decay: float = 1.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
    ):
        defaults = dict(lr=lr, beta=beta, variance_reduction=bool(variance_reduction), eps=eps, round_decay=round_decay)
        super().__init__(params, defaults, backend, replay)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("beta", group["beta"], low=0.0, high=1.0)
        check_number("eps", group["eps"], low=0.0, low_open=True)

    def _structure(self, group: Dict[str, Any]) -> tuple:
        return super()._structure(group) + (bool(group["variance_reduction"]),)

    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        names_in = ("global_control", "local_control", "momentum")
        got = {k: inputs.pop(k, None) for k in names_in}
        super()._check_round_inputs(inputs)
        params = self._params_flat
        return {k: (None if v is None else check_tensor_list(k, v, params, self._name_of)) for k, v in got.items()}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        c, ci, m = inputs["global_control"], inputs["local_control"], inputs["momentum"]
        i = 0
        for group in self.param_groups:
            beta = group["beta"]
            for p in group["params"]:
                dt = state_dtype(p)
                D = torch.zeros_like(p, dtype=dt, memory_format=torch.contiguous_format)
                if c is not None:
                    D.add_(c[i].to(dt), alpha=beta)
                if ci is not None:
                    D.sub_(ci[i].to(dt), alpha=beta)
                if m is not None:
                    D.add_(m[i].to(dt), alpha=1 - beta)
                st = self.state[p]
                st["D"] = D
                st["acc"] = torch.zeros_like(p, dtype=dt, memory_format=torch.contiguous_format)
                i += 1

    def _step_roles(self) -> Tuple[str, ...]:
        return ("anchor_grad",)

    def _check_step_inputs(self, anchor: Any) -> Dict[str, List[Optional[torch.Tensor]]]:
        params = self._params_flat
        vr = [g["variance_reduction"] for g in self.param_groups]
        if anchor is None:
            if any(vr):
                raise ValueError(
                    "variance_reduction=True needs step(anchor_grads=[...]): the gradients of "
                    "the same mini-batch at the round's starting model, one per parameter"
                )
            return {}
        if not any(vr):
            raise ValueError("anchor_grads was given but variance_reduction=False")
        if not isinstance(anchor, (list, tuple)) or len(anchor) != len(params):
            raise TypeError(
                f"anchor_grads must be a list with one tensor (or None) per parameter "
                f"({len(params)}), got {type(anchor).__name__}"
                + (f" of length {len(anchor)}" if isinstance(anchor, (list, tuple)) else "")
            )

        def entry_name(i: int) -> Callable[[int], str]:  # check_tensor_list's names for entry i alone
            return lambda _j: self._name_of(i)

        for i, (t, p) in enumerate(zip(anchor, params, strict=True)):
            if p.grad is None:
                continue
            if t is None:
                raise ValueError(f"anchor_grads entry for {self._name_of(i)} is None but the parameter has a gradient")
            if (
                not isinstance(t, torch.Tensor)
                or t.shape != p.shape
                or t.device != p.device
                or t.is_sparse
                or t.is_complex()
                or _dtensor.misplaced(t, p)
            ):
                check_tensor_list("anchor_grads", [t], [p], entry_name(i))
        return {"anchor_grad": list(anchor)}

    def _step_tensors(self, p, group, state, idx):
        tensors, override = super()._step_tensors(p, group, state, idx)
        if "D" not in state or "acc" not in state:
            raise RuntimeError(
                f"{self._name_of(idx)} has no PAdaMFed round state (D, acc): it was added to the "
                f"optimizer after start_round(); call start_round() before the next step()"
            )
        tensors["D"], tensors["acc"] = state["D"], state["acc"]
        if group["variance_reduction"]:
            tensors["anchor_grad"] = p  # marks the role present; each step's anchor_grads fill it (_step_roles)
        return tensors, override

    @torch.no_grad()
    def local_control(self) -> List[torch.Tensor]:
        """The client's new control ``c_i' = acc / K`` after the round's K steps, one per parameter."""
        if self._k_bound() == 0:
            raise RuntimeError("local_control() needs at least one step() since start_round()")
        k = self._k()
        if not isinstance(k, torch.Tensor):
            return [self.state[p]["acc"] / k for p in self._params_flat]
        # K from the device counter (steps skipped by GradScaler do not count): no host sync
        return [_dtensor.divided(self.state[p]["acc"], k) for p in self._params_flat]


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
                self.state[p]["local_control"] = (
                    ci[i].detach().to(state_dtype(p)).clone(memory_format=torch.contiguous_format)
                )

    @torch.no_grad()
    def local_control(self) -> List[torch.Tensor]:
        """Each client's new control ``acc / K_c`` (``K_c``: the steps client c took), stacked ``[C, ...]``;
        a client with ``K_c = 0`` keeps the local control it was given at start_round (zeros if none)."""
        out = []
        counted = self._k()
        for p in self._params_flat:
            st = self.state[p]
            acc = st["acc"]
            k = (
                counted.to(acc.dtype)
                if isinstance(counted, torch.Tensor)
                else torch.tensor(self.round_step, dtype=acc.dtype)
            )
            k = k.to(acc.device).view(-1, *([1] * (acc.dim() - 1)))
            given = st.get("local_control")
            kept = given if given is not None else torch.zeros_like(acc)
            # no host sync: the choice is made on the device, per client
            out.append(torch.where(k > 0, acc / k.clamp(min=1), kept))
        return out


def theory_hparams(S: int, K: int, T: int, variance_reduction: bool = False) -> Tuple[float, float, float]:
    """PAdaMFed's step sizes from theory ("Problem-Parameter-Free Federated Learning", Thm. 1-2):
    returns ``(eta, gamma, beta)``.

    non-VR: ``eta = 1/(K sqrt(T))``, ``gamma = (S K)^(1/4) / T^(3/4)``, ``beta = min(1, sqrt(S K / T))``;
    VR: ``eta = 1/(K T)``, ``gamma = beta = min(1, (S K)^(1/3) / T^(2/3))``.
    ``S``: clients sampled per round, ``K``: local steps, ``T``: rounds.
    """
    for name, v in (("S", S), ("K", K), ("T", T)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if variance_reduction:
        eta = 1.0 / (K * T)
        gamma = beta = min(1.0, (S * K) ** (1.0 / 3.0) / T ** (2.0 / 3.0))
    else:
        eta = 1.0 / (K * math.sqrt(T))
        gamma = (S * K) ** 0.25 / T**0.75
        beta = min(1.0, math.sqrt(S * K / T))
    return eta, gamma, beta
