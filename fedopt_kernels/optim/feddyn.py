"""FedDyn: dynamic regularization (docs/algorithms.md), on the ``sgd`` op of FedDecaySGD.

The client's local step is FedDecaySGD's with the FedProx term ``alpha * (x - x0)`` and the
correction ``-g_i``, so every backend runs it with the kernels it already has. ``-g_i`` is kept
as the state tensor the step reads (negation is exact), so a step makes no copy of it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..batched.mixin import ClientBatched
from ..core.ops import BATCHED
from ..core.optimizer import ROUND_KEY, check_number, check_tensor_list, round_entry
from ..core.schedules import DecaySchedule, ScheduleLike
from .sgd import SGDFamily

Tensors = List[torch.Tensor]

# per-parameter state: -g_i, the correction every local step adds to the gradient
_NEG_G = "dyn_correction"


def _compute(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 (float64 for float64 tensors), as the kernels compute."""
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


class FedDyn(SGDFamily):
    r"""Dynamic regularization: a per-client linear term and a proximal term (FedDyn).

    From "Federated Learning Based on Dynamic Regularization" (Durmus Alp Emre Acar, Yue Zhao,
    Ramon Matas, Matthew Mattina, Paul Whatmough, Venkatesh Saligrama; ICLR 2021).
    Client i keeps ``g_i`` (one tensor per parameter, zero at the start). In a round it receives
    the global model ``x0`` and minimises ``L_i(x) - <g_i, x> + (alpha/2) ||x - x0||^2``; step k::

        d     = g + weight_decay * x - g_i + alpha * (x - x0)
        lr_k  = lr * s(k // decay_every)          (FedDecaySGD's within-round schedule)

    then one ``torch.optim.SGD`` step with ``lr_k`` (momentum, dampening, nesterov, maximize:
    ``maximize`` negates ``g`` only). After local training, ``end_round()`` updates::

        g_i  <-  g_i - alpha * (x - x0)

    ``x0`` is taken at every ``start_round()``; ``g_i`` persists across rounds and is part of the
    ``state_dict`` (as ``-g_i``, key ``"dyn_correction"``, in the parameter's dtype);
    ``dyn_grad()`` returns it and ``start_round(dyn_grad=...)`` sets it. The server rule is
    ``feddyn_server_step``. FedDyn's own terms take the places of FedProx and SCAFFOLD: ``prox_mu``
    and ``start_round(correction=...)`` are refused.

    Args:
        params: parameters or param groups.
        lr: base learning rate (read from each param group at every step).
        alpha: the dynamic regularization coefficient, > 0 (keyword, required; per param group).
        beta, schedule, decay_every: FedDecaySGD's within-round decay (default: none).
        momentum, dampening, nesterov, weight_decay, maximize: as ``torch.optim.SGD``.
        round_decay: the learning rate of round ``t`` is ``lr * round_decay ** t`` (default 1: none).
        backend: "auto", "reference", "triton", "cuda" or "cpu" (docs/backends.md).
        replay: record a GPU step in a CUDA graph and replay it while its launch inputs stay the
            same (docs/replay.md); None: on unless ``FEDOPT_REPLAY=0``.
    """

    schedule: DecaySchedule
    _accepts_correction = False
    _state_keys: Tuple[str, ...] = ("momentum_buffer", "x0", _NEG_G)
    # the sgd op's FedProx column carries alpha: its math, prox_mu * (x - x0), is FedDyn's alpha term
    _hp_columns = {"prox_mu": "alpha"}

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        alpha: float,
        beta: float = 1.0,
        schedule: ScheduleLike = "exponential",
        decay_every: int = 1,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        maximize: bool = False,
        round_decay: float = 1.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
        **unsupported: Any,
    ):
        if "prox_mu" in unsupported:
            raise TypeError("FedDyn takes no prox_mu: its alpha * (x - x0) term takes FedProx's place (use alpha)")
        if unsupported:
            raise TypeError(f"FedDyn got unexpected keyword arguments {sorted(unsupported)}")
        check_number("alpha", alpha, low=0.0, low_open=True)  # before anything is built
        self._round_ended = False  # end_round() was called in the current round
        self.schedule = DecaySchedule(beta, schedule, decay_every)
        defaults = dict(
            lr=lr,
            alpha=alpha,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            maximize=maximize,
            round_decay=round_decay,
        )
        super().__init__(params, defaults, backend, replay)

    # ---------------------------------------------------------------- hyperparameters
    def _validate_group(self, group: Dict[str, Any]) -> None:
        if "prox_mu" in group:
            raise TypeError("FedDyn's param groups take no prox_mu: its alpha * (x - x0) term takes FedProx's place")
        super()._validate_group(group)
        check_number("alpha", group["alpha"], low=0.0, low_open=True)

    # ---------------------------------------------------------------- rounds
    def start_round(
        self, *, reset_state: bool = True, correction: Optional[Sequence[torch.Tensor]] = None, **inputs: Any
    ) -> None:
        """Begin local training on a freshly received global model: ``x0 = x`` for every parameter,
        the step counter to 0, momentum buffers cleared unless ``reset_state=False``.

        ``g_i`` is kept from the previous round, unless ``dyn_grad=[...]`` (one tensor per parameter
        in param-group order, e.g. what ``dyn_grad()`` returned) gives the client's ``g_i``: a client
        whose optimizer does not live across rounds hands its state back this way.
        """
        if correction is not None:
            raise TypeError(
                "FedDyn.start_round() takes no correction: FedDyn's own -g_i term takes SCAFFOLD's "
                "place (its g_i is kept by the optimizer and updated by end_round())"
            )
        super().start_round(reset_state=reset_state, **inputs)

    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        given = inputs.pop("dyn_grad", None)
        super()._check_round_inputs(inputs)
        if given is not None:
            given = check_tensor_list("dyn_grad", given, self._params_flat, self._name_of)
            for i, t in enumerate(given):
                if not t.is_floating_point():
                    raise TypeError(
                        f"dyn_grad entry for {self._name_of(i)} has dtype {t.dtype}; it must be floating point"
                    )
        return {"dyn_grad": given}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        super()._apply_round_inputs(inputs)
        given = inputs.get("dyn_grad")
        for i, p in enumerate(self._params_flat):
            st = self.state[p]
            st["x0"] = p.detach().clone(memory_format=torch.preserve_format)
            if given is not None:  # stored negated (exact) in the parameter's dtype
                neg = torch.empty_like(p, memory_format=torch.preserve_format)
                st[_NEG_G] = neg.copy_(given[i].detach()).neg_()
            elif _NEG_G not in st:
                st[_NEG_G] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self._round_ended = False

    def _step_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        if self._round_ended:
            raise RuntimeError(
                "step() after end_round(): the round is over; call start_round() with the next global model first"
            )
        if "x0" not in state or _NEG_G not in state:  # checked before the momentum buffer is made
            raise RuntimeError(
                f"{self._name_of(idx)} has no FedDyn round state (x0, g_i): it was added to the "
                f"optimizer after start_round(); call start_round() before the next step()"
            )
        tensors, override = super()._step_tensors(p, group, state, idx)
        tensors["x0"] = state["x0"]
        tensors["correction"] = state[_NEG_G]
        return tensors, override

    @torch.no_grad()
    def end_round(self) -> None:
        """After local training: ``g_i <- g_i - alpha * (x - x0)`` for every parameter (each group's
        alpha), on the parameters' device without a host sync.

        Once per round: a second call in the same round, a call before any ``start_round()`` and a
        ``step()`` after it raise RuntimeError and change nothing. A client that took no step keeps
        its ``g_i`` (``x == x0``).
        """
        if self._t < 0:
            raise RuntimeError("end_round() before any start_round(): there is no round to end")
        if self._round_ended:
            raise RuntimeError(
                "end_round() was already called in this round; g_i is updated once per round "
                "(call start_round() for the next one)"
            )
        entries: List[Tuple[torch.Tensor, Dict[str, Any], float]] = []
        for group in self.param_groups:  # everything checked before any g_i changes
            alpha = check_number("alpha", group["alpha"], low=0.0, low_open=True)
            for p in group["params"]:
                st = self.state.get(p, {})
                if "x0" not in st or _NEG_G not in st:
                    raise RuntimeError(
                        f"{self._name_of(len(entries))} has no FedDyn round state: it was added "
                        f"after start_round(), so this round has no x0 for it"
                    )
                entries.append((p, st, alpha))
        for p, st, alpha in entries:
            neg = st[_NEG_G]
            # -g_i + alpha * (x - x0) in the compute dtype, rounded once to the state's dtype
            neg.copy_(_compute(neg) + alpha * (_compute(p.detach()) - _compute(st["x0"])))
        self._round_ended = True
        self._drop_plan()  # the next step() must see that the round is over (a graph's replay too)

    @torch.no_grad()
    def dyn_grad(self) -> Tensors:
        """Copies of ``g_i``, one per parameter in param-group order (zeros before the first round)."""
        out = []
        for p in self._params_flat:
            neg = self.state.get(p, {}).get(_NEG_G)
            out.append(torch.zeros_like(p) if neg is None else neg.neg())
        return out

    # ---------------------------------------------------------------- state_dict
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        for entry in [sd[ROUND_KEY]] + [g[ROUND_KEY] for g in sd["param_groups"]]:
            entry["round_ended"] = self._round_ended
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        rnd = round_entry(state_dict)
        assert rnd is not None  # the base class refused a state_dict without its round entry
        self._round_ended = bool(rnd.get("round_ended", False))


class BatchedFedDyn(ClientBatched, FedDyn):
    """FedDyn for ``C`` stacked clients (docs/client_batched.md): parameters, ``x0``, momentum
    buffers and ``-g_i`` are ``[C, *shape]``; one alpha per param group. ``end_round()`` updates
    every client's ``g_i``; a client that took no step in the round keeps its own."""

    _spec = BATCHED["sgd_batched"]

    def current_lr_factor(self) -> List[float]:  # type: ignore[override]  # one factor per client
        """s(k_c // decay_every) of each client's next step."""
        return [self.schedule.factor(k) for k in self.round_step]
