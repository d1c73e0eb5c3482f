"""Reading a client-batched result: the row of a model, C and mode, the sequential rate a C compares
with, a part's time, the device's FLOP/s; and how the report writes rates, ratios and bytes."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .settings import BATCHED, SEQ

Result = Dict[str, Any]
Row = Dict[str, Any]
# the earlier names of parts and modes, in results saved before they were renamed
EARLIER = {
    "grad stacked": "grad layers",
    "grad stacked default": "grad layers default",
    "batched-fused-graph": "batched-fused-replay",
}


def named(label: Optional[str]) -> Optional[str]:
    """A row's part or mode under today's name."""
    return None if label is None else EARLIER.get(label, label)


def mode_row(result: Result, model: str, C: int, mode: str) -> Optional[Row]:
    """The timed row of ``mode`` for ``model`` at C clients (None: not run, skipped or failed)."""
    for r in result["rows"]:
        if r.get("model") == model and named(r.get("mode")) == mode and r["clients"] == C and "client_steps_per_s" in r:
            return r
    return None


def seq_row(result: Result, model: str, C: Optional[int] = None) -> Optional[Row]:
    """The sequential row measured at C (interleaved with that C's modes), else at the first C it ran."""
    rows = [r for r in result["rows"] if r.get("model") == model and r.get("mode") == SEQ and "client_steps_per_s" in r]
    same = [r for r in rows if r["clients"] == C]
    return (same or rows)[0] if rows else None


def best_row(result: Result, model: str, C: int) -> Optional[Row]:
    """The fastest of the batched modes (the simulator's client-batched step in its forms) at C."""
    rows = [r for r in (mode_row(result, model, C, m) for m in BATCHED) if r is not None]
    return max(rows, key=lambda r: r["client_steps_per_s"]) if rows else None


def part_row(result: Result, model: str, C: int, name: str) -> Optional[Row]:
    """The timed row of part ``name`` (the gradients alone, the update alone) at C."""
    for r in result["rows"]:
        if r.get("model") == model and named(r.get("part")) == name and r["clients"] == C and "step_s" in r:
            return r
    return None


def rate(result: Result, model: str, C: int, mode: str) -> Optional[float]:
    r = mode_row(result, model, C, mode)
    return None if r is None else r["client_steps_per_s"]


def seq_rate(result: Result, model: str, C: Optional[int] = None) -> Optional[float]:
    r = seq_row(result, model, C)
    return None if r is None else r["client_steps_per_s"]


def part_time(result: Result, model: str, C: int, name: str) -> Optional[float]:
    r = part_row(result, model, C, name)
    return None if r is None else r["step_s"]


def div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def device_flops(result: Result) -> Optional[float]:
    """The device's FLOP/s: the higher of the run's two measurements (other processes' load only ever
    lowers a measurement of the device, so the higher is the nearer to what it can do)."""
    peaks = [p["peak_flops_per_s"] for p in result.get("peak", [])]
    return max(peaks) if peaks else None


def model_flops(result: Result, model: str) -> Optional[float]:
    """Model FLOPs of one client-step (forward + backward)."""
    return result.get("models", {}).get(model, {}).get("flops_per_client_step")


def fmt_rate(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def fmt_x(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2f}x"


def fmt_bytes(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v / 2**20:,.1f} MiB" if v >= 2**20 else f"{v / 2**10:,.0f} KiB"
