"""What turns a per-client optimizer of the package into its client-batched form (docs/client_batched.md).

Parameters are stacked client copies ``[C, *shape]``; so is every state tensor. Per-client inputs
(round index, learning-rate scale, active mask, the within-round counter) live in ``[C]``
tensors and per-client hp rows, so one step updates every client at once, and client ``c`` ends
up exactly where the per-client optimizer would have taken it alone.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..core.ops import FRESH
from ..core.optimizer import ROUND_KEY, FedOptimizer
from ..core.plan_inputs import param_name


def _per_client(name: str, value: Any, C: int, cast: Callable[[str, Any], Any]) -> Optional[List]:
    """None, one value for all clients, or one per client -> a list of C host values (``cast`` checks each)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name} must hold real numbers, got a {value.dtype} tensor")
        value = value.detach().cpu().reshape(-1).tolist() if value.dim() else value.item()
    if isinstance(value, (list, tuple)):
        if len(value) != C:
            raise ValueError(f"{name} has {len(value)} values but there are {C} clients")
        return [cast(name, v) for v in value]
    return [cast(name, value)] * C


def _real(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must hold numbers, got {v!r}")
    return float(v)


def _round_number(name: str, v: Any) -> int:
    """A round index: a non-negative integer (an integral float counts); fractions, NaN, inf refused, not truncated."""
    x = _real(name, v)
    if not (math.isfinite(x) and x >= 0 and x == int(x)):
        raise ValueError(f"{name} must hold non-negative integers, got {v!r}")
    return int(x)


class ClientBatched(FedOptimizer):
    """Mixin placed before a per-client optimizer class: ``class BatchedX(ClientBatched, X)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.num_clients: Optional[int] = None
        self._t_clients: Optional[List[int]] = None  # per-client round index of the current round
        self._lr_scale: Optional[List[float]] = None  # per-client learning-rate factor
        self._fresh_round = True  # momentum buffers are new this round
        self._active: Optional[torch.Tensor] = None  # this step's active mask
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ parameters: [C, *shape]
    def _check_new_params(self, params: List[torch.Tensor], gi: int) -> None:
        super()._check_new_params(params, gi)
        for pi, p in enumerate(params):
            if p.dim() == 0:
                raise ValueError(
                    f"{param_name(gi, pi, p)} is 0-dim; client-batched parameters are stacked "
                    f"client copies with a leading client dimension [C, *shape]"
                )
            if self.num_clients is None:
                if p.shape[0] == 0:
                    raise ValueError(
                        f"{param_name(gi, pi, p)} has leading (client) dimension 0: a client-batched "
                        f"optimizer needs at least one client"
                    )
                self.num_clients = int(p.shape[0])
            elif p.shape[0] != self.num_clients:
                raise ValueError(
                    f"{param_name(gi, pi, p)} has leading (client) dimension {p.shape[0]} but other "
                    f"parameters have {self.num_clients}"
                )

    def _num_clients(self) -> int:
        """C: set by the first parameter (torch's Optimizer refuses an empty parameter list)."""
        assert self.num_clients is not None
        return self.num_clients

    # ------------------------------------------------------------------ rounds
    @property
    def round_step(self) -> List[int]:  # type: ignore[override]  # one k per client, where the base has one
        """k of every client: the steps each one took since the last start_round."""
        k = self._k()
        if isinstance(k, torch.Tensor):
            return [int(v) for v in k.tolist()]
        return list(k) if isinstance(k, (list, tuple)) else [int(k)] * (self.num_clients or 0)

    def _new_counter(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.round_step, dtype=torch.int32, device=device)

    @torch.no_grad()
    def start_round(
        self,
        *,
        reset_state: bool = True,
        correction: Optional[Sequence[torch.Tensor]] = None,
        round_index: Any = None,
        lr_scale: Any = None,
        **inputs: Any,
    ) -> None:
        """Begin a round for every client (docs/algorithms.md per client).

        ``round_index``: the round index ``t`` of each client (an int for all, or C ints; default:
        this optimizer's own round count); ``lr_scale``: a factor on every group's learning rate
        per client (default 1). Corrections, controls and scales are ``[C, *shape]`` tensors.
        """
        C = self._num_clients()
        t = _per_client("round_index", round_index, C, _round_number)
        scale = _per_client("lr_scale", lr_scale, C, _real)
        if scale is not None and any(not (v >= 0 and v != float("inf")) for v in scale):
            raise ValueError(f"lr_scale must be finite and >= 0 per client, got {lr_scale!r}")
        had_buffers = any("momentum_buffer" in self.state.get(p, ()) for p in self._params_flat)
        super().start_round(reset_state=reset_state, correction=correction, **inputs)
        self._t_clients = t
        self._lr_scale = scale
        self._fresh_round = reset_state or not had_buffers

    @property
    def client_round_index(self) -> List[int]:
        """t of every client in the current round (given to start_round, else this optimizer's round count)."""
        return list(self._t_clients) if self._t_clients is not None else [max(self._t, 0)] * self._num_clients()

    # ------------------------------------------------------------------ state_dict: what start_round was given
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd[ROUND_KEY].update(
            clients=self.num_clients,
            client_round_index=self._t_clients,
            lr_scale=self._lr_scale,
            fresh_round=self._fresh_round,
        )
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        rnd = state_dict.get(ROUND_KEY) if isinstance(state_dict, dict) else None
        if isinstance(rnd, dict):  # checked before anything is loaded (a refused load changes nothing)
            counts = {"clients": rnd.get("clients")}
            for key in ("k", "client_round_index", "lr_scale"):
                if isinstance(rnd.get(key), (list, tuple)):
                    counts[key] = len(rnd[key])
            for key, n in counts.items():
                if n is not None and n != self.num_clients:
                    raise ValueError(
                        f"state_dict was saved by a client-batched optimizer with {n} clients ({key}), "
                        f"this one has {self.num_clients} clients"
                    )
        super().load_state_dict(state_dict)
        assert rnd is not None  # the base class refused a state_dict without its round entry
        self._t_clients = None if rnd.get("client_round_index") is None else [int(v) for v in rnd["client_round_index"]]
        self._lr_scale = None if rnd.get("lr_scale") is None else [float(v) for v in rnd["lr_scale"]]
        self._fresh_round = bool(rnd.get("fresh_round", True))

    # ------------------------------------------------------------------ per-client hp rows
    def _clients(self) -> Optional[int]:
        return self.num_clients

    def _group_rows(self, group: Dict[str, Any]):
        # client c's row is the per-client optimizer's row for its round, its lr column (OpSpec.lr)
        # times lr_scale[c]; a tensor lr becomes (lr * round decay of c's round) * lr_scale[c]
        C = self._num_clients()
        ts = self._t_clients or [max(self._t, 0)] * C
        rows = tuple(tuple(self._row_of(group, t)) for t in ts)
        factor = None
        if isinstance(group["lr"], torch.Tensor):
            a = tuple(self._lr_factor(group, t) for t in ts)
            factor = None if all(v == 1.0 for v in a) else a
        return rows, factor, None if self._lr_scale is None else tuple(self._lr_scale)

    def _step_tensors(self, p, group, state, idx):
        tensors, override = super()._step_tensors(p, group, state, idx)
        # per client, the first-step rule comes from k == 0 under the FRESH bit (not a one-step plan)
        override.pop("dampening", None)
        return tensors, override

    def _extra_present(self, tensors: Dict[str, torch.Tensor]) -> int:
        return FRESH if ("momentum_buffer" in tensors and self._fresh_round) else 0

    # ------------------------------------------------------------------ step
    def _active_for(self, device: torch.device) -> Optional[torch.Tensor]:
        return self._active

    def check_active(self, active: Any) -> Optional[torch.Tensor]:
        """``active`` as the batched ops take it: a bool tensor ``[C]`` on the parameters' device (or None)."""
        if active is None:
            return None
        if not isinstance(active, torch.Tensor):
            active = torch.tensor(list(active))
        if active.shape != (self.num_clients,) or active.dtype != torch.bool:
            raise ValueError(
                f"active must be a bool tensor of shape ({self.num_clients},) (one flag per "
                f"client), got {active.dtype} {tuple(active.shape)}"
            )
        device = self._params_flat[0].device
        if active.device != device:
            active = active.to(device, non_blocking=True)
        return active

    @torch.no_grad()
    def step(self, closure=None, *, active: Any = None, **step_inputs: Any):
        """One local step of every active client (``active``: C bools, default all).

        An inactive client's parameters, state and step counter stay as they are: a client with
        fewer local steps than the others sits out the rest of the round.
        """
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "torch.compile of a client-batched step is not supported; capture the batched "
                "step in a CUDA graph instead (its steps never synchronise with the host)"
            )
        active = self.check_active(active)
        self._active = active
        try:
            # not super().step: torch wraps each instantiated class's step with the hooks, so the
            # per-client class's step may be wrapped too and would run them a second time
            return FedOptimizer.step(self, closure, **step_inputs)
        finally:
            self._active = None
