"""``python -m bench loop``: a user's training loop, wall time per iteration, rows interleaved.

Each iteration is what a client's local training does: ``zero_grad(set_to_none=True)`` (torch's
default), forward, cross-entropy, backward, ``step()``. Models: the simulator's ``SmallCNN`` on
8x8 single-channel images and ``ResNet18GN`` on 32x32 RGB (CIFAR), batch 32, random data already
on the device. Optimizers doing the same work (momentum 0.9, weight decay 5e-4, lr 0.05):
``torch.optim.SGD(fused=True)``, the baseline; ``FedDecaySGD`` (beta 1, i.e. plain SGD) on each
fused backend, replaying steps as it does by default and with ``replay=False`` (``eager``);
``FedNAR`` (also ``eager``) and ``PAdaMFed``, whose hand-written alternatives cost most. The
``graphed`` rows capture the whole iteration in one CUDA graph (docs/replay.md, "A whole iteration in
one graph": gradients kept, zeroed inside the graph) and replay it after copying the batch into the
graph's input, with torch's fused SGD (capturable as it is) and with FedDecaySGD, FedNAR and PAdaMFed
on each fused backend; on a CPU they are listed as not run.

Protocol (fixed before a run): every row of a model is built and warmed up first; then ``--blocks``
rounds, in each of which every row times one block of ``--per-block`` iterations (after two
untimed ones; the device is waited for at the block's start and end), the rows taken in a rotated
order each round, so that no row always runs first or after the same neighbour. A row's figure is
the median of its blocks; its ratio to torch's fused SGD is the median over rounds of the ratio
of the two blocks of the same round (>= 1: the iteration is at least as fast). Verdicts (the
``Goals`` table) follow these medians: a FedDecaySGD or FedNAR row passes ">= 1.0x torch.SGD(fused)"
when its median ratio is >= 1.00; a replaying row passes "never slower than its eager row" when
the median over rounds of eager / replaying is >= 1.00; FedNAR and PAdaMFed pass "replay >= 90%"
when at least 90% of their timed steps replayed. On the small CNN each of the package's graphed rows
passes ">= 3x torch.SGD(fused)" when its median ratio to the eager torch row is >= 3.00, and
">= 1.0x torch.SGD(fused) graphed" when the median over rounds of torch's graphed block over its own
is >= 1.00. Then, untimed, how many gradient address sets 20 more iterations of each row give (what
decides whether steps can replay).

On a CPU (``--device cpu``) the same runs as a check of the machinery: the fused rows run the cpu
backend and nothing replays (replayed steps are a GPU feature).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import cli
from .goals import INFORMATION, Figure, Goal
from .loop_rows import (
    BASELINE,
    BATCH,
    GRAPH_WARMUP,
    GRAPHED,
    MODELS,
    TORCH_GRAPHED,
    GraphedRow,
    Row,
    fused_backends,
    graphed,
    make_row,
    optimizers,
    selected,
)
from .machine import run_meta
from .report import publish
from .stopping import sigterm_interrupts
from .timing import Rounds, error_text, median, sync, time_round

PROBE = 20  # iterations after the timed ones whose gradient addresses are counted
UNTIMED = 2  # iterations of a row before each of its timed blocks

Result = Dict[str, Any]


def address_sets(iteration: Callable[[], None], params: List[torch.Tensor], iterations: int = PROBE) -> int:
    """How many different gradient address sets ``iterations`` more iterations see (untimed): 1 when
    the caching allocator hands the gradients the same blocks back, as with torch's optimizers."""
    seen = set()
    for _ in range(iterations):
        iteration()
        seen.add(tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in params))
    return len(seen)


def _build(
    model_name: str, makers: Dict[str, Callable], device: torch.device, warmup: int, steps: int
) -> Tuple[List[Row], List[Result]]:
    """Every row of a model, built and warmed up (a graphed row captured for ``steps`` iterations);
    and the rows that could not run, with the reason."""
    rows: List[Row] = []
    failed: List[Result] = []
    for name, make in makers.items():
        if name.endswith(GRAPHED) and device.type != "cuda":
            failed.append({"model": model_name, "optimizer": name, "not_run": "needs CUDA"})
            continue
        try:
            row = make_row(model_name, name, make, device)
            if isinstance(row, GraphedRow):
                row.capture(steps)
            for _ in range(warmup):
                row.iteration()
            sync(device)
            rows.append(row)
        except Exception as exc:  # a failing optimizer is a result, not a crash
            failed.append({"model": model_name, "optimizer": name, "error": error_text(exc, 200)})
    return rows, failed


def run_model(
    model_name: str,
    makers: Dict[str, Callable],
    device: torch.device,
    warmup: int,
    blocks: int,
    per_block: int,
    log: Callable[[str], None],
) -> List[Result]:
    """Every row of a model: built and warmed up, then ``blocks`` rounds of one block of each, in a
    rotated order (``timing.time_round``), then the gradient address sets of each."""
    steps = GRAPH_WARMUP + 1 + warmup + blocks * (UNTIMED + per_block) + PROBE  # of a graphed row, in all
    rows, failed = _build(model_name, makers, device, warmup, steps)
    by_name = {row.name: row for row in rows}
    timed = {name: Rounds() for name in by_name}
    fns = {name: row.iteration for name, row in by_name.items()}
    for r in range(blocks):
        time_round(fns, device, r, timed, per_block, UNTIMED, around=lambda name: by_name[name].counting())
        log(f"  {model_name}: round {r + 1}/{blocks}")
    base = timed.get(BASELINE)
    out = []
    for row in rows:
        t = timed[row.name]
        if t.error is not None:
            failed.append({"model": model_name, "optimizer": row.name, "error": t.error[:200]})
            continue
        res: Result = {
            "model": model_name,
            "optimizer": row.name,
            "blocks_s": t.times,
            "median_s": median(t.times),
            "min_s": min(t.times),
        }
        if base is not None and base.error is None:
            res["ratios"] = [b / s for b, s in zip(base.times, t.times)]
        stats = row.stats()
        if stats is not None:
            res["replay_timed"] = dict(row.replay)
            res["replay"] = stats
        if isinstance(row, GraphedRow):
            res["graphed"] = True
        res["address_sets"] = address_sets(row.iteration, list(row.model.parameters()))
        out.append(res)
        log(f"  {model_name:<10} {row.name:<26} {1e3 * res['median_s']:.3f} ms")
    return out + failed


# ------------------------------------------------------------------ goals (bench.goals), from the medians
def _timed(rows: List[Result]) -> Dict[Tuple[str, str], Result]:
    return {(r["model"], r["optimizer"]): r for r in rows if "median_s" in r}


def _figure(r: Result, value: float) -> Figure:
    return Figure(f"{r['model']} / {r['optimizer']}", value, row=r)


def _vs_torch(rows: List[Result]) -> List[Figure]:
    """FedDecaySGD and FedNAR rows: the median over rounds of torch's fused SGD block over theirs."""
    return [
        _figure(r, median(r["ratios"]))
        for (_, name), r in _timed(rows).items()
        if not name.endswith(GRAPHED) and name.startswith(("FedDecaySGD", "FedNAR")) and "ratios" in r
    ]


def _vs_eager(rows: List[Result]) -> List[Figure]:
    """A replaying row against its eager twin: the median over rounds of eager / replaying."""
    by = _timed(rows)
    out = []
    for (model, name), r in by.items():
        eager = by.get((model, f"{name} eager"))
        if eager is not None and not name.endswith(GRAPHED):
            out.append(_figure(r, median([e / s for e, s in zip(eager["blocks_s"], r["blocks_s"])])))
    return out


def _replayed(rows: List[Result]) -> List[Figure]:
    """FedNAR and PAdaMFed (replaying): the share of their timed steps that replayed."""
    out = []
    for (_, name), r in _timed(rows).items():
        if name.startswith(("FedNAR", "PAdaMFed")) and not name.endswith(("eager", GRAPHED)) and "replay_timed" in r:
            t = r["replay_timed"]
            total = t["eager"] + t["recorded"] + t["replayed"]
            out.append(_figure(r, t["replayed"] / total if total else 0.0))
    return out


def _graphs(rows: List[Result], against_torch_graph: bool) -> List[Figure]:
    """The package's graphed rows on the small CNN: the median ratio to the eager torch row, or the
    median over rounds of torch's graphed block over theirs."""
    by = _timed(rows)
    out = []
    for (model, name), r in by.items():
        if model != "small_cnn" or not name.endswith(GRAPHED) or name == TORCH_GRAPHED:
            continue
        torch_graph = by.get((model, TORCH_GRAPHED))
        if not against_torch_graph and "ratios" in r:
            out.append(_figure(r, median(r["ratios"])))
        elif against_torch_graph and torch_graph is not None:
            out.append(_figure(r, median([t / s for t, s in zip(torch_graph["blocks_s"], r["blocks_s"])])))
    return out


def _x(v: float) -> str:
    return f"{v:.2f}x"


# in the order a row's goals are listed; the replay goals only where steps replay (a GPU)
GOALS: List[Goal] = [
    Goal(
        ">= 1.0x torch.SGD(fused)", ">= 1.0x torch.SGD(fused)", "FedDecaySGD and FedNAR rows", 1.0, _vs_torch, show=_x
    ),
    Goal(
        "replaying never slower than eager",
        "replaying never slower than eager",
        "replaying rows with an eager twin",
        1.0,
        _vs_eager,
        show=lambda v: f"eager / replaying {v:.2f}",
    ),
    Goal(
        "replay >= 90% of steps",
        "replay >= 90% of steps",
        "FedNAR and PAdaMFed, replaying",
        0.9,
        _replayed,
        show=lambda v: f"{100 * v:.0f}%",
    ),
    Goal(
        ">= 3x torch.SGD(fused)",
        ">= 3x torch.SGD(fused)",
        "graphed rows, small CNN",
        3.0,
        lambda rows: _graphs(rows, False),
        show=_x,
    ),
    Goal(
        f">= 1.0x {TORCH_GRAPHED}",
        f">= 1.0x {TORCH_GRAPHED}",
        "graphed rows, small CNN",
        1.0,
        lambda rows: _graphs(rows, True),
        show=_x,
    ),
]
REPLAY_GOALS = ("replaying never slower than eager", "replay >= 90% of steps")


def goals(rows: List[Result], replaying: bool = True) -> List[Tuple[str, str, str, str]]:
    """(goal, row, value, verdict) per judged row, the rows in their order and each row's goals in
    ``GOALS``' order; ``replaying``: the device replays steps (a GPU), else the replay goals are left out."""
    order = {id(r): i for i, r in enumerate(rows)}
    judged = []
    for k, g in enumerate(GOALS):
        if g.key in REPLAY_GOALS and not replaying:
            continue
        for figure, verdict in g.judge(rows, "cuda" if replaying else "cpu").figures:
            shown = "—" if figure.value is None else g.show(figure.value)
            judged.append((order[id(figure.row)], k, (g.text, figure.where, shown, verdict)))
    return [entry for _, _, entry in sorted(judged, key=lambda j: j[:2])]


def markdown(result: Dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"# A user's training loop: {m['device_name']}" + (" (**interrupted**)" if m.get("interrupted") else ""),
        "",
        f"- {m['date']}, commit `{m['commit']}`, torch {m['torch']}; `{m['command']}`",
        f"- iteration: zero_grad(set_to_none=True), forward, loss, backward, step; batch {BATCH}",
        f"- rows interleaved: {m['blocks']} rounds, each timing one block of {m['per_block']} iterations "
        f"of every row (after {UNTIMED} untimed), the rows in a rotated order each round; "
        f"{m['warmup']} warm-up iterations per row first",
        "",
        f"| model | optimizer | ms / iteration (median of {m['blocks']} blocks) | x torch.SGD(fused) "
        f"(median [min-max] over rounds) | steps replayed (timed) | gradient address sets in {PROBE} iterations |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r or "not_run" in r:
            what = f"error: {r['error']}" if "error" in r else f"not run: {r['not_run']}"
            lines.append(f"| {r['model']} | {r['optimizer']} | {what} | | | |")
            continue
        t = r.get("replay_timed")
        replayed = "—" if t is None else f"{t['replayed']}/{t['eager'] + t['recorded'] + t['replayed']}"
        if r.get("graphed"):
            replayed = "in the graph"
        ratios = r.get("ratios")
        ratio = "—" if not ratios else f"{median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {1e3 * r['median_s']:.3f} | {ratio} | {replayed} | "
            f"{r.get('address_sets', '—')} |"
        )
    lines += [
        "",
        "x torch.SGD(fused) > 1: the iteration is faster than with torch's fused SGD. graphed: the whole "
        "iteration is one CUDA graph, replayed after the batch is copied into its input (docs/replay.md).",
        "",
        "## Goals",
        "",
        INFORMATION,
        "",
        "| goal | row | value | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {g} | {row} | {v} | **{verdict}** |" for g, row, v, verdict in result.get("goals", [])]
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = cli.parser("loop", __doc__)
    cli.add_device(ap, "cuda", help="cuda (default), or cpu: the machinery without a GPU")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--rows", nargs="+", help="only the rows whose names start with one of these (the baseline always runs)"
    )
    ap.add_argument("--warmup", type=int, default=20, help="untimed iterations per row before the rounds")
    ap.add_argument("--blocks", type=int, default=7, help="rounds: timed blocks per row")
    ap.add_argument("--per-block", type=int, default=20, help="timed iterations per block")
    ap.add_argument("--profile", action="store_true", help="run the profile (python -m bench profile) instead")
    cli.add_output(ap)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    if "--profile" in argv:
        from .profile import main as profile_main

        return profile_main([a for a in argv if a != "--profile"])
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        cli.log("bench loop: torch sees no CUDA device (--device cpu runs the machinery without one)")
        return 2
    if min(args.blocks, args.per_block) < 1 or args.warmup < 0:
        cli.log("bench loop: --blocks and --per-block must be >= 1, --warmup >= 0")
        return 2
    backends = fused_backends(device)
    makers = selected({**optimizers(backends), **graphed(backends)}, args.rows)
    meta = run_meta(device, cli.command_line("loop", argv))
    meta.update(warmup=args.warmup, blocks=args.blocks, per_block=args.per_block)
    rows: List[Result] = []
    try:
        with sigterm_interrupts():  # stopped (Ctrl-C, gpu_check's deadline, kill): the models done are kept
            for model_name in args.models:
                rows += run_model(model_name, makers, device, args.warmup, args.blocks, args.per_block, cli.log)
    except KeyboardInterrupt:
        meta["interrupted"] = True
        cli.log("bench loop: interrupted; writing the models timed so far")
    result = {"meta": meta, "rows": rows, "goals": goals(rows, replaying=device.type == "cuda")}
    publish(result, cli.out_dir(args), f"loop-{meta['device_slug']}-{meta['date']}", markdown, latest=False)
    return 0
