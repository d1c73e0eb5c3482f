"""The equivalence harness: build a problem, run an optimizer for several rounds, compare runs.

A *case* is (algorithm, option set, shape set). ``run_case`` builds the parameters from a seed,
feeds every backend the same gradients and round inputs, and returns the final parameters and
optimizer state, so that a fused backend can be compared with ``reference`` tensor by tensor.
Every backend registered with ``fedopt_kernels.core.registry`` is covered without touching this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from fedopt_kernels.core import registry as _registry
from fedopt_kernels.fl import algorithm, catalogue

FUSED_BACKENDS = [b for b in _registry.BACKENDS if b != "reference"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (rtol, atol) per parameter dtype after a few rounds; fused kernels differ from the reference only
# by rounding (FMA contraction, reduction order), i.e. an ulp or two of the storage type.
TOLERANCE = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

ROUNDS, STEPS = 2, 3

# ---------------------------------------------------------------- shape sets
# (shape, layout): layout "c" contiguous, "t" transposed view, "s" strided slice view
SHAPE_SETS: Dict[str, List[Tuple[Tuple[int, ...], str]]] = {
    "odd": [((7,), "c"), ((1,), "c"), ((0,), "c"), ((13, 5), "c"), ((3, 4, 3, 3), "c"), ((), "c"), ((33,), "c")],
    "chunk": [((n,), "c") for n in (1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 65535, 65536, 65537)]
    + [((257, 255), "c")],
    "many": [((1 + (i * 37) % 61,) if i % 3 else (1 + i % 5, 1 + (i * 7) % 9), "c") for i in range(210)],
    "noncontig": [((9, 6), "t"), ((10, 7), "s"), ((4, 3, 5), "t"), ((6,), "c"), ((12, 12), "s")],
    "frozen": [((8, 3), "c"), ((5,), "c"), ((6, 2), "c"), ((11,), "c"), ((4, 4), "c")],
}
# in "frozen": parameter 1 never has a gradient, parameter 3 loses its gradient from global step 3 on
FROZEN_NEVER, FROZEN_FROM = (1,), {3: 3}


def make_params(shape_set: str, dtype: torch.dtype, seed: int) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape, layout in SHAPE_SETS[shape_set]:
        if layout == "t":  # transposed view of a contiguous tensor
            data = torch.randn((*shape[:-2], shape[-1], shape[-2]), generator=g).to(dtype).transpose(-1, -2)
        elif layout == "s":  # every other column
            data = torch.randn((shape[0], 2 * shape[1]), generator=g).to(dtype)[:, ::2]
        else:
            data = torch.randn(shape, generator=g).to(dtype)
        assert data.is_contiguous() == (layout == "c") or data.numel() <= 1
        params.append(torch.nn.Parameter(data))
    return params


def make_grads(params: Sequence[torch.Tensor], shape_set: str, step: int, seed: int) -> List[Optional[torch.Tensor]]:
    """Gradients for global step ``step``: random, some non-contiguous, some missing (``frozen``)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out: List[Optional[torch.Tensor]] = []
    for i, p in enumerate(params):
        if shape_set == "frozen" and (i in FROZEN_NEVER or (i in FROZEN_FROM and step >= FROZEN_FROM[i])):
            out.append(None)
            continue
        v = torch.randn(p.shape, generator=g).to(p.dtype)
        if shape_set == "noncontig" and p.dim() >= 2:
            v = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, transposed strides
        out.append(v)
    return out


# ---------------------------------------------------------------- algorithms and options
# every configuration comes from the package's catalogue (fedopt_kernels/fl/catalogue.py)
ALGOS = catalogue.ALGOS


def cases() -> List[Tuple[str, str, str]]:
    """Every option of every algorithm on the "odd" shapes, and every shape set with the full option."""
    out = []
    for algo in ALGOS.values():
        out += [(algo.name, option, "odd") for option in algo.options]
        out += [(algo.name, algo.full, s) for s in SHAPE_SETS if s != "odd"]
    return out


# ---------------------------------------------------------------- running
@dataclass
class RunResult:
    params: List[torch.Tensor]
    state: List[Dict[str, torch.Tensor]]
    optimizer: torch.optim.Optimizer
    state_dict: Optional[Dict[str, Any]] = None  # run_case(snapshot=...): the optimizer's, at the snapshot


def run_case(
    algo_name: str,
    option: str,
    shape_set: str,
    dtype: torch.dtype,
    backend: str,
    device: str = "cpu",
    seed: int = 0,
    rounds: int = ROUNDS,
    steps: int = STEPS,
    snapshot: Optional[Tuple[int, int]] = None,
    load_from: Optional[Dict[str, Any]] = None,
    start_at: Tuple[int, int] = (0, 0),
) -> RunResult:
    """Run ``rounds`` x ``steps`` local steps.

    ``snapshot=(r, s)``: return right after step s of round r with ``result.state_dict`` set.
    ``load_from``/``start_at``: resume from a state_dict (and matching parameters) at (round, step).
    """
    cfg = ALGOS[algo_name].options[option]
    params = make_params(shape_set, dtype, seed)
    if device != "cpu":
        params = [torch.nn.Parameter(p.detach().to(device)) for p in params]
    opt = cfg.build(params, backend)
    if load_from is not None:
        with torch.no_grad():
            for p, saved in zip(params, load_from["params"]):
                p.copy_(saved)
        opt.load_state_dict(load_from["state_dict"])
    ordered = [p for g in opt.param_groups for p in g["params"]]  # per-parameter inputs follow this order
    r0, s0 = start_at
    for rnd in range(r0, rounds):
        if not (load_from is not None and rnd == r0 and s0 > 0):
            if rnd > 0:  # the previous round ends when the next one starts (as catalogue.run)
                algorithm.end_round(opt)
            opt.start_round(**cfg.round_inputs(ordered, rnd, seed))
        for step in range(s0 if rnd == r0 else 0, steps):
            gstep = rnd * steps + step
            for p, g in zip(params, make_grads(params, shape_set, gstep, seed)):
                p.grad = None if g is None else g.to(device)
            opt.step(**cfg.step_inputs(ordered, gstep, seed))
            if snapshot == (rnd, step):
                res = RunResult([p.detach().clone() for p in params], _state(opt, params), opt)
                res.state_dict = opt.state_dict()
                return res
    return RunResult([p.detach().clone() for p in params], _state(opt, params), opt)


def _state(opt, params) -> List[Dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]


def assert_close_runs(ref: RunResult, got: RunResult, dtype: torch.dtype, what: str = "") -> None:
    rtol, atol = TOLERANCE[dtype]
    assert len(ref.params) == len(got.params)
    for i, (a, b) in enumerate(zip(ref.params, got.params)):
        torch.testing.assert_close(
            b.cpu(),
            a.cpu(),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m: f"{what} parameter {i} {tuple(a.shape)}: {m}",  # noqa: B023 (called in this iteration)
        )
    for i, (sa, sb) in enumerate(zip(ref.state, got.state)):
        assert sorted(sa) == sorted(sb), f"{what} state keys of parameter {i}: {sorted(sb)} != reference {sorted(sa)}"
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, (
                f"{what} state {key} of parameter {i}: dtype {sb[key].dtype} != {sa[key].dtype}"
            )
            torch.testing.assert_close(
                sb[key].cpu(),
                sa[key].cpu(),
                rtol=rtol,
                atol=atol,
                equal_nan=True,
                msg=lambda m: f"{what} state {key!r} of parameter {i}: {m}",  # noqa: B023 (called in this iteration)
            )


def backend_skip_reason(backend: str, device: str = "cpu") -> Optional[str]:
    return _registry.unavailable_reason(backend, torch.device(device))
