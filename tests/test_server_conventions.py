"""torch.optim's conventions (docs/torch_optim.md) for the server optimizers, as torch's generic
optimizer tests state them: named parameters, a tensor ``lr`` (same bits as a float lr, in-place
changes take effect, LR schedulers), no empty state entries, ``step()`` without gradients, state_dict
round trips (deterministic, across backends, through ``torch.save``/``torch.load(weights_only=True)``),
hooks, deepcopy and pickling, a state_dict of another class refused. On every backend that runs here
(triton under TRITON_INTERPRET=1)."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Dict, List

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels.core import registry as _registry

CLASSES: Dict[str, Dict[str, Any]] = {
    "FedAvgM": dict(lr=0.5, momentum=0.9),
    "FedAdam": dict(lr=0.05, bias_correction=True),
    "FedYogi": dict(lr=0.05, betas=(0.8, 0.95)),
    "FedAdagrad": dict(lr=0.05, initial_accumulator_value=0.1),
    "FedExP": dict(eps=1e-2),
}
SHAPES = [(4, 3), (5,), (2, 3, 2)]


def _backends(name: str) -> List[Any]:
    op = getattr(fk, name).op_spec().name
    out = []
    for b in ("reference", "cpu", "triton"):
        why = _registry.unavailable_reason(b, torch.device("cpu"), op)
        out.append(pytest.param(name, b, id=f"{name}-{b}", marks=pytest.mark.skipif(why is not None, reason=str(why))))
    return out


CASES = [c for n in CLASSES for c in _backends(n)]


def _params(seed: int = 0) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _build(name: str, backend: str, params, **over) -> torch.optim.Optimizer:
    return getattr(fk, name)(params, backend=backend, **{**CLASSES[name], **over})


def _step(opt, params, r: int, skip: int = -1) -> None:
    g = torch.Generator().manual_seed(100 + r)
    for i, p in enumerate(params):
        p.grad = None if i == skip else torch.randn(p.shape, generator=g) * 0.3
    if isinstance(opt, fk.FedExP):
        opt.step(mean_sq_norm=torch.tensor(5.0 + r))
    else:
        opt.step()


def _run(opt, params, rounds: int = 3, start: int = 0) -> None:
    for r in range(start, start + rounds):
        _step(opt, params, r)


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _state_tensors(opt) -> List[torch.Tensor]:
    return [t for st in opt.state_dict()["state"].values() for t in st.values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name,backend", CASES)
def test_named_parameters_and_loading_between_named_and_unnamed(name, backend):
    params = _params()
    named = _build(name, backend, [(f"layer{i}.weight", p) for i, p in enumerate(params)])
    _run(named, params)
    sd = named.state_dict()
    assert sd["param_groups"][0]["param_names"] == [f"layer{i}.weight" for i in range(len(SHAPES))]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = _build(name, backend, twin)
    plain.load_state_dict(copy.deepcopy(sd))  # a state_dict holds the optimizer's own tensors (torch's too)
    _run(named, params, start=3)
    _run(plain, twin, start=3)
    _same(params, twin)


@pytest.mark.parametrize("name,backend", CASES)
@pytest.mark.parametrize("kind", ["float32", "float64"])
def test_tensor_lr_gives_the_bits_of_a_float_lr_and_follows_a_scheduler(name, backend, kind):
    lr = CLASSES[name].get("lr", 1.0)
    dtype = torch.float32 if kind == "float32" else torch.float64
    params, twin = _params(), _params()
    opt = _build(name, backend, params, lr=torch.tensor(lr, dtype=dtype))
    ref = _build(name, backend, twin, lr=lr)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5) for o in (opt, ref)]
    for r in range(3):
        _step(opt, params, r)
        _step(ref, twin, r)
        for s in scheds:
            s.step()
    _same(params, twin)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    with pytest.raises(ValueError, match="lr"):
        _build(name, backend, _params(), lr=torch.tensor([lr, lr]))


@pytest.mark.parametrize("name,backend", CASES)
def test_params_without_grad_keep_no_state_and_a_step_without_grads_changes_nothing(name, backend):
    params = _params()
    opt = _build(name, backend, params)
    before = [p.detach().clone() for p in params]
    opt.step(**({"mean_sq_norm": 1.0} if name == "FedExP" else {}))
    _same(params, before)
    assert not opt.state and opt.state_dict()["fedopt_round"]["k"] == 0
    _step(opt, params, 0, skip=1)
    assert params[1] not in opt.state and torch.equal(params[1], before[1])
    assert all(opt.state[p] for p in opt.state)  # no empty entries


@pytest.mark.parametrize("name,backend", CASES)
def test_state_dict_round_trips_deterministically_and_through_torch_save(name, backend):
    params = _params()
    opt = _build(name, backend, params)
    _run(opt, params)
    sd1, sd2 = opt.state_dict(), opt.state_dict()
    assert sd1["fedopt_round"] == sd2["fedopt_round"] and sd1["fedopt_round"]["k"] == 3
    buf = io.BytesIO()
    torch.save(sd1, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = _build(name, backend, twin)
    other.load_state_dict(loaded)
    _same(_state_tensors(other), _state_tensors(opt))
    _run(opt, params, start=3)
    _run(other, twin, start=3)
    _same(params, twin)
    _same(_state_tensors(other), _state_tensors(opt))


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_state_dict_loads_across_backends(name):
    """reference's state_dict continues on every other backend as on reference (float32 kernels:
    within a few ulps of reference's own continuation)."""
    params = _params()
    ref = _build(name, "reference", params)
    _run(ref, params)
    sd = ref.state_dict()
    for backend in ("cpu", "triton"):
        if _registry.unavailable_reason(backend, torch.device("cpu"), ref.op_spec().name) is not None:
            continue
        twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
        fused = _build(name, backend, twin)
        fused.load_state_dict(copy.deepcopy(sd))
        base = [torch.nn.Parameter(p.detach().clone()) for p in params]
        again = _build(name, "reference", base)
        again.load_state_dict(copy.deepcopy(sd))
        _run(fused, twin, start=3)
        _run(again, base, start=3)
        for a, b in zip(twin, base, strict=True):
            torch.testing.assert_close(a, b, rtol=8 * torch.finfo(torch.float32).eps, atol=1e-6)
        # and back: the fused state loads into reference
        _build(name, "reference", _params()).load_state_dict(fused.state_dict())


@pytest.mark.parametrize("name,backend", CASES)
def test_hooks_copies_and_pickles_continue_as_the_original(name, backend):
    params = _params()
    opt = _build(name, backend, params)
    seen: Dict[str, int] = {"pre": 0, "post": 0}
    hooks = [
        opt.register_step_pre_hook(lambda o, a, k: seen.__setitem__("pre", seen["pre"] + 1)),
        opt.register_step_post_hook(lambda o, a, k: seen.__setitem__("post", seen["post"] + 1)),
    ]
    _run(opt, params, rounds=2)
    assert seen == {"pre": 2, "post": 2}
    for h in hooks:  # the lambdas cannot be pickled
        h.remove()
    pair = copy.deepcopy((opt, params))
    pickled = pickle.loads(pickle.dumps((opt, params)))
    _run(opt, params, start=2)
    for o, ps in (pair, pickled):
        _run(o, ps, start=2)
        _same(ps, params)
    repr(opt)


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_state_dict_of_another_optimizer_is_refused(name):
    params = _params()
    other = "FedAdam" if name != "FedAdam" else "FedYogi"
    src = _build(other, "reference", params)
    _run(src, params)
    with pytest.raises((ValueError, TypeError, KeyError)):
        _build(name, "reference", _params()).load_state_dict(src.state_dict())
    sgd = torch.optim.SGD(params, lr=0.1)
    with pytest.raises((ValueError, TypeError, KeyError)):
        _build(name, "reference", _params()).load_state_dict(sgd.state_dict())
