"""Where every benchmark's results go, and how: ``<stem>.json`` (every figure), ``<stem>.md`` (the
table), ``<stem>.png`` (a chart, where the benchmark draws one and matplotlib is installed), and
LATEST.md (the newest run per device, mode and dtype in the folder).

A user's runs go to ``bench_runs/`` (git-ignored: the clone stays clean); the committed tables live
in ``bench/results/`` and are written only when that folder is named (``--out-dir bench/results``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from .machine import ROOT

DEFAULT_OUT = ROOT / "bench_runs"  # a user's runs: git-ignored, the clone stays clean
COMMITTED = ROOT / "bench" / "results"  # the tables kept in git: written only when named

Result = Dict[str, Any]
Markdown = Callable[[Result], str]
Chart = Callable[[Result, Path], bool]  # draws into the path; False where it drew nothing


def write_json(result: Result, path: Path) -> None:
    """Every figure of ``result`` (a run that writes as it goes calls this after each step of it)."""
    path.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")


def save(
    result: Result,
    out_dir: Path,
    stem: str,
    markdown_fn: Markdown,
    chart_fn: Optional[Chart] = None,
    latest: bool = True,
) -> Dict[str, Path]:
    """Write ``stem.{json,md,png}`` into ``out_dir`` (no PNG where ``chart_fn`` draws nothing) and, with
    ``latest``, refresh LATEST.md there."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    write_json(result, paths["json"])
    paths["md"].write_text(markdown_fn(result))
    if chart_fn is None or not chart_fn(result, paths["png"]):
        paths.pop("png").unlink(missing_ok=True)  # an earlier run's chart would not match these numbers
    if latest:
        paths["latest"] = write_latest(out_dir)
    return paths


def publish(
    result: Result,
    out_dir: Optional[Path],
    stem: str,
    markdown_fn: Markdown,
    chart_fn: Optional[Chart] = None,
    latest: bool = True,
    name: str = "bench",
) -> Dict[str, Path]:
    """Print the table; unless ``out_dir`` is None (``--no-write``), ``save`` the result and say where.
    ``name``: the command, for its messages."""
    text = markdown_fn(result)
    print(text, end="" if text.endswith("\n") else "\n")
    if out_dir is None:
        return {}
    paths = save(result, out_dir, stem, markdown_fn, chart_fn, latest)
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr, flush=True)
    if chart_fn is not None and "png" not in paths:
        print(
            f"{name}: no chart drawn: matplotlib is not installed (pip install 'fedopt_kernels[bench]' "
            "or pip install matplotlib)",
            file=sys.stderr,
            flush=True,
        )
    return paths


def rerender(json_path: Path, markdown_fn: Markdown, chart_fn: Optional[Chart] = None) -> None:
    """Rewrite the markdown table (and chart) of a saved result: the same numbers, the current layout."""
    result = json.loads(json_path.read_text())
    json_path.with_suffix(".md").write_text(markdown_fn(result))
    if chart_fn is not None:
        chart_fn(result, json_path.with_suffix(".png"))


def write_latest(out_dir: Path) -> Path:
    """LATEST.md: for each device and mode, the newest result files in ``out_dir`` (and GPU check folders)."""
    newest: Dict[tuple, tuple] = {}
    # top-level runs and GPU-check folders; tmp/ holds dry runs and scratch output
    for js in sorted(out_dir.glob("*.json")) + sorted(out_dir.glob("gpu-*/*.json")):
        try:
            meta = json.loads(js.read_text())["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        key = (meta.get("device_name", "?"), meta.get("mode", "?"), meta.get("dtype", "?"))
        stamp = meta.get("timestamp", meta.get("date", ""))
        if key not in newest or stamp >= newest[key][0]:
            newest[key] = (stamp, js, meta)
    lines = [
        "# Latest benchmark results",
        "",
        "Written by `python -m bench`; one line per device, mode and dtype (newest run).",
        "",
        "| device | mode | dtype | date | commit | table | data | chart |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (dev, mode, dtype), (_, js, meta) in sorted(newest.items(), key=lambda kv: kv[0]):
        rel = js.relative_to(out_dir)
        md, png = rel.with_suffix(".md"), rel.with_suffix(".png")
        lines.append(
            f"| {dev} | {mode} | {dtype} | {meta.get('date', '?')} | `{str(meta.get('commit', '?'))[:10]}` "
            f"| [{md.name}]({md.as_posix()}) | [{rel.name}]({rel.as_posix()}) | "
            + (f"[{png.name}]({png.as_posix()}) |" if (out_dir / png).is_file() else "— |")
        )
    path = out_dir / "LATEST.md"
    path.write_text("\n".join(lines) + "\n")
    return path
