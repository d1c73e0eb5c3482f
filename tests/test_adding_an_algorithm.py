"""docs/dispatch.md's "Adding an algorithm" checklist, as a test: every registered algorithm is wired
into every layer that should pick it up from its descriptor, and a descriptor that misses one is named;
an algorithm on an existing op, written out of the package as one module (its optimizer, its descriptor,
its benchmark rows and its Flower name, each registered with its layer), reaches the command line,
Flower, the catalogue and the benchmark with nothing else but its export and its docs section.
"""

from __future__ import annotations

import math
import pathlib
from typing import List, cast

import pytest
import torch
from harness import TOLERANCE

import fedopt_kernels
import fedopt_kernels.batched
from bench import cases as bench_cases
from fedopt_kernels.batched.mixin import ClientBatched
from fedopt_kernels.core import ops as _ops
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.core.optimizer import FedOptimizer
from fedopt_kernels.fl import algorithm, catalogue, server_step
from fedopt_kernels.fl.algorithm import Algorithm, Variant
from fedopt_kernels.fl.config import FLConfig, algorithm_settings
from fedopt_kernels.fl.server_rules import RULES

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "algorithms.md").read_text()


def missing_registrations(a: Algorithm) -> List[str]:
    """What the checklist finds missing for descriptor ``a`` (empty: fully wired)."""
    out = []
    opt, batched = a.optimizer, a.batched
    if not (isinstance(opt, type) and issubclass(opt, FedOptimizer)):
        out.append("optimizer: not a FedOptimizer subclass")
        return out
    spec = getattr(opt, "_spec", None)
    if spec is None or _ops.PER_CLIENT.get(spec.name) is not spec:
        out.append("op: the optimizer's _spec is not an op declared in _ops.PER_CLIENT")
        return out
    assert spec is not None  # returned above otherwise (mypy reads `get(...) is not spec` as widening it)
    if not (isinstance(batched, type) and issubclass(batched, ClientBatched) and issubclass(batched, opt)):
        out.append("batched form: not ClientBatched + the per-client class")
    elif batched._spec is not _ops.BATCHED.get(f"{spec.name}_batched"):
        out.append(f"batched form: its _spec is not {spec.name}_batched")
    if getattr(fedopt_kernels, opt.__name__, None) is not opt or opt.__name__ not in fedopt_kernels.__all__:
        out.append(f"export: fedopt_kernels.{opt.__name__} (and __all__)")
    if isinstance(batched, type) and getattr(fedopt_kernels.batched, batched.__name__, None) is not batched:
        out.append(f"export: fedopt_kernels.batched.{batched.__name__}")
    if algorithm.ALGORITHMS.get(a.name) is not a:
        out.append("registry: algorithm.register(...) was not called")
    for op in (spec.name, f"{spec.name}_batched"):
        if _registry.unavailable_reason("reference", op=op) is not None:
            out.append(f"reference: no implementation of op {op!r}")
    if a.name not in catalogue.ALGOS or a.full not in catalogue.ALGOS[a.name].options:
        out.append("catalogue: its option sets")
    if not any(case.core for case in bench_cases.of(a.name)):
        out.append("bench: no core benchmark row")
    if not a.variants:
        out.append("simulator/Flower: no variant (fedopt-sim --algorithm name)")
    for v in a.variants:
        if v.server not in RULES:
            out.append(f"variant {v.name!r}: server rule {v.server!r} is not registered (server_rules.register_rule)")
    if f"## {opt.__name__}" not in DOCS and f"`{opt.__name__}`" not in DOCS:
        out.append(f"docs/algorithms.md: no section on {opt.__name__}")
    return out


@pytest.mark.parametrize("name", list(algorithm.ALGORITHMS))
def test_every_registered_algorithm_is_wired_everywhere(name):
    assert missing_registrations(algorithm.ALGORITHMS[name]) == []


@pytest.mark.parametrize("variant", list(algorithm.VARIANTS))
def test_every_variant_runs_through_the_simulator_and_flower_settings(variant):
    """Its settings resolve, the client optimizer builds (both forms) and takes a round and a step."""
    cfg = FLConfig(algorithm=variant, clients=4, clients_per_round=2, rounds=3, local_steps=2).validate()
    hp = cfg.hparams()
    a = cfg.algo
    for batched in (False, True):
        w = torch.nn.Parameter(torch.randn(2, 3, 4) if batched else torch.randn(3, 4))
        opt = a.make([w], cfg, cfg.variant, hp, "reference", batched=batched)
        assert isinstance(opt, a.batched if batched else a.optimizer)
        rule = RULES[cfg.server_rule]
        inputs = rule.client_inputs({k: [torch.zeros_like(w)] for k in rule.sent.values()}, None, [w.detach()])
        if inputs.get("local_control") is None:
            inputs.pop("local_control", None)
        opt.start_round(**inputs)
        w.grad = torch.ones_like(w)
        before = w.detach().clone()
        if a.needs_anchor(cfg.variant):
            opt.step(anchor_grads=[torch.ones_like(w)])
        else:  # as the simulator and the Flower client step it (FedSAM: a closure for the second gradient)
            a.local_step(opt, lambda w=w: setattr(w, "grad", torch.ones_like(w)))
        assert not torch.equal(before, w.detach())


def test_the_checklist_names_what_a_descriptor_misses():
    """A descriptor registered nowhere, without bench rows, variants or docs: each gap is named."""

    class Undocumented(fedopt_kernels.FedDecaySGD):
        pass

    fake = Algorithm(
        "undocumented",
        Undocumented,
        fedopt_kernels.batched.BatchedFedDecaySGD,
        options={"plain": dict(lr=0.1, beta=0.5)},
        full="plain",
        variants=(Variant("undoc", "no-such-rule"),),
    )
    missing = missing_registrations(fake)
    for what in (
        "batched form",
        "export: fedopt_kernels.Undocumented",
        "registry",
        "catalogue",
        "bench",
        "server rule 'no-such-rule'",
        "docs/algorithms.md",
    ):
        assert any(what in m for m in missing), (what, missing)


def test_registering_a_name_twice_is_refused():
    a = algorithm.ALGORITHMS["feddecay"]
    with pytest.raises(ValueError, match="registered twice"):
        algorithm.register(a)


# where an algorithm's name may stand as a string: its own modules (optim/, fl/algorithms/), the
# kernels, the shared server rules (SCAFFOLD's rule is called "scaffold", as its variant), the Flower
# names and the benchmark rows declared by algorithm or variant name, and these few places that name
# one on purpose (a default, the benchmark's goals and its client-batched workload)
_NAME_FOLDERS = (
    "fedopt_kernels/optim/",
    "fedopt_kernels/fl/algorithms/",
    "fedopt_kernels/core/backends/",
    "triton_kernels/",
)
_NAME_HOMES = {
    "fedopt_kernels/core/ops.py",
    "fedopt_kernels/core/reference.py",
    "fedopt_kernels/fl/server_rules.py",
    "fedopt_kernels/flower/paper_names.py",
    "bench/cases.py",
}
_NAMED_ON_PURPOSE = {
    "fedopt_kernels/fl/config.py": {"fedavg"},
    "fedopt_kernels/flower/runconfig.py": {"fedavg"},
    "bench/step_goals.py": {"feddecay", "fednar", "padamfed"},
    "bench/clients/workload.py": {"fednar"},
    # the memory benchmark's rows: FedAvg beside each rule that keeps client state
    "bench/scale.py": {"fedavg", "scaffold", "feddyn", "padamfed"},
}


_OLD_KINDS = {"decay", "nlr", "nar"}  # the simulator's old optimizer kinds, as whole strings


def _string_names(path: pathlib.Path, names) -> List[tuple]:
    """(line, name) of every string constant (docstrings aside) that is, or mentions as a word, an algorithm name."""
    import ast
    import re

    pat = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")(?![\w-])")
    tree = ast.parse(path.read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and len(node.value) < 40
        ):  # names and keys, not messages
            out += [(node.lineno, m.group(0)) for m in pat.finditer(node.value)]
            if node.value in _OLD_KINDS:
                out.append((node.lineno, node.value))
    return out


def test_no_algorithm_name_outside_its_descriptor_and_kernels():
    names = set(algorithm.VARIANTS) | set(algorithm.ALGORITHMS)
    found = []
    for path in sorted(ROOT.glob("fedopt_kernels/**/*.py")) + sorted(ROOT.glob("bench/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _NAME_HOMES or rel.startswith(_NAME_FOLDERS):
            continue
        allowed = _NAMED_ON_PURPOSE.get(rel, set())
        found += [f"{rel}:{line}: {name!r}" for line, name in _string_names(path, names) if name not in allowed]
    assert found == []


def _out_of_range(f) -> list:
    low, high, low_open, _ = f.metadata["range"]
    if f.metadata["choices"]:
        return ["no-such-choice", 3]
    bad = [float("nan"), float("inf"), True, "1"]
    bad.append(low - 1 if not low_open else low)
    if high != float("inf"):
        bad.append(high + 1)
    return bad


@pytest.mark.parametrize("setting", [f.name for f in algorithm_settings(FLConfig)])
def test_every_algorithm_setting_refuses_bad_values_naming_itself(setting):
    f = next(f for f in algorithm_settings(FLConfig) if f.name == setting)
    takes = next(
        v
        for v in algorithm.VARIANTS.values()
        if not f.metadata["some"] or setting in algorithm.ALGORITHMS[v.algorithm].settings
    )
    for value in _out_of_range(f):
        with pytest.raises(ValueError, match=setting):
            FLConfig(algorithm=takes.name, **{setting: value}).validate()


@pytest.mark.parametrize("setting", [f.name for f in algorithm_settings(FLConfig) if f.metadata["some"]])
def test_a_setting_is_refused_by_the_algorithms_that_do_not_take_it(setting):
    f = next(f for f in algorithm_settings(FLConfig) if f.name == setting)
    given = {"beta": 0.5, "momentum": 0.5, "weight_decay": 0.1, "clip_norm": 1.0, "round_decay": 0.9}.get(setting, 0.5)
    assert f.default != given
    for v in algorithm.VARIANTS.values():
        cfg = FLConfig(algorithm=v.name, **{setting: given})
        if setting in algorithm.ALGORITHMS[v.algorithm].settings:
            if v.beta is None or setting != "beta":
                cfg.validate()
        else:
            with pytest.raises(ValueError, match=f"{setting} does not apply"):
                cfg.validate()


# ---------------------------------------------------------------- an algorithm from one module
# An algorithm on an existing op (sgd), complete in one file: optimizer, client-batched form, descriptor
# with variants on two server rules, option sets, a benchmark row with its baseline, a Flower name.
ONE_MODULE = '''
"""HeavyBallSGD: SGD with momentum 0.9 unless told otherwise, on the round API (a test's algorithm)."""
import torch

from bench import cases
from bench.cases import Baseline, BenchCase
from fedopt_kernels.batched.mixin import ClientBatched
from fedopt_kernels.core.ops import BATCHED
from fedopt_kernels.fl import algorithm
from fedopt_kernels.fl.algorithm import Variant
from fedopt_kernels.fl.algorithms.sgd import SGDAlgorithm
from fedopt_kernels.optim.feddecay import FedDecaySGD


class HeavyBallSGD(FedDecaySGD):
    """Heavy-ball SGD: torch.optim.SGD with momentum (default 0.9) and no within-round decay."""

    def __init__(self, params, lr=0.01, momentum=0.9, **kw):
        super().__init__(params, lr=lr, beta=1.0, momentum=momentum, **kw)


class BatchedHeavyBallSGD(ClientBatched, HeavyBallSGD):
    _spec = BATCHED["sgd_batched"]


class _HeavyBall(SGDAlgorithm):
    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(params, lr=hp["lr"], momentum=cfg.momentum or 0.9, weight_decay=cfg.weight_decay,
                   backend=backend)


def plain_sgd(params, kwargs):
    return torch.optim.SGD(params, lr=kwargs["lr"], momentum=kwargs["momentum"], foreach=True)


DESCRIPTOR = algorithm.register(_HeavyBall(
    "heavyball", HeavyBallSGD, BatchedHeavyBallSGD, title="A heavy ball for a test",
    settings=("momentum", "weight_decay", "round_decay"),
    variants=(Variant("heavyball", "avg"), Variant("heavyball-scaffold", "scaffold")),
    full="momentum_wd",
    options={"plain": dict(lr=0.1, momentum=0.9), "momentum_wd": dict(lr=0.05, momentum=0.5, weight_decay=0.01,
                                                                      correction=True)},
))
cases.add("heavyball", BenchCase("heavyball", "HeavyBallSGD", "plain", core=True,
                                 baselines=(Baseline("torch.SGD(foreach) by hand", plain_sgd),)))
try:  # its Flower name, where Flower is installed
    from fedopt_kernels.flower.naming import FlowerName, declare
except ImportError:
    pass
else:
    declare(FlowerName("HeavyBallStrategy", "heavyball"))
'''


def _one_module(tmp_path, name: str, text: str, flower_name: str):
    """Import ``text`` as module ``name`` from a file of its own (it registers its algorithm ``name``,
    its benchmark rows and, with Flower, its strategy ``flower_name``); all withdrawn afterwards."""
    import importlib.util
    import sys

    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    try:
        yield mod
    finally:
        algorithm.unregister(name)
        bench_cases.withdraw(name)
        naming = sys.modules.get("fedopt_kernels.flower.naming")
        if naming is not None:
            naming.withdraw(flower_name)
        del sys.modules[name]


@pytest.fixture
def heavyball(tmp_path):
    yield from _one_module(tmp_path, "heavyball", ONE_MODULE, "HeavyBallStrategy")


def test_an_algorithm_on_an_existing_op_is_one_module(heavyball, tmp_path):
    import bench.algorithms as bench_algorithms
    from fedopt_kernels.sim.cli.fedopt_sim import build_parser, config_from_args

    a = algorithm.ALGORITHMS["heavyball"]
    # the checklist: only the other two of its three files (the export and the docs section) are missing
    missing = missing_registrations(a)
    assert len(missing) == 2 and missing[0].startswith("export: fedopt_kernels.HeavyBallSGD"), missing
    assert missing[1].startswith("docs/algorithms.md"), missing
    # the command line: its variants are choices, and a run of one is configured from the flags
    parser = build_parser()
    assert "heavyball-scaffold" in parser.format_help()
    args = parser.parse_args(["--algorithm", "heavyball-scaffold", "--momentum", "0.5", "--rounds", "1"])
    cfg = config_from_args(args, 0)
    opt = cfg.algo.make([torch.nn.Parameter(torch.randn(3))], cfg, cfg.variant, cfg.hparams(), "reference")
    assert isinstance(opt, heavyball.HeavyBallSGD) and opt.param_groups[0]["momentum"] == 0.5
    # the catalogue: every backend against the reference, per client and client-batched
    cfg = catalogue.config("heavyball")
    ref = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    got = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    catalogue.run(cfg, ref, "reference")
    catalogue.run(cfg, got, "auto")
    for x, y in zip(ref, got):
        torch.testing.assert_close(x, y)
    assert isinstance(cfg.build_batched([torch.nn.Parameter(torch.randn(2, 3))]), heavyball.BatchedHeavyBallSGD)
    # the benchmark: its row and its baseline
    case = bench_algorithms.ALGOS["heavyball"]
    assert "heavyball" in bench_algorithms.core_cases() and case.by_hand == "torch.SGD(foreach) by hand"
    params = [torch.nn.Parameter(torch.randn(6))]
    params[0].grad = torch.randn(6)
    case.build(params, "reference").step()
    bench_algorithms.build_baseline(case, params, case.by_hand).step()


def test_an_algorithm_without_benchmark_rows_gets_its_default_row():
    """A descriptor that declares no rows is benchmarked on its first option set (the paper
    configuration), in the default table and without a baseline; an unregistered name has none."""
    import bench.algorithms as bench_algorithms

    feddecay = algorithm.ALGORITHMS["feddecay"]
    algorithm.register(
        type(feddecay)(
            "norows",
            fedopt_kernels.FedDecaySGD,
            fedopt_kernels.batched.BatchedFedDecaySGD,
            options={"first": dict(lr=0.1, beta=0.5), "second": dict(lr=0.05, beta=0.9, momentum=0.9)},
            full="second",
            variants=(Variant("norows", "avg"),),
        )
    )
    try:
        (case,) = bench_cases.of("norows")
        assert (case.name, case.option, case.core, case.baselines) == ("norows", "first", True, ())
        assert "norows" in bench_algorithms.core_cases()
        params = [torch.nn.Parameter(torch.randn(6))]
        params[0].grad = torch.randn(6)
        before = params[0].detach().clone()
        bench_algorithms.ALGOS["norows"].build(params, "reference").step()
        assert not torch.equal(before, params[0].detach())
    finally:
        algorithm.unregister("norows")
    assert bench_cases.of("norows") == ()


def test_an_algorithm_from_one_module_gets_its_flower_strategy(heavyball):
    pytest.importorskip("flwr")
    import fedopt_kernels.flower as flower
    from fedopt_kernels.fl.config import FLConfig

    s = flower.HeavyBallStrategy(lr=0.2, local_steps=3, fraction_train=0.5)
    assert s.cfg.algorithm == "heavyball" and s.hp["lr"] == 0.2 and s.fraction_train == 0.5
    assert isinstance(flower.strategy_for(FLConfig(algorithm="heavyball-scaffold")), flower.AveragingStrategy)
    with pytest.raises(TypeError, match="no_such_keyword"):
        flower.HeavyBallStrategy(no_such_keyword=1)


# ---------------------------------------------------------------- a second op and two gradients, from one module
# A seventh algorithm whose step runs a second op (sam_ascent, declared as an OtherOp and run by the base's
# _run_op) and takes two gradients (the descriptor's closure_step), complete in one file: nothing in sim/,
# flower/ or batched/ knows it, and the command line, the simulator (client by client and client-batched,
# its step graph included) and Flower run it.
TWO_GRADIENTS = '''
"""PushSGD: SGD from a pushed point (a test's algorithm: a second op and two gradients per step)."""
import torch

from bench import cases
from bench.cases import Baseline, BenchCase
from fedopt_kernels.batched.mixin import ClientBatched
from fedopt_kernels.core.op_runner import OtherOp
from fedopt_kernels.core.ops import BATCHED, SAM_ASCENT
from fedopt_kernels.core.optimizer import FedOptimizer, check_number
from fedopt_kernels.fl import algorithm
from fedopt_kernels.fl.algorithm import Variant
from fedopt_kernels.fl.algorithms.sgd import SGDAlgorithm
from fedopt_kernels.optim.sgd import SGDFamily


class PushSGD(SGDFamily):
    """SGD from a pushed point: x += rho * g / (||g|| + eps), then SGD there with the gradient there."""

    _state_keys = SGDFamily._state_keys + ("pushed_from",)
    _hp_columns = {"maximize": 0.0}
    # the push is the sam_ascent op with w = 1; the x it saves is kept, never restored
    _other_ops = (OtherOp("push", SAM_ASCENT, state={"saved_x": "pushed_from"}, columns={"eta": 0.0, "adaptive": 0.0}),)

    def __init__(self, params, lr=0.1, rho=0.05, momentum=0.0, weight_decay=0.0, eps=1e-12, prox_mu=0.0,
                 backend="auto", replay=None):
        defaults = dict(lr=lr, rho=rho, eps=eps, momentum=momentum, dampening=0.0, weight_decay=weight_decay,
                        nesterov=False, prox_mu=prox_mu)
        super().__init__(params, defaults, backend, replay)

    def _validate_group(self, group):
        super()._validate_group(group)
        check_number("rho", group["rho"], low=0.0)
        check_number("eps", group["eps"], low=0.0)

    def step(self, closure=None):
        return self._push_then_step(closure, {})

    def _push_then_step(self, closure, kwargs):
        if closure is None:
            raise RuntimeError("PushSGD.step() needs a closure: its second gradient, at the pushed point")
        if self._t < 0:
            self.start_round()
        self._run_op("push", active=kwargs.get("active"))
        return FedOptimizer.step(self, closure, **kwargs)  # the closure, then the sgd op


class BatchedPushSGD(ClientBatched, PushSGD):
    _spec = BATCHED["sgd_batched"]

    def step(self, closure=None, *, active=None):
        active = self.check_active(active)
        if closure is None:
            return self._push_then_step(None, {})
        self._run_op("push", active=active)
        return ClientBatched.step(self, closure, active=active)


class _Push(SGDAlgorithm):
    closure_step = True  # two gradients per step: every front end hands the step its closure

    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(params, lr=hp["lr"], momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   prox_mu=hp["prox_mu"], backend=backend)

    def lr_sum(self, opt, hp, t, steps):
        return steps * opt.param_groups[0]["lr"]

    def state_copies(self, cfg, variant):
        return super().state_copies(cfg, variant) + 1  # pushed_from


def plain_sgd(params, kwargs):
    return torch.optim.SGD(params, lr=kwargs["lr"], momentum=kwargs.get("momentum", 0.0), foreach=True)


DESCRIPTOR = algorithm.register(_Push(
    "pushsgd", PushSGD, BatchedPushSGD, title="A pushed point for a test",
    settings=("momentum", "weight_decay", "round_decay"),
    variants=(Variant("pushsgd", "avg"), Variant("pushsgd-scaffold", "scaffold")),
    full="momentum_wd",
    options={"plain": dict(lr=0.1, rho=0.05),
             "momentum_wd": dict(lr=0.05, rho=0.2, momentum=0.5, weight_decay=0.01, correction=True),
             "groups": dict(lr=0.1, rho=0.05, groups=dict(lr=0.03, rho=0.5))},
))
cases.add("pushsgd", BenchCase("pushsgd", "PushSGD", "plain", core=True,
                               baselines=(Baseline("torch.SGD(foreach) by hand", plain_sgd),),
                               also=(("sam_ascent", ("saved_x",)),)))  # the push
try:  # its Flower name, where Flower is installed
    from fedopt_kernels.flower.naming import FlowerName, declare
except ImportError:
    pass
else:
    declare(FlowerName("PushSGDStrategy", "pushsgd"))
'''


@pytest.fixture
def pushsgd(tmp_path):
    yield from _one_module(tmp_path, "pushsgd", TWO_GRADIENTS, "PushSGDStrategy")


def _push_oracle(x0, g0, b, lr, rho, eps, wd):
    """One PushSGD step in float64 by hand: x1 = x0 + rho g0 / (||g0|| + eps), g1 = b + x1 (the
    catalogue's second gradient), x2 = x1 - lr (g1 + wd x1)."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in g0))
    x1 = [x + rho * g / (norm + eps) for x, g in zip(x0, g0)]
    return [x - lr * ((bb + x) + wd * x) for x, bb in zip(x1, b)]


def _check_push_step(cls, kw) -> None:
    """``cls``'s first step on the reference backend, float64, against ``_push_oracle``. Each element
    goes through about ten float64 roundings (the norm's sum over 17 squares included), so 64 ulps of
    the largest magnitude involved bound the difference."""
    g = torch.Generator().manual_seed(3)
    params: List[torch.Tensor] = [
        torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in ((4, 3), (5,))
    ]
    x0 = [p.detach().clone() for p in params]
    g0 = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    b = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    opt = cls(params, backend="reference", **kw)
    opt.start_round()
    for p, gg in zip(params, g0):
        p.grad = gg.clone()
    opt.step(catalogue.SecondGradient(params, b))
    want = _push_oracle(x0, g0, b, kw["lr"], kw["rho"], 1e-12, kw["weight_decay"])
    scale = max(float(t.abs().max()) for t in x0 + g0 + b)
    for got, w in zip(params, want):
        torch.testing.assert_close(got.detach(), w, rtol=0, atol=64 * torch.finfo(torch.float64).eps * scale)


PUSH_KW = dict(lr=0.3, rho=0.7, weight_decay=0.05)


def test_a_second_op_and_two_gradients_take_one_module(pushsgd):
    import bench.algorithms as bench_algorithms
    from fedopt_kernels.sim.cli.fedopt_sim import build_parser, config_from_args

    a = algorithm.ALGORITHMS["pushsgd"]
    missing = missing_registrations(a)
    assert len(missing) == 2 and missing[0].startswith("export: fedopt_kernels.PushSGD"), missing
    assert missing[1].startswith("docs/algorithms.md"), missing
    assert a.closure_step  # the capability the front ends read (Algorithm.local_step)
    # the command line
    args = build_parser().parse_args(["--algorithm", "pushsgd-scaffold", "--momentum", "0.5", "--rounds", "1"])
    cfg = config_from_args(args, 0)
    opt = cfg.algo.make([torch.nn.Parameter(torch.randn(3))], cfg, cfg.variant, cfg.hparams(), "reference")
    assert isinstance(opt, pushsgd.PushSGD) and opt.param_groups[0]["momentum"] == 0.5
    # its step is the math, through the base's _run_op and the sgd op
    _check_push_step(pushsgd.PushSGD, PUSH_KW)
    # the catalogue: every backend against the reference (the harness's fused-vs-reference tolerance)
    rtol, atol = TOLERANCE[torch.float32]
    for option in catalogue.ALGOS["pushsgd"].options:
        cfg = catalogue.config("pushsgd", option)
        ref = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
        got = [torch.nn.Parameter(p.detach().clone()) for p in ref]
        catalogue.run(cfg, ref, "reference")
        opt = catalogue.run(cfg, got, "auto")
        for x, y in zip(ref, got):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        push, own = opt.step_plans  # the push's plan launches first, then the step's own
        assert push.spec.name == "sam_ascent" and own.spec.name == "sgd"
    # the client-batched form: each client is the per-client optimizer alone, bit for bit (reference)
    _check_batched_is_per_client(catalogue.config("pushsgd"), pushsgd.BatchedPushSGD)
    # the benchmark: its row and its baseline
    case = bench_algorithms.ALGOS["pushsgd"]
    params = [torch.nn.Parameter(torch.randn(6))]
    params[0].grad = torch.randn(6)
    case.build(params, "reference").step()
    bench_algorithms.build_baseline(case, params, case.by_hand).step()


def _check_batched_is_per_client(cfg, batched_cls, C=3) -> None:
    g = torch.Generator().manual_seed(5)
    singles = [[torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((4, 3), (5,), (2,))] for _ in range(C)]
    stacked = [torch.nn.Parameter(torch.stack([ps[i].detach() for ps in singles])) for i in range(3)]
    opts = [cfg.build(ps, "reference") for ps in singles]
    bopt = cfg.build_batched(stacked, "reference")
    assert isinstance(bopt, batched_cls)
    order = [[p for gr in o.param_groups for p in gr["params"]] for o in opts]
    border = [p for gr in bopt.param_groups for p in gr["params"]]
    for c, (o, ps) in enumerate(zip(opts, order)):
        o.start_round(**cfg.round_inputs(ps, 0, 100 * c))
    bopt.start_round(**cfg.batched_round_inputs(order, border, 0))
    for step in range(3):
        active = [True, step != 1, True]
        for c in range(C):
            for p in singles[c]:
                p.grad = catalogue.rand_like_list([p], 100 * step + c)[0]
        for i, sp in enumerate(stacked):
            sp.grad = torch.stack([cast(torch.Tensor, singles[c][i].grad) for c in range(C)])  # set above
        for c in range(C):
            if active[c]:
                opts[c].step(**cfg.step_inputs(order[c], step, 100 * c))
        views = [[p[c] for p in border] for c in range(C)]
        bopt.step(active=torch.tensor(active), **cfg.batched_step_inputs(views, step, stacked=border))
    for i, sp in enumerate(stacked):
        for c in range(C):
            assert torch.equal(sp.detach()[c], singles[c][i].detach()), (i, c)


def test_the_push_check_can_fail(pushsgd):
    """Not vacuous: a push whose rho column reads the lr instead fails the hand computation."""
    from fedopt_kernels.core.op_runner import OtherOp
    from fedopt_kernels.core.ops import SAM_ASCENT

    class WrongColumn(pushsgd.PushSGD):
        _other_ops = (OtherOp("push", SAM_ASCENT, state={"saved_x": "pushed_from"},
                              columns={"rho": "lr", "eta": 0.0, "adaptive": 0.0}),)  # fmt: skip

    _check_push_step(pushsgd.PushSGD, PUSH_KW)
    with pytest.raises(AssertionError):
        _check_push_step(WrongColumn, PUSH_KW)


@pytest.mark.slow
def test_a_second_op_and_two_gradients_run_in_the_simulator_and_on_flower(pushsgd, capsys):
    """fedopt-sim validates it against the cpu backend and its client-batched run against the
    sequential one; the step graph (emulated) replays both launches to the eager bits; a Flower run
    equals the simulator's."""
    from test_sim_batched import model_fn, tiny_config, tiny_images

    from fedopt_kernels.sim.cli import fedopt_sim
    from fedopt_kernels.sim.simulation import Simulation

    short = ["--rounds", "2", "--clients", "6", "--local-steps", "2", "--no-files", "--quiet"]
    assert fedopt_sim.main(["--algorithm", "pushsgd-scaffold", "--validate", "auto", *short]) == 0
    assert fedopt_sim.main(["--algorithm", "pushsgd", "--client-batched", "3", "--validate", "sequential", *short]) == 0
    assert capsys.readouterr().out.count("PASS pushsgd") == 2

    cfg = tiny_config("pushsgd", rounds=3, local_steps=4, clients_per_round=5, momentum=0.5)
    runs = []
    for emulate in (False, True):
        sim = Simulation(cfg, data=tiny_images(), model_fn=model_fn)
        if emulate:
            sim.batched.replay_mode = "emulate"
        for t in range(cfg.rounds):
            sim.run_round(t)
        runs.append(sim)
    g = runs[1].batched.trainer.replay
    assert [after for after, *_ in g.recorded] == [False, True]  # the push, then (after the closure) the sgd op
    assert all(torch.equal(a, b) for a, b in zip(runs[0].global_params, runs[1].global_params))

    pytest.importorskip("flwr")
    from test_flower_strategies import run_config

    from fedopt_kernels.flower.apps import client_app, run_algorithm
    from fedopt_kernels.flower.inprocess import InProcessGrid
    from fedopt_kernels.flower.runconfig import sim_configs
    from fedopt_kernels.sim.validate import PARAM_RTOL, param_divergence

    rc = run_config("pushsgd", rounds=2)
    cfg = sim_configs(rc)[0]
    out = run_algorithm(InProcessGrid(client_app(), cfg.num_train_clients, rc), cfg, tag="push")
    assert out["rejections"] == []
    sim = Simulation(cfg)
    for t in range(cfg.rounds):
        sim.run_round(t)
        assert param_divergence(sim.global_params, out["history"][t + 1]["params"])["rel"] <= PARAM_RTOL


def test_the_two_gradient_capability_is_read_in_one_place():
    """``closure_step`` is read by ``Algorithm.local_step`` (and the catalogue's seeded closures),
    never by a front end: the next algorithm that needs it touches only its own module."""
    sources = {rel: (ROOT / rel).read_text() for rel in _package_files()}
    assert capability_readers(sources) == []


def test_the_capability_check_can_fail():
    sources = {"fedopt_kernels/sim/x.py": "def f(algo, opt):\n    if algo.closure_step:\n        opt.step()\n"}
    assert capability_readers(sources) == ["fedopt_kernels/sim/x.py:2"]


_CAPABILITY_HOMES = {"fedopt_kernels/fl/algorithm.py", "fedopt_kernels/fl/catalogue.py"}


def _package_files() -> List[str]:
    return [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("fedopt_kernels/**/*.py"))]


def capability_readers(sources) -> List[str]:
    """``file:line`` of every read of ``.closure_step`` outside the descriptor and the catalogue."""
    import ast

    found = []
    for rel, src in sources.items():
        if rel in _CAPABILITY_HOMES:
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Attribute) and node.attr == "closure_step" and isinstance(node.ctx, ast.Load):
                found.append(f"{rel}:{node.lineno}")
    return found


# ---------------------------------------------------------------- the docs index
INDEX_FILES = ("docs/algorithms.md", "README.md")
BEGIN, END = "<!-- algorithms: generated from the descriptors", "<!-- /algorithms -->"


def index_markdown() -> str:
    """The table of algorithms docs/algorithms.md and README.md show, one row per registered algorithm:
    its optimizer, what it does (the first line of the optimizer's docstring), its ``fedopt-sim``
    names, its Flower strategies and its paper."""
    from fedopt_kernels.flower import naming

    flower = naming.declared().values()
    rows = [
        "| optimizer | what it does | `fedopt-sim --algorithm` | Flower strategy | paper |",
        "|---|---|---|---|---|",
    ]
    for a in algorithm.ALGORITHMS.values():
        doc = (a.optimizer.__doc__ or "").strip().splitlines()
        what = doc[0].rstrip(".") if doc else ""
        names = ", ".join(f"`{v.name}`" for v in a.variants)
        strategies = ", ".join(f"`{f.name}`" for f in flower if f.algorithm == a.name) or "via `strategy_for`"
        rows.append(f"| `{a.optimizer.__name__}` | {what} | {names} | {strategies} | *{a.title}* |")
    refused = [
        v.name for a in algorithm.ALGORITHMS.values() for v in a.variants if not RULES[v.server].takes_server_optimizer
    ]
    but = f" (all but {', '.join(f'`{r}`' for r in refused)})" if refused else ""
    for name, (cls, what, title) in server_step.INDEX.items():  # a server optimizer composes with any of them
        rows.append(
            f"| `{cls}` | {what} | any, with `--server-optimizer {name}`{but} | any, run config "
            f'`server-optimizer = "{name}"` | *{title}* |'
        )
    return "\n".join(rows) + "\n"


def test_the_algorithm_index_is_generated_from_the_descriptors():
    """docs/algorithms.md's and README.md's tables of algorithms are ``index_markdown()`` (its Flower
    column needs Flower); FEDOPT_WRITE_INDEX=1 rewrites them."""
    import os

    pytest.importorskip("flwr")
    want = index_markdown()
    stale = []
    for rel in INDEX_FILES:
        path = ROOT / rel
        text = path.read_text()
        assert BEGIN in text and END in text, f"{rel} has no generated index ({BEGIN} ... {END})"
        head, rest = text.split(BEGIN, 1)
        marker_line, rest = rest.split("\n", 1)
        _, tail = rest.split(END, 1)
        new = head + BEGIN + marker_line + "\n" + want + END + tail
        if new != text:
            if os.environ.get("FEDOPT_WRITE_INDEX") == "1":
                path.write_text(new)
            else:
                stale.append(rel)
    assert not stale, f"{stale}: the index is stale; rerun with FEDOPT_WRITE_INDEX=1 to rewrite it"
