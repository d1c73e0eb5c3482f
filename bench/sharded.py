"""``python -m bench sharded``: the optimizers on DTensor parameters (docs/sharded.md), 2 CPU processes.

For each algorithm x size x backend, on a gloo world of ``--world`` processes with one thread each:

* ``whole``: the step on the whole (unsharded) parameter list, in one process (rank 0 alone; the
  other ranks wait at a barrier);
* ``local``: each rank's step on plain tensors of its own shard sizes (what a rank's kernels do,
  without DTensors or any communication);
* ``sharded``: the step on the ``Shard(0)`` DTensor parameters: the same kernels on the local
  shards, plus, for the norm algorithms, one all-reduce of one float64 per step;
* ``local + all-reduce``: that local step followed by a one-float64 all-reduce: the same work and
  the same synchronisation of the ranks as a sharded norm step, written by hand;
* the all-reduces and bytes each sharded step sends (counted by wrapping
  ``torch.distributed.all_reduce`` during one step), and the latency of a bare one-float64
  all-reduce on this world.

``sharded - local`` is the cost of sharding a step (unwrapping, placement checks, the all-reduce and
the wait for the slowest rank it implies); ``sharded - (local + all-reduce)`` what the optimizer
adds beyond that all-reduce.
Every rank times the same fixed number of steps (a step with a collective must run on all ranks);
a figure is the slowest rank's median. Results go to ``bench_runs/`` (JSON and Markdown).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import torch

from . import cli
from .algorithms import ALGOS, CORE
from .machine import loadavg, run_meta, slug
from .report import publish
from .runner import _make_params
from .shapes import SIZES
from .timing import Budget, Stopwatch, median, time_calls

DEFAULT_ALGOS = CORE  # each algorithm's core row
DEFAULT_SIZES = ["small_cnn", "resnet18"]


def _sharded_params(whole: List[torch.Tensor], mesh) -> List[torch.Tensor]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for p in whole:
        q = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
        assert p.grad is not None  # _make_params gives every whole tensor a gradient
        q.grad = distribute_tensor(p.grad, mesh, [Shard(0)], src_data_rank=None)
        out.append(q)
    return out


def _local_params(sharded: List[Any]) -> List[torch.Tensor]:  # sharded: DTensors
    out = []
    for q in sharded:
        p = q.to_local().detach().clone().requires_grad_()
        p.grad = q.grad.to_local().clone()
        out.append(p)
    return out


def _stepper(algo: str, params: List[torch.Tensor], like: List[torch.Tensor], backend: str):
    """The case's optimizer on ``params`` with its round and step inputs (drawn for ``like``, the
    whole tensors, and placed like ``params``)."""
    from fedopt_kernels.core.dtensor import is_dtensor

    cfg = ALGOS[algo].config
    opt = cfg.build(params, backend)

    def place(t, p):
        if is_dtensor(p):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
        return t if t.shape == p.shape else t[: p.shape[0]]  # a local shard: its first rows stand in

    inputs: Dict[str, Any] = {}
    for key, v in cfg.round_inputs(like, 0, seed=1).items():
        if isinstance(v, dict):
            index = {id(p): i for i, p in enumerate(like)}
            inputs[key] = {
                params[index[id(p)]]: (r if is_dtensor(params[index[id(p)]]) else r[: params[index[id(p)]].shape[0]])
                for p, r in v.items()
            }
        else:
            inputs[key] = [place(t, p) for t, p in zip(v, params)]
    opt.start_round(**inputs)
    step_in: Dict[str, Any] = {
        k: [place(t, p) for t, p in zip(v, params)] for k, v in cfg.step_inputs(like, 0, seed=1).items()
    }
    return lambda: opt.step(**step_in)


def _world(rank: int, n: int, cases: List[tuple], reps: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (n,))
    budget = Budget(warmup=3, min_reps=reps, max_reps=reps, min_time_s=0.0)  # the same count on every rank
    cpu = torch.device("cpu")
    out: Dict[str, Any] = {"rows": []}
    x = torch.ones(1, dtype=torch.float64)
    lat = time_calls(lambda: dist.all_reduce(x), cpu, budget)
    out["allreduce_s"] = median(lat)
    for algo, size, backend in cases:
        whole = _make_params(SIZES[size], torch.float32, cpu)
        row: Dict[str, Any] = {"algo": algo, "size": size, "backend": backend}
        if rank == 0:
            row["whole_s"] = median(time_calls(_stepper(algo, whole, whole, backend), cpu, budget))
        dist.barrier()
        sharded = _sharded_params(whole, mesh)
        local = _local_params(sharded)
        local_step = _stepper(algo, local, whole, backend)
        row["local_s"] = median(time_calls(local_step, cpu, budget))
        row["local_ar_s"] = median(
            time_calls(lambda: (local_step(), dist.all_reduce(x)), cpu, budget)  # noqa: B023 (timed here)
        )
        step = _stepper(algo, sharded, whole, backend)
        step()
        calls: List[int] = []
        real = dist.all_reduce

        def counting(t, *a, **kw):  # installed only for the step() below, in this iteration
            calls.append(t.numel() * t.element_size())  # noqa: B023
            return real(t, *a, **kw)  # noqa: B023

        dist.all_reduce = counting  # type: ignore[assignment]  # for the one step() below, then restored
        try:
            step()
        finally:
            dist.all_reduce = real
        row["allreduces"], row["allreduce_bytes"] = len(calls), sum(calls)
        row["sharded_s"] = median(time_calls(step, cpu, budget))
        row["local_numel"] = sum(p.numel() for p in local)
        row["numel"] = sum(p.numel() for p in whole)
        out["rows"].append(row)
    return out


def _merge(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        merged = dict(row)
        for key in ("local_s", "local_ar_s", "sharded_s"):
            merged[key] = max(r["rows"][i][key] for r in per_rank)  # the slowest rank sets the pace
        merged["local_numel"] = max(r["rows"][i]["local_numel"] for r in per_rank)
        rows.append(merged)
    return {"rows": rows, "allreduce_s": max(r["allreduce_s"] for r in per_rank)}


def markdown(result: Dict[str, Any]) -> str:
    meta = result["meta"]
    us = lambda s: f"{s * 1e6:,.0f} us" if s < 1e-2 else f"{s * 1e3:,.2f} ms"  # noqa: E731
    lines = [
        f"# Sharded step: {meta['world']} CPU processes (gloo), 1 thread each",
        "",
        f"{meta['device_name']}; commit {meta['commit'][:10]}{' (dirty)' if meta.get('dirty') else ''}; "
        f"torch {meta['torch']}; load average {meta['loadavg_before']} before, {meta['loadavg_after']} after. "
        f"Command: `{meta['command']}`.",
        "",
        f"A bare all-reduce of one float64 on this world: {us(result['allreduce_s'])}.",
        "",
        "| algorithm | size | backend | whole, 1 process | local shard, plain tensors | local + all-reduce "
        "| sharded (DTensor) | sharded - local | sharded - (local + all-reduce) | all-reduces / step "
        "| bytes all-reduced / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {ALGOS[r['algo']].label} | {r['size']} ({r['numel']:,} -> {r['local_numel']:,} per rank) "
            f"| {r['backend']} | {us(r['whole_s'])} | {us(r['local_s'])} | {us(r['local_ar_s'])} "
            f"| {us(r['sharded_s'])} | {us(r['sharded_s'] - r['local_s'])} "
            f"| {us(r['sharded_s'] - r['local_ar_s'])} | {r['allreduces']} | {r['allreduce_bytes']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = cli.parser("sharded", __doc__)
    ap.add_argument("--algos", nargs="+", choices=list(ALGOS), default=DEFAULT_ALGOS)
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=DEFAULT_SIZES)
    ap.add_argument("--backends", nargs="+", choices=["cpu", "reference"], default=["cpu"])
    ap.add_argument("--world", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--reps", type=int, default=30, help="timed steps per case on every rank (default 30)")
    cli.add_output(ap)
    args = ap.parse_args(argv)
    from fedopt_kernels.fl.local_world import gloo_unavailable, run_local_world

    why = gloo_unavailable()
    if why is not None:
        raise SystemExit(f"bench sharded: {why}")
    cases = [(a, s, b) for a in args.algos for s in args.sizes for b in args.backends]
    meta = run_meta(torch.device("cpu"), cli.command_line("sharded", sys.argv[2:] if argv is None else argv))
    meta.update(world=args.world, reps=args.reps, threads=1, loadavg_before=loadavg())
    wall = Stopwatch()
    result = _merge(run_local_world(_world, args.world, cases, args.reps))
    meta.update(wall_s=wall.seconds(), loadavg_after=loadavg())
    result["meta"] = meta
    stem = f"sharded-{meta['date']}-{slug(meta['device_slug'])}-{meta['commit'][:7]}"
    publish(result, cli.out_dir(args), stem, markdown, latest=False)
    return 0
