"""The client-batched benchmark's goals, declared in ``bench.goals``: one figure each, read from the
whole result (a rate, a ratio of two rates, a fraction of the device's FLOP/s), judged pass / miss,
disturbed (on a CPU, a round it rests on ran while other processes used more than 0.25 cores: the
rows marked ⚠) or n/a (not measured in this run)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from ..contention import DISTURBED
from ..goals import Figure, Goal, goals_for
from .results import Result, Row, best_row, device_flops, mode_row, model_flops, part_row, seq_row
from .settings import DEFAULTS, FUSED

EVERY_MODEL = "every model"
REASONS = {
    "n/a": "not measured in this run",
    "disturbed": f"other processes used more than {DISTURBED} cores while a round it compares ran (⚠)",
}


class Measured(NamedTuple):
    """A figure's value and the cores other processes used while each row it comes from was timed."""

    value: float
    loads: Tuple[Optional[float], ...]


Value = Optional[Measured]


def _of(row: Optional[Row], key: str) -> Value:
    return None if row is None else Measured(row[key], (row.get("other_load_cores"),))


def _rate(r: Result, model: str, C: int, mode: str) -> Value:
    return _of(mode_row(r, model, C, mode), "client_steps_per_s")


def _seq(r: Result, model: str, C: int) -> Value:
    return _of(seq_row(r, model, C), "client_steps_per_s")


def _best(r: Result, model: str, C: int) -> Value:
    return _of(best_row(r, model, C), "client_steps_per_s")


def _div(a: Value, b: Value) -> Value:
    return None if a is None or b is None or b.value == 0 else Measured(a.value / b.value, a.loads + b.loads)


def _ratio(r: Result, model: str, C: int, mode: str) -> Value:
    return _div(_rate(r, model, C, mode), _seq(r, model, C))


def _frac(r: Result, model: str, C: int) -> Value:
    """The best batched mode's model FLOP/s as a fraction of the device's."""
    best, flops, peak = _best(r, model, C), model_flops(r, model), device_flops(r)
    return None if best is None or flops is None or not peak else Measured(best.value * flops / peak, best.loads)


def _max_over(r: Result, model: str, value: Callable[[int], Value], min_c: int) -> Value:
    vals = [v for v in (value(C) for C in r["meta"]["clients"].get(model, []) if C >= min_c) if v is not None]
    return max(vals, key=lambda v: v.value) if vals else None


def _part_ratio(r: Result, model: str, C: int) -> Value:
    return _div(
        _of(part_row(r, model, C, "update plain torch"), "step_s"), _of(part_row(r, model, C, "update fused"), "step_s")
    )


def _choice_row(r: Result, model: str, C: int) -> Optional[Row]:
    return next(
        (row for row in r["rows"] if row.get("model") == model and row["clients"] == C and "choice" in row), None
    )


def _median_rate(row: Row) -> Measured:
    """Client-steps/s of a mode's median round (interleaved with the other modes: load reaches both alike;
    a row without its rounds' times: its own rate)."""
    if not row.get("round_times_s"):
        return Measured(row["client_steps_per_s"], (row.get("other_load_cores"),))
    times = sorted(row["round_times_s"])
    mid = len(times) // 2
    t = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return Measured(row["clients"] * row["steps"] / t, (row.get("other_load_cores"),))


def _chosen_vs_defaults(r: Result, model: str, C: int) -> Value:
    """batched-fused / batched-fused-default at C: exactly 1 where the search kept the defaults (the same
    computation), else the ratio of their median interleaved rounds."""
    choice = _choice_row(r, model, C)
    fused, fixed = mode_row(r, model, C, FUSED), mode_row(r, model, C, DEFAULTS)
    if fused is None or fixed is None:
        return None
    if choice is not None and not choice["choice"].get("compiled"):
        if choice["choice"]["formulations"] == choice.get("default_formulations"):
            return Measured(1.0, ())
    return _div(_median_rate(fused), _median_rate(fixed))


def _min_over_models(r: Result) -> Value:
    """The smallest batched-fused / batched-fused-default ratio over the models, at each one's largest C run."""
    vals: List[Measured] = []
    for model in r["meta"]["models"]:
        sizes = [C for C in r["meta"]["clients"].get(model, []) if _rate(r, model, C, FUSED) is not None]
        v = _chosen_vs_defaults(r, model, max(sizes)) if sizes else None
        if v is not None:
            vals.append(v)
    return min(vals, key=lambda v: v.value) if vals else None


def _goal(device: str, text: str, model: str, value: Callable[[Result], Value], threshold: float) -> Goal:
    """A goal on ``model``'s rows (``EVERY_MODEL``: all of them) with one figure, ``value(result)``."""

    def figures(r: Result) -> List[Figure]:
        v = value(r)
        return [Figure(model, None if v is None else v.value, () if v is None else v.loads)]

    return Goal(text, text, model, threshold, figures, device=device)


# the project's targets (benchmark goals, not tests)
GOALS: List[Goal] = [
    _goal(
        "cpu",
        "small-cnn: batched-fused >= 8x sequential at C=50",
        "small-cnn",
        lambda r: _ratio(r, "small-cnn", 50, FUSED),
        8.0,
    ),
    _goal(
        "cpu",
        "small-cnn: chosen formulations >= the defaults at C=50 (median rounds; 1 where it kept the defaults)",
        "small-cnn",
        lambda r: _chosen_vs_defaults(r, "small-cnn", 50),
        1.0,
    ),
    _goal(
        "cpu",
        "fedavg-cnn: best batched >= 50% of the device's FLOP/s at C=20",
        "fedavg-cnn",
        lambda r: _frac(r, "fedavg-cnn", 20),
        0.5,
    ),
    _goal(
        "cpu",
        "fedavg-cnn: batched-fused >= sequential at C=20",
        "fedavg-cnn",
        lambda r: _ratio(r, "fedavg-cnn", 20, FUSED),
        1.0,
    ),
    _goal(
        "cpu",
        "fedavg-cnn: chosen formulations >= the defaults at C=20 (median rounds; 1 where it kept the defaults)",
        "fedavg-cnn",
        lambda r: _chosen_vs_defaults(r, "fedavg-cnn", 20),
        1.0,
    ),
    _goal(
        "cpu",
        "small-cnn: fused update >= 1.3x plain torch at C=50",
        "small-cnn",
        lambda r: _part_ratio(r, "small-cnn", 50),
        1.3,
    ),
    _goal(
        "cuda",
        "small-cnn: >= 1,000,000 client-steps/s at C=1000",
        "small-cnn",
        lambda r: _best(r, "small-cnn", 1000),
        1e6,
    ),
    _goal(
        "cuda",
        "small-cnn: no collapse at C=1000 (best >= best at C=200)",
        "small-cnn",
        lambda r: _div(_best(r, "small-cnn", 1000), _best(r, "small-cnn", 200)),
        1.0,
    ),
    _goal(
        "cuda",
        "fedavg-cnn: best batched >= 25% of the device's FLOP/s at C>=100",
        "fedavg-cnn",
        lambda r: _max_over(r, "fedavg-cnn", lambda C: _frac(r, "fedavg-cnn", C), 100),
        0.25,
    ),
    _goal(
        "cuda",
        "fedavg-cnn: best batched >= 50x sequential at C>=100",
        "fedavg-cnn",
        lambda r: _max_over(r, "fedavg-cnn", lambda C: _div(_best(r, "fedavg-cnn", C), _seq(r, "fedavg-cnn", C)), 100),
        50.0,
    ),
    _goal(
        "cuda",
        "fedavg-cnn: no collapse at C=200 (best >= best at C=100)",
        "fedavg-cnn",
        lambda r: _div(_best(r, "fedavg-cnn", 200), _best(r, "fedavg-cnn", 100)),
        1.0,
    ),
    _goal(
        "cuda",
        "resnet18-gn: best batched >= 4x sequential at C>=16",
        "resnet18-gn",
        lambda r: _max_over(
            r, "resnet18-gn", lambda C: _div(_best(r, "resnet18-gn", C), _seq(r, "resnet18-gn", C)), 16
        ),
        4.0,
    ),
    _goal(
        "cuda",
        "resnet18-gn: best batched >= 30% of the device's FLOP/s at C>=16",
        "resnet18-gn",
        lambda r: _max_over(r, "resnet18-gn", lambda C: _frac(r, "resnet18-gn", C), 16),
        0.30,
    ),
    _goal(
        "cuda",
        "char-lstm: best batched >= 10x sequential at C=200",
        "char-lstm",
        lambda r: _div(_best(r, "char-lstm", 200), _seq(r, "char-lstm", 200)),
        10.0,
    ),
    _goal(
        "cuda", "every model: chosen formulations >= the defaults at its largest C", EVERY_MODEL, _min_over_models, 1.0
    ),
]


def judge(result: Result) -> List[Dict[str, Any]]:
    """Each goal of the run's device whose model ran: its value, threshold and verdict (with the reason
    for n/a and disturbed)."""
    device_type, models = result["meta"]["device_type"], result["meta"]["models"]
    out = []
    for g in goals_for(GOALS, device_type):
        if g.where != EVERY_MODEL and g.where not in models:
            continue
        j = g.judge(result, device_type)
        ((figure, _),) = j.figures
        out.append(
            {
                "goal": g.text,
                "value": figure.value,
                "threshold": g.threshold,
                "verdict": j.verdict,
                "reason": REASONS.get(j.verdict),
            }
        )
    return out
