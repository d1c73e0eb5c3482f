"""A stand-in for ``torch.cuda.CUDAGraph`` on CPU tensors: what the whole-iteration graph tests check
on a GPU, run by CI without one.

A CUDA graph holds the kernels launched while it was captured, with the tensors they had, and a replay
runs those kernels again: none of the Python that launched them runs. Here, inside ``capture()``:

* the optimizer sees a capture (``capturing`` answers True where the package asks), so it refuses
  what a real capture refuses and runs its host side as it would then;
* its kernel calls (every step plan's ``fn``) and the aten ops around them (a restore, a zeroing of
  gradients) are recorded, and leave the tensors as they were, as a capture runs no kernel (a
  backend's host side runs, as it does in a capture: its checks, its tables);
* the model's forward and backward, handed to ``model()``, run (the capture's backward makes the
  gradient tensors) and are recorded too.

``replay()`` runs the records in order on the same tensors: an out-of-place op's output is the
replay's own; a recorded backward writes its gradients into the tensors the capture's backward made,
as a graph's backward does (or adds into gradients that were there before, as ``backward()`` does).
A forward and backward not handed to ``model()`` are recorded op by op like the rest (what
``tests/test_bench_loop.py`` does with the benchmark's graphed rows). A host sync inside the capture
(``.item()``) raises, as it does on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fedopt_kernels.core import capture as _capture
from fedopt_kernels.core import op_runner as _op_runner
from fedopt_kernels.core import plan as _plan
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.core import stepper as _stepper

_capturing_now: List[StandInGraph] = []


def capturing(device: Any = None) -> bool:
    """What ``capturing(device)`` answers while a stand-in graph is captured."""
    return bool(_capturing_now)


def install(monkeypatch: Any) -> None:
    """Route the package's capture checks and kernel calls through the stand-in (for one test). Plans
    built before this call keep kernels that are never recorded: build optimizers after it."""
    for module in (_plan, _stepper, _capture, _op_runner):  # every module of the package that asks
        monkeypatch.setattr(module, "capturing", capturing)
    try:  # loaded now, so that its own check is replaced before any plan of it runs
        triton_backend = importlib.import_module("fedopt_kernels.core.backends.triton")
    except ImportError:
        pass
    else:
        monkeypatch.setattr(triton_backend, "_capturing", capturing)
    resolve = _registry.resolve
    monkeypatch.setattr(_registry, "resolve", lambda *a, **k: _recorded(resolve(*a, **k)))


def _recorded(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, a backend's step of an op, recorded while a stand-in is captured: its host side runs (its
    checks, its tables), as a capture runs it, and what its kernels wrote is undone, as a capture runs
    no kernel."""

    def kernel(*args: Any, cache: Any = None) -> None:
        graph = _capturing_now[-1] if _capturing_now else None
        if graph is None or graph.paused:
            fn(*args, cache=cache)
            return
        written = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        before = [t.clone() for t in written]
        with graph.pause(), torch.no_grad():
            try:
                fn(*args, cache=cache)
            finally:
                for t, b in zip(written, before):
                    t.copy_(b)
        graph.records.append(("kernel", fn, args, {"cache": cache}, None))

    return kernel


class _Recorder(TorchDispatchMode):
    """Records the aten ops of a capture; ops that write are recorded and not run."""

    def __init__(self, graph: StandInGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.graph.paused or func.namespace == "profiler":  # record_function's ranges are host-side
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host sync (reading a tensor's value) inside a CUDA graph capture")
        schema = func._schema
        if schema.is_mutable:
            self.graph.records.append(("op", func, args, kwargs, None))
            if not schema.returns:
                return None
            return kwargs["out"] if "out" in kwargs else args[0]  # what an in-place or out= op returns
        out = func(*args, **kwargs)
        self.graph.records.append(("op", func, args, kwargs, out))
        return out


class StandInGraph:
    """``capture()``, ``model(fn, params)`` inside it, ``replay()``: the interface the tests drive
    ``torch.cuda.CUDAGraph`` through too."""

    def __init__(self) -> None:
        self.records: List[tuple] = []
        self.paused = False

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        if _capturing_now:
            raise RuntimeError("stand-in graphs are captured one at a time")
        _capturing_now.append(self)
        try:
            with _Recorder(self):
                yield
        finally:
            _capturing_now.pop()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Run without recording."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def model(self, fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` (forward and backward; returns the loss) as part of the graph: its loss tensor is
        rewritten by every replay, as a captured graph's output is."""
        had = [p.grad is not None for p in params]
        with self.pause():
            loss = fn().detach()
        made = [p.grad for p in params]
        self.records.append(("model", fn, list(params), {"had": had, "made": made}, loss))
        return loss

    def replay(self) -> None:
        env: Dict[int, torch.Tensor] = {}  # a recorded output -> this replay's

        def sub(x: Any) -> Any:
            return env.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for kind, fn, args, kwargs, out in self.records:
            if kind == "model":
                self._rerun(fn, args, kwargs["had"], kwargs["made"], out)
                continue
            with torch.no_grad():  # what was recorded ran below autograd: a graph has no autograd either
                if kind == "kernel":
                    fn(*tree_map(sub, args), **kwargs)
                    continue
                new = fn(*tree_map(sub, args), **tree_map(sub, kwargs))
                if out is not None:
                    for a, b in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                        if isinstance(a, torch.Tensor):
                            env[id(a)] = b

    @staticmethod
    def _rerun(fn, params, had, made, loss) -> None:
        for p, h in zip(params, had):
            if not h:
                p.grad = None  # the capture's backward made this gradient: the replay writes it
        loss.copy_(fn().detach())
        for p, h, g in zip(params, had, made):
            if not h and g is not None:
                g.copy_(p.grad)
                p.grad = g
