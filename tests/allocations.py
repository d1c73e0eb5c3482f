"""Counting the tensors a piece of code allocates, on any device: every aten op that returns a tensor
it made (a factory such as ``zeros_like``, or an out-of-place op such as ``add``), as a
``TorchDispatchMode`` sees it. In-place and ``out=`` ops, views and ops returning nothing count 0.

On the CPU this is what stands in for ``torch.cuda.memory_stats()``: an op that makes a tensor on
the CPU makes it on the GPU in the same code path. Host tensors made without an aten op
(``torch.tensor(list)``) are not seen: they are host memory on a GPU too.
"""

from __future__ import annotations

from typing import Any, List

from torch.utils._python_dispatch import TorchDispatchMode


def makes_a_tensor(func: Any) -> bool:
    """Does aten op ``func`` return a tensor that aliases none of its inputs?"""
    return any(r.alias_info is None and "Tensor" in str(r.type) for r in func._schema.returns)


class FreshTensors(TorchDispatchMode):
    """``with FreshTensors() as seen: ...``; ``seen.ops``: the ops that made tensors, in order.
    ``seen.paused = True`` stops counting (code whose allocations are not the subject's)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and makes_a_tensor(func):
            self.ops.append(str(func))
        return out
