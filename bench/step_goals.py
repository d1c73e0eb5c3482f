"""The step benchmark's goals (``python -m bench``), judged row by row: declarations in ``bench.goals``.

A goal applies to some rows only (a device type, fused backends, a size); elsewhere its column is
blank. The thresholds are the project's targets; which sizes they are judged on is stated in ``where``.
Each figure compares a row with another timing (the reference row, torch's fused SGD, the copy
roofline, ...) timed interleaved in the same rounds (``bench.runner.measure_group``); the load
other processes put on either side while it was timed is in the row (``other_load_cores``,
``against_load``). A row whose counterpart was not timed (the GPU check leaves the reference rows
out) is n/a, and a goal none of whose rows has a figure says n/a with the reason, never miss.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .algorithms import TORCH_FUSED, baseline_names
from .goals import Figure, Goal, goals_for

Row = Dict[str, Any]

FUSED = ("triton", "cuda", "cpu", "triton eager", "cuda eager")
SGD_FAMILY = ("feddecay", "feddecay_plain", "feddecay_scaffold_prox")


def row_goal(
    key: str,
    text: str,
    where: str,
    device: str,
    applies: Callable[[Row], bool],
    column: str,
    threshold: float,
    against: Optional[str],
    to_value: Callable[[float], float] = lambda v: v,
) -> Goal:
    """A goal judged on each row of ``device`` that it ``applies`` to: the row's ``column``, through
    ``to_value``, held to ``threshold``; the loads of the row and of its counterpart for that column."""

    def figures(rows: List[Row]) -> List[Figure]:
        out = []
        for r in rows:
            if r.get("device_type") != device or not applies(r):
                continue
            v = r.get(column)
            loads = (r.get("other_load_cores"), (r.get("against_load") or {}).get(column))
            where_ = f"{r['algorithm']}/{r['backend']}/{r['size']}"
            out.append(Figure(where_, None if v is None else to_value(v), loads, r))
        return out

    return Goal(key, text, where, threshold, figures, device=device, against=against)


def _fused(row: Row) -> bool:
    return row["backend"] in FUSED and not row.get("error")


def _ok(row: Row, backend: str) -> bool:
    return row["backend"] == backend and not row.get("error")


GOALS: List[Goal] = [
    row_goal(
        "gpu: >=85% copy",
        "every fused algorithm >= 85% of measured copy bandwidth",
        "fused backends, large list",
        "cuda",
        lambda r: _fused(r) and r["size"] == "large",
        "pct_copy",
        85.0,
        "copy",
    ),
    row_goal(
        "gpu: >=10x ref",
        ">= 10x over reference",
        "fused backends, ResNet-18 list",
        "cuda",
        lambda r: _fused(r) and r["size"] == "resnet18",
        "speedup_ref",
        10.0,
        "reference",
    ),
    row_goal(
        "gpu: <=1.1x SGD fused",
        "eager FedDecaySGD within 1.1x of torch.optim.SGD(fused=True)",
        "FedDecaySGD (momentum, wd) on cuda eager, small CNN and ResNet-18 lists",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "feddecay" and r["size"] in ("small_cnn", "resnet18"),
        "speedup_sgd_fused",
        1 / 1.1,
        TORCH_FUSED,
    ),
    row_goal(
        "gpu: FedNAR >=2.5x clip+SGD",
        "eager FedNAR >= 2.5x faster than clip_grad_norm_(foreach) + SGD(fused)",
        "FedNAR on cuda eager, ResNet-18 list",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "fednar" and r["size"] == "resnet18",
        "speedup_hand",
        2.5,
        "hand-written baseline",
    ),
    row_goal(
        "gpu: triton <=1.2x cuda",
        "triton within 1.2x of cuda (replayed against replayed, eager against eager)",
        "triton and triton eager, every algorithm and list",
        "cuda",
        lambda r: _ok(r, "triton") or _ok(r, "triton eager"),
        "speedup_cuda",
        1 / 1.2,
        "cuda",
    ),
    row_goal(
        "gpu: FedNAR >=90% copy",
        "FedNAR cuda eager >= 90% of copy bandwidth",
        "FedNAR on cuda eager, large list",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "fednar" and r["size"] == "large",
        "pct_copy",
        90.0,
        "copy",
    ),
    row_goal(
        "gpu: replayed host <=15us",
        "a replayed step costs <= 15 us of host time",
        "cuda and triton (replaying), every algorithm, 62 one-element tensors",
        "cuda",
        lambda r: (_ok(r, "cuda") or _ok(r, "triton")) and r["size"] == "overhead",
        "host_s",
        1.0,
        None,
        lambda s: 15e-6 / s if s > 0 else float("inf"),
    ),
    row_goal(
        "gpu: step <=0.5x SGD fused",
        "every fused algorithm's step (as a user loop gets it) <= 0.5x "
        "torch.optim.SGD(fused=True)'s step time on the same list",
        "cuda (replaying), every algorithm, small CNN and ResNet-18 lists",
        "cuda",
        lambda r: _ok(r, "cuda") and r["size"] in ("small_cnn", "resnet18"),
        "vs_torch_sgd_step",
        1.0,
        TORCH_FUSED,
        lambda v: 0.5 / v if v > 0 else float("inf"),
    ),
    row_goal(
        "cpu: >=70% copy",
        "every algorithm's cpu step >= 70% of copy bandwidth",
        "backend cpu, ResNet-18 and large lists",
        "cpu",
        lambda r: r["backend"] == "cpu" and not r.get("error") and r["size"] in ("resnet18", "large"),
        "pct_copy",
        70.0,
        "copy",
    ),
    row_goal(
        "cpu: >=5x ref",
        "FedNAR and PAdaMFed cpu >= 5x over reference",
        "backend cpu, FedNAR/PAdaMFed, ResNet-18 and large lists",
        "cpu",
        lambda r: (
            r["backend"] == "cpu"
            and not r.get("error")
            and r["algorithm"].startswith(("fednar", "padamfed"))
            and r["size"] in ("resnet18", "large")
        ),
        "speedup_ref",
        5.0,
        "reference",
    ),
    row_goal(
        "cpu: >=1x SGD fused",
        "FedDecaySGD cpu no slower than torch.optim.SGD(fused=True)",
        "backend cpu, FedDecaySGD, ResNet-18 list",
        "cpu",
        lambda r: (
            r["backend"] == "cpu" and not r.get("error") and r["algorithm"] in SGD_FAMILY and r["size"] == "resnet18"
        ),
        "speedup_sgd_fused",
        1.0,
        TORCH_FUSED,
    ),
    row_goal(
        "cpu: overhead <=1x SGD fused",
        "pure-overhead step no slower than torch.optim.SGD(fused=True)",
        "backend cpu, FedDecaySGD, 62 one-element tensors",
        "cpu",
        lambda r: _ok(r, "cpu") and r["algorithm"] == "feddecay" and r["size"] == "overhead",
        "speedup_sgd_fused",
        1.0,
        TORCH_FUSED,
    ),
]


def step_goals(device_type: str) -> List[Goal]:
    """The step table's goals judged on a device type (its goal columns, in order)."""
    return goals_for(GOALS, device_type)


def judge_rows(rows: List[Row], device_type: str, skipped: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Set ``row["goals"]`` = {goal key: verdict} and return a summary per goal. ``skipped``: the
    rows left out of the run on purpose, by backend, with the reason (for the n/a verdicts)."""
    baselines = baseline_names()
    judged_rows = [r for r in rows if r["backend"] not in baselines]
    summary = []
    for g in step_goals(device_type):
        j = g.judge(judged_rows, device_type, skipped)
        for figure, verdict in j.figures:
            assert figure.row is not None  # row_goal's figures carry their rows
            figure.row.setdefault("goals", {})[g.key] = verdict
        summary.append(
            {
                "goal": g.key,
                "text": g.text,
                "where": g.where,
                "judged": len(j.figures) - j.count("n/a"),
                "passed": j.count("pass"),
                "missed": j.named("miss"),
                "disturbed": j.named("disturbed"),
                "not_judged": j.count("n/a"),
                "verdict": j.verdict,
                "reason": j.reason,
            }
        )
    return summary
