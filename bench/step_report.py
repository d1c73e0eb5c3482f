"""The step benchmark's report (``python -m bench``): the markdown table and the chart of % copy
bandwidth; ``bench.report`` writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from .contention import DISTURBED
from .goals import INFORMATION
from .report import rerender
from .step_goals import GOALS, step_goals

SIZE_LABEL = {"overhead": "overhead", "small_cnn": "small CNN", "resnet18": "ResNet-18", "large": "large"}


def _fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _fmt_x(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _fmt_bytes(b: Optional[int]) -> str:
    if b is None:
        return "n/a"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b} B"


def _fmt_num(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _disturbed(r: Dict[str, Any]) -> bool:
    return r.get("device_type") == "cpu" and (r.get("other_load_cores") or 0.0) > DISTURBED


def _contention_line(result: Dict[str, Any]) -> str:
    loads = [r["other_load_cores"] for r in result["rows"] if r.get("other_load_cores") is not None]
    if not loads:
        return "- other processes' CPU use during the cases: not measured"
    bad = sum(_disturbed(r) for r in result["rows"])
    line = (
        f"- other processes' CPU use during each case: median {sorted(loads)[len(loads) // 2]:.2f}, "
        f"max {max(loads):.2f} cores"
    )
    if result["meta"]["device_type"] == "cpu" and bad:
        line += (
            f" — **{bad} rows ran while other processes used > {DISTURBED} cores (marked ⚠): "
            "their CPU timings are disturbed**"
        )
    return line


def markdown(result: Dict[str, Any]) -> str:
    """The human-readable report: header, goal summary, one table row per case."""
    meta = result["meta"]
    dev_type = meta["device_type"]
    goals = step_goals(dev_type)
    cuda = dev_type == "cuda"
    lines = [
        f"# fedopt_kernels benchmark — {meta['device_name']} ({meta['date']}, {meta['mode']} mode)",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: `{meta['commit']}`{' (uncommitted changes)' if meta.get('dirty') else ''}; torch {meta['torch']}; "
        f"threads {meta['threads']}; dtype {meta['dtype']}; wall time {meta['wall_s']:.0f} s",
        *(
            [f"- **interrupted** after {len(result['rows'])} rows: the table holds the cases timed before the stop"]
            if result.get("interrupted")
            else []
        ),
        f"- backends timed: {', '.join(result['backends'])}; left out: "
        + ("; ".join(f"{k} ({v})" for k, v in result["skipped"].items()) or "none"),
        _contention_line(result),
        "- GB/s = minimum bytes per step (`bench/traffic.py`, docs/benchmarks.md) / median step time; "
        "% copy = that over `dst.copy_(src)` moving the same bytes on the same device in the same run; "
        "host/step = host time of one step() call without waiting for the device (on a CPU, the step time); "
        "x columns = speedup (other time / this time; by hand: the torch code a user writes for the same work, "
        "each algorithm's own: FedNAR `grad += wd*x; clip_grad_norm_(foreach); SGD(fused)`, FedSAM the usual "
        "two-pass SAM, ...); state = bytes of optimizer state; step extra = peak memory one step "
        "allocates on top of it "
        f"({'CUDA max_memory_allocated' if cuda else 'torch CPU allocator events via torch.profiler'})."
        + (
            ""
            if cuda
            else " On a CPU, % copy can exceed 100%: a copy's stores to `dst` also read `dst` into the cache "
            "(write-allocate), traffic the counted bytes leave out, "
            "while an in-place update reads what it writes anyway."
        ),
        "",
        "## Goals",
        "",
        INFORMATION,
        "",
        *(
            [
                "Each figure compares rows timed interleaved, in the same rounds. **disturbed**: other processes "
                f"used more than {DISTURBED} cores while a judged row or what it is compared with was timed, so "
                "neither pass nor miss can be told; **n/a**: what the goal compares with was not timed.",
                "",
            ]
            if any("disturbed" in g for g in result.get("goals", []))
            else []
        ),
        "| goal | judged on | verdict | passed | missed | disturbed |",
        "|---|---|---|---|---|---|",
    ]
    for g in result.get("goals", []):
        missed = ", ".join(g["missed"]) or "—"
        if "disturbed" in g:
            disturbed = ", ".join(g["disturbed"]) or "—"
        else:  # a result written before goals judged disturbed rows: count the flagged ones
            disturbed = str(sum(1 for r in result["rows"] if g["goal"] in r.get("goals", {}) and _disturbed(r)))
        verdict = f"**{g['verdict']}**" + (f": {g['reason']}" if g.get("reason") else "")
        lines.append(
            f"| {g['text']} | {g['where']} | {verdict} | {g['passed']}/{g['judged']} | {missed} | {disturbed} |"
        )
    head = [
        "algorithm",
        "backend",
        "size",
        "B/elem",
        "median step",
        "host/step",
        "GB/s",
        "% copy",
        "x ref",
        "x SGD fused",
        "x SGD foreach",
        "x by hand",
        "state",
        "step extra",
    ]
    if cuda:
        head.insert(head.index("state"), "x cuda")
        head.insert(head.index("state"), "step / torch SGD step")
        head.insert(head.index("state"), "recording step (host)")
    if cuda:
        head += ["graph step", "graph GB/s"]
    head += [g.key for g in goals]
    lines += ["", "## Results", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        size = f"{SIZE_LABEL.get(r['size'], r['size'])} ({r['n_tensors']} t, {_fmt_num(r['numel'])})"
        if "median_s" not in r:
            cells = [r["algorithm"], r["backend"], size, str(r["bytes_per_element"]), f"error: {r.get('error', '?')}"]
            cells += [""] * (len(head) - len(cells))
        else:
            flag = " ⚠" if _disturbed(r) else ""
            cells = [
                r["algorithm"],
                r["backend"],
                size,
                str(r["bytes_per_element"]),
                _fmt_time(r["median_s"]) + flag,
                _fmt_time(r.get("host_s")),
                f"{r['gbps']:.1f}",
                f"{r['pct_copy']:.0f}%",
                _fmt_x(r.get("speedup_ref")),
                _fmt_x(r.get("speedup_sgd_fused")),
                _fmt_x(r.get("speedup_sgd_foreach")),
                _fmt_x(r.get("speedup_hand")),
            ]
            if cuda:
                cells.append(_fmt_x(r.get("speedup_cuda")))
                v = r.get("vs_torch_sgd_step")
                cells.append(f"{v:.2f}" if v is not None else "—")
                cells.append(_fmt_time(r.get("record_host_s")) if r.get("record_host_s") else "—")
            cells += [_fmt_bytes(r.get("state_bytes")), _fmt_bytes(r.get("step_extra_bytes"))]
            if cuda:
                if "graph_median_s" in r:
                    cells += [_fmt_time(r["graph_median_s"]), f"{r['graph_gbps']:.1f}"]
                else:
                    cells += ["n/a" if r.get("graph_error") else "—", ""]
            cells += [r.get("goals", {}).get(g.key, "") for g in goals]
        lines.append("| " + " | ".join(cells) + " |")
    graph_errors = {
        f"{r['algorithm']}/{r['backend']}/{r['size']}": r["graph_error"] for r in result["rows"] if r.get("graph_error")
    }
    if graph_errors:
        lines += ["", "CUDA-graph capture failures:", ""] + [f"- {k}: {v}" for k, v in graph_errors.items()]
    lines.append("")
    return "\n".join(lines)


def chart(result: Dict[str, Any], path: Path) -> bool:
    """Bar chart of % of copy bandwidth per algorithm and backend, one panel per size.

    Returns False, drawing nothing, when matplotlib (the ``[bench]`` extra) is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "pct_copy" in r]
    sizes = [s for s in result["meta"]["sizes"] if any(r["size"] == s for r in rows)] or ["(none)"]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(11, 3.2 * len(sizes)), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for ax, size in zip(axes[:, 0], sizes):
        sub = [r for r in rows if r["size"] == size]
        algos = list(dict.fromkeys(r["algorithm"] for r in sub))
        width = 0.8 / max(1, len(backends))
        for j, b in enumerate(backends):
            xs, ys = [], []
            for i, a in enumerate(algos):
                hit = [r for r in sub if r["algorithm"] == a and r["backend"] == b]
                if hit:
                    xs.append(i + (j - (len(backends) - 1) / 2) * width)
                    ys.append(hit[0]["pct_copy"])
            if xs:
                ax.bar(xs, ys, width, label=b)
        ax.set_xticks(range(len(algos)))
        ax.set_xticklabels(algos, rotation=15, fontsize=8)
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(f"{SIZE_LABEL.get(size, size)} — {result['meta']['device_name']}", fontsize=9)
        ax.axhline(100, color="grey", lw=0.5)
        ax.axhline(copy_goal(result["meta"]["device_type"]), color="black", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=len(backends))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def copy_goal(device_type: str) -> float:
    """The % of copy bandwidth every fused step is to reach on a device type (its "% copy" goal)."""
    return next(g.threshold for g in GOALS if g.device == device_type and g.key.endswith("% copy"))


def stem(result: Dict[str, Any]) -> str:
    """A result's file name without extension: ``<device>-<date>[-mode]``."""
    meta = result["meta"]
    return f"{meta['device_slug']}-{meta['date']}" + ("" if meta["mode"] == "full" else f"-{meta['mode']}")


def render(json_path: Path) -> None:
    """Rewrite the markdown table and chart of a saved result (same numbers, current layout)."""
    rerender(json_path, markdown, chart)
