"""A round's aggregate hardly depends on the order its updates are added in (fl/fold.py): the sums
are float64 and rounded to the model's dtype once, so one process adding the clients one by one and
two ranks each adding their share, then merging, give the same float32 model on all but a rare
element. Summed in float32 instead, most elements would differ: the check below fails there."""

from __future__ import annotations

import math

import pytest
import torch

import fedopt_kernels.optim  # noqa: F401  (registers the algorithms' own rules)
from fedopt_kernels.fl import fold as fold_module
from fedopt_kernels.fl.server_rules import RULES

CLIENTS = 24
HP = {"server_lr": 0.7, "lr": 0.05, "beta": 0.3, "dyn_alpha": 0.5}


def _round(rule_name: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(40_000,), (7, 3), (129,)]
    x = [torch.randn(s, generator=g) for s in shapes]
    rule = RULES[rule_name]
    state = {k: [torch.randn(s, generator=g) * 1e-2 for s in shapes] for k in rule.state}  # small: the sums show
    updates = [
        (
            [torch.randn(s, generator=g) * 10 ** float(torch.randint(-3, 1, (), generator=g)) for s in shapes],
            float(torch.randint(1, 500, (), generator=g)),
            {"dc": [torch.randn(s, generator=g) for s in shapes]},
        )
        for _ in range(CLIENTS)
    ]
    return rule, x, state, updates


def _one_process(rule, x, state, updates, exponent):
    f = rule.begin(x, state, HP, 1000, 5, exponent)
    for d, w, r in updates:
        f.add(d, w, r)
    return f.finish()


def _two_ranks(rule, x, state, updates, exponent):
    shares = [updates[1::3] + updates[2::3], updates[0::3]]  # not contiguous, as the split by work
    folds = []
    for share in shares:
        f = rule.begin(x, state, HP, 1000, 5, exponent)
        for d, w, r in share:
            f.add(d, w, r)
        folds.append(f)
    folds[0].merge(folds[1:])  # what every rank does after the gather, in rank order
    return folds[0].finish()


def _differing(a, b) -> tuple:
    diff = sum(int((u != v).sum()) for name in a for u, v in zip(a[name], b[name]))
    return diff, sum(t.numel() for ts in a.values() for t in ts)


@pytest.mark.parametrize("rule_name", ["avg", "scaffold", "feddyn", "padamfed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_process_and_two_ranks_round_to_the_same_model(rule_name, seed, monkeypatch):
    rule, x, state, updates = _round(rule_name, seed)
    exponent = fold_module.weight_exponent([w for _, w, _ in updates])
    one = _one_process(rule, x, state, updates, exponent)
    two = _two_ranks(rule, x, state, updates, exponent)
    assert {k: [t.dtype for t in ts] for k, ts in one.items()} == {k: [t.dtype for t in x] for k in one}
    diff, total = _differing(one, two)
    # Two float64 evaluations of the same sum of CLIENTS terms (and a few scalings) differ by at
    # most about (CLIENTS + 4) units of 2**-53 of the largest term; their float32 roundings differ
    # only where the exact value lies that close to a float32 rounding boundary (units of 2**-24).
    # Terms span 10**3 in size, so the distance is up to 10**3 times larger relative to the mean.
    per_element = 2 * (CLIENTS + 4) * 2.0**-53 / 2.0**-24 * 1e3
    allowed = 2 + math.ceil(10 * per_element * total)
    assert diff <= allowed, (diff, total, allowed)

    monkeypatch.setattr(fold_module, "sum_dtype", lambda like: like.dtype)  # sums in float32
    one32 = _one_process(rule, x, state, updates, exponent)
    two32 = _two_ranks(rule, x, state, updates, exponent)
    assert _differing(one32, two32)[0] > 10 * allowed  # what the float64 sums avoid


def test_the_sums_are_float64_and_the_initial_fold_rounds_once():
    x = [torch.randn(5, dtype=torch.bfloat16), torch.randn(3)]
    f = RULES["avg"].begin(x, {}, HP, 10, 1, 0)
    assert [s.dtype for s in f.sums["delta"]] == [torch.float64, torch.float64]
    init = RULES["padamfed"].initial_fold(x, 10)
    for _ in range(3):
        init.add([torch.randn(5, dtype=torch.bfloat16), torch.randn(3)])
    out = init.finish()
    assert [t.dtype for t in out["c"]] == [torch.bfloat16, torch.float32]
    assert [t.dtype for t in out["m"]] == [torch.bfloat16, torch.float32]
