"""``fedopt-sim``'s options for clients that differ in their work (``fedopt_kernels/fl/work.py``):
``--local-steps``, ``--local-epochs``, ``--local-steps-range``, ``--stragglers``."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import SimConfig


def add_work_options(g: Any, d: SimConfig) -> None:
    """The options, in argument group ``g``; ``d``: the default settings."""
    g.add_argument("--local-steps", type=int, help=f"local steps of every client in a round (default {d.local_steps})")
    g.add_argument(
        "--local-epochs",
        type=int,
        metavar="E",
        help="instead of --local-steps: client i takes E * ceil(n_i / batch size) steps, E passes over its "
        'n_i samples (docs/simulator.md, "Clients that differ in their work")',
    )
    g.add_argument(
        "--local-steps-range",
        type=int,
        nargs=2,
        metavar=("A", "B"),
        help="instead of --local-steps: each client's steps drawn per round uniformly from A..B, from the seed",
    )
    g.add_argument(
        "--stragglers",
        type=float,
        default=d.stragglers,
        metavar="F",
        help="this fraction of each round's clients, drawn from the seed, stops after a uniform fraction "
        "of its steps (at least 1), in [0, 1) (default %(default)s)",
    )


def local_steps(args: argparse.Namespace) -> int:
    """``--local-steps`` (its default where not given); ValueError when another option sets the steps too."""
    if args.local_steps is None:
        return SimConfig.local_steps
    for name in ("local_epochs", "local_steps_range"):
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"give local_steps (--local-steps) or {name} ({flag}), not both: both set the local steps")
    return args.local_steps


def steps_text(cfg: SimConfig) -> str:
    """The local steps of a run's clients in words (the summary line)."""
    if cfg.local_epochs is not None:
        text = f"{cfg.local_epochs} local epoch{'s' * (cfg.local_epochs != 1)}"
    elif cfg.local_steps_range is not None:
        text = f"{cfg.local_steps_range[0]}-{cfg.local_steps_range[1]} steps"
    else:
        text = f"{cfg.local_steps} steps"
    return text + (f", {cfg.stragglers:g} stragglers" if cfg.stragglers else "")
