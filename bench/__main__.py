"""``python -m bench``: run the benchmark matrix, print the table, write the result files.

``python -m bench clients``: the client-batched training benchmark instead (bench/clients.py).
``python -m bench clients-sim``: a simulator run, sequential vs client-parallel in lockstep (bench/clients_sim.py).
``python -m bench sharded``: the step on DTensor parameters over 2 CPU processes (bench/sharded.py).
``python -m bench loop``: a user's training loop on a GPU, wall time per iteration (bench/loop.py).
``python -m bench profile``: where that loop's iteration time goes, under torch.profiler (bench/profile.py).
``python -m bench host``: the host side of a replayed and of an eager triton step, on any machine (bench/host.py).
``python -m bench cpu-floor``: the small CNN's stacked CPU step per operator, beside alternatives (bench/cpu_floor.py).
``python -m bench checkpoints``: bytes and seconds of a simulator checkpoint (bench/checkpoints.py).

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
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from .algorithms import ALGOS, CORE, FULL, baseline_names
from .contention import wait_quiet
from .goals import judge_rows
from .machine import ROOT, loadavg, run_meta
from .report import markdown, render, write, write_latest
from .runner import Plan, run
from .shapes import SIZES
from .timing import Budget

DEFAULT_OUT = ROOT / "bench_runs"  # a user's runs: git-ignored, the clone stays clean
COMMITTED = ROOT / "bench" / "results"  # the tables kept in git: written only when named
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
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--full", action="store_const", dest="mode", const="full", help="every size and configuration (default)"
    )
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="short run (README main job)")
    mode.add_argument(
        "--smoke", action="store_const", dest="mode", const="smoke", help="quickest run: checks the machinery"
    )
    ap.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available)")
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
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT,
        help="where the result files and LATEST.md go (default: bench_runs/, git-ignored; "
        "the committed tables: --out-dir bench/results)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--render", type=Path, metavar="RESULT.json", help="only redraw that result's .md and .png")
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
    if (sys.argv[1:] if argv is None else argv)[:1] == ["clients"]:
        # the client-batched training benchmark (bench/clients.py): python -m bench clients --help
        from .clients import main as clients_main

        return clients_main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["clients-sim"]:
        # a simulator run timed sequential vs client-parallel, in lockstep (bench/clients_sim.py)
        from .clients_sim import main as clients_sim_main

        return clients_sim_main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["loop"]:
        # a user's training loop on the GPU, wall time per iteration (bench/loop.py)
        from .loop import main as loop_main

        return loop_main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["profile"]:
        # the loop's iterations under torch.profiler: host time per phase, the step's calls, GPU gaps
        from .profile import main as profile_main

        return profile_main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["host"]:
        # a step's host side with a stand-in graph or stubbed launches: no GPU needed
        from .host import main as host_main

        return host_main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["cpu-floor"]:
        # the small CNN's stacked step on CPU threads against the alternatives to its calls
        from .cpu_floor import main as cpu_floor_main

        return cpu_floor_main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["checkpoints"]:
        # bytes and seconds of a simulator checkpoint (bench/checkpoints.py)
        from .checkpoints import main as checkpoints_main

        return checkpoints_main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["sharded"]:
        # the optimizers on DTensor parameters over a 2-process gloo world (bench/sharded.py)
        from .sharded import main as sharded_main

        return sharded_main((sys.argv[1:] if argv is None else argv)[1:])
    args = parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    if args.rebuild_latest:
        print(write_latest(args.out_dir))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
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
    meta = run_meta(
        device, "python -m bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    )
    meta.update(
        mode=args.mode,
        dtype=args.dtype,
        sizes=sizes,
        algos=plan.algos,
        budget=dataclasses.asdict(budget),
        retries=plan.retries,
        graph_steps=args.graph_steps if device.type == "cuda" else None,
    )
    print(f"bench: {meta['device_name']}, mode {args.mode}, sizes {sizes}", file=sys.stderr, flush=True)
    if (
        not args.no_write
        and _is_committed_folder(args.out_dir)
        and device.type == "cpu"
        and args.wait_quiet == 0
        and args.retries == 0
    ):
        print(
            "bench: note: writing into the committed tables (bench/results) without --wait-quiet / --retries; "
            "disturbed rows will only be flagged",
            file=sys.stderr,
            flush=True,
        )
    if args.wait_quiet > 0:
        cores = wait_quiet(args.wait_quiet)
        print(
            f"bench: other processes use {cores if cores is None else round(cores, 2)} cores; starting",
            file=sys.stderr,
            flush=True,
        )
    meta["loadavg_before"] = loadavg()
    t0 = time.perf_counter()
    result = run(plan)
    meta["wall_s"] = time.perf_counter() - t0
    meta["loadavg_after"] = loadavg()
    result["meta"] = meta
    left_out = dict(result["skipped"])
    if not plan.baselines:
        left_out.update((name, "--no-baselines") for name in baseline_names())
    result["goals"] = judge_rows(result["rows"], device.type, left_out)
    print(markdown(result))
    if not args.no_write:
        paths = write(result, args.out_dir)
        print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
        if "png" not in paths:
            print(
                "bench: no chart drawn: matplotlib is not installed (pip install 'fedopt_kernels[bench]' "
                "or pip install matplotlib)",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
