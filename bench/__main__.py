"""``python -m bench``: run the step table (every algorithm x backend x size), print it, write the result files.

``python -m bench COMMAND``: another benchmark instead (``COMMANDS`` below names the module of each):

- ``clients``: the client-batched training benchmark (bench/clients/);
- ``clients-sim``: a simulator run, sequential vs client-batched side by side;
- ``sharded``: the step on DTensor parameters over 2 CPU processes;
- ``loop``: a user's training loop on a GPU, wall time per iteration;
- ``profile``: where that loop's iteration time goes, under torch.profiler;
- ``host``: the host side of a replayed and of an eager triton step, on any machine;
- ``cpu-floor``: the small CNN's layers-engine CPU step per operator, beside alternatives;
- ``checkpoints``: bytes and seconds of a simulator checkpoint;
- ``scale``: a simulator run's peak memory against its clients per round and population;
- ``privacy``: a round with user-level DP against the same round without, and the clip by hand.
- ``calls``: the files and functions one ``step()`` runs, per optimizer (what a reader follows).
- ``server``: one server step of each server optimizer beside torch's Adam / SGD and a NumPy step.

Modes: default (full: every size, every configuration, ~1 s per case), ``--quick`` (the core
algorithms; on CPU without the 100M list; shorter timing: the README's main-job command) and
``--smoke`` (small CNN only, three timed steps: checks the machinery, numbers mean little).

The cases of one algorithm and list are timed interleaved, round by round (``timing.time_interleaved``),
so the goals compare medians taken under the same load. A run never waits for the machine to be
quiet and never redoes a group unless asked (a disturbed block of timed steps is replaced by another
round): rows that other processes disturbed are flagged (⚠), and a goal judged on them says
"disturbed" instead of pass or miss. ``--wait-quiet`` and ``--retries`` are for the tables
that get committed. Files go to ``bench_runs/`` (git-ignored); the committed tables in
``bench/results/`` are written only when that folder is named with ``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path
from typing import List, Optional

import torch

from . import cli
from .algorithms import ALGOS, CORE, FULL, baseline_names
from .contention import wait_quiet
from .machine import loadavg, run_meta
from .report import COMMITTED, publish, write_latest
from .runner import Plan, run
from .shapes import SIZES
from .step_goals import judge_rows
from .step_report import chart, markdown, render, stem
from .timing import Budget, Stopwatch

# python -m bench COMMAND ...: the module whose main(argv) runs it
COMMANDS = {
    "clients": "bench.clients.cli",
    "clients-sim": "bench.clients_sim",
    "sharded": "bench.sharded",
    "loop": "bench.loop",
    "profile": "bench.profile",
    "host": "bench.host",
    "cpu-floor": "bench.cpu_floor",
    "checkpoints": "bench.checkpoints",
    "scale": "bench.scale",
    "privacy": "bench.privacy",
    "calls": "bench.calls",
    "server": "bench.server",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MODES = {
    # sizes on cpu, sizes on cuda, algorithms, timing budget
    "full": (list(SIZES), list(SIZES), FULL, Budget(warmup=2, min_reps=5, max_reps=300, min_time_s=1.0)),
    "quick": (
        ["overhead", "small_cnn", "resnet18"],
        list(SIZES),
        CORE,
        Budget(warmup=1, min_reps=3, max_reps=100, min_time_s=0.25),
    ),
    "smoke": (
        ["overhead", "small_cnn"],
        ["overhead", "small_cnn"],
        CORE,
        Budget(warmup=1, min_reps=3, max_reps=3, min_time_s=0.0),
    ),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = cli.parser("", __doc__)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--full", action="store_const", dest="mode", const="full", help="every size and configuration (default)"
    )
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="short run (README main job)")
    mode.add_argument(
        "--smoke", action="store_const", dest="mode", const="smoke", help="quickest run: checks the machinery"
    )
    cli.add_device(ap)
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help="override the mode's sizes")
    ap.add_argument("--algos", nargs="+", choices=list(ALGOS), help="override the mode's algorithms")
    ap.add_argument("--backends", nargs="+", help="only these fedopt backends (default: all available)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--graph-steps", type=int, default=10, help="optimizer steps per captured CUDA graph (0: off)")
    ap.add_argument("--no-baselines", action="store_true", help="skip torch.optim.SGD fused/foreach")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help="first wait (at most this long) until other processes leave the CPU cores idle (default 0: start at once)",
    )
    ap.add_argument(
        "--retries",
        type=int,
        default=0,
        help="CPU: time a group of cases that other processes disturbed again, up to N times, waiting for "
        "idle cores before each (default 0: disturbed rows are only flagged)",
    )
    cli.add_output(
        ap,
        render="only redraw that result's .md and .png",
        out_help="where the result files and LATEST.md go (default: bench_runs/, git-ignored; "
        "the committed tables: --out-dir bench/results)",
    )
    ap.add_argument("--rebuild-latest", action="store_true", help="only rewrite LATEST.md in --out-dir")
    args = ap.parse_args(argv)
    args.mode = args.mode or "full"
    if args.retries < 0 or args.wait_quiet < 0:
        ap.error("--retries and --wait-quiet must be >= 0")
    return args


def _is_committed_folder(path: Path) -> bool:
    try:
        return path.resolve() == COMMITTED.resolve()
    except OSError:
        return False


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COMMANDS:  # another benchmark: its own command line (COMMAND --help)
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    args = parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    if args.rebuild_latest:
        print(write_latest(args.out_dir))
        return 0
    device = cli.device_of(args.device)
    cpu_sizes, cuda_sizes, algos, budget = MODES[args.mode]
    sizes = args.sizes or (cuda_sizes if device.type == "cuda" else cpu_sizes)
    plan = Plan(
        device=device,
        sizes=sizes,
        algos=args.algos or algos,
        dtype=DTYPES[args.dtype],
        backends=args.backends,
        budget=budget,
        graph_steps=args.graph_steps,
        baselines=not args.no_baselines,
        retries=args.retries,
    )
    meta = run_meta(device, cli.command_line("", argv))
    meta.update(
        mode=args.mode,
        dtype=args.dtype,
        sizes=sizes,
        algos=plan.algos,
        budget=dataclasses.asdict(budget),
        retries=plan.retries,
        graph_steps=args.graph_steps if device.type == "cuda" else None,
    )
    cli.log(f"bench: {meta['device_name']}, mode {args.mode}, sizes {sizes}")
    if (
        not args.no_write
        and _is_committed_folder(args.out_dir)
        and device.type == "cpu"
        and args.wait_quiet == 0
        and args.retries == 0
    ):
        cli.log(
            "bench: note: writing into the committed tables (bench/results) without --wait-quiet / --retries; "
            "disturbed rows will only be flagged"
        )
    if args.wait_quiet > 0:
        cores = wait_quiet(args.wait_quiet)
        cli.log(f"bench: other processes use {cores if cores is None else round(cores, 2)} cores; starting")
    meta["loadavg_before"] = loadavg()
    wall = Stopwatch()
    result = run(plan)
    meta["wall_s"] = wall.seconds()
    meta["loadavg_after"] = loadavg()
    result["meta"] = meta
    left_out = dict(result["skipped"])
    if not plan.baselines:
        left_out.update((name, "--no-baselines") for name in baseline_names())
    result["goals"] = judge_rows(result["rows"], device.type, left_out)
    publish(result, cli.out_dir(args), stem(result), markdown, chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
