"""Client-batched optimizers: what ``start_round`` was given survives a restore, and bad round inputs are refused.

* a ``state_dict()`` taken mid-round carries every client's ``round_index`` and ``lr_scale`` (and
  whether the momentum buffers are fresh this round): a fresh optimizer that loads it finishes the
  round bit for bit as the original, on every catalogue configuration;
* ``round_index`` holds non-negative integers (fractions, NaN, negatives refused by name, never
  truncated); zero clients are refused at construction; a refused call changes nothing;
* ``BatchedPAdaMFed.local_control()`` of a client that took no step is the control it was given.
"""

from __future__ import annotations

import io

import pytest
import torch

from fedopt_kernels.core import registry as _registry
from fedopt_kernels.fl import catalogue

C = 4
SHAPES = [(3, 2), (5,), (0,)]
T = [0, 3, 7, 1]
SCALE = [1.0, 0.0, 2.5, 0.5]  # client 1 is frozen (lr_scale 0)
CASES = [(a, o) for a, algo in catalogue.ALGOS.items() for o in algo.options]


def _stacked(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(C, *s, generator=g, dtype=torch.float64)) for s in SHAPES]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def _start(cfg, opt, params, rnd: int, **kw) -> None:
    ordered = [p for grp in opt.param_groups for p in grp["params"]]
    views = [[p[c] for p in ordered] for c in range(C)]
    opt.start_round(
        round_index=[t + rnd for t in T], lr_scale=SCALE, **cfg.batched_round_inputs(views, ordered, rnd), **kw
    )


def _step(cfg, opt, params, step: int) -> None:
    ordered = [p for grp in opt.param_groups for p in grp["params"]]
    views = [[p[c] for p in ordered] for c in range(C)]
    _grads(params, step)
    opt.step(active=torch.tensor([True, True, step % 2 == 0, True]), **cfg.batched_step_inputs(views, step))


def _backends():
    out = []
    for b in ("reference", "cpu"):
        why = _registry.unavailable_reason(b, torch.device("cpu"), "sgd_batched")
        out.append(pytest.param(b, marks=pytest.mark.skipif(why is not None, reason=str(why))))
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("algo,option", CASES)
def test_restore_mid_round_continues_bitwise(algo, option, backend):
    cfg = catalogue.config(algo, option)
    params = _stacked()
    opt = cfg.build_batched(params, backend)
    _start(cfg, opt, params, 0)
    for k in range(2):
        _step(cfg, opt, params, k)
    # round 2 keeps its momentum buffers (reset_state=False): not a fresh round for them
    _start(cfg, opt, params, 1, reset_state=False)
    _step(cfg, opt, params, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # through bytes: nothing shared with the original
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = cfg.build_batched(twin_params, backend)
    twin.load_state_dict(saved)
    for k in range(3, 6):
        _step(cfg, opt, params, k)
        _step(cfg, twin, twin_params, k)
    for i, (a, b) in enumerate(zip(params, twin_params)):
        assert torch.equal(a.detach(), b.detach()), f"parameter {i}"
        assert a.detach()[1].equal(params[i].detach()[1])
        for key, value in opt.state[a].items():
            assert torch.equal(twin.state[b][key], value), (i, key)
    assert twin.round_step == opt.round_step
    if algo == "padamfed":
        for x, y in zip(opt.local_control(), twin.local_control()):
            assert torch.equal(x, y)


def test_frozen_client_stays_frozen_after_restore():
    cfg = catalogue.config("fednar", "wd")
    params = _stacked()
    opt = cfg.build_batched(params, "reference")
    opt.start_round(round_index=2, lr_scale=[1.0, 0.0, 1.0, 1.0])
    _grads(params, 0)
    opt.step()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = cfg.build_batched(twin_params, "reference")
    twin.load_state_dict(opt.state_dict())
    frozen = [p.detach()[1].clone() for p in twin_params]
    _grads(twin_params, 1)
    twin.step()
    assert all(torch.equal(p.detach()[1], f) for p, f in zip(twin_params, frozen))


def test_restore_into_another_number_of_clients_is_refused():
    cfg = catalogue.config("fednar", "wd")
    opt = cfg.build_batched(_stacked(), "reference")
    opt.start_round(round_index=T, lr_scale=SCALE)
    sd = opt.state_dict()
    other = cfg.build_batched(
        [torch.nn.Parameter(torch.randn(C + 1, *s, dtype=torch.float64)) for s in SHAPES], "reference"
    )
    with pytest.raises(ValueError, match="clients"):
        other.load_state_dict(sd)
    assert other.round_index == -1


# ------------------------------------------------------------------ round_index: integers only
@pytest.mark.parametrize(
    "bad",
    [
        [1, 1.5, 2, 3],
        1.5,
        float("nan"),
        [0, float("nan"), 1, 2],
        -1,
        [0, -2, 1, 1],
        float("inf"),
        torch.tensor([1.0, 1.5, 2.0, 3.0]),
        torch.tensor([0.0, float("nan"), 1.0, 1.0]),
        torch.tensor(-3),
        torch.tensor([0, -1, 2, 3]),
        True,
        "2",
        [0, 1, None, 2],
    ],
    ids=lambda v: repr(v).replace(" ", ""),
)
def test_round_index_must_hold_non_negative_integers(bad):
    params = _stacked()
    opt = catalogue.config("fednar", "clipped").build_batched(params, "reference")
    opt.start_round(round_index=4)
    _grads(params, 0)
    opt.step()
    before = (opt.round_index, opt.round_step, opt.client_round_index)
    with pytest.raises((ValueError, TypeError), match="round_index"):
        opt.start_round(round_index=bad)
    assert (opt.round_index, opt.round_step, opt.client_round_index) == before


@pytest.mark.parametrize(
    "good,want",
    [
        (3, [3] * C),
        (2.0, [2] * C),
        ([0, 1, 2.0, 5], [0, 1, 2, 5]),
        (torch.tensor([4, 3, 2, 1]), [4, 3, 2, 1]),
        (torch.tensor([4.0, 3.0, 2.0, 1.0]), [4, 3, 2, 1]),
        (torch.tensor(6), [6] * C),
    ],
)
def test_integral_round_indices_are_taken(good, want):
    params = _stacked()
    opt = catalogue.config("fednar", "clipped").build_batched(params, "reference")
    opt.start_round(round_index=good)
    assert opt.client_round_index == want


def test_per_client_optimizer_names_round_index():
    opt = catalogue.config("fednar", "clipped").build([torch.nn.Parameter(torch.randn(3))], "reference")
    with pytest.raises((TypeError, ValueError), match="round_index"):
        opt.start_round(round_index=float("nan"))
    assert opt.round_index == -1


# ------------------------------------------------------------------ zero clients
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_zero_clients_are_refused_at_construction(algo):
    with pytest.raises(ValueError, match="client"):
        catalogue.config(algo).build_batched(
            [torch.nn.Parameter(torch.zeros(0, 4)), torch.nn.Parameter(torch.zeros(0, 2, 3))], "reference"
        )


# ------------------------------------------------------------------ PAdaMFed: a client without steps
@pytest.mark.parametrize("backend", _backends())
def test_padamfed_client_without_steps_keeps_its_control(backend):
    cfg = catalogue.config("padamfed", "controls")
    params = [torch.nn.Parameter(p.detach().float()) for p in _stacked()]
    opt = cfg.build_batched(params, backend)
    ci = [torch.randn(p.shape) for p in params]
    opt.start_round(
        global_control=[torch.randn(p.shape) for p in params],
        local_control=ci,
        momentum=[torch.randn(p.shape) for p in params],
    )
    for k in range(2):
        _grads(params, k)
        opt.step(active=torch.tensor([True, False, True, True]))
    out = opt.local_control()
    for o, c in zip(out, ci):
        assert torch.isfinite(o).all()
        assert torch.equal(o[1], c[1])  # client 1 took no step: what it was given
        assert o[0].numel() == 0 or not torch.equal(o[0], c[0])  # the others: acc / K
    # no client stepped at all: every client keeps its control; none given: zeros
    opt.start_round(local_control=ci)
    assert all(torch.equal(o, c) for o, c in zip(opt.local_control(), ci))
    opt.start_round()
    assert all(torch.equal(o, torch.zeros_like(c)) for o, c in zip(opt.local_control(), ci))


def test_per_client_padamfed_without_steps_raises():
    opt = catalogue.config("padamfed", "controls").build([torch.nn.Parameter(torch.randn(3))], "reference")
    opt.start_round(local_control=[torch.randn(3)])
    with pytest.raises(RuntimeError, match="step"):
        opt.local_control()
