"""``--validate BACKEND``: the same run on ``reference`` and on BACKEND, in lockstep, compared.

Both runs share the data and every seed, so they see the same clients and mini-batches; they differ
only in the optimizer kernels. After every round we measure the largest parameter difference of the
two global models, relative to the largest reference parameter; at the end, the largest difference
between their final accuracies. A fused backend matches the reference up to float rounding (SPEC
§7: ~1e-5 relative per step in fp32); training can amplify such differences over rounds, which is
why the default tolerances below are looser than one step's and the check is on the whole run.

Tolerances (documented defaults, overridable on the command line):
    PARAM_RTOL = 1e-3   max_j |x_ref_j - x_j| / max_j |x_ref_j| after every round
    ACC_TOL    = 0.01   |difference| of each final accuracy (fraction, i.e. one percentage point)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from .config import SimConfig
from .report import final_rows
from .simulation import Simulation

PARAM_RTOL = 1e-3
ACC_TOL = 0.01


@dataclass
class Validation:
    backend: str
    rounds: List[Dict[str, float]] = field(default_factory=list)  # per round: max_abs, rel
    acc_diff: Dict[str, float] = field(default_factory=dict)      # final metric -> |ref - backend|
    param_rtol: float = PARAM_RTOL
    acc_tol: float = ACC_TOL

    @property
    def max_rel(self) -> float:
        return _nan_max(r["rel"] for r in self.rounds)

    @property
    def max_acc_diff(self) -> float:
        return _nan_max(self.acc_diff.values())

    @property
    def passed(self) -> bool:
        # "<=" is False for NaN: a run that blew up on one side fails
        return all(r["rel"] <= self.param_rtol for r in self.rounds) and \
            all(v <= self.acc_tol for v in self.acc_diff.values())

    def report(self) -> str:
        lines = [f"validate: reference vs {self.backend} (same seeds and batches)",
                 f"  {'round':>5}  {'max |dx|':>10}  {'relative':>10}"]
        for r in self.rounds:
            lines.append(f"  {r['round']:>5}  {r['max_abs']:>10.3e}  {r['rel']:>10.3e}")
        lines.append("  final accuracy differences (|reference - backend|, percentage points):")
        for k, v in self.acc_diff.items():
            lines.append(f"    {k:<32} {100 * v:.3f}")
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"  {verdict}: max relative divergence {self.max_rel:.3e} (tolerance {self.param_rtol:.1e}), "
                     f"max accuracy difference {100 * self.max_acc_diff:.3f} pp (tolerance {100 * self.acc_tol:.2f} pp)")
        return "\n".join(lines)


def _nan_max(values) -> float:
    """max that returns NaN if any value is NaN (Python's max may skip it), 0 for no values."""
    out = 0.0
    for v in values:
        if v != v:
            return float("nan")
        out = max(out, v)
    return out


def param_divergence(a: List[torch.Tensor], b: List[torch.Tensor]) -> Dict[str, float]:
    max_abs = max((float((x.double() - y.double()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)
    scale = max((float(x.double().abs().max()) for x in a if x.numel()), default=0.0)
    return {"max_abs": max_abs, "rel": max_abs / scale if scale > 0 else max_abs}


def validate_backend(cfg: SimConfig, backend: str, param_rtol: float = PARAM_RTOL, acc_tol: float = ACC_TOL,
                     on_round: Optional[Callable[[Dict[str, Any]], None]] = None) -> Validation:
    """Run ``cfg`` on reference and on ``backend`` round by round; compare (see module docstring)."""
    ref = Simulation(cfg.replace(backend="reference"))
    other = Simulation(cfg.replace(backend=backend), data=ref.data)
    out = Validation(backend=other.backend, param_rtol=param_rtol, acc_tol=acc_tol)
    for t in range(cfg.rounds):
        ref.run_round(t)
        other.run_round(t)
        rec = {"round": t + 1, **param_divergence(ref.global_params, other.global_params)}
        out.rounds.append(rec)
        if on_round is not None:
            on_round(rec)
    a, b = final_rows(ref.final_evaluation()), final_rows(other.final_evaluation())
    # a metric that is NaN on both sides (e.g. no new users) is not a difference
    out.acc_diff = {k: abs(a[k] - b[k]) for k in a
                    if not k.endswith(" std") and not (a[k] != a[k] and b[k] != b[k])}
    return out
