"""``python -m bench scale``: a run's peak memory against its clients per round and its population.

Each row is one ``fedopt-sim`` run in a process of its own (``bench/scale_run.py``), whose
anonymous resident memory (``RssAnon`` of ``/proc/<pid>/status``: the process's own memory, not
the page cache that a store in files goes through) is sampled every 0.1 s; the peak is reported
with the run's set-up, round and evaluation seconds and, on a GPU, its peak device memory.
Algorithms that keep client state run with it in files (``--client-state-dir``, a temporary folder
under ``--store-dir``), and each group of rows has FedAvg, which keeps none, beside it.

Parts (``--parts``):

* ``clients``: FedProx Synthetic, the MLP at ``--hidden 2048`` (4.3M parameters), N = 1,000, one
  round of 2 local steps, at 25 and 200 clients per round, one client after another and
  ``--client-batched 20``: the peak should not grow with the clients per round.
* ``population``: SCAFFOLD with 5,000 clients (250 a round, 8 rounds) and PAdaMFed with 3,000
  (which computes every client's first control), the MLP at ``--hidden 1024``: their peak against
  FedAvg's same run, while the store holds several GB.
* ``setup``: FedAvg with 20 clients per round, 3 rounds, N = 1,000 and 100,000: set-up seconds,
  a training round's seconds (``training_round``: the rounds between the first and the last), and
  the peak.

* ``ranks`` (not in the default parts): one run under torchrun on ``--world`` processes against the
  same run on one (each at one thread; ``--repeats`` pairs, their order alternating): wall and
  training seconds, each rank's peak, the final metrics. Default run: the 20-round FedAvg CNN on
  Fashion-MNIST (100 clients, 20 a round; Debian's ``dataset-fashion-mnist``), ``--ranks-args``
  to change it.

* ``merge`` (not in the default parts): the extra memory of combining the ranks' sums, per rank, at
  each of ``--merge-worlds`` processes (``bench/scale_merge.py`` under torchrun: sums of
  ``--merge-numbers`` float64 numbers combined by the simulator's chunked merge, by gathering every
  rank's whole sums as the merge did before, and by ``all_reduce``), as a multiple of the sums.

Results: ``scale-<device>-<date>.{json,md,png}`` in ``--out-dir``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import cli
from .machine import loadavg, run_meta, utc_date
from .report import publish, write_json

SYNTHETIC = ["--dataset", "synthetic", "--model", "mlp", "--device", "cpu", "--threads", "1", "--quiet"]
# the ranks part: the 20-round FedAvg CNN run on Fashion-MNIST (Debian's dataset-fashion-mnist package)
RANKS_RUN = [
    "--dataset", "fmnist", "--data-dir", "/usr/share/datasets/fashion-mnist", "--model", "fedavg-cnn",
    "--clients", "100", "--holdout-fraction", "0", "--clients-per-round", "20", "--local-steps", "210",
    "--batch-size", "10", "--rounds", "20", "--threads", "1", "--device", "cpu", "--quiet",
    "--checkpoint-every", "0",
]  # fmt: skip


def rss_anon(pid: int) -> Optional[int]:
    """Bytes of ``pid``'s anonymous resident memory (None where /proc does not say)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(argv: List[str], timeout: float) -> Dict[str, Any]:
    """Run ``bench.scale_run`` with ``argv``, sampling its memory; its figures and the peak."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.scale_run", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, rss_anon(proc.pid) or 0)
        if time.perf_counter() - start > timeout:
            proc.kill()
            break
        time.sleep(0.1)
    out, err = proc.communicate()
    row: Dict[str, Any] = {"argv": argv, "wall_s": time.perf_counter() - start, "peak_rss_anon": peak}
    line = next((s for s in out.splitlines() if s.startswith("SCALE ")), None)
    if proc.returncode != 0 or line is None:
        row["error"] = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return row
    row.update(json.loads(line[len("SCALE ") :]))
    row["train_round_s"] = training_round(row["round_s"])
    return row


def training_round(rounds: List[float]) -> float:
    """A training round's seconds: the median of the rounds between the first (warm-up: the kernels'
    first calls, a rule's initial round) and the last (whose pooled evaluation reads every client)."""
    inner = rounds[1:-1] or rounds[:-1] or rounds
    return statistics.median(inner)


def _descendants(pid: int) -> List[int]:
    """The processes below ``pid`` (torchrun's ranks), from /proc."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def measure_ranks(sim_argv: List[str], world: int, out: Path, timeout: float) -> Dict[str, Any]:
    """``fedopt-sim`` on ``world`` processes (torchrun; one process without it): wall time, the peak
    RssAnon of each rank (the processes that import torch: torchrun's own agent is not counted), and
    the run's final metrics."""
    head = [sys.executable, "-m", "fedopt_kernels.sim.cli"]
    if world > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
        head += ["-m", "fedopt_kernels.sim.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*head, *sim_argv, "--out", str(out), "--overwrite"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    peaks: Dict[int, int] = {}
    while proc.poll() is None:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            peaks[pid] = max(peaks.get(pid, 0), rss_anon(pid) or 0)
        if time.perf_counter() - start > timeout:
            proc.kill()
            break
        time.sleep(0.1)
    _, err = proc.communicate()
    row: Dict[str, Any] = {"world_size": world, "wall_s": time.perf_counter() - start}
    if proc.returncode != 0:
        row["error"] = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return row
    ranks = sorted((p for p in peaks.values() if p > 200 * 2**20), reverse=True)[:world]  # torch importers
    result = json.loads((out / "metrics_seed0.json").read_text())
    row.update(
        peak_rss_anon_per_rank=ranks,
        train_s=result["train_seconds"],
        final=result["final"],
        last_round={k: v for k, v in result["history"][-1].items() if k != "clients"},
        ranks=result["ranks"],
    )
    return row


def measure_merge(world: int, numbers: int, out: Path, timeout: float) -> Dict[str, Any]:
    """``bench/scale_merge.py`` on ``world`` processes: each rank's extra bytes for each way to combine."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += [str(Path(__file__).with_name("scale_merge.py")), str(out), str(numbers)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    row: Dict[str, Any] = {"world_size": world, "sums_bytes": numbers * 8}
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return row
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    row["extra_bytes_per_rank"] = {name: [r["extra_bytes"][name] for r in ranks] for name in ranks[0]["extra_bytes"]}
    return row


def _run(common: List[str], algorithm: str, extra: List[str], store: Path) -> List[str]:
    return [*SYNTHETIC, *common, "--algorithm", algorithm, *extra, "--client-state-dir", str(store)]


def plan(parts: List[str], store: Path, big: int) -> List[Tuple[str, Dict[str, Any], List[str]]]:
    """(part, the row's labels, its fedopt-sim arguments) of every row."""
    rows: List[Tuple[str, Dict[str, Any], List[str]]] = []
    if "clients" in parts:
        common = ["--hidden", "2048", "--clients", "1000", "--rounds", "1", "--local-steps", "2"]
        common += ["--finetune-steps", "0", "--eval-every", "1000", "--no-final"]
        for algo in ("fedavg", "scaffold", "feddyn", "padamfed"):
            for mode in ("1", "20"):
                for per_round in (25, 40, 200) if mode != "1" else (25, 200):
                    labels = {"algorithm": algo, "clients at once": mode, "per round": per_round, "N": 1000}
                    extra = ["--clients-per-round", str(per_round), "--client-batched", mode]
                    extra += ["--formulations", "default"]  # the search's own memory is not the round's
                    rows.append(("clients", labels, _run(common, algo, extra, store)))
    if "population" in parts:
        common = ["--hidden", "1024", "--local-steps", "2", "--finetune-steps", "0", "--eval-every", "1000"]
        common += ["--no-final"]
        for algo, n, per_round, rounds in (
            ("fedavg", 5000, 250, 8),
            ("scaffold", 5000, 250, 8),
            ("fedavg", 3000, 20, 2),
            ("padamfed", 3000, 20, 2),
        ):
            labels = {"algorithm": algo, "clients at once": "1", "per round": per_round, "N": n}
            extra = ["--clients", str(n), "--clients-per-round", str(per_round), "--rounds", str(rounds)]
            rows.append(("population", labels, _run(common, algo, extra, store)))
    if "setup" in parts:
        common = ["--clients-per-round", "20", "--rounds", "3", "--finetune-steps", "0", "--eval-every", "1000"]
        common += ["--no-final"]
        for n in (1000, big):
            labels = {"algorithm": "fedavg", "clients at once": "1", "per round": 20, "N": n}
            rows.append(("setup", labels, _run(common, "fedavg", ["--clients", str(n)], store)))
    return rows


def _gb(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 1e9:.2f}"


def markdown(result: Dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"# Peak memory against clients per round and population ({m['device_name']}, {m['date']})",
        "",
        f"`{m['command']}` at commit `{m['commit']}`, torch {m['torch']}; load average "
        f"{result.get('load_before')} before, {result.get('load_after')} after. Peak: RssAnon of the run's "
        "process, sampled every 0.1 s; keeping algorithms with their client state in files.",
        "",
        "| part | algorithm | N | per round | --client-batched (trained at once) | peak GB | vs FedAvg | set-up s "
        "| round s | store GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lab = r["labels"]
        base = _fedavg_peak(result["rows"], r)
        ratio = f"{r['peak_rss_anon'] / base:.2f}x" if base and lab["algorithm"] != "fedavg" else ""
        if "error" in r:
            lines.append(
                f"| {r['part']} | {lab['algorithm']} | {lab['N']} | {lab['per round']} | "
                f"{lab['clients at once']} | failed: {r['error']} | | | | |"
            )
            continue
        lines.append(
            f"| {r['part']} | {lab['algorithm']} | {lab['N']} | {lab['per round']} | {lab['clients at once']} "
            f"({r.get('trained_at_once', '?')}) | {_gb(r['peak_rss_anon'])} | {ratio} | {r['setup_s']:.1f} | "
            f"{training_round(r['round_s']):.2f} | {_gb(r.get('store_bytes'))} |"
        )
    lines += ["", "Growth with the clients per round (peak at 200 / peak at 25, same algorithm and mode):", ""]
    for key, grown in growth(result["rows"]).items():
        lines.append(f"- {key}: {grown:.2f}x")
    if result.get("ranks"):
        lines += ["", "One run on several processes (torchrun, one thread each), in the order run:", ""]
        lines += [
            "| processes | wall s | training s | wall vs 1 process | peak GB per rank | pooled test acc "
            "| last train loss |",
            "|---|---|---|---|---|---|---|",
        ]
        ones = [r["wall_s"] for r in result["ranks"] if r["world_size"] == 1 and "error" not in r]
        for r in result["ranks"]:
            if "error" in r:
                lines.append(f"| {r['world_size']} | failed: {r['error']} | | | | | |")
                continue
            ratio = f"{r['wall_s'] / statistics.median(ones):.2f}x" if ones else ""
            peaks = ", ".join(_gb(p) for p in r["peak_rss_anon_per_rank"])
            lines.append(
                f"| {r['world_size']} | {r['wall_s']:.1f} | {r['train_s']:.1f} | {ratio} | {peaks} | "
                f"{r['final']['pooled_test_acc']:.4f} | {r['last_round']['train_loss']:.6f} |"
            )
    if result.get("merge"):
        lines += merge_markdown(result["merge"])
    return "\n".join(lines) + "\n"


def merge_markdown(rows: List[Dict[str, Any]]) -> List[str]:
    """The merge part's table: each way's extra memory per rank, as a multiple of the sums."""
    names = next((list(r["extra_bytes_per_rank"]) for r in rows if "error" not in r), [])
    lines = [
        "",
        "Combining the ranks' sums: the extra memory of each rank (peak resident set during it minus the "
        "one before), as a multiple of the sums (float64):",
        "",
        "| processes | sums GB | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['world_size']} | failed: {r['error']} |" + " |" * len(names))
            continue
        cells = [", ".join(f"{b / r['sums_bytes']:.2f}x" for b in r["extra_bytes_per_rank"][name]) for name in names]
        lines.append(f"| {r['world_size']} | {_gb(r['sums_bytes'])} | " + " | ".join(cells) + " |")
    return lines


def _fedavg_peak(rows: List[Dict[str, Any]], row: Dict[str, Any]) -> Optional[float]:
    lab = row["labels"]
    for r in rows:
        other = r["labels"]
        if (
            r["part"] == row["part"]
            and other["algorithm"] == "fedavg"
            and "error" not in r
            and all(other[k] == lab[k] for k in ("N", "per round", "clients at once"))
        ):
            return r["peak_rss_anon"]
    return None


def growth(rows: List[Dict[str, Any]]) -> Dict[str, float]:
    out = {}
    by = {
        (r["labels"]["algorithm"], r["labels"]["clients at once"], r["labels"]["per round"]): r
        for r in rows
        if r["part"] == "clients" and "error" not in r
    }
    for (algo, mode, per_round), r in by.items():
        small = by.get((algo, mode, 25))
        if per_round == 200 and small is not None:
            out[f"{algo}, {'sequential' if mode == '1' else 'client-batched ' + mode}"] = (
                r["peak_rss_anon"] / small["peak_rss_anon"]
            )
    return out


def chart(result: Dict[str, Any], path: Path) -> bool:
    """Peak memory of every row: the clients-per-round part as lines, the others as bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        return False
    lines = [r for r in rows if r["part"] == "clients"]
    bars = [r for r in rows if r["part"] != "clients"]
    fig, axes = plt.subplots(1, 1 + bool(lines and bars), figsize=(11 if lines and bars else 7, 4), squeeze=False)
    ax = axes[0][0]
    if lines:
        for algo, mode in sorted({(r["labels"]["algorithm"], r["labels"]["clients at once"]) for r in lines}):
            pts = sorted(
                (r["labels"]["per round"], r["peak_rss_anon"] / 1e9)
                for r in lines
                if r["labels"]["algorithm"] == algo and r["labels"]["clients at once"] == mode
            )
            ax.plot(*zip(*pts), marker="o", label=f"{algo} ({'seq' if mode == '1' else 'batched ' + mode})")
        ax.set_xlabel("clients per round")
        ax.set_ylabel("peak RssAnon (GB)")
        ax.set_title("N = 1000, 4.3M-parameter MLP", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[0][-1]
    if bars:
        names = [f"{r['labels']['algorithm']}\nN={r['labels']['N']}" for r in bars]
        ax.bar(range(len(bars)), [r["peak_rss_anon"] / 1e9 for r in bars])
        ax.set_xticks(range(len(bars)), names, fontsize=7)
        ax.set_ylabel("peak RssAnon (GB)")
        ax.set_title("population and set-up rows", fontsize=9)
    fig.suptitle("Peak memory of a run (keeping algorithms: client state in files)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    p = cli.parser("scale", __doc__.split("\n\n")[0])
    p.add_argument(
        "--parts",
        nargs="+",
        default=["clients", "population", "setup"],
        choices=["clients", "population", "setup", "ranks", "merge"],
    )
    p.add_argument("--merge-worlds", type=int, nargs="+", default=[2, 4], help="processes of the merge part")
    p.add_argument("--merge-numbers", type=int, default=2**24, help="float64 numbers of the merge part's sums")
    p.add_argument("--world", type=int, default=2, help="processes of the ranks part (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="1-rank / N-rank pairs of the ranks part, order alternating")
    p.add_argument(
        "--ranks-args",
        default=" ".join(RANKS_RUN),
        help="the fedopt-sim arguments of the ranks part (default: %(default)s)",
    )
    p.add_argument("--big", type=int, default=100_000, help="the large population of the setup part")
    p.add_argument("--store-dir", help="where the client-state folders go (default: the system's temporary folder)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a row may take before it is stopped")
    cli.add_output(p)
    args = p.parse_args(argv)
    device = torch.device("cpu")
    result: Dict[str, Any] = {
        "meta": run_meta(device, cli.command_line("scale", argv if argv is not None else sys.argv[1:])),
        "load_before": loadavg(),
        "rows": [],
    }
    out = cli.out_dir(args)
    stem = f"scale-{result['meta']['device_slug']}-{utc_date()}"
    with tempfile.TemporaryDirectory(dir=args.store_dir) as tmp:
        for part, labels, run_argv in plan(args.parts, Path(tmp), args.big):
            row = {"part": part, "labels": labels, **measure(run_argv, args.timeout)}
            result["rows"].append(row)
            print(
                f"{part} {labels}: peak {_gb(row['peak_rss_anon'])} GB"
                + (f", failed: {row['error']}" if "error" in row else f", set-up {row['setup_s']:.1f} s"),
                file=sys.stderr,
                flush=True,
            )
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                write_json(result, out / f"{stem}.json")
        if "ranks" in args.parts:
            result["ranks"] = []
            for i in range(args.repeats):
                for world in (1, args.world) if i % 2 == 0 else (args.world, 1):
                    row = measure_ranks(args.ranks_args.split(), world, Path(tmp) / f"run-{world}", args.timeout)
                    result["ranks"].append(row)
                    print(
                        f"ranks {world}: {row.get('wall_s', 0):.1f} s"
                        + (f", failed: {row['error']}" if "error" in row else ""),
                        file=sys.stderr,
                        flush=True,
                    )
                    if out is not None:
                        out.mkdir(parents=True, exist_ok=True)
                        write_json(result, out / f"{stem}.json")
        if "merge" in args.parts:
            result["merge"] = []
            for world in args.merge_worlds:
                row = measure_merge(world, args.merge_numbers, Path(tmp) / f"merge-{world}", args.timeout)
                result["merge"].append(row)
                print(f"merge {world}: " + row.get("error", "done"), file=sys.stderr, flush=True)
    result["load_after"] = loadavg()
    publish(result, out, stem, markdown, chart, name="bench scale")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
