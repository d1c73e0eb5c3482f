"""The equivalence harness: build a problem, run an optimizer for several rounds, compare runs.

A *case* is (algorithm, option set, shape set). ``run_case`` builds the parameters from a seed,
feeds every backend the same gradients and round inputs, and returns the final parameters and
optimizer state, so that a fused backend can be compared with ``reference`` tensor by tensor.
Every backend registered with ``fedopt_kernels._registry`` is covered without touching this file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import fedopt_kernels as fk
from fedopt_kernels import _registry

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


def make_grads(params: List[torch.Tensor], shape_set: str, step: int, seed: int) -> List[Optional[torch.Tensor]]:
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
@dataclass
class Algo:
    name: str
    build: Callable[..., torch.optim.Optimizer]
    options: Dict[str, Dict[str, Any]]
    full_option: str  # the option set used for every shape set
    round_inputs: Callable[[torch.optim.Optimizer, List[torch.Tensor], Dict[str, Any], int, int], Dict[str, Any]] = \
        field(default=lambda opt, params, opts, rnd, seed: {})
    step_inputs: Callable[[List[torch.Tensor], Dict[str, Any], int, int], Dict[str, Any]] = \
        field(default=lambda params, opts, step, seed: {})


def _rand_like_list(params, seed, scale=0.1, dtype=None):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(p.shape, generator=g)).to(dtype or p.dtype) for p in params]


def _groups(params: List[torch.Tensor], opts: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Two param groups with different hyperparameters when the option set asks for it."""
    if not opts.get("groups"):
        return [{"params": params}]
    return [{"params": params[0::2]}, {"params": params[1::2], **opts["groups"]}]


def _strip(opts: Dict[str, Any], *keys: str) -> Dict[str, Any]:
    return {k: v for k, v in opts.items() if k not in ("groups", "correction", "scales", "controls") + keys}


def _correction_inputs(opt, params, opts, rnd, seed):
    return {"correction": _rand_like_list(params, seed + 17 * rnd)} if opts.get("correction") else {}


def _scales_for(params: List[torch.Tensor], seed: int) -> Dict[torch.Tensor, torch.Tensor]:
    """Positive per-row scales for two thirds of the parameters that have rows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, p in enumerate(params):
        if p.dim() >= 1 and i % 3 != 2:
            dt = torch.float64 if p.dtype == torch.float64 else torch.float32
            out[p] = (0.5 + torch.rand(p.shape[0], generator=g)).to(dt)
    return out


def _nlr_round_inputs(opt, params, opts, rnd, seed):
    inputs = _correction_inputs(opt, params, opts, rnd, seed)
    if opts.get("scales"):
        inputs["neuron_scales"] = _scales_for(params, seed + rnd)
    return inputs


def _padam_round_inputs(opt, params, opts, rnd, seed):
    if not opts.get("controls"):
        return {}
    return {"global_control": _rand_like_list(params, seed + 31 * rnd, dtype=torch.float32),
            "local_control": _rand_like_list(params, seed + 37 * rnd + 1),
            "momentum": _rand_like_list(params, seed + 41 * rnd + 2)}


def _padam_step_inputs(params, opts, step, seed):
    if not opts.get("variance_reduction"):
        return {}
    return {"anchor_grads": _rand_like_list(params, seed + 7 * step + 3, scale=1.0)}


ALGOS: Dict[str, Algo] = {
    "feddecay": Algo(
        "feddecay",
        lambda params, backend, opts: fk.FedDecaySGD(_groups(params, opts), backend=backend, **_strip(opts)),
        {
            "plain": dict(lr=0.1, beta=0.5),
            "momentum": dict(lr=0.05, beta=0.8, momentum=0.9, dampening=0.1),
            "nesterov": dict(lr=0.05, beta=0.7, momentum=0.9, nesterov=True, weight_decay=0.01),
            "wd_maximize": dict(lr=0.1, beta=0.9, weight_decay=0.05, maximize=True),
            "prox_correction": dict(lr=0.1, beta=0.6, prox_mu=0.5, correction=True, momentum=0.5),
            "linear_every2": dict(lr=0.1, beta=0.4, schedule="linear", decay_every=2, momentum=0.3),
            "fedsgd_beta0": dict(lr=0.1, beta=0.0),
            "groups": dict(lr=0.1, beta=0.5, momentum=0.9, groups=dict(lr=0.03, weight_decay=0.1)),
        },
        full_option="prox_correction",
        round_inputs=_correction_inputs,
    ),
    "neuron_lr": Algo(
        "neuron_lr",
        lambda params, backend, opts: fk.NeuronLRSGD(_groups(params, opts), backend=backend, **_strip(opts)),
        {
            "scales": dict(lr=0.1, scales=True),
            "scales_momentum": dict(lr=0.05, momentum=0.9, nesterov=True, scales=True),
            "scales_all": dict(lr=0.05, momentum=0.5, weight_decay=0.01, prox_mu=0.2, correction=True, scales=True),
            "groups": dict(lr=0.1, scales=True, groups=dict(lr=0.01, momentum=0.9)),
        },
        full_option="scales_all",
        round_inputs=_nlr_round_inputs,
    ),
    "fednar": Algo(
        "fednar",
        lambda params, backend, opts: fk.FedNAR(_groups(params, opts), backend=backend, **_strip(opts)),
        {
            "unclipped": dict(lr=0.1, weight_decay=0.01, max_norm=1e6),
            "clipped": dict(lr=0.1, weight_decay=0.1, max_norm=0.5, round_decay=0.9),
            "prox_correction": dict(lr=0.1, weight_decay=0.05, max_norm=2.0, prox_mu=0.3, correction=True),
            "groups": dict(lr=0.1, weight_decay=0.01, max_norm=1.0, groups=dict(lr=0.5, max_norm=3.0, weight_decay=0.0)),
        },
        full_option="prox_correction",
        round_inputs=_correction_inputs,
    ),
    "padamfed": Algo(
        "padamfed",
        lambda params, backend, opts: fk.PAdaMFed(_groups(params, opts), backend=backend, **_strip(opts)),
        {
            "plain": dict(lr=0.05, beta=0.5),
            "controls": dict(lr=0.05, beta=0.3, controls=True),
            "vr": dict(lr=0.02, beta=0.4, variance_reduction=True, controls=True),
            "groups": dict(lr=0.05, beta=0.5, controls=True, groups=dict(lr=0.01, beta=0.9)),
        },
        full_option="controls",
        round_inputs=_padam_round_inputs,
        step_inputs=_padam_step_inputs,
    ),
}


def cases() -> List[Tuple[str, str, str]]:
    """Every option of every algorithm on the "odd" shapes, and every shape set with the full option."""
    out = []
    for algo in ALGOS.values():
        out += [(algo.name, option, "odd") for option in algo.options]
        out += [(algo.name, algo.full_option, s) for s in SHAPE_SETS if s != "odd"]
    return out


# ---------------------------------------------------------------- running
@dataclass
class RunResult:
    params: List[torch.Tensor]
    state: List[Dict[str, torch.Tensor]]
    optimizer: torch.optim.Optimizer


def run_case(algo_name: str, option: str, shape_set: str, dtype: torch.dtype, backend: str,
             device: str = "cpu", seed: int = 0, rounds: int = ROUNDS, steps: int = STEPS,
             snapshot: Optional[Tuple[int, int]] = None, load_from: Optional[Dict[str, Any]] = None,
             start_at: Tuple[int, int] = (0, 0)) -> RunResult:
    """Run ``rounds`` x ``steps`` local steps.

    ``snapshot=(r, s)``: return right after step s of round r with ``result.state_dict`` set.
    ``load_from``/``start_at``: resume from a state_dict (and matching parameters) at (round, step).
    """
    algo = ALGOS[algo_name]
    opts = algo.options[option]
    params = make_params(shape_set, dtype, seed)
    if device != "cpu":
        params = [torch.nn.Parameter(p.detach().to(device)) for p in params]
    opt = algo.build(params, backend, opts)
    if load_from is not None:
        with torch.no_grad():
            for p, saved in zip(params, load_from["params"]):
                p.copy_(saved)
        opt.load_state_dict(load_from["state_dict"])
    ordered = [p for g in opt.param_groups for p in g["params"]]  # per-parameter inputs follow this order
    r0, s0 = start_at
    for rnd in range(r0, rounds):
        if not (load_from is not None and rnd == r0 and s0 > 0):
            inputs = algo.round_inputs(opt, ordered, opts, rnd, seed)
            opt.start_round(**{k: _to(v, device) for k, v in inputs.items()})
        for step in range(s0 if rnd == r0 else 0, steps):
            gstep = rnd * steps + step
            for p, g in zip(params, make_grads(params, shape_set, gstep, seed)):
                p.grad = None if g is None else g.to(device)
            opt.step(**{k: _to(v, device) for k, v in algo.step_inputs(ordered, opts, gstep, seed).items()})
            if snapshot == (rnd, step):
                res = RunResult([p.detach().clone() for p in params], _state(opt, params), opt)
                res.state_dict = opt.state_dict()
                return res
    return RunResult([p.detach().clone() for p in params], _state(opt, params), opt)


def _to(v, device):
    if isinstance(v, dict):
        return {k: t.to(device) for k, t in v.items()}
    if isinstance(v, list):
        return [t.to(device) for t in v]
    return v


def _state(opt, params) -> List[Dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]


def assert_close_runs(ref: RunResult, got: RunResult, dtype: torch.dtype, what: str = "") -> None:
    rtol, atol = TOLERANCE[dtype]
    assert len(ref.params) == len(got.params)
    for i, (a, b) in enumerate(zip(ref.params, got.params)):
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what} parameter {i} {tuple(a.shape)}: {m}")
    for i, (sa, sb) in enumerate(zip(ref.state, got.state)):
        assert sorted(sa) == sorted(sb), f"{what} state keys of parameter {i}: {sorted(sb)} != reference {sorted(sa)}"
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, f"{what} state {key} of parameter {i}: dtype {sb[key].dtype} != {sa[key].dtype}"
            torch.testing.assert_close(sb[key].cpu(), sa[key].cpu(), rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{what} state {key!r} of parameter {i}: {m}")


def backend_skip_reason(backend: str, device: str = "cpu") -> Optional[str]:
    return _registry.unavailable_reason(backend, torch.device(device))
