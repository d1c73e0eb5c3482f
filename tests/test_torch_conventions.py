"""torch.optim's conventions (docs/torch_optim.md), as torch's generic optimizer tests check them, for
every algorithm and option set of the catalogue, per-client and client-batched, on every backend.

Named parameters, a tensor ``lr`` (same bits as a float lr, no host read inside ``step()``, in-place
changes take effect), no empty state entries, state_dict determinism and loading across named and
unnamed optimizers, hooks, printing, deepcopy, ``step()`` without gradients, and
``torch.save``/``torch.load(weights_only=True)``. Triton runs on CPU under its interpreter for the
full option set of each algorithm only (it is slow there); GPU cases run where a GPU is present.
"""

from __future__ import annotations

import copy
import io
from typing import Any, Dict, List, Optional

import pytest
import torch
from no_sync import no_host_sync

from fedopt_kernels.core import registry as _registry
from fedopt_kernels.fl import algorithm, catalogue

SHAPES = [(4, 3), (5,), (2, 3, 2)]
C = 2  # clients of the batched form
ROUND_INDEX, LR_SCALE = [0, 3], [1.0, 0.5]  # batched per-client round inputs (tensor-lr bits test)
HAS_CUDA = torch.cuda.is_available()


class Case:
    """One optimizer configuration (algorithm, option set, per-client or batched) on one backend."""

    def __init__(self, algo: str, option: str, form: str, backend: str, device: str):
        self.cfg = catalogue.config(algo, option)
        self.form, self.backend, self.device = form, backend, device
        self.cls = self.cfg.cls if form == "client" else algorithm.of_optimizer(self.cfg.cls).batched

    # ------------------------------------------------------------------ building
    def params(self, seed: int = 0) -> List[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(seed)
        lead = (C,) if self.form == "batched" else ()
        return [torch.nn.Parameter(torch.randn(lead + s, generator=g).to(self.device)) for s in SHAPES]

    def build(self, params, named: bool = False, lr: Optional[str] = None):
        """``lr``: None (floats), "tensor" (float32 0-d tensors on the CPU), "tensor64", "device"
        (float32 on the parameters' device) for every group's lr."""
        groups = self.cfg.param_groups(params)
        kwargs = dict(self.cfg.kwargs)
        if named:
            names = {id(p): f"layer{i}.weight" for i, p in enumerate(params)}
            for group in groups:
                group["params"] = [(names[id(p)], p) for p in group["params"]]
        if lr is not None:
            kwargs["lr"] = self.lr_tensor(kwargs["lr"], lr)
            for group in groups[1:]:
                if "lr" in group:
                    group["lr"] = self.lr_tensor(group["lr"], lr)
        return self.cls(groups, backend=self.backend, **kwargs)

    def lr_tensor(self, value: float, kind: str) -> torch.Tensor:
        dtype = torch.float64 if kind == "tensor64" else torch.float32
        return torch.tensor(value, dtype=dtype, device=self.device if kind == "device" else "cpu")

    def twin(self, params, named: bool = False, lr: Optional[str] = None):
        """Fresh parameters equal to ``params`` and an optimizer on them."""
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        return copies, self.build(copies, named, lr)

    # ------------------------------------------------------------------ running
    @staticmethod
    def ordered(opt) -> List[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def start_round(self, opt, rnd: int, client_inputs: bool = False) -> None:
        ordered = self.ordered(opt)
        if self.form == "client":
            opt.start_round(**self.cfg.round_inputs(ordered, rnd))
            return
        views = [[p[c] for p in ordered] for c in range(C)]
        extra: Dict[str, Any] = {}
        if client_inputs:
            extra = dict(round_index=[t + rnd for t in ROUND_INDEX], lr_scale=LR_SCALE)
        opt.start_round(**self.cfg.batched_round_inputs(views, ordered, rnd), **extra)

    def step_inputs(self, opt, gstep: int) -> Dict[str, Any]:
        ordered = self.ordered(opt)
        if self.form == "client":
            return self.cfg.step_inputs(ordered, gstep)
        return self.cfg.batched_step_inputs([[p[c] for p in ordered] for c in range(C)], gstep)

    def step(self, opt, params, gstep: int) -> None:
        for p, g in zip(params, catalogue.rand_like_list(params, 500 + gstep, 1.0)):
            p.grad = g
        opt.step(**self.step_inputs(opt, gstep))

    def run(self, opt, params, rounds: int = 2, steps: int = 2, client_inputs: bool = False, between=None) -> None:
        for rnd in range(rounds):
            if rnd > 0:  # the previous round ends when the next one starts (as catalogue.run)
                algorithm.end_round(opt)
            self.start_round(opt, rnd, client_inputs)
            for k in range(steps):
                self.step(opt, params, rnd * steps + k)
                if between is not None:
                    between(opt, rnd * steps + k)

    def __repr__(self) -> str:
        return f"{self.cfg.algo}-{self.cfg.option}-{self.form}-{self.backend}-{self.device}"


def _device_pairs(triton: bool):
    # the Triton interpreter costs ~50 ms a step: on CPU only where the test reaches the kernels' hp
    pairs = [("reference", "cpu"), ("cpu", "cpu")] + ([("triton", "cpu")] if triton else [])
    if HAS_CUDA:
        pairs += [("reference", "cuda"), ("cuda", "cuda"), ("triton", "cuda")]
    return pairs


# besides each algorithm's full option set: two param groups, and PAdaMFed's per-step inputs
SOME_OPTIONS = {"groups", "vr"}


def _cases(every_option: bool, triton: bool = False) -> List[Any]:
    """Option sets x form x backend as pytest params: every option set, or each algorithm's full one
    and those of SOME_OPTIONS (Triton on CPU: the full option set only)."""
    out = []
    for algo in catalogue.ALGOS.values():
        options = [o for o in algo.options if every_option or o == algo.full or o in SOME_OPTIONS]
        for backend, device in _device_pairs(triton):
            for option in options:
                if backend == "triton" and device == "cpu" and option != algo.full:
                    continue
                for form in ("client", "batched"):
                    case = Case(algo.name, option, form, backend, device)
                    why = _registry.unavailable_reason(backend, torch.device(device), case.cls._spec.name)
                    marks = [pytest.mark.skipif(why is not None, reason=str(why))]
                    if device == "cuda":
                        marks.append(pytest.mark.gpu)
                    out.append(pytest.param(case, id=repr(case), marks=marks))
    return out


ALL = _cases(every_option=True)
SOME = _cases(every_option=False)
ALL_AND_TRITON = _cases(every_option=True, triton=True)
LR_KINDS = ["tensor"] + (["device"] if HAS_CUDA else [])  # a 0-d lr on the CPU / the parameters' device


# ---------------------------------------------------------------- comparisons
def _same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested state_dict-like structures (tensors: dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        )
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"{where}: values differ"
    elif isinstance(a, dict):
        # key order is not compared (torch compares state_dicts as dicts, too)
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), (
            f"{where}: keys {list(a)} vs {list(b) if isinstance(b, dict) else b}"
        )
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _same_run(params_a, opt_a, params_b, opt_b) -> None:
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"parameter {i} differs"
    _same(opt_a.state_dict()["state"], opt_b.state_dict()["state"], "state")


def _continue_alike(case, runs, gstep: int, rnd: Optional[int] = None, before=None) -> None:
    """Step every ``(params, optimizer)`` of ``runs`` at ``gstep`` (after ``before(optimizer)``), then, with
    ``rnd``, start round ``rnd`` and step again: every run ends with the bits of the first."""
    for ps, o in runs:
        if before is not None:
            before(o)
        case.step(o, ps, gstep)
        if rnd is not None:
            case.start_round(o, rnd)
            case.step(o, ps, gstep + 1)
    (p0, o0), *others = runs
    for ps, o in others:
        _same_run(p0, o0, ps, o)


def _tensor_and_float_lr(case, kind: str):
    """(params, optimizer with a tensor lr of ``kind``, twin params, twin optimizer whose lr is the float
    with the tensor's value: a float32 tensor rounds it)."""
    params = case.params()
    opt = case.build(params, lr=kind)
    twin, ref = case.twin(params)
    for gt, gf in zip(opt.param_groups, ref.param_groups):
        gf["lr"] = float(gt["lr"])
    return params, opt, twin, ref


def _without_lr(sd: Dict[str, Any]) -> Dict[str, Any]:
    """A state_dict with every group's lr as a float (to compare a tensor-lr run with a float-lr one)."""
    sd = dict(sd)
    sd["param_groups"] = [{k: (float(v) if k == "lr" else v) for k, v in g.items()} for g in sd["param_groups"]]
    return sd


# ---------------------------------------------------------------- named parameters
@pytest.mark.parametrize("case", SOME)
def test_named_parameters_are_kept_and_change_nothing_else(case):
    params = case.params()
    named = case.build(params, named=True)
    names = [f"layer{i}.weight" for i in range(len(params))]
    got = [n for g in named.param_groups for n in g["param_names"]]
    assert sorted(got) == sorted(names)
    for g in named.state_dict()["param_groups"]:
        assert len(g["param_names"]) == len(g["params"])
    twin, plain = case.twin(params)
    case.run(named, params)
    case.run(plain, twin)
    _same_run(params, named, twin, plain)
    assert "param_names" not in plain.state_dict()["param_groups"][0]


@pytest.mark.parametrize("case", ALL)
def test_state_dict_loads_across_named_and_unnamed(case):
    """Named -> unnamed (the names come along), named -> named, unnamed -> named (the optimizer keeps
    its names), mid-round; every loaded optimizer continues with the original's bits."""
    params = case.params()
    opt = case.build(params, named=True)
    case.run(opt, params, rounds=2, steps=1)
    case.start_round(opt, 2)
    case.step(opt, params, 10)  # mid-round
    sd = opt.state_dict()
    names = [g["param_names"] for g in opt.param_groups]
    unnamed_sd = copy.deepcopy(sd)
    for g in unnamed_sd["param_groups"]:
        del g["param_names"]
    loaded = []
    for named, saved in ((False, sd), (True, sd), (True, unnamed_sd)):
        twin, other = case.twin(params, named=named)
        other.load_state_dict(copy.deepcopy(saved))
        assert [g["param_names"] for g in other.param_groups] == names
        loaded.append((twin, other))
    _continue_alike(case, [(params, opt)] + loaded, 11, rnd=3)


@pytest.mark.parametrize("case", SOME)
@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
def test_state_dict_is_deterministic(case, named):
    """Two identical runs give identical state_dicts; loading one and stepping gives the same bits."""
    runs = []
    for _ in range(2):
        params = case.params()
        opt = case.build(params, named=named)
        case.run(opt, params)
        runs.append((params, opt))
    (pa, a), (pb, b) = runs
    _same(a.state_dict(), b.state_dict(), "state_dict")
    _same(a.state_dict(), a.state_dict(), "state_dict called twice")
    twin, c = case.twin(pa, named=named)
    c.load_state_dict(copy.deepcopy(a.state_dict()))  # as torch: load aliases tensors it need not cast
    _same(c.state_dict(), a.state_dict(), "state_dict after load")
    _continue_alike(case, [(pa, a), (twin, c)], 20)


@pytest.mark.parametrize("case", SOME)
def test_named_and_unnamed_groups_do_not_mix(case):
    params = case.params()
    extra = case.params(seed=1)
    named, unnamed = case.build(params, named=True), case.twin(params)[1]
    n = len(named.param_groups)
    with pytest.raises(ValueError, match="with/without names"):
        named.add_param_group({"params": [extra[0]]})
    with pytest.raises(ValueError, match="with/without names"):
        unnamed.add_param_group({"params": [("extra", extra[0])]})
    with pytest.raises(ValueError, match="names are missing"):
        named.add_param_group({"params": [("extra0", extra[0]), extra[1]]})
    with pytest.raises(TypeError, match="named parameter 0 of param group"):
        named.add_param_group({"params": [(0, extra[0])]})
    assert len(named.param_groups) == len(unnamed.param_groups) == n
    named.add_param_group({"params": [("extra0", extra[0])]})
    assert named.param_groups[-1]["param_names"] == ["extra0"]


# ---------------------------------------------------------------- tensor lr
@pytest.mark.parametrize("case", ALL_AND_TRITON)
@pytest.mark.parametrize("kind", LR_KINDS)
def test_tensor_lr_gives_the_bits_of_a_float_lr(case, kind):
    if kind == "device" and case.device == "cpu":
        pytest.skip("the parameters are on the CPU: covered by 'tensor'")
    params, opt, twin, ref = _tensor_and_float_lr(case, kind)
    case.run(opt, params, rounds=2, client_inputs=True)
    case.run(ref, twin, rounds=2, client_inputs=True)
    _same_run(params, opt, twin, ref)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    _same(_without_lr(opt.state_dict()), ref.state_dict(), "state_dict")


@pytest.mark.parametrize("case", SOME)
def test_tensor_lr_changed_in_place_or_replaced_takes_effect(case):
    """In place (as torch's schedulers change a tensor lr) and by a new tensor object."""
    params, opt, twin, ref = _tensor_and_float_lr(case, "tensor64")

    def tensor_change(o, gstep):
        for gi, g in enumerate(o.param_groups):
            if gstep == 2:
                g["lr"] = torch.tensor(float(g["lr"]) * 0.5, dtype=torch.float64)
            else:
                g["lr"].fill_(float(g["lr"]) * (0.9 - 0.1 * gi))

    def float_change(o, gstep):
        for gi, g in enumerate(o.param_groups):
            g["lr"] = g["lr"] * 0.5 if gstep == 2 else g["lr"] * (0.9 - 0.1 * gi)

    case.run(opt, params, steps=3, between=tensor_change)
    case.run(ref, twin, steps=3, between=float_change)
    _same_run(params, opt, twin, ref)


@pytest.mark.parametrize("case", SOME)
def test_an_lr_scheduler_changes_a_tensor_lr(case):
    """torch's LRScheduler fills a tensor lr in place; the steps follow it as they follow a float lr."""
    params, opt, twin, ref = _tensor_and_float_lr(case, "tensor64")
    lrs = [id(g["lr"]) for g in opt.param_groups]
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7) for o in (opt, ref)]
    case.run(opt, params, between=lambda o, k: scheds[0].step())
    case.run(ref, twin, between=lambda o, k: scheds[1].step())
    assert [id(g["lr"]) for g in opt.param_groups] == lrs  # changed in place
    assert float(opt.param_groups[0]["lr"]) != float(case.cfg.kwargs["lr"])
    _same_run(params, opt, twin, ref)


@pytest.mark.parametrize("case", SOME)
def test_bad_tensor_lr_is_refused_naming_lr(case):
    params = case.params()
    for bad, err, match in [
        (
            torch.tensor([0.1, 0.2]),
            ValueError,
            "^Tensor lr must be 1-element: lr must be a number or a tensor with one",
        ),
        (torch.tensor(-0.1), ValueError, "lr must be >= 0"),
        (torch.tensor(float("nan")), ValueError, "lr must be finite"),
        (torch.tensor(1), TypeError, "lr tensor must have a real floating-point dtype"),
    ]:
        with pytest.raises(err, match=match):
            case.cls(case.cfg.param_groups(params), backend=case.backend, **{**case.cfg.kwargs, "lr": bad})
    # set on a built optimizer: refused at the next step, which changes nothing
    opt = case.build(params)
    other = next(k for k in opt.defaults if k not in ("lr", "variance_reduction", "nesterov", "maximize"))
    value = torch.tensor(float(case.cfg.kwargs.get(other, opt.defaults[other])))
    with pytest.raises(TypeError, match=f"{other} must be a Python number, got a tensor \\(only lr may be"):
        case.cls(case.cfg.param_groups(params), backend=case.backend, **{**case.cfg.kwargs, other: value})
    case.run(opt, params, rounds=1, steps=1)
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[0]["lr"] = torch.ones(2)
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element"):
        case.step(opt, params, 5)
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))
    _same(opt.state_dict()["state"], state, "state after a refused step")
    if HAS_CUDA and case.device == "cpu":
        opt.param_groups[0]["lr"] = torch.tensor(0.1, device="cuda")
        with pytest.raises(ValueError, match="lr tensor is on cuda"):
            case.step(opt, params, 5)


@pytest.mark.parametrize(
    "case", [c for c in ALL_AND_TRITON if c.values[0].device == "cpu" and c.values[0].backend != "reference"]
)
def test_tensor_lr_step_reads_no_value_back(case, monkeypatch):
    """Inside step() a tensor lr goes tensor to tensor into the hp row: no .item()/float()/bool().
    (The reference backend is plain PyTorch that reads its step counter back: fused backends only.)"""
    params = case.params()
    opt = case.build(params, lr="tensor")
    twin, ref = case.twin(params)
    for gt, gf in zip(opt.param_groups, ref.param_groups):
        gf["lr"] = float(gt["lr"])

    def refuse(*_a, **_k):
        raise AssertionError("a tensor's value was read on the host inside step()")

    def steps(o, ps, changes):
        case.start_round(o, 0)
        for k in range(3):
            if o is opt:
                with monkeypatch.context() as m:
                    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "__index__"):
                        m.setattr(torch.Tensor, name, refuse)
                    case.step(o, ps, k)
            else:
                case.step(o, ps, k)
            changes(o)

    def tensor_change(o):
        for g in o.param_groups:
            g["lr"].mul_(0.75)  # in place, tensor arithmetic

    def float_change(o):
        for g in o.param_groups:
            g["lr"] = float(torch.tensor(g["lr"], dtype=torch.float32) * 0.75)

    steps(opt, params, tensor_change)
    steps(ref, twin, float_change)
    _same_run(params, opt, twin, ref)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in SOME if c.values[0].device == "cuda" and c.values[0].backend != "reference"]
)
@pytest.mark.parametrize("kind", ["tensor", "device"])
def test_tensor_lr_step_does_not_sync_the_device(case, kind):
    """A 0-d lr on the CPU or the parameters' device, changed in place between steps: no host sync
    (fused backends; the reference reads its step counter back)."""
    params = case.params()
    opt = case.build(params, lr=kind)
    case.start_round(opt, 0)
    for k in range(2):  # the first steps build the plan and the device counters
        case.step(opt, params, k)
    grads = [catalogue.rand_like_list(params, 900 + k, 1.0) for k in range(3)]
    inputs = [case.step_inputs(opt, 900 + k) for k in range(3)]
    with no_host_sync():
        for k in range(3):
            for p, g in zip(params, grads[k]):
                p.grad = g
            opt.step(**inputs[k])
            for g in opt.param_groups:
                g["lr"].mul_(0.9)
    assert all(torch.isfinite(p).all() for p in params)


# ---------------------------------------------------------------- state entries
@pytest.mark.parametrize("case", ALL_AND_TRITON)
def test_no_empty_state_entries(case):
    params = case.params()
    opt = case.build(params)
    case.run(opt, params)
    for _p, st in opt.state.items():
        assert st, "an empty state entry"
    sd = opt.state_dict()["state"]
    assert all(sd.values()), f"empty entries in state_dict()['state']: {sd}"
    if not case.cfg.present() and not algorithm.of_optimizer(case.cls).closure_step:  # FedSAM keeps x
        assert len(opt.state) == 0 and sd == {}


@pytest.mark.parametrize("case", SOME)
def test_a_state_dict_with_empty_entries_still_loads(case):
    """state_dicts saved before empty entries were dropped hold {i: {}}: they load and continue alike."""
    params = case.params()
    opt = case.build(params)
    case.run(opt, params, rounds=1, steps=1)
    sd = copy.deepcopy(opt.state_dict())
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    for i in ids:
        sd["state"].setdefault(i, {})
    twin, other = case.twin(params)
    other.load_state_dict(sd)
    assert all(other.state.values())
    _continue_alike(case, [(params, opt), (twin, other)], 3, rnd=1)


# ---------------------------------------------------------------- torch.optim machinery
@pytest.mark.parametrize("case", SOME)
def test_hooks_run(case):
    params = case.params()
    opt = case.build(params)
    calls: List[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("step_pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("step_post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))

    def sd_post(o, sd):
        calls.append("sd_post")
        sd["marker"] = 1
        return sd

    opt.register_state_dict_post_hook(sd_post)

    def load_pre(o, sd):
        calls.append("load_pre")
        sd = dict(sd)
        sd.pop("marker", None)
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    case.start_round(opt, 0)
    case.step(opt, params, 0)
    sd = opt.state_dict()
    assert sd["marker"] == 1
    opt.load_state_dict(sd)
    assert calls == ["step_pre", "step_post", "sd_pre", "sd_post", "load_pre", "load_post"]


@pytest.mark.parametrize("case", SOME)
def test_global_hooks_and_the_profilers_range(case):
    """torch.optim's global step hooks run around every step, and a running profiler sees the step as
    ``Optimizer.step#<Class>.step`` (the range is entered only while a profiler records)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    params = case.params()
    opt = case.build(params)
    calls: List[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append("pre") if o is opt else None),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append("post") if o is opt else None),
    ]
    opt.register_step_pre_hook(lambda o, a, k: calls.append("own_pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("own_post"))
    try:
        case.start_round(opt, 0)
        # acc_events: one cycle either way; without it torch 2.10's profiler warns that it would clear
        # the events of earlier cycles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
            case.step(opt, params, 0)
    finally:
        for h in handles:
            h.remove()
    assert calls == ["pre", "own_pre", "own_post", "post"]
    names = {e.name for e in prof.events()}
    assert f"Optimizer.step#{type(opt).__name__}.step" in names, sorted(names)[:20]


@pytest.mark.parametrize("case", SOME)
@pytest.mark.parametrize("lr", [None, "tensor"], ids=["float_lr", "tensor_lr"])
def test_repr_shows_every_group(case, lr):
    params = case.params()
    opt = case.build(params, named=True, lr=lr)
    text = repr(opt)
    assert text.startswith(case.cls.__name__ + " (")
    for gi in range(len(opt.param_groups)):
        assert f"Parameter Group {gi}" in text
    assert "param_names: ['layer0.weight'" in text and "lr: " in text


@pytest.mark.parametrize("case", SOME)
@pytest.mark.parametrize("lr", [None, "tensor"], ids=["float_lr", "tensor_lr"])
def test_deepcopy_continues_exactly_as_the_original(case, lr):
    params = case.params()
    opt = case.build(params, lr=lr)
    case.start_round(opt, 0)
    case.step(opt, params, 0)
    twin, copied = copy.deepcopy((params, opt))
    if lr is not None:
        assert copied.param_groups[0]["lr"] is not opt.param_groups[0]["lr"]

    def halve_lr(o):
        for g in o.param_groups:
            g["lr"] = g["lr"].mul_(0.5) if lr is not None else g["lr"] * 0.5

    _continue_alike(case, [(params, opt), (twin, copied)], 1, rnd=1, before=halve_lr)
    assert copied.round_step == opt.round_step and copied.round_index == opt.round_index


@pytest.mark.parametrize("case", ALL)
@pytest.mark.parametrize("when", ["fresh", "mid_round"])
def test_step_without_grads_changes_nothing(case, when):
    """Mid-round, or as the first call (which starts a round: compared with a started twin); the
    within-round step counter does not count such a step."""
    params = case.params()
    opt = case.build(params)
    if when == "mid_round":
        case.start_round(opt, 0)
        case.step(opt, params, 0)
        opt.zero_grad(set_to_none=True)
        twin, expected = params, opt
    else:
        twin, expected = case.twin(params)
        expected.start_round()
    before = [p.detach().clone() for p in twin]
    state = copy.deepcopy(expected.state_dict())
    inputs = case.step_inputs(opt, 1)
    # per-step inputs of absent grads: None; a closure (FedSAM's) stays, as the step calls it anyway
    opt.step(**{k: v if callable(v) else [None] * len(v) for k, v in inputs.items()})
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))
    assert all(opt.state.values()), "the step made empty state entries"
    after = opt.state_dict()
    _same(after["state"], state["state"], "state")
    _same(after["fedopt_round"], state["fedopt_round"], "round counters")  # k does not count it
    _same(after["param_groups"], state["param_groups"], "param_groups")


@pytest.mark.parametrize("case", ALL)
def test_save_and_load_with_weights_only_continues_alike(case):
    _save_load_continue(case, "plain")


@pytest.mark.parametrize("case", SOME)
@pytest.mark.parametrize("variant", ["named", "tensor_lr"])
def test_save_and_load_named_or_tensor_lr_with_weights_only(case, variant):
    _save_load_continue(case, variant)


def _save_load_continue(case, variant: str) -> None:
    params = case.params()
    named, lr = variant == "named", ("tensor" if variant == "tensor_lr" else None)
    opt = case.build(params, named=named, lr=lr)
    case.start_round(opt, 0)
    case.step(opt, params, 0)
    case.step(opt, params, 1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    twin, other = case.twin(params, named=named, lr=lr)
    other.load_state_dict(loaded)
    _same(other.state_dict(), opt.state_dict(), "state_dict after load")
    for ps, o in ((params, opt), (twin, other)):
        case.step(o, ps, 2)
        case.start_round(o, 1)
        case.step(o, ps, 3)
    _same_run(params, opt, twin, other)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_within_round_decay_fills_a_tensor_lr_in_place(backend):
    """FedDecay's scheduler treats a tensor lr as torch's schedulers do: in place, same values."""
    from fedopt_kernels import FedNAR, WithinRoundDecay

    runs = []
    for lr in (torch.tensor(0.1, dtype=torch.float64), 0.1):
        params = Case("fednar", "wd", "client", backend, "cpu").params()
        opt = FedNAR(params, lr=lr, weight_decay=1e-3, backend=backend)
        sched = WithinRoundDecay(opt, beta=0.5)
        for rnd in range(2):
            opt.start_round()
            sched.start_round()
            for k in range(2):
                for p, g in zip(params, catalogue.rand_like_list(params, 700 + 2 * rnd + k, 1.0)):
                    p.grad = g
                opt.step()
                sched.step()
        if isinstance(lr, torch.Tensor):
            assert opt.param_groups[0]["lr"] is lr
        runs.append((params, opt))
    (pa, a), (pb, b) = runs
    assert float(a.param_groups[0]["lr"]) == b.param_groups[0]["lr"]
    _same_run(pa, a, pb, b)
