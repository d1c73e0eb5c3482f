"""``python -m bench privacy``: what user-level DP costs a round, and the clip a user writes by hand.

Two measurements, each interleaved (the cases take turns, the first one rotating) so that load
from other processes falls on all of them alike:

* **rounds**: the same simulator round (digits, the small CNN, 50 clients per round, all of them
  sampled, 10 local steps) without DP and with DP (clip, noise, adaptive clip, accounting),
  sequential (each reply clipped as it comes) and client-batched (50 at once: the chunk's replies
  clipped and summed by one ``clip_sum`` call), and client-batched with the reply-by-reply clip
  beside it; median seconds per round, ratio DP / no DP.
* **server side alone**: 50 clients' updates of the small CNN clipped and summed, then noised:
  the package's per-reply clip added to a float64 fold (what a sequential DP round runs per
  reply), the fused op ``clip_sum`` on the stacked ``[50, *shape]`` updates (the C++ kernel, and
  the PyTorch reference), and the loop a user writes: each client's update copied into ``.grad``,
  ``torch.nn.utils.clip_grad_norm_``, summed, then ``torch.normal`` noise per tensor. Median
  milliseconds.

Results: ``privacy-<device>-<date>.{json,md}`` in ``--out-dir`` (default ``bench_runs/``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, cast

import torch

from fedopt_kernels.core.clip_sum import backends_with_kernel
from fedopt_kernels.fl.fold import sum_dtype
from fedopt_kernels.privacy import add_noise, clip, clip_sum_batched, round_generator
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.simulation import Simulation

from .machine import loadavg, run_meta, utc_date
from .timing import median, rotated

CLIENTS = 50


def _config(batched: int, dp: bool, rounds: int) -> SimConfig:
    extra: Dict[str, Any] = dict(dp_clip=0.5, dp_noise_multiplier=1.0, dp_adaptive_quantile=0.5) if dp else {}
    return SimConfig(
        dataset="digits",
        clients=63,  # 50 training clients (13 held out), every one sampled
        clients_per_round=CLIENTS,
        rounds=rounds,
        device="cpu",
        client_batched=batched,
        eval_every=10**6,  # rounds only: no validation pass in the timed rounds
        **extra,
    ).validate()


def _no_chunk() -> Any:
    """No chunk clip: the client-batched engine then clips reply by reply, as the sequential one."""
    return None


def time_rounds(rounds: int) -> Dict[str, Any]:
    cases = {
        f"{engine} {'DP' if dp else 'no DP'}": Simulation(_config(batched, dp, rounds + 1))
        for engine, batched in (("sequential", 1), ("client-batched", CLIENTS))
        for dp in (False, True)
    }
    by_reply = Simulation(_config(CLIENTS, True, rounds + 1))
    by_reply._dp_chunk = _no_chunk  # type: ignore[method-assign]  # each reply clipped as it comes
    cases["client-batched DP, reply by reply"] = by_reply
    for sim in cases.values():  # warm-up round (client-batched: its first round chooses formulations)
        sim.run_round(0)
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for r in range(1, rounds + 1):
        for name in rotated(list(cases), r):
            start = time.perf_counter()
            cases[name].run_round(r)
            times[name].append(time.perf_counter() - start)
    out: Dict[str, Any] = {name: {"median_s": median(ts), "rounds_s": ts} for name, ts in times.items()}
    for engine in ("sequential", "client-batched"):
        out[f"{engine} ratio"] = median(times[f"{engine} DP"]) / median(times[f"{engine} no DP"])
    out["client-batched reply-by-reply ratio"] = median(times["client-batched DP, reply by reply"]) / median(
        times["client-batched no DP"]
    )
    return out


def time_server(repeats: int) -> Dict[str, Any]:
    sim = Simulation(_config(1, False, 1))
    params = list(sim.model.parameters())
    g = torch.Generator().manual_seed(0)
    stacked = [torch.randn(CLIENTS, *p.shape, generator=g) * 0.01 for p in params]
    C, std = 0.05, 1.0 * 0.05

    def ours() -> None:
        sums = [torch.zeros(p.shape, dtype=sum_dtype(p)) for p in params]
        for c in range(CLIENTS):
            clipped, _, _ = clip([t[c] for t in stacked], C)
            for s, x in zip(sums, clipped):
                s.add_(x)
        add_noise(sums, std, round_generator(0, 0))

    def fused(backend: str) -> Callable[[], None]:
        def run() -> None:
            _, _, _, sums = clip_sum_batched(stacked, C, backend=backend)
            add_noise(sums, std, round_generator(0, 0))

        return run

    def by_hand() -> None:  # what a user writes with torch alone
        sums = [torch.zeros_like(p) for p in params]
        for c in range(CLIENTS):
            for p, t in zip(params, stacked):
                p.grad = t[c].clone()
            torch.nn.utils.clip_grad_norm_(params, C)
            for s, p in zip(sums, params):
                s.add_(cast(torch.Tensor, p.grad))
        for s in sums:
            s.add_(torch.normal(0.0, std, s.shape))

    cases: Dict[str, Callable[[], None]] = {
        "package clip + fold, reply by reply": ours,
        "clip_sum, one op (cpu)": fused("cpu" if backends_with_kernel(torch.device("cpu"))["cpu"] is None else "auto"),
        "clip_sum, one op (reference)": fused("reference"),
        "by hand": by_hand,
    }
    for fn in cases.values():
        fn()
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for r in range(repeats):
        for name in rotated(list(cases), r):
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_ms": 1e3 * median(ts)} for name, ts in times.items()}


def markdown(meta: Dict[str, Any], rounds: Dict[str, Any], server: Dict[str, Any]) -> str:
    lines = [
        f"# User-level DP: a round's cost ({meta.get('device_name', meta.get('device'))}, {meta['date']})",
        "",
        f"Command: `{meta['command']}`; commit {meta['commit']}; torch {meta['torch']}, {meta['threads']} thread(s);",
        f"load average at the start and the end: {meta['load_average']} (other processes on the same cores).",
        "",
        "Digits, the small CNN, 50 clients per round (all sampled), 10 local steps at batch 10; DP: clip 0.5,",
        "z 1, adaptive clip toward the median, RDP accounting. Median seconds per round, rounds interleaved.",
        "Client-batched DP clips and sums a chunk's replies with one `clip_sum` call; the last row clips",
        "them reply by reply instead (the sequential engine's way), for comparison.",
        "",
        "| engine | no DP (s) | DP (s) | DP / no DP (ratio of medians) |",
        "|---|---|---|---|",
    ]
    for engine in ("sequential", "client-batched"):
        a, b = rounds[f"{engine} no DP"]["median_s"], rounds[f"{engine} DP"]["median_s"]
        lines.append(f"| {engine} | {a:.3f} | {b:.3f} | {rounds[f'{engine} ratio']:.3f} |")
    a, b = rounds["client-batched no DP"]["median_s"], rounds["client-batched DP, reply by reply"]["median_s"]
    ratio = rounds["client-batched reply-by-reply ratio"]
    lines.append(f"| client-batched, reply-by-reply clip | {a:.3f} | {b:.3f} | {ratio:.3f} |")
    lines += [
        "",
        "Server side alone: 50 updates of the small CNN clipped, summed and noised (median ms):",
        "",
        "| how | ms |",
        "|---|---|",
    ]
    lines += [f"| {name} | {v['median_ms']:.2f} |" for name, v in server.items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench privacy", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per case (default %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed server-side repeats (default %(default)s)")
    p.add_argument("--out-dir", type=Path, default=Path("bench_runs"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    meta = run_meta(torch.device("cpu"), "python -m bench privacy " + " ".join(argv or []))
    load = [loadavg()]
    server = time_server(args.repeats)
    rounds = time_rounds(args.rounds)
    meta["load_average"] = load + [loadavg()]  # at the start and the end: other processes' load on the cores
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"privacy-{meta.get('device_slug', 'cpu')}-{utc_date()}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "rounds": rounds, "server": server}, indent=1))
    text = markdown(meta, rounds, server)
    (args.out_dir / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
