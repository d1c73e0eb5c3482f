"""The client-batched benchmark's report: the markdown table (goals, then per model every mode at every
C, the parts of a step, the formulations chosen and why, the layers alone) and the chart of
client-steps/s against C; ``bench.report`` writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from fedopt_kernels.sim.batched.precision import summary

from ..contention import DISTURBED
from ..goals import INFORMATION
from ..report import rerender, save
from .results import device_flops, div, fmt_bytes, fmt_rate, fmt_x, named, part_time, rate, seq_rate
from .settings import MODES, SEQ


def markdown(result: Dict[str, Any]) -> str:
    meta = result["meta"]
    peak = device_flops(result)
    lines = [
        f"# Client-batched training — {meta['device_name']} ({meta['date']})",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: `{meta['commit']}`{' (uncommitted changes)' if meta.get('dirty') else ''}; torch {meta['torch']}; "
        f"threads {meta['threads']}; wall time {meta['wall_s']:.0f} s; load average before/after "
        f"{meta.get('loadavg_before')} / {meta.get('loadavg_after')}"
        + (
            "; **interrupted** (deadline): the cases after the last row were not run" if meta.get("interrupted") else ""
        ),
        "- round: C clients x K local steps, FedNAR update; the modes of one C timed interleaved, best of "
        f"{meta['rounds']} rounds after one untimed round; batched backend (auto): {meta['fused_backend']}, "
        f"sequential: {meta['sequential_backend']}",
        f"- precision: {summary(meta.get('precision', 'fp32'))}",
        "- device FLOP/s, measured in this run at that precision (start, end): "
        + "; ".join(
            f"matmul {p['matmul_flops_per_s'] / 1e9:,.1f} G, conv {p['conv_flops_per_s'] / 1e9:,.1f} G"
            + f" ({p.get('dtype', 'float32')}"
            + (", TF32 matmul" if p.get("tf32_matmul") else "")
            + (", TF32 conv" if p.get("tf32_conv") else "")
            + ")"
            for p in result.get("peak", [])
        )
        + (f"; the table uses {peak / 1e9:,.1f} G" if peak else ""),
        "",
        "## Goals",
        "",
        INFORMATION,
        "",
        "| goal | value | verdict |",
        "|---|---|---|",
    ]
    for g in result.get("goals", []):
        v = g["value"]
        if v is None:
            shown = "—"
        elif g["threshold"] > 100:
            shown = f"{v:,.0f}"
        elif "FLOP/s" in g["goal"]:
            shown = f"{v:.1%}"
        else:
            shown = f"{v:.3g}x"
        verdict = f"**{g['verdict']}**" + (f": {g['reason']}" if g.get("reason") else "")
        lines.append(f"| {g['goal']} | {shown} | {verdict} |")
    for name in meta["models"]:
        m = result["models"][name]
        flops = m.get("flops_per_client_step")
        lines += [
            "",
            f"## {name}",
            "",
            f"{m['paper']}. Inputs {tuple(m['shape'])}, {m['classes']} classes, batch {m['batch']}, "
            f"K={m['steps']} steps per timed round; {m['parameters']:,} parameters; "
            + (f"{flops / 1e6:,.1f} MFLOP per client-step (forward + backward)." if flops else "FLOPs not counted."),
            "",
            "| clients | mode | backend | client-steps/s | vs sequential | model GFLOP/s | of device | "
            "peak memory per client |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for C in meta["clients"][name]:
            seq = seq_rate(result, name, C)
            for mode in MODES:
                r = next(
                    (
                        r
                        for r in result["rows"]
                        if r.get("model") == name and named(r.get("mode")) == mode and r["clients"] == C
                    ),
                    None,
                )
                if r is None or ("skipped" in r and mode == SEQ):
                    continue
                if "skipped" in r:
                    lines.append(f"| {C} | {mode} | — | not run: {r['skipped']} | | | | |")
                    continue
                if "error" in r:
                    lines.append(f"| {C} | {mode} | {r.get('backend', '')} | error: {r['error'][:80]} | | | | |")
                    continue
                rate = r.get("client_steps_per_s")
                gf = None if rate is None or flops is None else rate * flops
                warn = " ⚠" if (r.get("other_load_cores") or 0) > DISTURBED else ""
                label = mode + (f" (chunks of {r['chunk']})" if r.get("chunk") else "")
                lines.append(
                    f"| {C} | {label} | {r['backend']} | {fmt_rate(rate)}{warn} | "
                    f"{fmt_x(div(rate, seq)) if mode != SEQ else '1.00x'} | "
                    f"{'—' if gf is None else f'{gf / 1e9:,.1f}'} | "
                    f"{'—' if gf is None or not peak else f'{gf / peak:.1%}'} | "
                    f"{fmt_bytes(r.get('peak_bytes_per_client'))}{' (one client)' if mode == SEQ else ''} |"
                )
        lines += [
            "",
            "| clients | grad layers (chosen) | grad layers (defaults) | grad vmap | update plain torch | "
            "update fused | update: plain / fused |",
            "|---|---|---|---|---|---|---|",
        ]
        for C in meta["clients"][name]:
            g, d, v, p, f = (
                part_time(result, name, C, n)
                for n in ("grad layers", "grad layers default", "grad vmap", "update plain torch", "update fused")
            )
            fmt = lambda s: "—" if s is None else f"{s * 1e3:.3f} ms"  # noqa: E731
            lines.append(f"| {C} | {fmt(g)} | {fmt(d)} | {fmt(v)} | {fmt(p)} | {fmt(f)} | {fmt_x(div(p, f))} |")
        lines += choice_lines(result, name)
        layer_rows_ = [r for r in result["rows"] if r.get("model") == name and "layer" in r]
        if layer_rows_:
            C = layer_rows_[0]["clients"]
            lines += [
                "",
                f"Layers alone at C={C}, forward + backward (median; **bold**: the default formulation):",
                "",
                "| layer | type | " + " | ".join(("formulation", "time")) + " |",
                "|---|---|---|---|",
            ]
            for r in layer_rows_:
                t = r.get("step_s")
                shown = f"error: {r['error'][:60]}" if "error" in r else f"{t * 1e3:.3f} ms"
                form = f"**{r['formulation']}**" if r.get("default") else r["formulation"]
                lines.append(f"| {r['layer']} | {r['kind']} | {form} | {shown} |")
    lines += [
        "",
        f"⚠: other processes kept more than {DISTURBED} cores busy during a timed round of that mode (CPU timings "
        "disturbed).",
        "",
    ]
    return "\n".join(lines)


def choice_lines(result: Dict[str, Any], name: str) -> List[str]:
    """The formulations each C ran and why, and the chunk size chosen, as report lines."""
    rows = [r for r in result["rows"] if r.get("model") == name and ("choice" in r or "chunk_choice" in r)]
    if not rows:
        return []
    how = result["meta"].get("formulations", "measure")
    out = [
        "",
        f"Formulations (`--formulations {how}`: each layer group's candidates timed in the whole step, "
        "interleaved medians; a candidate replaces the default when 5% faster):",
        "",
        "| clients | layer | formulation | why |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if "choice" not in r:
            continue
        ch = r["choice"]
        for i, (layer, form) in enumerate(ch["formulations"].items()):
            when = f"{r['clients']} ({r['search_s']:.1f} s to choose)" if i == 0 else ""
            out.append(f"| {when} | {layer} | {form} | {ch['why'].get(layer, '')} |")
    for r in rows:
        if "chunk_choice" in r:
            ch = r["chunk_choice"]
            out.append(
                f"\nC={r['clients']}: chunks of {ch['clients']} clients chosen (at most {r['fit']:,} fit in "
                f"memory; candidates timed per round: chunks x step time)"
            )
    return out


def chart(result: Dict[str, Any], path: Path) -> bool:
    """Client-steps/s against C, a panel per model; False, drawing nothing, without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["meta"]["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        sizes = result["meta"]["clients"][name]
        for mode in MODES:
            pts = [(C, rate(result, name, C, mode)) for C in sizes]
            if mode == SEQ:
                pts = [(C, seq_rate(result, name, C)) for C in sizes]
            pts = [(C, v) for C, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode, linestyle="--" if mode == SEQ else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients per round (C)")
        ax.set_ylabel("client-steps / s")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"client-batched FedNAR — {result['meta']['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def stem(result: Dict[str, Any]) -> str:
    """A result's file name without extension: ``clients-<device>-<date>[-smoke]``."""
    meta = result["meta"]
    return f"clients-{meta['device_slug']}-{meta['date']}" + ("-smoke" if meta.get("smoke") else "")


def write(result: Dict[str, Any], out_dir: Path) -> Dict[str, Path]:
    """Write ``clients-<device>-<date>[-smoke].{json,md,png}`` into ``out_dir`` and refresh LATEST.md there."""
    return save(result, out_dir, stem(result), markdown, chart)


def render(json_path: Path) -> None:
    """Rewrite the markdown table and chart of a saved result (same numbers, current layout)."""
    rerender(json_path, markdown, chart)
