"""docs/dispatch.md's "Adding an algorithm" checklist, as a test: every registered algorithm is wired
into every layer that should pick it up from its descriptor, and a descriptor that misses one is named.
"""
from __future__ import annotations

import pathlib
from typing import List

import pytest
import torch

import fedopt_kernels
from fedopt_kernels.core import ops as _ops, registry as _registry
from fedopt_kernels.fl import algorithm, catalogue
from fedopt_kernels.core.optimizer import FedOptimizer
from fedopt_kernels.fl.server_rules import RULES
from fedopt_kernels.fl.algorithm import Algorithm, Variant
from fedopt_kernels.batched.mixin import ClientBatched
from fedopt_kernels.fl.config import FLConfig, algorithm_settings

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
        step_inputs = {"anchor_grads": [torch.ones_like(w)]} if a.needs_anchor(cfg.variant) else {}
        before = w.detach().clone()
        opt.step(**step_inputs)
        assert not torch.equal(before, w.detach())


def test_the_checklist_names_what_a_descriptor_misses():
    """A descriptor registered nowhere, without bench rows, variants or docs: each gap is named."""

    class Undocumented(fedopt_kernels.FedDecaySGD):
        pass

    fake = Algorithm("undocumented", Undocumented, fedopt_kernels.batched.BatchedFedDecaySGD,
                     options={"plain": dict(lr=0.1, beta=0.5)}, full="plain",
                     variants=(Variant("undoc", "no-such-rule"),))
    missing = missing_registrations(fake)
    for what in ("batched form", "export: fedopt_kernels.Undocumented", "registry", "catalogue", "bench",
                 "server rule 'no-such-rule'", "docs/algorithms.md"):
        assert any(what in m for m in missing), (what, missing)


def test_registering_a_name_twice_is_refused():
    a = algorithm.ALGORITHMS["feddecay"]
    with pytest.raises(ValueError, match="registered twice"):
        algorithm.register(a)


# where an algorithm's name may stand as a string: its descriptor module, the server rules, the
# kernels, and these few places that name one on purpose (a default, the paper-named Flower
# constructors, the benchmark's goals and its client-batched workload)
_NAME_HOMES = {"fedopt_kernels/optim/feddecay.py", "fedopt_kernels/optim/neuron_lr.py",
               "fedopt_kernels/optim/fednar.py", "fedopt_kernels/optim/padamfed.py", "fedopt_kernels/optim/feddyn.py",
               "fedopt_kernels/fl/server_rules.py", "fedopt_kernels/core/ops.py"}
_NAME_FOLDERS = ("fedopt_kernels/core/reference/", "fedopt_kernels/core/backends/", "triton_kernels/")
_NAMED_ON_PURPOSE = {"fedopt_kernels/fl/config.py": {"fedavg"}, "fedopt_kernels/flower/runconfig.py": {"fedavg"},
                     "fedopt_kernels/flower/averaging.py": {"fedavg", "fedprox", "scaffold", "fednar", "fednar-fedprox",
                                                            "fednar-scaffold", "feddecay", "fednlr"},
                     "fedopt_kernels/flower/padamfed.py": {"padamfed", "padamfed-vr"},
                     "bench/goals.py": {"feddecay", "fednar", "padamfed"}, "bench/clients.py": {"fednar"}}


_OLD_KINDS = {"decay", "nlr", "nar"}  # the simulator's old optimizer kinds, as whole strings


def _string_names(path: pathlib.Path, names) -> List[tuple]:
    """(line, name) of every string constant (docstrings aside) that is, or mentions as a word, an algorithm name."""
    import ast
    import re

    pat = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")(?![\w-])")
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and \
                len(node.value) < 40:  # names and keys, not messages
            out += [(node.lineno, m.group(0)) for m in pat.finditer(node.value)]
            if node.value in _OLD_KINDS:
                out.append((node.lineno, node.value))
    return out


def test_no_algorithm_name_outside_its_descriptor_and_kernels():
    names = set(algorithm.VARIANTS) | set(algorithm.ALGORITHMS)
    found = []
    for path in sorted(ROOT.glob("fedopt_kernels/**/*.py")) + sorted(ROOT.glob("bench/*.py")):
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
    takes = next(v for v in algorithm.VARIANTS.values()
                 if not f.metadata["some"] or setting in algorithm.ALGORITHMS[v.algorithm].settings)
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
