"""The project's performance goals, evaluated per result row as pass / miss / disturbed / n/a.

A goal applies to some rows only (a device type, fused backends, a size); elsewhere it is
blank. The thresholds are the project's targets; which sizes they are judged on is stated in ``where``.

A goal's figure compares a row with another timing (the reference row, torch's fused SGD, the copy
roofline, ...), both timed interleaved in the same rounds (``bench.runner.measure_group``), so the
machine's load falls on both alike. On a CPU, a row whose own timing or whose counterpart's ran
while other processes used more than ``DISTURBED`` cores is judged **disturbed**, not pass or miss:
its figure says nothing reliable about the goal. A row whose counterpart was not timed (the GPU check
leaves the reference rows out) is **n/a**, and a goal none of whose rows has a figure says n/a with
the reason, never miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .algorithms import TORCH_FUSED, baseline_names
from .contention import DISTURBED

Row = Dict[str, Any]

FUSED = ("triton", "cuda", "cpu", "triton eager", "cuda eager")
SGD_FAMILY = ("feddecay", "feddecay_plain", "feddecay_scaffold_prox")


@dataclass(frozen=True)
class Goal:
    key: str  # column name
    text: str  # what it asks
    where: str  # which rows it is judged on
    device: str  # "cuda" or "cpu"
    applies: Callable[[Row], bool]
    column: str  # the row's figure it reads
    threshold: float
    against: Optional[str]  # what that figure compares the row with (a row's backend, "copy"), if anything
    to_value: Callable[[float], float] = lambda v: v  # the figure -> the value held to the threshold

    def value(self, row: Row) -> Optional[float]:
        v = row.get(self.column)
        return None if v is None else self.to_value(v)

    def disturbed(self, row: Row) -> bool:
        """Whether other processes' load on a CPU disturbed this row's timing or its counterpart's."""
        if row.get("device_type") != "cpu":
            return False
        loads = [row.get("other_load_cores"), (row.get("against_load") or {}).get(self.column)]
        return any(c is not None and c > DISTURBED for c in loads)

    def judge(self, row: Row) -> Optional[str]:
        """'pass', 'miss', 'disturbed', 'n/a' (applies but no figure), or None (does not apply)."""
        if row.get("device_type") != self.device or not self.applies(row):
            return None
        v = self.value(row)
        if v is None:
            return "n/a"
        if self.disturbed(row):
            return "disturbed"
        return "pass" if v >= self.threshold else "miss"

    def why_no_figure(self, skipped: Dict[str, str]) -> str:
        """Why no row of this goal has a figure, for its n/a verdict."""
        if self.against is None:
            return "its rows have no figure"
        if self.against in skipped:
            return f"the {self.against} rows were not timed ({skipped[self.against]})"
        return f"no {self.against} row was timed"


def _fused(row: Row) -> bool:
    return row["backend"] in FUSED and not row.get("error")


def _ok(row: Row, backend: str) -> bool:
    return row["backend"] == backend and not row.get("error")


GOALS: List[Goal] = [
    Goal(
        "gpu: >=85% copy",
        "every fused algorithm >= 85% of measured copy bandwidth",
        "fused backends, large list",
        "cuda",
        lambda r: _fused(r) and r["size"] == "large",
        "pct_copy",
        85.0,
        "copy",
    ),
    Goal(
        "gpu: >=10x ref",
        ">= 10x over reference",
        "fused backends, ResNet-18 list",
        "cuda",
        lambda r: _fused(r) and r["size"] == "resnet18",
        "speedup_ref",
        10.0,
        "reference",
    ),
    Goal(
        "gpu: <=1.1x SGD fused",
        "eager FedDecaySGD within 1.1x of torch.optim.SGD(fused=True)",
        "FedDecaySGD (momentum, wd) on cuda eager, small CNN and ResNet-18 lists",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "feddecay" and r["size"] in ("small_cnn", "resnet18"),
        "speedup_sgd_fused",
        1 / 1.1,
        TORCH_FUSED,
    ),
    Goal(
        "gpu: FedNAR >=2.5x clip+SGD",
        "eager FedNAR >= 2.5x faster than clip_grad_norm_(foreach) + SGD(fused)",
        "FedNAR on cuda eager, ResNet-18 list",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "fednar" and r["size"] == "resnet18",
        "speedup_hand",
        2.5,
        "hand-written baseline",
    ),
    Goal(
        "gpu: triton <=1.2x cuda",
        "triton within 1.2x of cuda (replayed against replayed, eager against eager)",
        "triton and triton eager, every algorithm and list",
        "cuda",
        lambda r: _ok(r, "triton") or _ok(r, "triton eager"),
        "speedup_cuda",
        1 / 1.2,
        "cuda",
    ),
    Goal(
        "gpu: FedNAR >=90% copy",
        "FedNAR cuda eager >= 90% of copy bandwidth",
        "FedNAR on cuda eager, large list",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "fednar" and r["size"] == "large",
        "pct_copy",
        90.0,
        "copy",
    ),
    Goal(
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
    Goal(
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
    Goal(
        "cpu: >=70% copy",
        "every algorithm's cpu step >= 70% of copy bandwidth",
        "backend cpu, ResNet-18 and large lists",
        "cpu",
        lambda r: r["backend"] == "cpu" and not r.get("error") and r["size"] in ("resnet18", "large"),
        "pct_copy",
        70.0,
        "copy",
    ),
    Goal(
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
    Goal(
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
    Goal(
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


def goals_for(device_type: str) -> List[Goal]:
    return [g for g in GOALS if g.device == device_type]


def _named(verdicts: List[Tuple[Row, str]], verdict: str) -> List[str]:
    return [f"{r['algorithm']}/{r['backend']}/{r['size']}" for r, v in verdicts if v == verdict]


def judge_rows(rows: List[Row], device_type: str, skipped: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Set ``row["goals"]`` = {goal key: verdict} and return a summary per goal. ``skipped``: the
    rows left out of the run on purpose, by backend, with the reason (for the n/a verdicts)."""
    goals = goals_for(device_type)
    baselines = baseline_names()
    summary = []
    for g in goals:
        verdicts: List[Tuple[Row, str]] = []
        for row in rows:
            if row["backend"] in baselines:
                continue
            v = g.judge(row)
            if v is not None:
                row.setdefault("goals", {})[g.key] = v
                verdicts.append((row, v))
        figures = [v for _, v in verdicts if v != "n/a"]
        reason = None
        if not verdicts:
            verdict, reason = "n/a", f"none of its rows ({g.where}) were run"
        elif not figures:
            verdict, reason = "n/a", g.why_no_figure(skipped or {})
        elif "miss" in figures:
            verdict = "miss"
        elif "disturbed" in figures:
            verdict = "disturbed"
        else:
            verdict = "pass"
        summary.append(
            {
                "goal": g.key,
                "text": g.text,
                "where": g.where,
                "judged": len(figures),
                "passed": figures.count("pass"),
                "missed": _named(verdicts, "miss"),
                "disturbed": _named(verdicts, "disturbed"),
                "not_judged": len(verdicts) - len(figures),
                "verdict": verdict,
                "reason": reason,
            }
        )
    return summary
