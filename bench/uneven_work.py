"""``python -m bench.uneven_work``: client-batched rounds whose clients differ in their work, timed.

Four runs of one ``fedopt-sim`` configuration (the small CNN on the digits, 50 clients all sampled
every round, batch 10, FedAvg), stepped together round by round in one process (the one that goes
first rotates, so load from other processes falls on all alike):

* ``batched, K = 10``: ``--client-batched 50 --local-steps 10``;
* ``batched, K in 5..15``: ``--client-batched 50 --local-steps-range 5 15`` (the same mean work);
* ``sequential, K = 10`` and ``sequential, K in 5..15``: the same two, one client after another.

Per run and timed round: the round's training seconds (no evaluation in a timed round) and its
clients' own steps; the table gives the median client-steps/s, the uneven run's against the even
one, and each client-batched run's against the sequential run of the same work. The first round is
untimed (warm-up). The layers engine's default formulations (``--formulations default``): no
measurement in the first round, the same engine for both client-batched runs.

Results: ``uneven-work-<device>-<date>.{json,md}`` in ``--out-dir`` (default ``bench_runs/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .machine import loadavg, run_meta, utc_date

RUNS: Dict[str, Dict[str, Any]] = {
    "batched, K = 10": dict(client_batched=50, local_steps=10),
    "batched, K in 5..15": dict(client_batched=50, local_steps_range=(5, 15)),
    "sequential, K = 10": dict(client_batched=1, local_steps=10),
    "sequential, K in 5..15": dict(client_batched=1, local_steps_range=(5, 15)),
}


def _simulation(rounds: int, seed: int, **kw: Any):
    from fedopt_kernels.sim.config import SimConfig
    from fedopt_kernels.sim.simulation import Simulation

    cfg = SimConfig(  # FedAvg, the default algorithm
        dataset="digits",
        model="cnn",
        clients=50,
        holdout_fraction=0.0,
        clients_per_round=50,
        batch_size=10,
        rounds=rounds + 1,
        eval_every=10**6,  # the last round only (never a timed one)
        finetune_steps=0,
        device="cpu",
        formulations="default",
        seed=seed,
        **kw,
    )
    return Simulation(cfg)


def measure(rounds: int, seed: int = 0) -> Dict[str, Any]:
    """Each run's per-round training seconds and client steps (module docstring)."""
    sims = {name: _simulation(rounds, seed, **kw) for name, kw in RUNS.items()}
    names = list(sims)
    out: Dict[str, Dict[str, List[float]]] = {n: {"seconds": [], "steps": [], "load": []} for n in names}
    for t in range(rounds):
        first = t % len(names)
        for name in names[first:] + names[:first]:
            sim = sims[name]
            before = loadavg()
            start = time.perf_counter()
            rec = sim.run_round(t)
            seconds = time.perf_counter() - start
            if t == 0:
                continue  # warm-up
            steps = sum(sim.work_plan.steps(t, rec["clients"]).values())
            out[name]["seconds"].append(seconds)
            out[name]["steps"].append(steps)
            out[name]["load"].append(before or 0.0)
    result: Dict[str, Any] = {"runs": {}}
    for name, sim in sims.items():
        rates = [s / sec for s, sec in zip(out[name]["steps"], out[name]["seconds"])]
        row: Dict[str, Any] = {**out[name], "client_steps_per_s": statistics.median(rates)}
        if sim.batched is not None:
            row["slot_steps"], row["client_steps"] = sim.batched.slot_steps, sim.batched.client_steps
        result["runs"][name] = row
    runs = result["runs"]
    rate = {n: runs[n]["client_steps_per_s"] for n in names}
    result["ratios"] = {
        "uneven / even, client-batched": rate["batched, K in 5..15"] / rate["batched, K = 10"],
        "client-batched / sequential, K = 10": rate["batched, K = 10"] / rate["sequential, K = 10"],
        "client-batched / sequential, K in 5..15": rate["batched, K in 5..15"] / rate["sequential, K in 5..15"],
    }
    return result


def markdown(result: Dict[str, Any], meta: Dict[str, Any]) -> str:
    lines = [
        f"# Clients that differ in their work: client-batched rounds, CPU ({meta.get('date', '')})",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: `{meta.get('commit')}`; torch {torch.__version__}; threads {torch.get_num_threads()}",
        "- run: small CNN on the digits, 50 clients, all 50 trained each round (client-batched: one "
        "chunk of 50), batch 10, FedAvg, layers engine default formulations; median of the timed rounds",
        "",
        "| run | client-steps/s | timed rounds | load average (median) | slot-steps / client-steps |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["runs"].items():
        waste = f"{row['slot_steps'] / row['client_steps']:.2f}" if "slot_steps" in row else "-"
        load = statistics.median(row["load"]) if row["load"] else float("nan")
        lines.append(f"| {name} | {row['client_steps_per_s']:,.0f} | {len(row['seconds'])} | {load:.2f} | {waste} |")
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    targets = {"uneven / even, client-batched": ">= 0.8x", "client-batched / sequential, K in 5..15": ">= 4x"}
    for name, value in result["ratios"].items():
        lines.append(f"| {name} | {value:.2f}x | {targets.get(name, '')} |")
    lines += [
        "",
        "slot-steps: the chunk's largest step count times its 50 slots; a sorted chunk computes only its "
        "active clients' gradients at each step, so the idle slot-steps cost an optimizer step's mask, "
        "not a gradient.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.uneven_work", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds per run, the first untimed (default %(default)s)")
    p.add_argument("--out-dir", default="bench_runs", help="where the result files go (default %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m bench.uneven_work " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = run_meta(torch.device("cpu"), command.strip())
    result = measure(args.rounds)
    result["meta"] = meta
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"uneven-work-{meta.get('device_slug', 'cpu')}-{utc_date()}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result, meta)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
