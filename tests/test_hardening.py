"""Hostile inputs that used to give silent wrong results or broken optimizers (docs/algorithms.md).

* global norms stay right (relative 1e-6) and agree across backends for every element magnitude
  in [1e-30, 1e30] (float32 sums of squares overflowed near 1e19 and underflowed near 1e-23);
* tensor schedules are validated like callables;
* the same parameter twice, or two overlapping views of one storage, are refused;
* ``copy.deepcopy`` and pickle give a working optimizer that continues exactly as the original;
* a rejected ``add_param_group`` adds nothing; PAdaMFed parameters added mid-round say what to do;
* a state_dict of another optimizer class is refused at load time.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from backends import cases, require

import fedopt_kernels as fk
from fedopt_kernels.fl import catalogue

LARGE, TINY = 1e18, 1e-25


def _params(n=3, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shapes = [(40, 3), (7,), (129,)][:n]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype=dtype, device=device)) for s in shapes]


def _grads(params, magnitude, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(p.shape, generator=g, dtype=torch.float64) * magnitude).to(dtype=p.dtype, device=p.device)
        for p in params
    ]


# ------------------------------------------------------------------ 1. norms without overflow / underflow
@pytest.mark.parametrize("magnitude", [LARGE, 1e30, TINY, 1e-30])
@pytest.mark.parametrize("backend,device", cases())
def test_fednar_clips_by_the_true_norm_at_extreme_magnitudes(backend, device, magnitude):
    require(backend, device)
    params = _params(device=device)
    x0 = [p.detach().double().clone() for p in params]
    grads = _grads(params, magnitude)
    max_norm, lr = 0.5, 0.1
    opt = fk.FedNAR(params, lr=lr, weight_decay=0.0, max_norm=max_norm, eps=0.0, round_decay=1.0, backend=backend)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    # float64 oracle: coef = min(1, max_norm / ||g||), x -= lr * coef * g
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    coef = min(1.0, max_norm / norm)
    assert math.isfinite(norm) and norm > 0
    moved = math.sqrt(sum(float(((x - p.detach().double()) ** 2).sum()) for x, p in zip(x0, params)))
    expected = lr * coef * norm
    assert abs(moved - expected) <= 1e-5 * expected + 1e-7, (moved, expected)


@pytest.mark.parametrize("magnitude", [LARGE, TINY, 1e-30])
@pytest.mark.parametrize("backend,device", cases())
def test_padamfed_steps_exactly_eta_at_extreme_magnitudes(backend, device, magnitude):
    require(backend, device)
    params = _params(device=device)
    x0 = [p.detach().double().clone() for p in params]
    eta = 0.01
    opt = fk.PAdaMFed(params, lr=eta, beta=1.0, eps=1e-300 if magnitude < 1e-20 else 1e-12, backend=backend)
    for p, g in zip(params, _grads(params, magnitude)):
        p.grad = g
    opt.step()
    moved = math.sqrt(sum(float(((x - p.detach().double()) ** 2).sum()) for x, p in zip(x0, params)))
    assert abs(moved - eta) <= 1e-5 * eta, f"{backend}: a step moved {moved}, not eta = {eta}"


@pytest.mark.parametrize("backend,device", cases(with_reference=False))
def test_backends_take_the_same_clip_decision_as_reference(backend, device):
    """Gradients whose norm lies just above / below max_norm, at magnitudes where float32 sums fail."""
    require(backend, device)
    for magnitude in (LARGE, TINY):
        base = _grads(_params(device=device), magnitude)
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in base))
        for max_norm in (norm * (1 - 1e-4), norm * (1 + 1e-4)):
            results = []
            for b in ("reference", backend):
                params = _params(device=device)
                opt = fk.FedNAR(params, lr=1.0 / norm, weight_decay=0.0, max_norm=max_norm, eps=0.0, backend=b)
                for p, g in zip(params, base):
                    p.grad = g.clone()
                opt.step()
                results.append([p.detach().double() for p in params])
            for a, c in zip(*results):
                torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ 2. tensor schedules
@pytest.mark.parametrize(
    "values,what",
    [
        ([1.0, float("nan")], "finite"),
        ([1.0, float("inf")], "finite"),
        ([1.0, -1.0], ">= 0"),
        ([1.0, 2.0], "non-increasing"),
        ([0.0, 0.0], "s\\(0\\) > 0"),
    ],
)
def test_tensor_schedule_is_validated_at_construction(values, what):
    with pytest.raises(ValueError, match=what):
        fk.FedDecaySGD(_params(1), lr=0.1, beta=0.5, schedule=torch.tensor(values))
    with pytest.raises(ValueError, match=what):
        fk.WithinRoundDecay(torch.optim.SGD(_params(1), lr=0.1), beta=0.5, schedule=torch.tensor(values))


def test_valid_tensor_schedule_is_used():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = fk.FedDecaySGD([p], lr=1.0, beta=0.5, schedule=torch.tensor([1.0, 0.25, 0.0]), backend="reference")
    for _ in range(3):
        p.grad = torch.ones(2)
        opt.step()
    torch.testing.assert_close(p.detach(), torch.full((2,), -1.25))


# ------------------------------------------------------------------ 3. shared memory
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_same_parameter_twice_is_refused(algo):
    cls = catalogue.ALGOS[algo].cls
    kw = catalogue.config(algo).kwargs
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="twice"):
        cls([p, p], **kw)
    with pytest.raises(ValueError, match="twice"):
        cls([{"params": [p]}, {"params": [p]}], **kw)
    opt = cls([p], **kw)
    with pytest.raises(ValueError, match="twice"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("views", ["slices", "transposed", "whole_and_part"])
def test_overlapping_views_are_refused(views):
    base = torch.randn(6, 4)
    a, b = {"slices": (base[:4], base[2:]), "transposed": (base, base.t()), "whole_and_part": (base.view(-1), base[1])}[
        views
    ]
    with pytest.raises(ValueError, match="share memory"):
        fk.FedNAR([torch.nn.Parameter(a), torch.nn.Parameter(b)], lr=0.1, weight_decay=0.0)
    opt = fk.FedNAR([torch.nn.Parameter(a)], lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group({"params": [torch.nn.Parameter(b)]})
    assert len(opt.param_groups) == 1


def test_disjoint_views_of_one_storage_are_allowed():
    base = torch.randn(6, 4)
    opt = fk.FedNAR([torch.nn.Parameter(base[:3]), torch.nn.Parameter(base[3:])], lr=0.1, weight_decay=0.0)
    assert len(opt.param_groups[0]["params"]) == 2


def test_overlap_made_later_through_data_is_refused_at_step():
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = fk.FedDecaySGD([a, b], lr=0.1, beta=0.5)
    b.data = a.data[1:3].clone()  # fine: own memory
    b.data = a.data.view(-1)[:2]  # now shares a's memory
    a.grad, b.grad = torch.ones(4), torch.ones(2)
    before = a.detach().clone()
    with pytest.raises(ValueError, match="share memory"):
        opt.step()
    assert torch.equal(a.detach(), before)


# ------------------------------------------------------------------ 4. copies
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
@pytest.mark.parametrize("backend,device", cases())
def test_copies_continue_exactly_as_the_original(backend, device, algo, how):
    require(backend, device)
    cfg = catalogue.config(algo)
    params = _params(device=device)
    opt = catalogue.run(cfg, params, backend, rounds=1, steps=2)
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        twin = pickle.loads(pickle.dumps(opt))
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b for a, b in zip(params, twin_params))
    assert (twin.round_index, twin.round_step, twin.backend) == (opt.round_index, opt.round_step, opt.backend)
    for step in range(2):  # the rest of the round, then a new round
        for o, ps in ((opt, params), (twin, twin_params)):
            for p, g in zip(ps, catalogue.rand_like_list(ps, 100 + step, 1.0)):
                p.grad = g
            o.step(**cfg.step_inputs(ps, 100 + step))
    for o, ps in ((opt, params), (twin, twin_params)):
        o.start_round(**cfg.round_inputs(ps, 5))
        for p, g in zip(ps, catalogue.rand_like_list(ps, 200, 1.0)):
            p.grad = g
        o.step(**cfg.step_inputs(ps, 200))
    for a, b in zip(params, twin_params):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(params, twin_params):
        for key, value in opt.state[a].items():
            assert torch.equal(value, twin.state[b][key]), key


def test_copy_of_a_schedule_optimizer_keeps_its_schedule_and_counters():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = fk.FedDecaySGD([p], lr=1.0, beta=0.5, decay_every=2)
    opt.start_round()
    for _ in range(3):
        p.grad = torch.ones(2)
        opt.step()
    twin = pickle.loads(pickle.dumps(opt))
    assert twin.round_step == 3 and twin.current_lr_factor() == opt.current_lr_factor() == 0.5  # s(3 // 2)


# ------------------------------------------------------------------ 5. rejected add_param_group
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_rejected_add_param_group_adds_nothing_and_can_be_retried(algo):
    cls, kw = catalogue.ALGOS[algo].cls, catalogue.config(algo).kwargs
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = cls([a], **kw)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [b], "lr": -1.0})
    assert len(opt.param_groups) == 1
    a.grad = torch.ones(3)
    opt.step(**catalogue.config(algo).step_inputs([a], 0))  # still works (FedSAM's closure included)
    opt.add_param_group({"params": [b], "lr": 0.01})  # and b can be added now
    assert len(opt.param_groups) == 2
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]})
    assert len(opt.param_groups) == 2


# ------------------------------------------------------------------ 6. PAdaMFed group added mid-round
def test_padamfed_group_added_mid_round_names_start_round():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = fk.PAdaMFed([a], lr=0.1, beta=0.5)
    opt.start_round()
    a.grad = torch.ones(3)
    opt.step()
    opt.add_param_group({"params": [b]})
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    before = (a.detach().clone(), b.detach().clone())
    with pytest.raises(RuntimeError, match=r"start_round\(\)"):
        opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
    opt.start_round()
    opt.step()
    assert opt.round_step == 1


# ------------------------------------------------------------------ 7. foreign state_dicts
@pytest.mark.parametrize("src", list(catalogue.ALGOS))
@pytest.mark.parametrize("dst", list(catalogue.ALGOS))
def test_state_dict_of_another_optimizer_class_is_refused(src, dst):
    src_cfg, dst_cfg = catalogue.config(src), catalogue.config(dst)
    if src_cfg.cls is dst_cfg.cls:
        pytest.skip("same class")
    params = _params()
    saved = catalogue.run(src_cfg, params, "reference", rounds=1, steps=1).state_dict()
    target = dst_cfg.build(_params(), "reference")
    before = target.state_dict()
    with pytest.raises(ValueError, match=src_cfg.cls.__name__):
        target.load_state_dict(saved)
    assert target.state_dict()["fedopt_round"] == before["fedopt_round"]


def test_torch_sgd_state_dict_is_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="fedopt_round"):
        fk.FedNAR([p], lr=0.1, weight_decay=0.0).load_state_dict(torch.optim.SGD([p], lr=0.1).state_dict())


def test_old_state_dict_without_class_marker_is_checked_by_its_keys():
    params = _params()
    sd = catalogue.run(catalogue.config("fednar"), params, "reference", rounds=1, steps=1).state_dict()
    del sd["fedopt_round"]["optimizer"]
    with pytest.raises(ValueError, match="param group 0"):
        catalogue.config("feddecay").build(_params(), "reference").load_state_dict(sd)


# the Triton interpreter computes in numpy, which warns on inf * 0 and inf - inf; a GPU makes the same NaN silently
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend,device", cases(with_reference=False))
def test_nonfinite_inputs_at_extreme_magnitudes_match_reference(backend, device, dtype):
    """1e30 gradients with an inf among them: NaN/inf patterns and values as reference."""
    require(backend, device, dtype)
    out = []
    for b in ("reference", backend):
        params = _params(dtype=dtype, device=device)
        grads = _grads(params, 1e30)
        grads[1][3] = float("inf")
        opt = fk.FedNAR(params, lr=0.1, weight_decay=0.01, max_norm=1.0, backend=b)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        out.append([p.detach().double() for p in params])
    for a, c in zip(*out):
        torch.testing.assert_close(c, a, equal_nan=True, rtol=1e-2, atol=1e-2)
