"""``fedopt-sim`` under torchrun: one run on every process it starts (docs/simulator.md, "Several
processes and machines").

Every rank parses the same command line. Rank 0 alone decides where the run's files go (the
first free ``sim_runs/...`` folder, the checkpoint and client-state folders) and tells the others,
so that they agree even while rank 0 creates them; a bad folder stops every rank with rank 0's
message. Rank 0 alone writes files and prints; the others run silently. A restart by torchrun
(``--max-restarts``, after a rank was killed) continues from the run's last checkpoint, as
``--resume`` does.

Client state (SCAFFOLD's, PAdaMFed's, FedDyn's) is shared through files every rank reaches:
``--client-state-dir``, or, when it is not given, ``<checkpoint folder>/shared-client-state``
(checkpoints on) or a temporary folder removed at the end (one machine, no checkpoints).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..ranks import Ranks

RESTARTS = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun on every start of the workers (0 first)
# testing hook: "<rank>:<round>": that rank kills itself (SIGKILL) once that round is done, on the first start
KILL_RANK = "FEDOPT_TEST_KILL_RANK"
SHARED = "shared-client-state"


def join(args: argparse.Namespace) -> Ranks:
    """This process's place in the run (one rank without torchrun); the flags a run on several
    processes cannot take are refused (ValueError naming them)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks.single()
    if args.validate is not None:
        raise ValueError("--validate compares two runs in one process: run it without torchrun")
    ranks = Ranks.from_environment(args.device)
    if int(os.environ.get(RESTARTS, "0")) > 0 and args.checkpoint_every > 0:
        args.resume = True  # torchrun restarted the workers: continue from the last checkpoint
        args.overwrite = False
    if not ranks.main:
        args.quiet = True
        sys.stdout = open(os.devnull, "w")  # rank 0 prints the results
    return ranks


def agree(ranks: Ranks, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0, its result (or its ValueError) on every rank."""
    if ranks.world == 1:
        return decide()
    got: Tuple[Optional[Any], Optional[str]] = (None, None)
    if ranks.main:
        try:
            got = (decide(), None)
        except ValueError as exc:
            got = (None, str(exc))
    value, error = ranks.broadcast(got)
    if error is not None:
        raise ValueError(error)
    return value


def shared_stores(
    ranks: Ranks, keeps: bool, stores: List[Optional[Path]], checkpoints: List[Optional[Path]]
) -> Tuple[List[Optional[Path]], Optional[str]]:
    """Each seed's client-state folder of a run on several processes, and a temporary folder made for
    them (to remove at the end), or None."""
    if ranks.world == 1 or not keeps or all(s is not None for s in stores):
        return stores, None
    if all(c is not None for c in checkpoints):
        return [c / SHARED for c in checkpoints if c is not None], None
    if int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world)) != ranks.world:
        raise ValueError(
            "a run on several machines shares its clients' state through files every rank reaches: "
            "give --client-state-dir on a shared file system (or --checkpoint-dir there)"
        )
    tmp = tempfile.mkdtemp(prefix="fedopt-client-state-")
    return [Path(tmp) / f"seed{i}" for i in range(len(stores))], tmp


def remove(ranks: Ranks, tmp: Optional[str]) -> None:
    ranks.barrier()
    if tmp is not None and ranks.main:
        shutil.rmtree(tmp, ignore_errors=True)


def kill_hook(ranks: Ranks, progress: Callable[[Dict[str, Any]], None]) -> Callable[[Dict[str, Any]], None]:
    """``progress``, and the testing hook ``FEDOPT_TEST_KILL_RANK`` (a rank killed mid-run)."""
    spec = os.environ.get(KILL_RANK)
    if not spec or int(os.environ.get(RESTARTS, "0")) > 0:
        return progress
    rank, _, after = spec.partition(":")

    def tick(record: Dict[str, Any]) -> None:
        progress(record)
        if int(rank) == ranks.rank and record["round"] == int(after):
            os.kill(os.getpid(), signal.SIGKILL)

    return tick
