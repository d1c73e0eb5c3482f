"""FedSAM: sharpness-aware local steps (docs/algorithms.md), an ascent op and the ``sgd`` op's descent.

The optimizer and its client-batched form; its FL descriptor (run settings ``sam_rho``, ``sam_eta``,
the variants on FedAvg and SCAFFOLD and ASAM's adaptive form) is ``fl/algorithms/fedsam.py``. A step
has two gradients, so the descriptor's ``local_step`` hands the step a closure that computes the
second one.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch._C import _set_grad_enabled

from ..batched.mixin import ClientBatched
from ..core.ops import BATCHED, SAM_ASCENT
from ..core.optimizer import ROUND_KEY, OtherOp, Prologue, check_number, round_entry
from .sam_steps import SAVED, Pending, Restore
from .sgd import SGDFamily

_TWO_STEPS = (
    "FedSAM takes two gradients per step: call step(closure), whose closure re-evaluates the loss and "
    "calls backward at the perturbed parameters, or first_step(), your forward and backward, then "
    "second_step()"
)


def _without_grad(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` with grad mode off: what ``torch.no_grad()`` does, without the microseconds its
    objects cost a step (eager steps only: a compiled region keeps ``torch.no_grad()``)."""
    grad = torch.is_grad_enabled()
    _set_grad_enabled(False)
    try:
        fn(*args)
    finally:
        _set_grad_enabled(grad)


class FedSAM(SGDFamily):
    r"""Sharpness-aware local steps: an ascent to x + e, then SGD with the gradient there (FedSAM, FedASAM).

    From "Improving Generalization in Federated Learning by Seeking Flat Minima" (Debora Caldarola,
    Barbara Caputo, Marco Ciccone; ECCV 2022) and "Generalized Federated Learning via Sharpness Aware
    Minimization" (Zhe Qu, Xingyu Li, Rui Duan, Yao Liu, Bo Tang, Zhuo Lu; ICML 2022): the clients of
    FedAvg (or SCAFFOLD, FedProx) minimise with SAM (Foret et al., ICLR 2021; ASAM: Kwon et al.,
    ICML 2021). With ``g`` the gradient at ``x``::

        first step:   w = |x| + eta (adaptive) or 1
                      e = rho * w^2 * g / (||w * g|| + eps)      (global norm, squares summed in float64)
                      saved = x;  x += e
        (the gradient g' is computed again at x + e)
        second step:  x = saved (bit for bit), then torch.optim.SGD's step with g'
                      (momentum, dampening, nesterov, weight_decay) plus the SCAFFOLD ``correction``
                      and ``prox_mu * (x - x0)`` (FedProx)

    ``rho = 0`` is that SGD step. Use it as torch users use SAM: ``step(closure)`` after the first
    backward, with a closure that clears the gradients, re-evaluates the loss and calls backward
    (it returns the loss of the perturbed model); or ``first_step()``, forward and backward,
    ``second_step()``. ``step()`` without a closure raises. When the closure raises, ``x`` is
    restored and the first step forgotten before the exception propagates: the model and the
    optimizer are where the step began. The saved ``x`` is optimizer state (``"saved_x"``, in a
    ``state_dict`` only while a second step is pending, with that fact): a ``state_dict`` taken
    between the two steps continues there.

    On a GPU both steps replay recorded launches (docs/replay.md) as the other optimizers' steps do,
    as two recordings: the ascent's, and the descent's, which restores ``x`` first. Two, not one,
    because the caller's forward and backward run between them: a recording holds no user code.

    Args:
        params: parameters or param groups.
        lr: learning rate of the descent (read from each param group at every step).
        rho: radius of the ascent (>= 0; per param group).
        adaptive: ASAM's scale-invariant ascent, ``w = |x| + eta``.
        eta: ASAM's ``eta`` (>= 0).
        momentum, dampening, nesterov, weight_decay: as ``torch.optim.SGD``.
        eps: added to the norm (>= 0).
        prox_mu: FedProx coefficient (anchor taken at ``start_round``).
        round_decay: the descent's learning rate of round ``t`` is ``lr * round_decay ** t`` (default 1).
        backend: "auto", "reference", "triton", "cuda" or "cpu" (docs/backends.md).
        replay: record both steps on a GPU in CUDA graphs (docs/replay.md); None: on unless
            ``FEDOPT_REPLAY=0``.
    """

    _state_keys: Tuple[str, ...] = SGDFamily._state_keys + (SAVED,)
    # GradScaler.step calls step() without a closure: unscale_ by hand, then first_step / second_step
    _step_supports_amp_scaling = False
    _hp_columns = {"maximize": 0.0}  # the sgd op's columns; FedSAM has no maximize
    # the ascent: its hp columns rho, eta, eps, adaptive are the param group's own
    _other_ops = (OtherOp("ascent", SAM_ASCENT, state={"saved_x": SAVED}),)

    def __init__(
        self,
        params: Iterable,
        lr: float,
        rho: float = 0.05,
        adaptive: bool = False,
        eta: float = 0.01,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        eps: float = 1e-12,
        prox_mu: float = 0.0,
        round_decay: float = 1.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
    ):
        self._pending: Optional[Pending] = None  # the last first_step(), until its second_step()
        self._restore: Optional[Restore] = None  # the last restore's tensors (reused while they hold)
        self._restored: Optional[Prologue] = None  # the last descent's restore (step_plans)
        defaults = dict(
            lr=lr,
            rho=rho,
            adaptive=adaptive,
            eta=eta,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            eps=eps,
            prox_mu=prox_mu,
            round_decay=round_decay,
        )
        super().__init__(params, defaults, backend, replay)
        self._sam_ops = self._as_ops()

    def _as_ops(self) -> Tuple[Callable[[], None], Callable[[], None]]:
        """The two steps as torch.compile sees them: each one opaque op whose body is the eager step."""
        return self._opaque(self._first_op), self._opaque(self._second_op)

    def _first_op(self, params: Any, step_inputs: Any, grad_scale: Any, found_inf: Any) -> None:
        self.first_step()

    def _second_op(self, params: Any, step_inputs: Any, grad_scale: Any, found_inf: Any) -> None:
        self.second_step()

    # ---------------------------------------------------------------- hyperparameters
    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("rho", group["rho"], low=0.0)
        check_number("eta", group["eta"], low=0.0)
        check_number("eps", group["eps"], low=0.0)
        if not isinstance(group["adaptive"], bool):
            raise TypeError(f"adaptive must be True or False, got {group['adaptive']!r}")

    # ---------------------------------------------------------------- rounds
    def start_round(self, **kwargs: Any) -> None:
        """Begin a round (docs/algorithms.md); a first step without its second one is forgotten
        (the caller loads the new global model into the parameters)."""
        super().start_round(**kwargs)
        self._pending = None

    # ---------------------------------------------------------------- the two steps
    def first_step(self, **step_inputs: Any) -> None:
        """The ascent: ``saved = x; x += e`` for every parameter with a gradient (its gradient at x).

        Under ``torch.compile`` (``torch.compile(opt.first_step)``) it is one opaque op, as ``step()``
        is for the other optimizers: compiled and eager steps compute the same bits."""
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return self._first(step_inputs) if step_inputs else self._sam_ops[0]()
        _without_grad(self._first, step_inputs)

    def second_step(self) -> None:
        """The descent: every parameter the first step moved back to its saved ``x`` (bit for bit),
        then the SGD step with the gradients now in ``p.grad`` (those at ``x + e``). Compiled like
        ``first_step``."""
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return self._sam_ops[1]()
        _without_grad(self._second)

    def step(self, closure: Optional[Callable[[], Any]] = None, **step_inputs: Any) -> Any:
        """One SAM step: ``first_step()``, ``closure()`` (loss and gradients at ``x + e``),
        ``second_step()``; returns the closure's loss. A closure that raises leaves the parameters
        and the optimizer as they were before the step."""
        return self._sam_step(closure, step_inputs)

    def _sam_step(self, closure: Optional[Callable[[], Any]], step_inputs: Dict[str, Any]) -> Any:
        # not FedSAM.step from the batched form: torch wraps each instantiated class's step with the
        # hooks, so both would run them
        if closure is None:
            raise RuntimeError(f"{type(self).__name__}.step() needs a closure. " + _TWO_STEPS)
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "torch.compile of FedSAM's step(closure) is not supported (its closure runs a forward "
                "and a backward): compile opt.first_step and opt.second_step and call your forward and "
                "backward between them"
            )
        grad = torch.is_grad_enabled()
        try:  # the grad mode set directly: torch.no_grad()'s objects cost microseconds a step
            _set_grad_enabled(False)
            self._first(step_inputs)
            _set_grad_enabled(True)
            try:
                loss = closure()
            except BaseException:
                _set_grad_enabled(False)
                self._abandon()
                raise
            _set_grad_enabled(False)
            self._second()
        finally:
            _set_grad_enabled(grad)
        return loss

    # ---------------------------------------------------------------- what the steps do
    def _first(self, step_inputs: Dict[str, Any]) -> None:
        if self._pending is not None:
            raise RuntimeError(
                "first_step() was called twice without second_step(): the parameters hold x + e; call "
                "second_step() (after the backward at x + e) first"
            )
        if self._t < 0:
            self.start_round()
        active = self._take_active(step_inputs)
        plan = self._run_op("ascent", active=active)
        self._pending = Pending(plan.order, plan, active)

    def _second(self) -> None:
        pending = self._pending
        if pending is None:
            raise RuntimeError("second_step() without first_step(): " + _TWO_STEPS)
        self._pending = None
        self._restored = restore = self._restore_of(pending)
        self._descend(pending, restore)  # the restore runs first in the descent's launch

    def _abandon(self) -> None:
        """The closure raised: ``x`` back to the saved ``x`` (active clients only) and the first step
        forgotten, so that the caller's handler finds the model where the step began."""
        pending = self._pending
        self._pending = None
        if pending is not None:
            pro = self._restore_of(pending)
            if pro is not None:
                pro.run()

    def _restore_of(self, pending: Pending) -> Optional[Prologue]:
        """The restore of what ``pending`` moved, as the descent's prologue."""
        r = self._restore
        if r is None or pending.plan is None or r.source is not pending.plan:
            r = self._restore = Restore(pending.plan, self._params_flat, self.state, pending.order)
        return r.prologue(pending.mask)

    def _take_active(self, step_inputs: Dict[str, Any]) -> Optional[torch.Tensor]:
        if step_inputs:
            raise TypeError(f"{type(self).__name__} steps take no {sorted(step_inputs)}")
        return None

    def _descend(self, pending: Pending, restore: Optional[Prologue]) -> None:
        self._run_after(restore)

    # ---------------------------------------------------------------- captures
    @property
    def step_plans(self) -> Tuple[Any, ...]:
        """The ascent's plan, the restore (a ``Prologue``) and the descent's plan, once a step ran."""
        plan, ascent, r, pro = self.step_plan, self._op_plan("ascent"), self._restore, self._restored
        if plan is None or ascent is None or r is None or r.source is not ascent:
            return ()
        return (ascent, plan) if pro is None else (ascent, pro, plan)

    # ---------------------------------------------------------------- state_dict
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        pending = self._pending
        if pending is None:  # between steps the saved x is scratch: left out
            state = {}
            for pid, st in sd["state"].items():
                kept = {k: v for k, v in st.items() if k != SAVED}
                if kept:
                    state[pid] = kept
            sd["state"] = state
        for entry in [sd[ROUND_KEY]] + [g[ROUND_KEY] for g in sd["param_groups"]]:
            entry["sam_pending"] = None if pending is None else [int(i) for i in pending.order]
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        rnd = round_entry(state_dict)
        assert rnd is not None  # the base class refused a state_dict without its round entry
        pending = rnd.get("sam_pending")
        self._pending = None if pending is None else Pending([int(i) for i in pending], None, self._loaded_mask(rnd))

    def _loaded_mask(self, rnd: Dict[str, Any]) -> Optional[torch.Tensor]:
        return None

    def __getstate__(self) -> Dict[str, Any]:
        # the restore's tensors are worked out again, as the plans are
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in ("_restore", "_restored", "_sam_ops")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._restore = self._restored = None
        self._sam_ops = self._as_ops()


class BatchedFedSAM(ClientBatched, FedSAM):
    """FedSAM for ``C`` stacked clients: each client's ascent is scaled by its own global norm
    (over all of that client's tensors); ``step(closure, active=mask)`` /
    ``first_step(active=mask)`` leave inactive clients' parameters and state untouched, and
    ``second_step()`` uses the first step's mask (as does the restore after a closure that raised)."""

    _spec = BATCHED["sgd_batched"]

    def step(self, closure: Optional[Callable[[], Any]] = None, *, active: Any = None) -> Any:  # type: ignore[override]
        """One SAM step of every active client (``active``: C bools, default all); see FedSAM.step."""
        return self._sam_step(closure, {} if active is None else {"active": active})

    def _take_active(self, step_inputs: Dict[str, Any]) -> Optional[torch.Tensor]:
        active = step_inputs.pop("active", None)
        if step_inputs:
            raise TypeError(f"{type(self).__name__} steps take no {sorted(step_inputs)}")
        return self.check_active(active)

    def _descend(self, pending: Pending, restore: Optional[Prologue]) -> None:
        self._active = pending.mask
        try:
            self._run_after(restore)
        finally:
            self._active = None

    def state_dict(self) -> Dict[str, Any]:
        # between the two steps the first step's mask says which clients' saved x to restore
        sd = super().state_dict()
        mask = None if self._pending is None else self._pending.mask
        listed = None if mask is None else [bool(v) for v in mask.tolist()]
        for entry in [sd[ROUND_KEY]] + [g[ROUND_KEY] for g in sd["param_groups"]]:
            entry["sam_active"] = listed
        return sd

    def _loaded_mask(self, rnd: Dict[str, Any]) -> Optional[torch.Tensor]:
        mask = rnd.get("sam_active")
        return None if mask is None else self.check_active(torch.tensor(mask, dtype=torch.bool))
