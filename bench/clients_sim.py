"""``python -m bench clients-sim``: a real simulator run, one client after another vs client-batched, timed.

The same ``fedopt-sim`` configuration (same seed, clients, batches) is built twice — sequential
(``client_batched=1``) and client-batched (``--client-batched N``) — and the two step together in
one process, round by round (the one that goes first alternates), so that load from other processes
falls on both alike. Per round and run: training seconds, evaluation seconds and model FLOPs (the
validation pass), then each run's final evaluation (the per-user protocol: the global model's one
test pass, the fine-tuning, the fine-tuned models' test passes). The device's FLOP/s (``peak.py``)
is measured at the start and the end.

Default: Fashion-MNIST, the FedAvg CNN (McMahan et al. 2017), 100 clients (no held-out users),
20 per round, 5 local epochs' worth of steps at batch 10, 50 rounds, FedAvg. ``--stand-in`` writes
random images in Fashion-MNIST's format first (a machine without the data: the timings do not
depend on the pixels; the accuracies then mean nothing).

Results: ``clients-sim-<device>-<date>.{json,md}`` in ``--out-dir`` (default ``bench_runs/``); the
JSON is rewritten after every round, so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import gzip
import math
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from fedopt_kernels.sim.cli.renamed import RenamedStore

from . import cli
from .machine import device_meta, loadavg, run_meta, utc_date
from .peak import device_peak
from .report import publish, rerender, write_json
from .timing import Stopwatch, rotated


def write_stand_in(folder: Path, train: int = 60000, test: int = 10000, seed: int = 0) -> Path:
    """Random 28x28 uint8 images and labels as the four gzipped IDX files of (Fashion-)MNIST."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)

    def idx(path: Path, array: np.ndarray) -> None:
        header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        with gzip.open(path, "wb", compresslevel=1) as f:
            f.write(header + array.astype(np.uint8).tobytes())

    for split, n in (("train", train), ("t10k", test)):
        idx(folder / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        idx(folder / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n, dtype=np.uint8))
    return folder


def _config(args: argparse.Namespace, at_once: Any, data_dir: str):
    from fedopt_kernels.sim.config import SimConfig

    chosen = {} if args.algorithm is None else {"algorithm": args.algorithm}  # None: the simulator's default
    return SimConfig(
        **chosen,
        dataset=args.dataset,
        data_dir=data_dir,
        model=args.model,
        clients=args.clients,
        clients_per_round=args.clients_per_round,
        holdout_fraction=args.holdout_fraction,
        local_steps=args.local_steps,
        batch_size=args.batch_size,
        rounds=args.rounds,
        device=args.device,
        eval_every=args.eval_every,
        client_batched=at_once,
        formulations=args.formulations,
        seed=args.seed,
    )


def _peak(device: torch.device, log) -> Dict[str, Any]:
    p = device_peak(device)
    log(f"  device FLOP/s: matmul {p['matmul_flops_per_s'] / 1e9:.1f} G, conv {p['conv_flops_per_s'] / 1e9:.1f} G")
    return p


def run(args: argparse.Namespace, log) -> Dict[str, Any]:
    from fedopt_kernels.sim.simulation import Simulation

    device = torch.device(args.device)
    data_dir = args.data_dir
    tmp: Optional[tempfile.TemporaryDirectory] = None
    if args.stand_in:
        tmp = tempfile.TemporaryDirectory(prefix="fmnist-stand-in-")
        n = args.stand_in_size
        data_dir = str(write_stand_in(Path(tmp.name), train=n, test=max(1, n // 6)))
    try:
        if args.local_steps is None:  # local epochs -> steps, from the clients' mean train size
            probe = Simulation(_config(argparse.Namespace(**{**vars(args), "local_steps": 1}), 1, data_dir))
            mean = float(np.mean([c.size for c in probe.train_clients]))
            args.local_steps = max(1, math.ceil(args.local_epochs * mean / args.batch_size))
            del probe
        runs = {
            "sequential": Simulation(_config(args, 1, data_dir)),
            "client-batched": Simulation(_config(args, args.client_batched, data_dir)),
        }
        bat = runs["client-batched"].batched
        search = Stopwatch()
        if bat is not None:  # the clients at once and the formulations, chosen by measurement: once a run
            bat.size  # noqa: B018
        search_s = search.seconds()
        meta = run_meta(device, cli.command_line("clients-sim", args.argv))
        meta.update(
            mode="clients-sim",
            dtype="float32",
            local_steps=args.local_steps,
            algorithm=runs["sequential"].cfg.algorithm,
            client_batched=None if bat is None else bat.at_once,
            search_s=search_s,
            choice=None if bat is None else bat.choice_state(),
            loadavg_before=loadavg(),
            config={k: v for k, v in vars(args).items() if k not in ("argv", "out_dir")},
            train_clients=len(runs["sequential"].train_clients),
            val_samples=sum(int(c.val_y.shape[0]) for c in runs["sequential"].train_clients),
            test_samples=sum(
                int(c.test_y.shape[0]) for c in runs["sequential"].train_clients + runs["sequential"].data.new_clients
            ),
        )
        result: Dict[str, Any] = {"meta": meta, "peak": [_peak(device, log)], "rounds": [], "final": {}}
        log(
            f"bench clients-sim: {meta['device_name']}, {args.model} on {args.dataset}, {meta['train_clients']} "
            f"clients, {args.clients_per_round} per round, K={args.local_steps}, {args.rounds} rounds, "
            f"client-batched N={meta['client_batched']}"
        )
        for t in range(args.rounds):
            row: Dict[str, Any] = {"round": t + 1}
            for name in rotated(list(runs), t):  # the one that goes first alternates
                sim = runs[name]
                rec = sim.run_round(t)
                last = sim.eval_log[-1] if sim.eval_log and sim.eval_log[-1]["round"] == t + 1 else {}
                ev = last.get("seconds", 0.0)
                row[name] = {
                    "train_s": rec["seconds"] - ev,
                    "eval_s": ev,
                    "eval_flops": rec.get("eval_flops", 0.0),
                    "val_acc": rec.get("val_acc"),
                    "train_loss": rec["train_loss"],
                }
            row["loadavg"] = loadavg()
            result["rounds"].append(row)
            log(
                f"  round {t + 1}: "
                + "; ".join(
                    f"{n} train {row[n]['train_s']:.1f} s eval {row[n]['eval_s']:.2f} s"
                    + ("" if row[n]["val_acc"] is None else f" val acc {row[n]['val_acc']:.4f}")
                    for n in runs
                )
            )
            if args.out_file is not None:  # a run stopped early keeps what it measured
                write_json(result, args.out_file)
        for name in runs:  # the final evaluations, one after the other
            sim = runs[name]
            took = Stopwatch()
            final = sim.final_evaluation()
            result["final"][name] = {
                "seconds": took.seconds(),
                "cost": sim.final_cost.as_dict(),
                "pooled_test_acc": final["pooled_test_acc"],
                "finetuned_existing_mean": final["finetuned"]["existing"]["mean"],
            }
            log(
                f"  final {name}: {result['final'][name]['seconds']:.1f} s, pooled test acc "
                f"{final['pooled_test_acc']:.4f}"
            )
        result["peak"].append(_peak(device, log))
        meta["loadavg_after"] = loadavg()
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def totals(result: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    out = {}
    for name in ("sequential", "client-batched"):
        rows = [r[name] for r in result["rounds"] if name in r]
        fin = result["final"].get(name, {})
        out[name] = {
            "train_s": sum(r["train_s"] for r in rows),
            "eval_s": sum(r["eval_s"] for r in rows),
            "eval_flops": sum(r["eval_flops"] for r in rows),
            "final_s": fin.get("seconds", float("nan")),
            "rounds": len(rows),
        }
        out[name]["total_s"] = out[name]["train_s"] + out[name]["eval_s"] + (fin.get("seconds") or 0.0)
    return out


# names in results saved before client-batched runs had that name (the run's key, the meta's field)
_EARLIER = {"client-parallel": "client-batched", "client_parallel": "client_batched"}


def renamed(result: Dict[str, Any]) -> Dict[str, Any]:
    """``result`` with the names of results saved before the rename replaced by today's."""

    def new(d: Dict[str, Any]) -> Dict[str, Any]:
        return {_EARLIER.get(k, k): v for k, v in d.items()}

    return {
        **result,
        "meta": new(result["meta"]),
        "rounds": [new(r) for r in result["rounds"]],
        "final": new(result["final"]),
    }


def markdown(result: Dict[str, Any]) -> str:
    result = renamed(result)
    meta, tot = result["meta"], totals(result)
    # the higher of the run's two device figures, as in bench clients: load from other processes only
    # ever lowers a measurement of the device, so the higher is the nearer to what it can do
    peak = max(p["peak_flops_per_s"] for p in result["peak"])
    peak_lo = min(p["peak_flops_per_s"] for p in result["peak"])
    cfg = meta["config"]
    seq, bat = tot["sequential"], tot["client-batched"]
    lines = [
        f"# A simulator run, sequential vs client-batched — {meta['device_name']} ({meta['date']})",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: `{meta['commit']}`{' (uncommitted changes)' if meta.get('dirty') else ''}; torch {meta['torch']}; "
        f"threads {meta['threads']}; load average before/after {meta.get('loadavg_before')} / "
        f"{meta.get('loadavg_after')}",
        f"- run: {meta.get('algorithm') or cfg['algorithm']}, {cfg['model']} on {cfg['dataset']}"
        f"{' (stand-in images)' if cfg['stand_in'] else ''}, "
        f"{meta['train_clients']} clients, {cfg['clients_per_round']} per round, K={meta['local_steps']} local steps "
        f"of batch {cfg['batch_size']}, {seq['rounds']} of {cfg['rounds']} rounds, validation every "
        f"{cfg['eval_every']} round(s) ({meta['val_samples']} images), final test {meta['test_samples']} images; "
        f"client-batched N={meta['client_batched']}; the two runs side by side, round by round",
        "- device FLOP/s measured in the run (start, end): "
        + ", ".join(f"{p['peak_flops_per_s'] / 1e9:,.1f} G ({p['peak_from']})" for p in result["peak"]),
        "",
        "| | sequential | client-batched | sequential / client-batched |",
        "|---|---|---|---|",
    ]

    def row(label: str, key: str) -> None:
        a, b = seq[key], bat[key]
        lines.append(f"| {label} | {a:,.1f} s | {b:,.1f} s | {a / b if b else float('nan'):.2f}x |")

    row("training (all rounds)", "train_s")
    row("validation passes (all rounds)", "eval_s")
    row("final evaluation", "final_s")
    row("total", "total_s")
    search = meta.get("search_s")
    if search is not None:
        lines.append(
            f"| formulation search (once, before round 1; `--formulations {cfg.get('formulations', 'auto')}`) | — | "
            f"{search:,.1f} s ({search / bat['train_s'] if bat['train_s'] else float('nan'):.1%} of its training) | |"
        )
    later = [r for r in result["rounds"][1:] if "sequential" in r and "client-batched" in r]
    if later:  # the first round pays the one-time costs (allocations, kernel selection, the trainer)
        a, b = (sum(r[n]["train_s"] for r in later) / len(later) for n in ("sequential", "client-batched"))
        lines.append(
            f"| training per round, rounds 2-{len(later) + 1} (mean) | {a:,.2f} s | {b:,.2f} s | "
            f"{a / b if b else float('nan'):.2f}x |"
        )
    lines.append("")
    lines += ["| evaluation | sequential | client-batched |", "|---|---|---|"]
    for name, label in (("eval_flops", "validation FLOPs per round"),):
        lines.append(
            f"| {label} | {seq[name] / max(seq['rounds'], 1) / 1e9:,.1f} G | "
            f"{bat[name] / max(bat['rounds'], 1) / 1e9:,.1f} G |"
        )
    rates = [t["eval_flops"] / t["eval_s"] if t["eval_s"] else float("nan") for t in (seq, bat)]
    lines.append(
        f"| validation FLOP/s | {rates[0] / 1e9:,.1f} G ({rates[0] / peak:.0%}) | "
        f"{rates[1] / 1e9:,.1f} G ({rates[1] / peak:.0%}) |"
    )
    fin = [result["final"].get(n, {}).get("cost", {}) for n in ("sequential", "client-batched")]
    if all(fin):
        lines.append(f"| final evaluation FLOPs | {fin[0]['flops'] / 1e9:,.1f} G | {fin[1]['flops'] / 1e9:,.1f} G |")
        lines.append(
            f"| final evaluation FLOP/s | {fin[0]['flops_per_s'] / 1e9:,.1f} G ({fin[0]['flops_per_s'] / peak:.0%}) | "
            f"{fin[1]['flops_per_s'] / 1e9:,.1f} G ({fin[1]['flops_per_s'] / peak:.0%}) |"
        )
        accs = [result["final"][n]["pooled_test_acc"] for n in ("sequential", "client-batched")]
        lines.append(f"| pooled test accuracy | {accs[0]:.4f} | {accs[1]:.4f} |")
    choice = meta.get("choice") or {}
    if choice.get("formulations"):
        lines += ["", "| layer | formulation (client-batched) | why |", "|---|---|---|"]
        lines += [f"| {p} | {f} | {choice.get('why', {}).get(p, '')} |" for p, f in choice["formulations"].items()]
    lines += [
        "",
        f"FLOP/s percentages are of the higher device figure ({peak / 1e9:,.1f} G; the lower was "
        f"{peak_lo / 1e9:,.1f} G). Every validation and test image goes through each model once per "
        f"pass (evaluate.split_scores).",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = cli.parser("clients-sim", __doc__)
    ap.add_argument("--algorithm", default=None, help="the simulator's algorithm (default: its default, FedAvg)")
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--stand-in", action="store_true", help="random images in Fashion-MNIST's format (no data here)")
    ap.add_argument("--stand-in-size", type=int, default=60000, help="--stand-in's training images (default 60000)")
    ap.add_argument("--model", default="fedavg-cnn")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--holdout-fraction", type=float, default=0.0)
    ap.add_argument("--clients-per-round", type=int, default=20)
    ap.add_argument("--local-epochs", type=float, default=5.0, help="local steps = ceil(E x mean train size / batch)")
    ap.add_argument("--local-steps", type=int, default=None, help="instead of --local-epochs")
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    cli.add_device(ap)
    ap.add_argument(
        "--client-batched",
        "--client-parallel",  # its earlier name, deprecated
        action=RenamedStore,
        default="auto",
        help="N or auto (as fedopt-sim; --client-parallel: its earlier name, deprecated)",
    )
    ap.add_argument(
        "--formulations",
        choices=("auto", "default", "measure"),
        default="auto",
        help="how the client-batched run chooses its formulations (as fedopt-sim; default %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as fedopt-sim)")
    cli.add_output(ap, render="only rewrite that result's .md")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[2:])
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.client_batched != "auto":
        args.client_batched = int(args.client_batched)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        rerender(args.render, markdown)
        return 0
    torch.set_num_threads(args.threads)
    out_dir = cli.out_dir(args)
    stem = f"clients-sim-{device_meta(torch.device(args.device))['device_slug']}-{utc_date()}"
    args.out_file = None if out_dir is None else out_dir / f"{stem}.json"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    publish(run(args, cli.log), out_dir, stem, markdown, latest=False)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
