"""``python -m bench host``: the host side of a step, measured on any machine (no GPU needed).

Two figures that decide a GPU step's host time, each over ``--tensors`` one-element (replay) or
small-CNN-like (triton) parameters:

* a **replayed step** (``replay``): the optimizer's whole path to a replay, on CPU tensors with the
  cpu backend, the recording replaced by a stand-in graph that replays nothing. Besides the host
  time: the Python function calls and the tensor accesses from Python (``p.grad``, ``data_ptr()``,
  counted with a ``TorchFunctionMode``) of one replayed step; flat in the tensor count when the key is
  checked without walking the tensors.
* an **eager triton step** (``triton``): the backend's Python side with every kernel launch stubbed
  out (under ``TRITON_INTERPRET=1``), with the gradients in place and with two gradient sets in
  turn; the stub stands for a compiled kernel, so bound launches are taken as on a GPU (triton's
  own launch path, which they skip, is not measured here). FedSAM's restore copy is stubbed too.

Every algorithm of the catalogue (its full option set; ``--algos`` for some), FedSAM as its two
steps without the closure (the closure's forward and backward are the user's).

Medians of 7 blocks; the machine's load moves them, so compare runs interleaved (``farm-bench``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import cli
from .timing import median, time_rounds

SMALL = [(64, 1, 3, 3), (64,), (128, 64, 3, 3), (128,), (10, 512), (10,)]
BLOCKS = 7


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No garbage collection pass lands in a timed block (a host cost of the collector, not of the step)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _median_us(step: Callable[[], None], reps: int) -> float:
    """Microseconds per call: the median of ``BLOCKS`` blocks of ``reps`` calls."""
    with _gc_paused():
        (res,) = time_rounds({"step": step}, torch.device("cpu"), BLOCKS, calls=reps).values()
    if res.error is not None:
        raise RuntimeError(f"the step failed: {res.error}")
    return median(res.times) * 1e6


def _optimizer(algo: str, params: Sequence[torch.Tensor], backend: str, replay: bool) -> Tuple[Any, Callable[[], Any]]:
    """The catalogue's full option set of ``algo`` (a catalogue name) over ``params``, in its first
    round, and one step of it with fixed inputs: a closure step (FedSAM) as its two steps without the
    closure, whose own work (a forward and backward) is the user's, not the optimizer's."""
    from fedopt_kernels.fl import algorithm, catalogue

    cfg = catalogue.config(algo, catalogue.ALGOS[algo].full)
    opt: Any = cfg.build(list(params), backend, replay=replay)
    order = [p for group in opt.param_groups for p in group["params"]]
    opt.start_round(**cfg.round_inputs(order, 0))
    if algorithm.of_optimizer(cfg.cls).closure_step:
        inputs = {k: v for k, v in cfg.step_inputs(order, 0).items() if k != "closure"}

        def two_steps() -> None:
            opt.first_step(**inputs)
            opt.second_step()

        return opt, two_steps
    # a partial, not a lambda: no Python call of the bench's own in the counts
    return opt, functools.partial(opt.step, **cfg.step_inputs(order, 0))


def replayed_step(algo: str, n: int, reps: int) -> Dict[str, Any]:
    from torch.overrides import TorchFunctionMode

    from fedopt_kernels.core import replay as _replay

    class Null:
        def replay(self) -> None:
            pass

    class Accesses(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Accesses.n += 1
            return func(*args, **(kwargs or {}))

    saved = (_replay.DEVICE_TYPES, _replay.BACKENDS, _replay.StepReplay._record)
    _replay.DEVICE_TYPES, _replay.BACKENDS = ("cuda", "cpu"), ("cuda", "triton", "cpu")
    _replay.StepReplay._record = lambda self, device, run: Null()  # type: ignore[method-assign]
    try:
        params = [torch.nn.Parameter(torch.randn(1)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt, step = _optimizer(algo, params, "cpu", replay=True)
        for _ in range(5):
            step()
        calls = [0]

        def count(frame: Any, event: str, arg: Any) -> None:
            calls[0] += event == "call"

        sys.setprofile(count)
        step()
        sys.setprofile(None)
        Accesses.n = 0
        with Accesses():
            step()
        replayed = opt.replay_stats()["replayed"]
        us = _median_us(step, reps)
        # (FedDecaySGD's schedule table grows after 1024 steps: a new table, one eager and one recorded step)
        assert opt.replay_stats()["replayed"] - replayed >= 0.99 * BLOCKS * reps, "the timed steps did not replay"
    finally:
        _replay.DEVICE_TYPES, _replay.BACKENDS, _replay.StepReplay._record = saved  # type: ignore[method-assign]
    return {"python_calls": calls[0], "tensor_accesses": Accesses.n, "host_us": us}


def eager_triton_step(algo: str, n: int, reps: int) -> Dict[str, float]:
    import fedopt_kernels.core.backends.triton  # noqa: F401 - loads this checkout's kernels first
    from fedopt_kernels.optim import sam_steps
    from fedopt_kernels.triton_kernels import launcher, sgd, two_pass_kernels

    class Compiled:  # what a compiled launch returns
        function, packed_metadata = 0, None

        def run(self, *args: Any) -> None:
            pass

    class Stub:
        def __init__(self, real: Any):
            self.arg_names = real.arg_names

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            return lambda *args, **kwargs: Compiled()

    names = [
        (sgd, "sgd_kernel"),
        (two_pass_kernels, "norm_kernel"),
        (two_pass_kernels, "update_kernel"),
        (two_pass_kernels, "advance_kernel"),
        (two_pass_kernels, "finalize_kernel"),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name in names]
    saved_stream, saved_copy = launcher._stream, sam_steps._copy_all
    for mod, name, real in saved:
        setattr(mod, name, Stub(real))
    launcher._stream = lambda: 0  # no driver here
    # FedSAM's restore (x = saved, one torch multi-tensor copy): a kernel launch on a GPU, as the
    # stubbed ones, but the copy itself here, on CPU tensors
    sam_steps._copy_all = lambda xs, saved: None
    try:
        params = [torch.nn.Parameter(torch.randn(SMALL[i % len(SMALL)])) for i in range(n)]
        sets = [[torch.randn_like(p) for p in params] for _ in range(2)]
        for p, g in zip(params, sets[0]):
            p.grad = g
        opt, step = _optimizer(algo, params, "triton", replay=False)
        for _ in range(3):
            step()
        in_place = _median_us(step, reps)
        turn = [0]

        def moving() -> None:
            turn[0] ^= 1
            for p, g in zip(params, sets[turn[0]]):
                p.grad = g
            step()

        two_sets = _median_us(moving, reps)
    finally:
        for mod, name, real in saved:
            setattr(mod, name, real)
        launcher._stream, sam_steps._copy_all = saved_stream, saved_copy
    return {"in_place_us": in_place, "two_sets_us": two_sets}


def main(argv: Optional[List[str]] = None) -> int:
    ap = cli.parser("host", __doc__)
    ap.add_argument("--what", nargs="+", choices=["replay", "triton"], default=["replay", "triton"])
    ap.add_argument("--tensors", nargs="+", type=int, default=[6, 62])
    ap.add_argument("--reps", type=int, default=1000, help="steps per timed block (7 blocks)")
    ap.add_argument("--algos", nargs="+", help="the catalogue's names (default: every algorithm)")
    args = ap.parse_args(argv)
    if "triton" in args.what and importlib.util.find_spec("triton") is None:  # e.g. torch's CPU wheel
        print("bench host: no eager triton step: the triton package is an extra (pip install 'fedopt_kernels[triton]')")
        args.what = [w for w in args.what if w != "triton"]
    if "triton" in args.what:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from fedopt_kernels.fl import catalogue

    algos = args.algos or list(catalogue.ALGOS)
    unknown = [a for a in algos if a not in catalogue.ALGOS]
    if unknown:
        ap.error(f"--algos: {unknown} not in the catalogue {list(catalogue.ALGOS)}")
    print(f"host side of a step; torch {torch.__version__}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}")
    for algo in algos:
        name = catalogue.ALGOS[algo].cls.__name__
        for n in args.tensors:
            if "replay" in args.what:
                r = replayed_step(algo, n, args.reps)
                print(
                    f"{name:11s} n={n:4d}  replayed step: {r['host_us']:7.2f} us, {r['python_calls']} Python calls, "
                    f"{r['tensor_accesses']} tensor accesses from Python"
                )
            if "triton" in args.what:
                t = eager_triton_step(algo, n, max(1, args.reps // 4))
                print(
                    f"{name:11s} n={n:4d}  eager triton step, launches stubbed: {t['in_place_us']:7.2f} us "
                    f"(gradients in place), {t['two_sets_us']:7.2f} us (two gradient sets in turn)"
                )
    return 0
