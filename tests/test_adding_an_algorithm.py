"""docs/dispatch.md's "Adding an algorithm" checklist, as a test: every registered algorithm is wired
into every layer that should pick it up from its descriptor, and a descriptor that misses one is named;
an algorithm on an existing op, written as one module, reaches the command line, Flower, the catalogue
and the benchmark with nothing else but its export and its docs section (the checklist's three files).
"""

from __future__ import annotations

import pathlib
from typing import List

import pytest
import torch

import fedopt_kernels
import fedopt_kernels.batched
from fedopt_kernels.batched.mixin import ClientBatched
from fedopt_kernels.core import ops as _ops
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.core.optimizer import FedOptimizer
from fedopt_kernels.fl import algorithm, catalogue
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
    if not any(case.core for case in a.bench):
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


# where an algorithm's name may stand as a string: its own module (optim/), the kernels, the shared
# server rules (SCAFFOLD's rule is called "scaffold", as its variant), and these few places that name
# one on purpose (a default, the benchmark's goals and its client-batched workload)
_NAME_FOLDERS = (
    "fedopt_kernels/optim/",
    "fedopt_kernels/core/reference/",
    "fedopt_kernels/core/backends/",
    "triton_kernels/",
)
_NAME_HOMES = {"fedopt_kernels/core/ops.py", "fedopt_kernels/fl/server_rules.py"}
_NAMED_ON_PURPOSE = {
    "fedopt_kernels/fl/config.py": {"fedavg"},
    "fedopt_kernels/flower/runconfig.py": {"fedavg"},
    "bench/step_goals.py": {"feddecay", "fednar", "padamfed"},
    "bench/clients/workload.py": {"fednar"},
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

from fedopt_kernels.batched.mixin import ClientBatched
from fedopt_kernels.core.ops import BATCHED
from fedopt_kernels.fl import algorithm
from fedopt_kernels.fl.algorithm import Baseline, BenchCase, FlowerName, Variant
from fedopt_kernels.optim.feddecay import FedDecaySGD
from fedopt_kernels.optim.sgd import SGDAlgorithm


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
    flower=(FlowerName("HeavyBallStrategy", "heavyball"),),
    full="momentum_wd",
    bench=(BenchCase("heavyball", "HeavyBallSGD", "plain", core=True,
                     baselines=(Baseline("torch.SGD(foreach) by hand", plain_sgd),)),),
    options={"plain": dict(lr=0.1, momentum=0.9), "momentum_wd": dict(lr=0.05, momentum=0.5, weight_decay=0.01,
                                                                      correction=True)},
))
'''


@pytest.fixture
def heavyball(tmp_path):
    import importlib.util
    import sys

    path = tmp_path / "heavyball.py"
    path.write_text(ONE_MODULE)
    spec = importlib.util.spec_from_file_location("heavyball", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["heavyball"] = mod
    spec.loader.exec_module(mod)
    yield mod
    algorithm.unregister("heavyball")
    del sys.modules["heavyball"]


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


def test_an_algorithm_from_one_module_gets_its_flower_strategy(heavyball):
    pytest.importorskip("flwr")
    import fedopt_kernels.flower as flower
    from fedopt_kernels.fl.config import FLConfig

    s = flower.HeavyBallStrategy(lr=0.2, local_steps=3, fraction_train=0.5)
    assert s.cfg.algorithm == "heavyball" and s.hp["lr"] == 0.2 and s.fraction_train == 0.5
    assert isinstance(flower.strategy_for(FLConfig(algorithm="heavyball-scaffold")), flower.AveragingStrategy)
    with pytest.raises(TypeError, match="no_such_keyword"):
        flower.HeavyBallStrategy(no_such_keyword=1)


# ---------------------------------------------------------------- the docs index
INDEX_FILES = ("docs/algorithms.md", "README.md")
BEGIN, END = "<!-- algorithms: generated from the descriptors", "<!-- /algorithms -->"


def test_the_algorithm_index_is_generated_from_the_descriptors():
    """docs/algorithms.md's and README.md's tables of algorithms are ``algorithm.index_markdown()``;
    FEDOPT_WRITE_INDEX=1 rewrites them."""
    import os

    want = algorithm.index_markdown()
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
