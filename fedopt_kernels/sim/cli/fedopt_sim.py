"""``fedopt-sim``: run an FL simulation (or ``--validate`` a backend against the reference) from the shell.

Examples::

    fedopt-sim --algorithm feddecay --beta 0.5 --rounds 50 --seeds 0 1 2
    fedopt-sim --algorithm scaffold --partition shards --clients 20 --out sim_runs/scaffold
    fedopt-sim --algorithm fedsam --sam-rho 0.1 --momentum 0.9 --rounds 20
    fedopt-sim --algorithm fednar --rounds 5 --validate cpu
    fedopt-sim --algorithm fednar --server-optimizer adam --server-lr 0.01 --rounds 50
    fedopt-sim --algorithm fednar-scaffold --clients 20 --rounds 5 --validate auto
    fedopt-sim --algorithm fednar --clients 100 --sample-rate 0.5 --client-batched auto
    fedopt-sim --algorithm scaffold --rounds 5 --client-batched 10 --validate sequential
    fedopt-sim --dataset cifar10 --data-dir ~/data --model resnet18-gn --augment --alpha 0.3 --clients 100
    fedopt-sim --dataset femnist --data-dir leaf/data/femnist/data --writer-fraction 0.1 --model fedavg-cnn

Exit status: 0 on success, 1 when ``--validate`` finds a divergence past its tolerance, 2 on bad
input (the message names the option), 3 when an optional dependency is missing (the message
names the pip extra that installs it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...fl.config import algorithm_settings
from ...fl.server_rules import RULES
from ..config import (
    DATASETS,
    DEVICES,
    FOLDER_DATASETS,
    FORMULATION_MODES,
    PARTITIONS,
    PRECISIONS,
    VARIANTS,
    SimConfig,
    default_dataset,
)
from ..models.build import MODELS
from ..validate import ACC_TOL, PARAM_RTOL
from . import ranks_cli
from .help_format import DefaultsHelpFormatter
from .privacy_options import add_privacy_options, epsilon_text, privacy_settings, say_noise
from .progress import advance, progress_bar
from .renamed import RenamedFlag, RenamedStore
from .run_folder import (
    check_checkpoint_flags,
    checkpoint_folders,
    choose_out_dir,
    clear_earlier_run,
    client_state_folders,
    refuse_earlier_checkpoints,
)
from .work_options import add_work_options, local_steps, steps_text

SEQUENTIAL = "sequential"  # --validate sequential: the client-batched run against the sequential one
# on the default run one checkpoint costs 12-15% of a round (four fsyncs dominate a 37 KiB state), so
# every 5th round keeps the cost per round near 2.4-2.9% (docs/checkpoints.md gives the measurement)
CHECKPOINT_EVERY = 5


def _folder_datasets() -> str:
    """The data sets read from --data-dir, for --help: "a, b and c"."""
    return ", ".join(FOLDER_DATASETS[:-1]) + " and " + FOLDER_DATASETS[-1]


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="fedopt-sim",
        formatter_class=DefaultsHelpFormatter,
        description=f"Federated learning simulator on the fedopt_kernels optimizers (offline data: "
        f"scikit-learn digits, FedProx Synthetic(alpha, beta); {_folder_datasets()} from --data-dir).",
    )
    g = p.add_argument_group("algorithm")
    g.add_argument(
        "--algorithm",
        default=d.algorithm,
        type=str.lower,  # the class names' spelling (FedNAR, SCAFFOLD) is taken too
        metavar="NAME",
        help=f"the FL algorithm, one of: {', '.join(VARIANTS)}, in any case (default %(default)s)",
    )
    for f in algorithm_settings(SimConfig):  # the algorithms' own settings, declared with their fields
        kind = f.metadata["type"]
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:  # a switch: given is True
            g.add_argument(flag, action="store_true", default=f.default, help=f.metadata["cli"])
            continue
        g.add_argument(
            flag,
            type=kind,
            default=f.default,
            help=f.metadata["cli"],
            **({"choices": f.metadata["choices"]} if f.metadata["choices"] else {}),
        )
    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        choices=DATASETS,
        help=f"default {d.dataset} (scikit-learn's digits; synthetic, FedProx's Synthetic(1, 1), where "
        f"scikit-learn is not installed)",
    )
    g.add_argument(
        "--partition",
        choices=PARTITIONS,
        help="default: dirichlet (digits, cifar10, cifar100, mnist, fmnist), natural (synthetic, femnist: "
        "one client per writer; shakespeare: one per (play, role)); classes: one class per client",
    )
    g.add_argument("--data-dir", help=f"folder with the {_folder_datasets()} files (layout: docs/data.md)")
    g.add_argument(
        "--download",
        action="store_true",
        help="cifar10/cifar100: download into --data-dir if missing (needs torchvision: the [data] extra)",
    )
    g.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=d.normalize,
        help="cifar/femnist: per-channel (x - mean) / std (default on)",
    )
    g.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=d.augment,
        help="cifar: random crop (padding 4) + horizontal flip of training batches (default off)",
    )
    g.add_argument(
        "--writer-fraction", type=float, help="femnist: use this fraction of the writers found (instead of --clients)"
    )
    g.add_argument(
        "--dirichlet-alpha",
        "--alpha",
        type=float,
        default=d.dirichlet_alpha,
        help="Dirichlet label-skew concentration, > 0 (default %(default)s)",
    )
    g.add_argument("--shards-per-client", type=int, default=d.shards_per_client)
    g.add_argument("--synthetic-alpha", type=float, default=d.synthetic_alpha)
    g.add_argument("--synthetic-beta", type=float, default=d.synthetic_beta)
    g.add_argument(
        "--clients",
        type=int,
        help=f"all users, new users included (default {d.clients}; femnist: writers drawn at random)",
    )
    g.add_argument(
        "--holdout-fraction",
        type=float,
        default=d.holdout_fraction,
        help="fraction of users held out as new users (default %(default)s)",
    )
    g.add_argument("--split", type=float, nargs=3, default=list(d.split), metavar=("TRAIN", "VAL", "TEST"))
    g = p.add_argument_group("training")
    g.add_argument(
        "--model", choices=MODELS, help="default: mlp for synthetic, char-gru for shakespeare, cnn for the images"
    )
    g.add_argument(
        "--hidden",
        type=int,
        help="mlp/mlp1 hidden width (default 64/25); char-* models: state size "
        "(default 256 char-lstm, 128 char-gru, 64 char-transformer)",
    )
    g.add_argument("--context", type=int, help="char-transformer: read only the last N characters of each window")
    g.add_argument("--rounds", type=int, default=d.rounds)
    add_work_options(g, d)
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument(
        "--sample-rate",
        type=float,
        default=d.sample_rate,
        help="fraction of training clients sampled per round (default %(default)s)",
    )
    g.add_argument(
        "--clients-per-round", type=int, help="number of clients sampled per round (overrides --sample-rate)"
    )
    g.add_argument("--finetune-steps", type=int, default=d.finetune_steps)
    g.add_argument("--finetune-lr", type=float, default=d.finetune_lr)
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g = p.add_argument_group("execution")
    g.add_argument("--backend", default=d.backend, help="auto, reference, triton, cuda or cpu (default %(default)s)")
    g.add_argument("--device", default=d.device, choices=DEVICES)
    g.add_argument(
        "--precision",
        default=d.precision,
        choices=PRECISIONS,
        help="what forward and backward passes compute in (training, fine-tuning, evaluation): fp32, "
        "IEEE float32 in every kernel (cuDNN's TF32 off, as cuBLAS's); tf32, CUDA "
        "matmuls and convolutions in TF32 (a CPU has no TF32: there it is fp32); bf16, autocast to "
        "bfloat16 (parameters, gradients, optimizer state and step stay float32; --validate compares "
        "at fp32, docs/simulator.md) (default %(default)s)",
    )
    g.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0], help="one run per seed (default 0)")
    g.add_argument(
        "--client-batched",
        "--client-parallel",  # its earlier name, deprecated
        action=RenamedStore,
        default="1",
        metavar="N|auto",
        help="train N sampled clients of a round at once, as one client-batched step "
        "(the layers engine or torch.func.vmap + fedopt_kernels.batched, the ops' _batched forms) with the "
        "same seeds and batches as one after another: it agrees with the sequential run to rounding, ~1e-16 "
        "relative in float64, and in float32 within --validate sequential's 1 pp accuracy check (not "
        "bitwise); auto: as many as fit in memory; default 1: one after another "
        "(docs/client_batched.md; --client-parallel: its earlier name, deprecated)",
    )
    g.add_argument(
        "--replay",
        "--cuda-graph",  # its earlier name, deprecated
        action=RenamedFlag,
        help="with --client-batched on CUDA: capture the batched local step in a CUDA graph and "
        "replay it (needs a fused backend; --cuda-graph: its earlier name, deprecated)",
    )
    g.add_argument(
        "--formulations",
        choices=FORMULATION_MODES,
        default=d.formulations,
        help="with --client-batched: how each layer's formulation (and, with auto clients, how many at "
        "once) is chosen: auto: measured on this device at the first round, within 2%% of the run's "
        "estimated training time, reusing earlier choices; measure: measured anew, no time limit; "
        "default: the fixed defaults, no measurement (default %(default)s; docs/client_batched.md)",
    )
    g.add_argument(
        "--formulation-cache",
        metavar="FILE",
        default=os.environ.get("FEDOPT_FORMULATION_CACHE"),
        help="a JSON file keeping measured formulation choices across runs (default: $FEDOPT_FORMULATION_CACHE, "
        "else none: this process only)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default 1, also with --client-batched: more pay only on cores no "
        'other process uses, for large client-batched rounds; docs/benchmarks.md, "Client-batched training on a CPU")',
    )
    g.add_argument(
        "--out",
        help="directory for metrics JSON/CSV and curves.png (default sim_runs/<algorithm>-<dataset>, "
        "or the first free <that>-2, -3, ... when an earlier run's files are there)",
    )
    g.add_argument(
        "--overwrite", action="store_true", help="let --out replace an earlier run's files there (refused without it)"
    )
    g.add_argument("--no-files", action="store_true", help="write no files")
    g.add_argument(
        "--quiet", action="store_true", help="no progress bar; --validate: a passing run prints its PASS line alone"
    )
    g = p.add_argument_group("checkpoints (docs/checkpoints.md)")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=CHECKPOINT_EVERY,
        metavar="N",
        help="checkpoint each seed's run after every N completed rounds and after the last one, "
        "into --checkpoint-dir; 0: no checkpoints (default %(default)s)",
    )
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="folder of the checkpoints, one subfolder seed<k> per seed (default: <out>/checkpoints; "
        "none with --no-files)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run whose checkpoints are in --checkpoint-dir (default: <out>/checkpoints; "
        "without --out: sim_runs/<algorithm>-<dataset>), each seed from its last checkpoint "
        "(a seed without one starts at round 1); the settings must be the checkpoint's",
    )
    g.add_argument(
        "--client-state-dir",
        metavar="DIR",
        help="keep what clients keep between rounds (SCAFFOLD's and PAdaMFed's controls, FedDyn's g_i) "
        "in files under DIR/seed<k> instead of host memory: a run's memory then does not grow with its "
        'population (default: host memory; docs/simulator.md, "Memory")',
    )
    add_privacy_options(p)
    g = p.add_argument_group("validation")
    g.add_argument(
        "--validate",
        metavar="BACKEND",
        help="run on reference and on BACKEND (or 'auto': the one backend=auto picks here) "
        "with identical seeds and batches; compare. 'sequential' (with --client-batched): "
        "compare the client-batched run with the same run one client after another",
    )
    g.add_argument(
        "--param-rtol",
        type=float,
        default=PARAM_RTOL,
        help="max relative parameter divergence per round (default %(default)s)",
    )
    g.add_argument(
        "--acc-tol",
        type=float,
        default=ACC_TOL,
        help="max final accuracy difference, as a fraction (default %(default)s)",
    )
    return p


def config_from_args(args: argparse.Namespace, seed: int) -> SimConfig:
    return SimConfig(
        algorithm=args.algorithm,
        dataset=args.dataset or default_dataset(),
        partition=args.partition,
        dirichlet_alpha=args.dirichlet_alpha,
        shards_per_client=args.shards_per_client,
        synthetic_alpha=args.synthetic_alpha,
        synthetic_beta=args.synthetic_beta,
        clients=SimConfig.clients if args.clients is None else args.clients,
        holdout_fraction=args.holdout_fraction,
        split=tuple(args.split),
        model=args.model or "",
        hidden=args.hidden,
        context=args.context,
        rounds=args.rounds,
        data_dir=args.data_dir,
        download=args.download,
        normalize=args.normalize,
        augment=args.augment,
        local_steps=local_steps(args),
        local_epochs=args.local_epochs,
        local_steps_range=None if args.local_steps_range is None else tuple(args.local_steps_range),
        stragglers=args.stragglers,
        batch_size=args.batch_size,
        sample_rate=args.sample_rate,
        clients_per_round=args.clients_per_round,
        finetune_steps=args.finetune_steps,
        finetune_lr=args.finetune_lr,
        backend=args.backend,
        device=args.device,
        seed=seed,
        eval_every=args.eval_every,
        client_batched=parse_client_batched(args.client_batched),
        replay=args.replay,
        formulations=args.formulations,
        formulation_cache=args.formulation_cache,
        precision=args.precision,
        **{f.name: getattr(args, f.name) for f in algorithm_settings(SimConfig)},
        **privacy_settings(args),
    ).validate()


def parse_client_batched(text: str) -> Any:
    """``--client-batched``: "auto" or an integer >= 1 (ValueError naming it otherwise)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"client_batched (--client-batched) must be an integer >= 1 or 'auto', got {text!r}")
    return value


# settings whose option has another name than the field (one run per --seeds value)
_FLAG_OF_FIELD = {"seed": "--seeds"}


def name_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """A settings error (which names the field, as the Python API does) in the terms of the command
    line: ``rounds must be ...`` -> ``--rounds must be ...``, ``dataset='cifar10'`` -> ``--dataset
    'cifar10'``, ``clients (--clients)`` -> ``--clients``. Only a field as the message's subject or
    as ``field=value`` is renamed: words such as "clients" stay words elsewhere, and text between
    backticks (a command or Python to run, ``CIFAR10('DIR', download=True)``) stays as it is."""
    flags = {
        a.dest: next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
        for a in parser._actions
        if a.option_strings and a.dest != "help"
    }
    flags.update(_FLAG_OF_FIELD)
    # even pieces are prose, odd ones the code between a pair of backticks
    pieces = re.split(r"(`[^`]*`)", message)
    for i in range(0, len(pieces), 2):
        text = pieces[i]
        for field, flag in flags.items():
            name = rf"(?<![\w-]){re.escape(field)}(?![\w-])"
            text = re.sub(rf"{name} \(({re.escape(flag)}[^)]*)\)", r"\1", text)  # already named: once
            text = re.sub(rf"{name}=", flag + " ", text)
            if i == 0:
                text = re.sub(rf"^{name}(?= )", flag, text)
        pieces[i] = text
    return "".join(pieces)


def resolve_writer_fraction(args: argparse.Namespace) -> None:
    """``--writer-fraction F``: set ``args.clients`` to round(F x the writers in --data-dir), at least 1."""
    f = args.writer_fraction
    if f is None:
        return
    if args.dataset != "femnist":
        raise ValueError(f"writer_fraction only applies to dataset='femnist', not {args.dataset!r}")
    if not (0.0 < f <= 1.0):
        raise ValueError(f"writer_fraction must be in (0, 1], got {f}")
    if args.clients is not None:
        raise ValueError("give clients (--clients) or writer_fraction (--writer-fraction), not both")
    from ..data.femnist import count_writers

    args.clients = max(1, int(round(f * count_writers(args.data_dir))))


def _prepare_environment(args: argparse.Namespace) -> None:
    import torch

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"threads must be >= 1, got {args.threads}")
    # One thread unless --threads asks for more, on both paths and in evaluation: torch's threads
    # wait for each other at every operator, so another process taking a core made 2-thread
    # client-batched runs several times slower than sequential ones (docs/benchmarks.md,
    # "Client-batched training on a CPU")
    torch.set_num_threads(1 if args.threads is None else args.threads)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    for name in ("backend", "validate"):
        if getattr(args, name) == "triton" and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            # on CPU tensors Triton runs only in its interpreter: correct, but many times slower than cpu
            raise ValueError(
                f"{name}='triton' on the CPU would run Triton's interpreter, many times slower than "
                f"the cpu backend; use --{name} cpu (or auto), or set TRITON_INTERPRET=1 to run "
                f"the interpreter on purpose"
            )


def _run(args: argparse.Namespace, configs: List[SimConfig]) -> int:
    from ..report import format_final_table, plot_curves, write_csv, write_json
    from ..simulation import Simulation

    out_dir = args.out_dir
    results: List[Dict[str, Any]] = []
    folders = dict(zip(args.seeds, args.checkpoint_folders, strict=True))
    stores = dict(zip(args.seeds, args.client_state_folders, strict=True))
    if not args.quiet and not args.resume and args.checkpoint_folders[0] is not None:
        again = f"--out {out_dir} --resume" if args.checkpoint_dir is None else "--resume"
        print(
            f"checkpoints: {args.checkpoint_folders[0].parent} (if the run is stopped, the same command with "
            f"{again} continues it)",
            file=sys.stderr,
        )
    for cfg in configs:
        if args.overwrite and stores[cfg.seed] is not None and args.ranks.main:
            from ..client_state_files import clear

            clear(stores[cfg.seed])  # --overwrite: this run's seed replaces the earlier run's store
        args.ranks.barrier()
        sim = Simulation(
            cfg,
            checkpoint_dir=folders[cfg.seed],
            checkpoint_every=max(args.checkpoint_every, 1),
            client_state_dir=stores[cfg.seed],
            ranks=args.ranks,
        )
        if args.resume:
            _resume_seed(sim, args.quiet)
        if args.ranks.main:
            _say_batched(sim)
        bar = progress_bar(cfg.rounds, f"{cfg.algorithm} seed {cfg.seed} [{sim.backend}]", args.quiet)
        bar.update(len(sim.history))

        result = sim.run(progress=ranks_cli.kill_hook(args.ranks, advance(bar, show_metrics=True)))
        bar.close()
        results.append(result)
        if out_dir is not None:
            if len(results) == 1 and args.overwrite:
                clear_earlier_run(out_dir)  # just before the first file of this run
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json(out_dir / f"metrics_seed{cfg.seed}.json", result)
            write_csv(out_dir / f"metrics_seed{cfg.seed}.csv", result["history"])
        # kept under --quiet, which hides only the progress bar: the time is part of the result
        at_once = f", {sim.batched.size} clients at once" if sim.batched is not None else ""
        ran = cfg.rounds - result["resumed_from_round"]  # this process's rounds, not the checkpoint's
        which = f" ({result['resumed_from_round'] + 1}-{cfg.rounds}, resumed)" if result["resumed_from_round"] else ""
        world = result["ranks"]["world_size"]
        ranks = f", {world} processes" if world > 1 else ""
        done = f"{ran} round{'s' * (ran != 1)}{which} in {result['train_seconds']:.1f} s"
        if ran == 0:  # resumed from the last round's checkpoint: only the final evaluation ran again
            done = f"no round left to run (its checkpoint holds all {cfg.rounds}): the final evaluation only"
        if args.ranks.main:
            print(
                f"seed {cfg.seed}: {done} (backend {result['backend']}, device {result['device']}{at_once}{ranks})"
                + epsilon_text(result["privacy"]),
                file=sys.stderr,
            )
    plotted = out_dir is not None and plot_curves(
        out_dir / "curves.png",
        {f"seed {r['config']['seed']}": r["history"] for r in results},
        title=f"{args.algorithm} on {args.dataset}",
    )
    hp = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in results[0]["hparams"].items())
    print(
        f"{args.algorithm} on {args.dataset} ({configs[0].resolved_partition}), {configs[0].clients} clients, "
        f"{configs[0].sampled_per_round} per round, {configs[0].rounds} rounds x {steps_text(configs[0])}, "
        f"precision {configs[0].precision}; {hp}"
    )
    print(format_final_table(results))
    if out_dir is not None:
        print(f"files: {out_dir}/metrics_seed*.json, metrics_seed*.csv" + (", curves.png" if plotted else ""))
        if not plotted:
            from ...core.extras import hint

            print(f"note: curves.png not drawn: matplotlib is not installed ({hint('matplotlib')})")
    return 0


def _say_batched(sim: Any) -> None:
    """Say how many clients a client-batched run trains at once when that is not plainly N (fewer are
    sampled per round, equal chunks, or ``auto``), and what choosing its formulations took."""
    n, batched = sim.cfg.client_batched, sim.batched
    if batched is None:
        return
    size = batched.size  # chosen now, by measurement, unless a checkpoint gave it back
    S = sim.cfg.sampled_per_round
    chunks = -(-S // size)
    how = f"all {S} sampled clients" if chunks == 1 else f"the {S} sampled clients in {chunks} equal chunks"
    chooser = batched.chooser
    # the search's time, where a user would notice it (a second or more)
    took = chooser.spent_s if chooser is not None else 0.0
    spent = f"; choosing formulations took {took:.1f} s" if took >= 1.0 else ""
    if n != "auto" and size == n and not spent:
        return
    print(
        f"seed {sim.cfg.seed}: --client-batched {n} trains {size} clients at once ({how} of a round){spent}",
        file=sys.stderr,
    )


def _resume_seed(sim: Any, quiet: bool) -> None:
    """``--resume``: continue ``sim`` from its checkpoint, if it has one (CheckpointError otherwise)."""
    seed, folder = sim.cfg.seed, sim.checkpoint.folder
    if sim.load_checkpoint():
        if not quiet:
            print(
                f"seed {seed}: resumed after round {sim.resumed_from} of {sim.cfg.rounds} from {folder}",
                file=sys.stderr,
            )
    elif sim.ranks.main:  # also under --quiet: a mistyped --out must not start a new run unnoticed
        print(f"seed {seed}: --resume found no checkpoint in {folder}: starting at round 1", file=sys.stderr)


def _validate(args: argparse.Namespace, configs: List[SimConfig]) -> int:
    from ..validate import validate_backend, validate_client_batched

    status = 0
    if args.validate == "reference":
        print("note: no fused backend is available for this device; comparing reference with itself")
    for cfg in configs:
        bar = progress_bar(cfg.rounds, f"validate {args.validate} seed {cfg.seed}", args.quiet)
        if args.validate == SEQUENTIAL:
            v = validate_client_batched(cfg, args.param_rtol, args.acc_tol, on_round=advance(bar))
        else:
            v = validate_backend(cfg, args.validate, args.param_rtol, args.acc_tol, on_round=advance(bar))
        bar.close()
        # the verdict line names the run, so the main job's --quiet runs in a row stay readable, and says
        # why its client count is not the one --client-batched asked for
        asked, S = cfg.client_batched, cfg.sampled_per_round
        why = ""
        if asked == "auto":
            why = "; --client-batched auto"
        elif cfg.batched and asked > S:
            why = f"; --client-batched {asked}, but a round samples {S} clients"
        report = v.report(name=f"{cfg.algorithm} ({v.reference} vs {v.backend}, seed {cfg.seed}{why})")
        if args.quiet and v.passed:  # the verdict alone (the main job runs seven): a FAIL keeps its tables
            report = report.splitlines()[-1].strip()
        print(f"seed {cfg.seed}: {report}")
        if not v.passed:
            status = 1
    return status


def _folders(args: argparse.Namespace, cfg: SimConfig) -> Tuple[Any, List[Any], List[Any], Optional[str]]:
    """Where the run writes: its result folder, each seed's checkpoint and client-state folders, and a
    temporary folder made for the client state of a run on several processes (``ranks_cli``)."""
    out_dir = (
        None
        if args.no_files or args.validate is not None
        else choose_out_dir(args.out, f"sim_runs/{args.algorithm}-{args.dataset}", args.overwrite or args.resume)
    )
    checkpoints = checkpoint_folders(
        out_dir, args.checkpoint_dir, 0 if args.validate is not None else args.checkpoint_every, args.seeds
    )
    refuse_earlier_checkpoints(checkpoints, args.resume, args.overwrite)
    stores = client_state_folders(args.client_state_dir, args.seeds, args.resume, args.overwrite, args.validate)
    stores, temporary = ranks_cli.shared_stores(args.ranks, RULES[cfg.server_rule].keeps, stores, checkpoints)
    return out_dir, checkpoints, stores, temporary


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for name in ("param_rtol", "acc_tol"):
            v = getattr(args, name)
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if len(set(args.seeds)) != len(args.seeds):
            raise ValueError(f"seeds must be distinct, got {args.seeds}")
        if args.dataset is None:
            args.dataset = default_dataset()
            if args.dataset != SimConfig.dataset:  # scikit-learn's digits are not there: say what runs instead
                from ...core.extras import hint

                print(
                    f"fedopt-sim: dataset {args.dataset} (the default, digits, needs scikit-learn: {hint('sklearn')})",
                    file=sys.stderr,
                )
        resolve_writer_fraction(args)
        configs = [config_from_args(args, s) for s in args.seeds]
        say_noise(configs[0])  # --dp-target-epsilon: calibrated (or refused) before anything starts
        _prepare_environment(args)
        check_checkpoint_flags(
            args.resume, args.overwrite, args.checkpoint_every, args.checkpoint_dir, args.no_files, args.validate
        )
        args.ranks = ranks_cli.join(args)  # one process, or torchrun's
        if args.resume and args.out is None:  # the folder a first run without --out writes to
            args.out = f"sim_runs/{args.algorithm}-{args.dataset}"
        args.out_dir, args.checkpoint_folders, args.client_state_folders, args.temporary = ranks_cli.agree(
            args.ranks, lambda: _folders(args, configs[0])
        )
        if not args.ranks.main:
            args.out_dir = None  # rank 0 writes the run's files
        from ..simulation import resolve_backend, resolve_device

        device = resolve_device(configs[0].device)
        resolve_backend(configs[0], device)
        from ..federated_data import check_data

        check_data(configs[0])  # a missing or damaged data file: exit 2 with its message
        if args.validate == SEQUENTIAL:
            if not configs[0].batched:
                raise ValueError(
                    "validate='sequential' compares a client-batched run with the sequential one: "
                    "give --client-batched N (N >= 2) or auto"
                )
            resolve_backend(configs[0].replace(client_batched=1, replay=False), device)
        elif args.validate is not None:
            # "auto": whatever backend=auto would pick here (cuda > triton on GPU, cpu > reference on CPU)
            try:
                args.validate = resolve_backend(configs[0].replace(backend=args.validate), device)
            except ValueError as exc:  # the backend --validate names, not --backend; and its other choice
                raise ValueError(
                    str(exc)
                    .replace(f"backend={args.validate!r}", f"validate={args.validate!r}", 1)
                    .replace(
                        "choose one of (",
                        f"choose {SEQUENTIAL!r} (a client-batched run against the sequential one) or one of (",
                        1,
                    )
                ) from exc
    except ValueError as exc:  # bad input: name the option, exit 2 (like argparse)
        parser.exit(2, f"fedopt-sim: error: {name_flags(str(exc), parser)}\n")
    from ...core.extras import MissingExtra
    from ...fl.checkpoint import CheckpointError
    from ..batched.precision import UnsupportedPrecision
    from ..client_state import ClientStateError

    try:
        if args.validate is not None:
            return _validate(args, configs)
        status = _run(args, configs)
        ranks_cli.remove(args.ranks, args.temporary)
        args.ranks.close()
        return status
    except MissingExtra as exc:
        parser.exit(3, f"fedopt-sim: error: {exc}\n")
    except (CheckpointError, ClientStateError) as exc:  # other settings, a damaged file, a failed write
        parser.exit(2, f"fedopt-sim: error: {exc}\n")
    except UnsupportedPrecision as exc:  # found when the run builds its model (bf16 LSTM on this CPU)
        parser.exit(2, f"fedopt-sim: error: {name_flags(str(exc), parser)}\n")
