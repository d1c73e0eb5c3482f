"""``torch.compile`` of the layers engine's step: a whole-step candidate beside the layers' formulations.

``CompiledLayersLoss`` is a ``LayersLoss`` (the same interface: ``grads``, ``grads_at``, ``logits``,
``input_stage``, ``layers_net``, ``engine``) whose loss over all clients::

    sum_c loss_c,   loss_c = sum_b w[c, b] * CE(f(theta_c; x[c, b]), y[c, b])

is compiled by ``torch.compile`` at its first call (``dynamic=False``), through the formulations the
layers have then; AOTAutograd compiles its backward with it, so ``grads`` and ``grads_at`` run a
compiled forward and backward. ``logits`` (evaluation) runs eagerly.

- ``fullgraph=True`` first (unless built with ``fullgraph=False``). Where Dynamo cannot take the step
  as one graph (``nn.LSTM``'s fused kernel, the LSTM's ``loop`` formulation), it compiles the parts
  between the breaks instead, and the attribute ``fullgraph`` says which it got.
- Where compiling fails anyway, the call raises ``NotCompilable`` with the reason, and so does every
  later call at once; a chooser takes it for "not a candidate". The eager engine first reruns the
  same call: an error of the inputs is raised as the eager engine raises it, not as ``NotCompilable``.
- Compiled code is specialised: new shapes (another number of clients) or other formulations compile
  again (Dynamo's guards), at most ``torch._dynamo.config.recompile_limit`` times for one engine; past
  that the call raises ``NotCompilable`` rather than silently running eagerly.
- Built with ``fallback=True`` (the engine a run trains through), a step that cannot be compiled
  or whose compiled code fails runs eagerly instead, then and for the rest of the run, with one
  warning naming the error (``core/fallbacks.py``; ``fallback_reason`` keeps it). An error of the
  inputs still raises, as the eager engine raises it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from ...core import fallbacks
from .layers_engine import LayersLoss

Grads = Tuple[Tuple[torch.Tensor, ...], torch.Tensor]


class NotCompilable(RuntimeError):
    """``torch.compile`` cannot compute this engine's step; the message says why."""


def _reason(exc: BaseException) -> str:
    """The exception's first line, and its root cause's (a compiler's failure arrives wrapped)."""

    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}"

    root = exc
    while getattr(root, "inner_exception", None) is not None or root.__cause__ is not None:
        root = getattr(root, "inner_exception", None) or root.__cause__  # type: ignore[assignment]
    return (line(exc) if root is exc else f"{line(exc)} {line(root)}")[:400]


def _strict_recompiles() -> Any:
    """Past the recompile limit Dynamo would run the step eagerly without a word: make it raise."""
    config = torch._dynamo.config
    if hasattr(config, "fail_on_recompile_limit_hit"):
        return config.patch(fail_on_recompile_limit_hit=True)
    return contextlib.nullcontext()


class CompiledLayersLoss(LayersLoss):
    """``LayersLoss`` with its loss compiled (module docstring); ``backend``: ``torch.compile``'s;
    ``fullgraph=False``: compile in parts from the start."""

    engine = "layers-compiled"

    def __init__(
        self,
        model: nn.Module,
        formulations: Optional[Dict[str, str]] = None,
        order: Optional[str] = None,
        backend: Any = "inductor",
        fullgraph: bool = True,
        precision: str = "fp32",
        fallback: bool = False,
    ):
        super().__init__(model, formulations, order, precision)
        self.fallback = fallback
        self.fallback_reason: Optional[str] = None  # fallback=True: why the steps now run eagerly
        self.backend = backend
        self._first = fullgraph
        self.fullgraph: Optional[bool] = None  # what the compiled step was built with (None: not built yet)
        self._compiled: Optional[Callable[..., torch.Tensor]] = None
        self._broken: Optional[str] = None  # why compiling failed, once it has
        self._eager = False  # the eager engine reruns a failed call

    def _traced(self, params: Sequence[torch.Tensor], x, y, w) -> torch.Tensor:
        return LayersLoss._loss(self, params, x, y, w)

    def _build(self, fullgraph: bool) -> None:
        self._compiled = torch.compile(self._traced, fullgraph=fullgraph, dynamic=False, backend=self.backend)
        self.fullgraph = fullgraph

    def _loss(self, params: Sequence[torch.Tensor], x, y, w) -> torch.Tensor:
        if self._eager:
            return LayersLoss._loss(self, params, x, y, w)
        if self._compiled is None:
            self._build(fullgraph=self._first)
        assert self._compiled is not None
        with _strict_recompiles():
            return self._compiled(params, x, y, w)

    def _run(self, method: Callable[..., Grads], *args: Any) -> Grads:
        if self._broken is not None:
            if self.fallback:
                return self._eager_call(method, args)
            raise NotCompilable(self._broken)
        try:
            return method(*args)
        except Exception as exc:  # noqa: BLE001 - sorted below: the compiler's failure or the inputs'
            failure: BaseException = exc
        if self.fullgraph and isinstance(failure, torch._dynamo.exc.Unsupported):
            self._build(fullgraph=False)  # a graph break: compile the parts between the breaks
            try:
                return method(*args)
            except Exception as exc:  # noqa: BLE001
                failure = exc
        out = self._eager_call(method, args)  # raises what the eager engine raises if the inputs are at fault
        self._compiled = None
        backend = getattr(self.backend, "__name__", self.backend)
        self._broken = f"torch.compile ({backend}) cannot compute {type(self.model).__name__}: {_reason(failure)}"
        if not self.fallback:
            raise NotCompilable(self._broken) from failure
        said = NotCompilable(self._broken)  # the compiler's failure arrives wrapped: name its root cause too
        self.fallback_reason = fallbacks.fall_back("the compiled step (torch.compile)", said, "eager steps", 5).error
        return out

    def _eager_call(self, method: Callable[..., Grads], args: tuple) -> Grads:
        self._eager = True
        try:
            return method(*args)
        finally:
            self._eager = False

    def grads(self, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Grads:
        """``LayersLoss.grads`` through the compiled step; ``NotCompilable`` if it cannot be compiled."""
        return self._run(super().grads, params, x, y, w)

    def grads_at(self, shared: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Grads:
        """``LayersLoss.grads_at`` through the compiled step; ``NotCompilable`` if it cannot be compiled."""
        return self._run(super().grads_at, shared, x, y, w)
