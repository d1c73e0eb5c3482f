"""``python -m bench clients``: client-steps per second of one FL round on the models the papers train,
one client after another vs all at once, against the device's measured FLOP/s.

Models (``--model``; the papers' input shapes and batch sizes, stated in the table):

* ``small-cnn``: the simulator's small CNN on 8x8 single-channel digits (3,818 parameters), batch 10;
* ``fedavg-cnn``: the CNN of McMahan et al. (AISTATS 2017) on 28x28 MNIST-like images, batch 10
  (the paper: E = 5 epochs of 600 samples, 300 local steps);
* ``resnet18-gn``: ResNet-18 with GroupNorm on 32x32 CIFAR-10 images, batch 50, 20 local steps
  (FedNAR's setting, NeurIPS 2023);
* ``char-lstm``: LEAF's character LSTM on Shakespeare (80-character windows, 80 symbols), batch 10
  (LEAF: one local epoch).

A round: C clients, each from the same global model, K local steps (``--steps``; each model's
default is stated), FedNAR's update (lr 0.05, weight decay 5e-4, max_norm 10). Throughput = C * K /
(wall time of the round). The modes of one C are timed interleaved (round 1 of every mode, then
round 2 of every mode, ..., each time in a rotated order: ``timing.time_rounds``) after one untimed
round each; a mode's figure is its best round:

* ``sequential``: per client, load the global model, ``start_round``, K x (forward, backward,
  ``FedNAR.step``), backend auto — what FL libraries do. On a CPU it runs at every C up to
  ``--seq-max-clients`` (200), interleaved with that C's modes, and each C compares with its own
  (other processes' load moves, and a short round is likelier to find a quiet moment than a long
  one); on a GPU its rate does not depend on C, and it runs at the smallest C only;
* ``batched-vmap``: ``torch.func.vmap`` gradients (``sim.batched.loss.VmapLoss``) + ``BatchedFedNAR``:
  the client-batched step before the layers engine;
* ``batched-plain-torch``: the layers engine's gradients + FedNAR in plain torch on stacked tensors;
* ``batched-fused-default``: the layers engine (``sim.batched.layers_engine``) with its fixed default
  formulations + ``BatchedFedNAR``: what the search is compared against;
* ``batched-fused``: the same with the formulations chosen by measurement on this device
  (``sim.batched.choose``, ``--formulations``): the simulator's ``--client-batched`` step;
* ``batched-fused-replay`` (CUDA): that step replayed from a CUDA graph (``--replay``);
* ``batched-fused-chunked``: the C clients in equal chunks through one trainer, the chunk size chosen
  by measurement among those that fit in memory (``--client-batched auto``), or ``--chunk``; not
  run when the chosen size is C itself.

Per model and C the report states each layer's formulation and why (the candidates' step times).
Models are run a size at a time: every model's smallest C first, the largest last, so that a run cut
at a deadline still has a row for every model.

Per row: model FLOPs per client-step (forward + backward, counted with ``torch.utils.flop_counter``
on one client's step, the LSTM written out in matmuls), the achieved model FLOP/s and its fraction
of the device's FLOP/s (``peak.py``: the faster of a dense matmul and a dense convolution of the
same dtype, timed at the start and the end of the same run: the larger figure is used), and peak
memory per client (CUDA: ``max_memory_allocated`` over the untimed round, less what was allocated
before the mode was built, over C; CPU: the same from malloc's in-use bytes, read after every
operator; sequential: the whole, as it holds one client at a time).

``--precision`` (fp32, tf32, bf16; ``fedopt_kernels.sim.batched.precision``) is what every mode's
forward and backward passes compute in, and what the device's FLOP/s are measured in; parameters,
gradients and every update stay float32.

Parts, per step at each C (medians, the parts timed interleaved: ``timing.time_interleaved``): the
gradients alone (layers engine, vmap) and the update alone (plain torch vs ``BatchedFedNAR``); with
``--layers``, every client layer's forward + backward under each of its candidate formulations
(``ClientLayer.candidates``, interleaved), at the largest C.

Goals (``bench.clients.goals``): pass / miss, or on a CPU "disturbed" where a round a figure rests on
ran while other processes kept more than 0.25 cores busy (its row is marked ⚠), or n/a.

Results: ``clients-<device>-<date>.{json,md,png}`` in ``--out-dir`` (default ``bench_runs/``,
git-ignored; ``--out-dir bench/results`` for the committed tables), listed in LATEST.md there.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

import torch

from fedopt_kernels.sim.batched.choose import MODES as FORMULATION_MODES
from fedopt_kernels.sim.batched.host_memory import keep_freed_memory
from fedopt_kernels.sim.batched.precision import PRECISIONS

from .. import cli
from ..machine import loadavg, run_meta
from ..report import publish
from ..timing import Budget, Stopwatch
from .goals import judge
from .report import chart, markdown, render, stem
from .run import run
from .settings import CHUNKED, CPU_STEPS, HP, MODES, SETTINGS
from .workload import fused_backend, sequential_backend

PART_BUDGET = Budget(warmup=2, min_reps=5, max_reps=200, min_time_s=0.5)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = cli.parser("clients", __doc__)
    cli.add_device(ap)
    ap.add_argument("--model", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), dest="models")
    ap.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=None,
        help="values of C, for every model (default: each model's list for the device)",
    )
    ap.add_argument("--steps", type=int, default=None, help="local steps K per client (default: each model's)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: each model's paper setting)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per mode, best taken (default %(default)s)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help=f"{CHUNKED}: for C above this, C clients in equal chunks of at most this many, one "
        f"after another (--client-batched N; CUDA: replayed from one CUDA graph) (default: the size the engine chooses "
        f"by measurement among those that fit in memory, as --client-batched auto)",
    )
    ap.add_argument(
        "--formulations",
        choices=FORMULATION_MODES,
        default="measure",
        help="how each layer's formulation is chosen for the batched modes but batched-fused-default: "
        "measure: timed on this device now; auto: earlier choices of this process or the cache file "
        "first; default: the fixed defaults (default %(default)s)",
    )
    ap.add_argument(
        "--search-budget",
        type=float,
        default=None,
        help="seconds the formulation search may spend per model and C (default: no limit)",
    )
    ap.add_argument(
        "--seq-clients",
        type=int,
        default=None,
        help="run the sequential mode at this C only (default: on a CPU every C up to --seq-max-clients, so each C "
        "compares with a sequential round timed in the same interleaving; on a GPU the smallest C: its rate does "
        "not depend on C)",
    )
    ap.add_argument("--seq-max-clients", type=int, default=200, help="see --seq-clients (default %(default)s)")
    ap.add_argument(
        "--layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time every client layer alone under each formulation at the largest C (default on; "
        "the search's step times, in context, are reported either way)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    ap.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="what forward and backward passes compute in, and the device FLOP/s are measured in: fp32 (torch's "
        "defaults), tf32 (CUDA matmuls and convolutions in TF32; a CPU computes fp32), bf16 (autocast; parameters, "
        "gradients and updates float32) (default %(default)s)",
    )
    ap.add_argument("--smoke", action="store_true", help="small-cnn and char-lstm, C in {2, 4}, K=2, one round")
    cli.add_output(
        ap,
        render="only redraw that result's .md and .png",
        out_help="where the result files and LATEST.md go (default: bench_runs/, git-ignored)",
    )
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.chunk is not None and args.chunk < 1:
        ap.error("--chunk must be >= 1")
    if args.search_budget is not None and not args.search_budget > 0:
        ap.error("--search-budget must be > 0")
    if args.clients is not None and any(c < 1 for c in args.clients):
        ap.error("--clients values must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    args.part_budget = PART_BUDGET
    args.layer_budget = Budget(warmup=1, min_reps=3, max_reps=20, min_time_s=0.1)
    if args.smoke:
        if args.models == list(SETTINGS):
            args.models = ["small-cnn", "char-lstm"]
        args.clients, args.rounds = [2, 4], 1
        args.steps = args.steps or 2
        args.part_budget = Budget(warmup=1, min_reps=2, max_reps=2, min_time_s=0.0)
        args.search_budget = args.search_budget or 0.5
        args.layer_budget = Budget(warmup=1, min_reps=1, max_reps=1, min_time_s=0.0)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    args = parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    device = cli.device_of(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        keep_freed_memory()  # as the simulator's client-batched path does (sim/batched/host_memory.py)
    kind = "cuda" if device.type == "cuda" else "cpu"
    args.clients_of = {n: args.clients or SETTINGS[n].clients[kind] for n in args.models}
    args.steps_of = {
        n: args.steps or (CPU_STEPS.get(n, SETTINGS[n].steps) if kind == "cpu" else SETTINGS[n].steps)
        for n in args.models
    }
    args.batch_of = {n: args.batch or SETTINGS[n].batch for n in args.models}
    meta = run_meta(device, cli.command_line("clients", argv))
    meta.update(
        mode="clients",
        dtype="float32",
        precision=args.precision,
        smoke=args.smoke,
        models=args.models,
        clients=args.clients_of,
        rounds=args.rounds,
        fused_backend=fused_backend(device),
        formulations=args.formulations,
        sequential_backend=sequential_backend(device),
        hp=HP,
    )
    cli.log(f"bench clients: {meta['device_name']}, models {args.models}")
    meta["loadavg_before"] = loadavg()
    wall = Stopwatch()
    result: Dict[str, Any] = {"meta": meta, "rows": [], "models": {}, "peak": []}
    run(args, device, result, cli.log)
    meta["wall_s"] = wall.seconds()
    meta["loadavg_after"] = loadavg()
    result["goals"] = judge(result)
    publish(result, cli.out_dir(args), stem(result), markdown, chart, name="bench clients")
    return 0
