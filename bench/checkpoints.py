"""``python -m bench checkpoints``: what a simulator checkpoint costs, on disk and in time.

Rows:

* ``small_cnn`` / ``resnet18``: a SCAFFOLD run (server control ``c`` and one control per client, the
  most state a registered rule keeps) of ``--clients`` clients (default 100), every client holding
  its control, so the checkpoint carries the global model, ``c`` and 100 client controls plus the
  generators and batch streams. The models: the simulator's CNN on 8x8 digits, and ResNet-18 with
  GroupNorm (``resnet18-gn``, 11.2M parameters) on CIFAR-shaped inputs. Reported: bytes of the state
  file, seconds per save (``Simulation.save_checkpoint``: capture, write with SHA-256, fsync,
  rename, manifest) and per load (checks, hash, ``torch.load(weights_only=True)``, restore), the
  median of ``--repeats``.
* ``default run``: ``fedopt-sim``'s default run (digits, CNN, FedAvg, 50 clients, 10 per round, 10
  local steps; ``--rounds`` of them, one torch thread as the CLI uses) checkpointing after every
  round: the mean seconds of a round's training and of a checkpoint, and their ratio.

The state files go to a temporary folder (``--dir`` to choose it: the disk is part of the cost).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from fedopt_kernels.sim import SimConfig, Simulation
from fedopt_kernels.sim.config import VARIANTS
from fedopt_kernels.sim.data.clients import ClientData
from fedopt_kernels.sim.federated_data import FederatedData
from fedopt_kernels.sim.models.resnet_gn import ResNet18GN

from . import cli
from .timing import host_call, median


def _tiny_cifar(clients: int) -> FederatedData:
    """``clients`` users with 2 CIFAR-shaped images each: the data does not matter, the state does."""
    g = torch.Generator().manual_seed(0)
    users = []
    for i in range(clients):
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        users.append(ClientData(i, x[:2], y[:2], x[2:3], y[2:3], x[3:], y[3:]))
    return FederatedData(users, [], (3, 32, 32), 10)


def _keeping_variant() -> str:
    """The first registered variant whose server rule has each client keep a tensor list (SCAFFOLD's
    control, say): the checkpoint that grows with the number of clients."""
    from fedopt_kernels.fl.server_rules import RULES

    return next(name for name, v in VARIANTS.items() if RULES[v.server].keeps)


def state_row(model: str, clients: int, repeats: int, folder: Path) -> Dict[str, Any]:
    cfg = SimConfig(
        algorithm=_keeping_variant(),
        clients=clients,
        holdout_fraction=0.0,
        rounds=1,
        local_steps=1,
        clients_per_round=1,
        device="cpu",
        backend="auto",
        model="cnn" if model == "small_cnn" else "mlp",
    )
    kw: Dict[str, Any] = (
        {} if model == "small_cnn" else dict(data=_tiny_cifar(clients), model_fn=lambda: ResNet18GN(3, 10))
    )
    sim = Simulation(cfg, checkpoint_dir=folder / model, **kw)
    for cid in range(cfg.num_train_clients):  # every client has trained once: each keeps its control
        sim.strategy.kept[cid] = [torch.full_like(p, 1e-3 * cid) for p in sim.global_params]
    sim.history = [{"round": 1, "train_loss": 0.0, "clients": [0]}]
    saves = [sim.save_checkpoint() for _ in range(repeats)]
    loads = [host_call(sim.load_checkpoint) for _ in range(repeats)]
    params = sum(p.numel() for p in sim.global_params)
    return {
        "row": model,
        "parameters": params,
        "clients": clients,
        "bytes": saves[-1]["bytes"],
        "save_s": median([s["seconds"] for s in saves]),
        "load_s": median(loads),
    }


def default_run_row(rounds: int, folder: Path) -> Dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fedopt-sim's default for clients trained one after another
    try:
        sim = Simulation(SimConfig(rounds=rounds, device="cpu"), checkpoint_dir=folder / "default")
        sim.run()
    finally:
        torch.set_num_threads(threads)
    rounds_s = [r["seconds"] for r in sim.history[1:]]  # round 1 includes one-time setup (imports, kernels)
    ckpt_s = [s["seconds"] for s in sim.checkpoint_stats[1:]]
    if not ckpt_s:
        raise SystemExit(
            f"--rounds {rounds} leaves no checkpoint after the first one to time; run at least "
            f"twice the checkpoint interval"
        )
    return {
        "row": "default run",
        "parameters": sum(p.numel() for p in sim.global_params),
        "clients": sim.cfg.num_train_clients,
        "bytes": sim.checkpoint_stats[-1]["bytes"],
        "round_s": statistics.mean(rounds_s),
        "save_s": statistics.mean(ckpt_s),
        "ratio": statistics.mean(ckpt_s) / statistics.mean(rounds_s),
    }


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def table(rows: List[Dict[str, Any]]) -> str:
    lines = [
        "| row | parameters | clients' state | state file | save (s) | load (s) | round (s) | save / round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        load = f"{r['load_s']:.3f}" if "load_s" in r else "-"
        rnd = f"{r['round_s']:.3f}" if "round_s" in r else "-"
        ratio = f"{100 * r['ratio']:.1f}%" if "ratio" in r else "-"
        lines.append(
            f"| {r['row']} | {r['parameters']:,} | {r['clients']} | {_size(r['bytes'])} | "
            f"{r['save_s']:.3f} | {load} | {rnd} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = cli.parser("checkpoints", __doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100, help="clients holding a control (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per model row (default %(default)s)")
    p.add_argument("--rounds", type=int, default=12, help="rounds of the default run (default %(default)s)")
    p.add_argument("--models", nargs="+", default=["small_cnn", "resnet18"], choices=["small_cnn", "resnet18"])
    p.add_argument("--dir", help="folder for the state files (default: a temporary folder, removed after)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [default_run_row(args.rounds, Path(tmp))]
        for m in args.models:
            rows.append(state_row(m, args.clients, args.repeats, Path(tmp)))
            print(table(rows), file=sys.stderr)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"state files in {args.dir or tempfile.gettempdir()}"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
