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
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

import fedopt_kernels as fk
from fedopt_kernels.sim.models.resnet_gn import ResNet18GN
from fedopt_kernels.sim.models.small import SmallCNN

from .machine import ROOT, run_meta
from .stopping import sigterm_interrupts

MODELS: Dict[str, Callable[[], tuple]] = {
    # name -> (model, input shape per sample, classes)
    "small_cnn": lambda: (SmallCNN((1, 8, 8), 10), (1, 8, 8), 10),
    "resnet18": lambda: (ResNet18GN(3, 10), (3, 32, 32), 10),
}
BATCH = 32
PROBE = 20  # iterations after the timed ones whose gradient addresses are counted
UNTIMED = 2  # iterations of a row before each of its timed blocks
SGD: Dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=5e-4)
BASELINE = "torch.SGD(fused)"
GRAPHED = " graphed"  # a row whose iteration is the replay of one CUDA graph holding it whole
TORCH_GRAPHED = BASELINE + GRAPHED
GRAPH_WARMUP = 3  # eager iterations before a capture (the first step makes the momentum buffers)


def fused_backends(device: torch.device) -> List[str]:
    """The fused backends the rows run on ``device``: cuda and triton on a GPU, cpu on a CPU."""
    wanted = ("cuda", "triton") if device.type == "cuda" else ("cpu",)
    return [b for b in wanted if b in fk.available_backends(device)]


def optimizers(backends: List[str]) -> Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]]:
    """Row name -> how to build its optimizer for a model's parameters."""
    out: Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = {
        BASELINE: lambda ps: torch.optim.SGD(ps, fused=True, **SGD)
    }
    nar: Dict[str, Any] = dict(lr=SGD["lr"], weight_decay=SGD["weight_decay"], max_norm=1.0)
    for b in backends:  # partial: the same calls as lambdas binding b, and typed
        out[f"FedDecaySGD {b}"] = functools.partial(fk.FedDecaySGD, beta=1.0, backend=b, **SGD)
        out[f"FedDecaySGD {b} eager"] = functools.partial(fk.FedDecaySGD, beta=1.0, backend=b, replay=False, **SGD)
        out[f"FedNAR {b}"] = functools.partial(fk.FedNAR, backend=b, **nar)
        out[f"FedNAR {b} eager"] = functools.partial(fk.FedNAR, backend=b, replay=False, **nar)
        out[f"PAdaMFed {b}"] = functools.partial(fk.PAdaMFed, lr=0.01, beta=0.5, backend=b)
    return out


def graphed(backends: List[str]) -> Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]]:
    """The rows whose whole iteration is one CUDA graph: torch's fused SGD (it has no ``capturable``
    flag: its fused step captures as it is) and the package's optimizers as ``optimizers`` builds them."""
    eager = optimizers(backends)
    out = {TORCH_GRAPHED: eager[BASELINE]}
    for b in backends:
        for name in (f"FedDecaySGD {b}", f"FedNAR {b}", f"PAdaMFed {b}"):
            out[name + GRAPHED] = eager[name]
    return out


@dataclass
class Row:
    """One model with one optimizer, its data, and what its timed blocks measured."""

    model_name: str
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    blocks: List[float] = field(default_factory=list)  # seconds per iteration, one per round
    replay: Dict[str, int] = field(default_factory=lambda: {"eager": 0, "recorded": 0, "replayed": 0})

    def iteration(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()

    def stats(self) -> Optional[Dict[str, Any]]:
        get = getattr(self.opt, "replay_stats", None)
        return get() if get is not None else None


@dataclass
class GraphedRow(Row):
    """A row whose iteration copies the batch into the graph's static input and replays one CUDA graph
    holding zero_grad (``set_to_none=False``: the gradients stay where the warm-up made them, which
    both fused backends can capture), forward, loss, backward and step."""

    graph: Any = None
    static: Optional[tuple] = None

    def eager_iteration(self) -> None:
        assert self.static is not None  # made by capture()
        self.opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(self.model(self.static[0]), self.static[1]).backward()
        self.opt.step()

    def capture(self, steps: int) -> None:
        """PyTorch's recipe: eager iterations on a side stream, then the capture; ``steps``: how many
        iterations the row will replay (what the optimizer's decay table must cover)."""
        self.static = (self.x.clone(), self.y.clone())
        prepare = getattr(self.opt, "prepare_capture", None)
        if prepare is not None:
            prepare(steps)
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP):
                self.eager_iteration()
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.eager_iteration()

    def iteration(self) -> None:
        assert self.static is not None
        self.static[0].copy_(self.x)
        self.static[1].copy_(self.y)
        self.graph.replay()

    def stats(self) -> Optional[Dict[str, Any]]:
        return None  # the steps are in the graph: the optimizer neither records nor replays them


def make_row(model_name: str, name: str, make_opt: Callable, device: torch.device, seed: int = 0) -> Row:
    torch.manual_seed(seed)
    model, shape, classes = MODELS[model_name]()
    model = model.to(device)
    opt = make_opt(list(model.parameters()))
    x = torch.randn((BATCH,) + shape, device=device)
    y = torch.randint(0, classes, (BATCH,), device=device)
    return (GraphedRow if name.endswith(GRAPHED) else Row)(model_name, name, model, opt, x, y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(row: Row, device: torch.device, per_block: int) -> float:
    """Seconds per iteration of one block of ``per_block`` iterations (after ``UNTIMED`` more)."""
    for _ in range(UNTIMED):
        row.iteration()
    before = row.stats()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(per_block):
        row.iteration()
    sync(device)
    seconds = (time.perf_counter() - t0) / per_block
    after = row.stats()
    if before is not None and after is not None:
        for k in row.replay:
            row.replay[k] += after[k] - before[k]
    return seconds


def rotated(rows: List[Any], r: int) -> List[Any]:
    """Round ``r``'s order: from row ``r`` on, forwards in even rounds and backwards in odd ones (each
    row comes first once in ``len(rows)`` rounds, and follows each neighbour in both directions)."""
    n = len(rows)
    step = 1 if r % 2 == 0 else -1
    return [rows[(r + step * i) % n] for i in range(n)]


def address_sets(iteration: Callable[[], None], params: List[torch.Tensor], iterations: int = PROBE) -> int:
    """How many different gradient address sets ``iterations`` more iterations see (untimed): 1 when
    the caching allocator hands the gradients the same blocks back, as with torch's optimizers."""
    seen = set()
    for _ in range(iterations):
        iteration()
        seen.add(tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in params))
    return len(seen)


def run_model(
    model_name: str,
    makers: Dict[str, Callable],
    device: torch.device,
    warmup: int,
    blocks: int,
    per_block: int,
    log: Callable[[str], None],
) -> List[Dict[str, Any]]:
    rows: List[Row] = []
    failed: List[Dict[str, Any]] = []
    steps = GRAPH_WARMUP + 1 + warmup + blocks * (UNTIMED + per_block) + PROBE  # of a graphed row, in all
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
            failed.append(
                {"model": model_name, "optimizer": name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
            )
    for r in range(blocks):
        for row in rotated(rows, r):
            row.blocks.append(time_block(row, device, per_block))
        log(f"  {model_name}: round {r + 1}/{blocks}")
    base = next((row for row in rows if row.name == BASELINE), None)
    out = []
    for row in rows:
        res: Dict[str, Any] = {
            "model": model_name,
            "optimizer": row.name,
            "blocks_s": row.blocks,
            "median_s": statistics.median(row.blocks),
            "min_s": min(row.blocks),
        }
        if base is not None:
            res["ratios"] = [b / s for b, s in zip(base.blocks, row.blocks)]
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


def _median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def goals(rows: List[Dict[str, Any]], replaying: bool = True) -> List[tuple]:
    """(goal, row, value, verdict) by the rules of the module docstring; ``replaying``: the device
    replays steps (a GPU), else the replay goals are left out."""
    by = {(r["model"], r["optimizer"]): r for r in rows if "median_s" in r}
    out = []
    for (model, name), r in by.items():
        if name.endswith(GRAPHED):
            out += _graph_goals(model, name, r, by.get((model, TORCH_GRAPHED)))
            continue
        if name.startswith(("FedDecaySGD", "FedNAR")) and "ratios" in r:
            v = _median(r["ratios"])
            out.append((">= 1.0x torch.SGD(fused)", f"{model} / {name}", f"{v:.2f}x", "pass" if v >= 1.0 else "miss"))
        eager = by.get((model, f"{name} eager"))
        if eager is not None and replaying:
            v = _median([e / s for e, s in zip(eager["blocks_s"], r["blocks_s"])])
            out.append(
                (
                    "replaying never slower than eager",
                    f"{model} / {name}",
                    f"eager / replaying {v:.2f}",
                    "pass" if v >= 1.0 else "miss",
                )
            )
        if replaying and name.startswith(("FedNAR", "PAdaMFed")) and not name.endswith("eager") and "replay_timed" in r:
            t = r["replay_timed"]
            total = t["eager"] + t["recorded"] + t["replayed"]
            share = t["replayed"] / total if total else 0.0
            out.append(
                (
                    "replay >= 90% of steps",
                    f"{model} / {name}",
                    f"{100 * share:.0f}%",
                    "pass" if share >= 0.9 else "miss",
                )
            )
    return out


def _graph_goals(model: str, name: str, r: Dict[str, Any], torch_graphed: Optional[Dict[str, Any]]) -> List[tuple]:
    """A graphed row of the package's on the small CNN: >= 3x the eager torch loop, and at least as fast
    as the same graph with torch's fused SGD (median over rounds of the two blocks' ratio)."""
    if model != "small_cnn" or name == TORCH_GRAPHED:
        return []
    out = []
    if "ratios" in r:
        v = _median(r["ratios"])
        out.append((">= 3x torch.SGD(fused)", f"{model} / {name}", f"{v:.2f}x", "pass" if v >= 3.0 else "miss"))
    if torch_graphed is not None:
        v = _median([t / s for t, s in zip(torch_graphed["blocks_s"], r["blocks_s"])])
        out.append((f">= 1.0x {TORCH_GRAPHED}", f"{model} / {name}", f"{v:.2f}x", "pass" if v >= 1.0 else "miss"))
    return out


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
        ratio = "—" if not ratios else f"{_median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
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
        "| goal | row | value | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {g} | {row} | {v} | **{verdict}** |" for g, row, v, verdict in result.get("goals", [])]
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench loop", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--rows", nargs="+", help="only the rows whose names start with one of these (the baseline always runs)"
    )
    ap.add_argument("--warmup", type=int, default=20, help="untimed iterations per row before the rounds")
    ap.add_argument("--blocks", type=int, default=7, help="rounds: timed blocks per row")
    ap.add_argument("--per-block", type=int, default=20, help="timed iterations per block")
    ap.add_argument("--profile", action="store_true", help="run the profile (python -m bench profile) instead")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_runs")
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args(argv)


def selected(makers: Dict[str, Callable], rows: Optional[List[str]]) -> Dict[str, Callable]:
    """The rows whose names start with one of ``rows``, with the baselines they are measured against."""
    if not rows:
        return makers
    out = {k: v for k, v in makers.items() if k == BASELINE or any(k.startswith(r) for r in rows)}
    if TORCH_GRAPHED in makers and any(k.endswith(GRAPHED) for k in out):
        out[TORCH_GRAPHED] = makers[TORCH_GRAPHED]
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--profile" in argv:
        from .profile import main as profile_main

        return profile_main([a for a in argv if a != "--profile"])
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench loop: torch sees no CUDA device (--device cpu runs the machinery without one)", file=sys.stderr)
        return 2
    if min(args.blocks, args.per_block) < 1 or args.warmup < 0:
        print("bench loop: --blocks and --per-block must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    backends = fused_backends(device)
    makers = selected({**optimizers(backends), **graphed(backends)}, args.rows)
    meta = run_meta(device, "python -m bench loop " + " ".join(argv))
    meta.update(warmup=args.warmup, blocks=args.blocks, per_block=args.per_block)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows: List[Dict[str, Any]] = []
    try:
        with sigterm_interrupts():  # stopped (Ctrl-C, gpu_check's deadline, kill): the models done are kept
            for model_name in args.models:
                rows += run_model(model_name, makers, device, args.warmup, args.blocks, args.per_block, log)
    except KeyboardInterrupt:
        meta["interrupted"] = True
        log("bench loop: interrupted; writing the models timed so far")
    result = {"meta": meta, "rows": rows, "goals": goals(rows, replaying=device.type == "cuda")}
    publish(result, markdown(result), "loop", None if args.no_write else args.out_dir)
    return 0


def publish(result: Dict[str, Any], text: str, kind: str, out_dir: Optional[Path]) -> None:
    """Print the table; unless ``out_dir`` is None, write it and the result as ``<kind>-<device>-<date>``."""
    print(text)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = result["meta"]
    stem = f"{kind}-{meta['device_slug']}-{meta['date']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / f"{stem}.md").write_text(text + "\n")
    print(f"wrote {out_dir / stem}.json/.md", file=sys.stderr)
