"""Writing a run's results: per-round metrics as JSON and CSV, a PNG of the curves, a final text table."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

from ..fl.checkpoint import atomic_file, write_text_atomic

HISTORY_FIELDS = ("round", "train_loss", "val_loss", "val_acc", "seconds")


# result files are written whole or not at all (a temporary file renamed into place): a run killed
# while writing them leaves the earlier file, never half of a new one


def write_json(path: Path, result: Dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(result, indent=2, sort_keys=True) + "\n")


def write_csv(path: Path, history: Sequence[Dict[str, Any]]) -> None:
    with atomic_file(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HISTORY_FIELDS, extrasaction="ignore")
        w.writeheader()
        for rec in history:
            w.writerow({k: rec.get(k, "") for k in HISTORY_FIELDS})


def plot_curves(path: Path, runs: Dict[str, Sequence[Dict[str, Any]]], title: str = "") -> bool:
    """Training loss and validation accuracy per round, one line per run (label -> history).

    Returns False (and draws nothing) when matplotlib, part of the ``[sim]`` extra, is missing."""
    from ..core.extras import optional

    matplotlib = optional("matplotlib")
    if matplotlib is None:
        return False

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for label, hist in runs.items():
        ax_loss.plot([r["round"] for r in hist], [r["train_loss"] for r in hist], label=label)
        ev = [r for r in hist if "val_acc" in r]
        ax_acc.plot([r["round"] for r in ev], [r["val_acc"] for r in ev], label=label)
    ax_loss.set(xlabel="round", ylabel="client training loss", yscale="log")
    ax_acc.set(xlabel="round", ylabel="validation accuracy (existing users)")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return True


def final_rows(final: Dict[str, Any]) -> Dict[str, float]:
    """Flatten a run's final evaluation into named numbers (the table's columns)."""
    row = {"pooled test acc": final["pooled_test_acc"]}
    for stage, label in (("global", "global"), ("finetuned", "fine-tuned")):
        for group in ("existing", "new"):
            s = final[stage][group]
            row[f"{label} {group} mean"] = s["mean"]
            if stage == "finetuned":
                row[f"{label} {group} bottom10%"] = s["bottom10"]
                row[f"{label} {group} std"] = s["std"]
    return row


def mean_std(values: Sequence[float]) -> str:
    """'m ± s' in percent over seeds (population std); '-' when there is no finite value."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return "-"
    if v.size == 1:
        return f"{100 * v[0]:.1f}"
    return f"{100 * v.mean():.1f} ± {100 * v.std():.1f}"


def format_final_table(results: List[Dict[str, Any]]) -> str:
    """Final metrics of one or more seeds of the same configuration (accuracies in %)."""
    rows = [final_rows(r["final"]) for r in results]
    width = max(len(k) for k in rows[0])
    lines = [f"final metrics over {len(rows)} seed(s), accuracy in % (mean ± std across seeds)"]
    for key in rows[0]:
        lines.append(f"  {key:<{width}}  {mean_std([r[key] for r in rows])}")
    return "\n".join(lines)
