"""The wrapper around every optimizer's ``step``: torch.optim's step hooks and profiler range.

torch.optim wraps ``step`` so that it enters a ``record_function`` range named
``Optimizer.step#<Class>.step`` and runs the global and per-optimizer pre and post hooks. Entering
the range costs a dispatcher call even when no profiler records, a few microseconds of host time
per step, which is most of a replayed step (docs/replay.md). This wrapper runs the same hooks in
the same order and enters the same range, but only while a profiler is running.
"""

from __future__ import annotations

import functools
from itertools import chain
from typing import Any, Callable

import torch
from torch.autograd import profiler
from torch.optim import optimizer as _torch_optimizer


def hooked_step(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def step(self, *args: Any, **kwargs: Any) -> Any:
        if profiler._is_profiler_enabled:
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
                return _with_hooks(func, self, args, kwargs)
        return _with_hooks(func, self, args, kwargs)

    step.hooked = True  # type: ignore[attr-defined]
    return step


def profiling() -> bool:
    """Is a torch profiler recording (then torch's own ranges are entered)?"""
    return bool(profiler._is_profiler_enabled)


def _with_hooks(func: Callable[..., Any], self: Any, args: tuple, kwargs: dict) -> Any:
    pre = self._optimizer_step_pre_hooks
    if pre or _torch_optimizer._global_optimizer_pre_hooks:
        full = (self,) + args
        for hook in chain(_torch_optimizer._global_optimizer_pre_hooks.values(), pre.values()):
            result = hook(self, full, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                full, kwargs = result
        args = tuple(full[1:])
    out = func(self, *args, **kwargs)
    self._optimizer_step_code()
    post = self._optimizer_step_post_hooks
    if post or _torch_optimizer._global_optimizer_post_hooks:
        full = (self,) + args
        for hook in chain(post.values(), _torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self, full, kwargs)
    return out
