"""The project's performance goals, evaluated per result row as pass / miss.

A goal applies to some rows only (a device type, fused backends, a size); elsewhere it is
blank. The thresholds are the project's targets; which sizes they are judged on is stated in ``where``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from .algorithms import baseline_names

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
    value: Callable[[Row], Optional[float]]
    threshold: float

    def judge(self, row: Row) -> Optional[str]:
        """'pass', 'miss', 'n/a' (applies but no figure), or None (does not apply)."""
        if row.get("device_type") != self.device or not self.applies(row):
            return None
        v = self.value(row)
        if v is None:
            return "n/a"
        return "pass" if v >= self.threshold else "miss"


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
        lambda r: r.get("pct_copy"),
        85.0,
    ),
    Goal(
        "gpu: >=10x ref",
        ">= 10x over reference",
        "fused backends, ResNet-18 list",
        "cuda",
        lambda r: _fused(r) and r["size"] == "resnet18",
        lambda r: r.get("speedup_ref"),
        10.0,
    ),
    Goal(
        "gpu: <=1.1x SGD fused",
        "eager FedDecaySGD within 1.1x of torch.optim.SGD(fused=True)",
        "FedDecaySGD (momentum, wd) on cuda eager, small CNN and ResNet-18 lists",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "feddecay" and r["size"] in ("small_cnn", "resnet18"),
        lambda r: r.get("speedup_sgd_fused"),
        1 / 1.1,
    ),
    Goal(
        "gpu: FedNAR >=2.5x clip+SGD",
        "eager FedNAR >= 2.5x faster than clip_grad_norm_(foreach) + SGD(fused)",
        "FedNAR on cuda eager, ResNet-18 list",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "fednar" and r["size"] == "resnet18",
        lambda r: r.get("speedup_hand"),
        2.5,
    ),
    Goal(
        "gpu: triton <=1.2x cuda",
        "triton within 1.2x of cuda (replayed against replayed, eager against eager)",
        "triton and triton eager, every algorithm and list",
        "cuda",
        lambda r: _ok(r, "triton") or _ok(r, "triton eager"),
        lambda r: r.get("speedup_cuda"),
        1 / 1.2,
    ),
    Goal(
        "gpu: FedNAR >=90% copy",
        "FedNAR cuda eager >= 90% of copy bandwidth",
        "FedNAR on cuda eager, large list",
        "cuda",
        lambda r: _ok(r, "cuda eager") and r["algorithm"] == "fednar" and r["size"] == "large",
        lambda r: r.get("pct_copy"),
        90.0,
    ),
    Goal(
        "gpu: replayed host <=15us",
        "a replayed step costs <= 15 us of host time",
        "cuda and triton (replaying), every algorithm, 62 one-element tensors",
        "cuda",
        lambda r: (_ok(r, "cuda") or _ok(r, "triton")) and r["size"] == "overhead",
        lambda r: 15e-6 / r["host_s"] if r.get("host_s") else None,
        1.0,
    ),
    Goal(
        "gpu: step <=0.5x SGD fused",
        "every fused algorithm's step (as a user loop gets it) <= 0.5x "
        "torch.optim.SGD(fused=True)'s step time on the same list",
        "cuda (replaying), every algorithm, small CNN and ResNet-18 lists",
        "cuda",
        lambda r: _ok(r, "cuda") and r["size"] in ("small_cnn", "resnet18"),
        lambda r: 0.5 / r["vs_torch_sgd_step"] if r.get("vs_torch_sgd_step") else None,
        1.0,
    ),
    Goal(
        "cpu: >=70% copy",
        "every algorithm's cpu step >= 70% of copy bandwidth",
        "backend cpu, ResNet-18 and large lists",
        "cpu",
        lambda r: r["backend"] == "cpu" and not r.get("error") and r["size"] in ("resnet18", "large"),
        lambda r: r.get("pct_copy"),
        70.0,
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
        lambda r: r.get("speedup_ref"),
        5.0,
    ),
    Goal(
        "cpu: >=1x SGD fused",
        "FedDecaySGD cpu no slower than torch.optim.SGD(fused=True)",
        "backend cpu, FedDecaySGD, ResNet-18 list",
        "cpu",
        lambda r: (
            r["backend"] == "cpu" and not r.get("error") and r["algorithm"] in SGD_FAMILY and r["size"] == "resnet18"
        ),
        lambda r: r.get("speedup_sgd_fused"),
        1.0,
    ),
    Goal(
        "cpu: overhead <=1x SGD fused",
        "pure-overhead step no slower than torch.optim.SGD(fused=True)",
        "backend cpu, FedDecaySGD, 62 one-element tensors",
        "cpu",
        lambda r: _ok(r, "cpu") and r["algorithm"] == "feddecay" and r["size"] == "overhead",
        lambda r: r.get("speedup_sgd_fused"),
        1.0,
    ),
]


def goals_for(device_type: str) -> List[Goal]:
    return [g for g in GOALS if g.device == device_type]


def judge_rows(rows: List[Row], device_type: str) -> List[Dict[str, Any]]:
    """Set ``row["goals"]`` = {goal key: verdict} and return a summary per goal."""
    goals = goals_for(device_type)
    baselines = baseline_names()
    summary = []
    for g in goals:
        verdicts = []
        for row in rows:
            if row["backend"] in baselines:
                continue
            v = g.judge(row)
            if v is not None:
                row.setdefault("goals", {})[g.key] = v
                verdicts.append((row, v))
        n_pass = sum(v == "pass" for _, v in verdicts)
        summary.append(
            {
                "goal": g.key,
                "text": g.text,
                "where": g.where,
                "judged": len(verdicts),
                "passed": n_pass,
                "missed": [f"{r['algorithm']}/{r['backend']}/{r['size']}" for r, v in verdicts if v != "pass"],
                "verdict": "n/a (no rows)" if not verdicts else ("pass" if n_pass == len(verdicts) else "miss"),
            }
        )
    return summary
