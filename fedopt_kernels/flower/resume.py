"""Checkpoints of a Flower run: a server restarted after round k continues with round k+1.

Server side (``FedOptStrategy.start(..., checkpoint_dir=...)``): after every ``checkpoint_every``
rounds (and the last), the strategy saves what its next round reads: the global model, the rule's
server tensors, the number of clients N, whether the rule's initial round ran, its sampling
generators, the replies it left out, the metrics Flower's ``Result`` holds, and whatever the caller
adds (``extra_state``: the ready-made app's history and its twin simulator's client sampling).
A restarted ``start`` with the same folder loads it (after the same checks as the simulator's
checkpoints: settings compared, size and SHA-256 verified, ``torch.load(weights_only=True)``) and
begins at the next round.

Client side: what a client keeps between rounds (its control variate, FedDyn's ``g_i``, its place
in its batch stream) lives in the node's ``context.state``, which does not survive a new run. The
ready-made ClientApp therefore also writes it, after each round it trains, to
``<folder>/client<id>/r<round>.pt`` (atomically). Each message tells the client two numbers
(``settings.RESUMED_AT``, ``settings.CHECKPOINTED``): the rounds the server had completed when it
(re)started, and the rounds of its newest checkpoint. A client with nothing in ``context.state``
takes its newest file of a round the server had completed when it restarted (files of later
rounds are from the run that was stopped, whose rounds are being redone), and drops files that no
restart can need any more.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from ..fl.checkpoint import atomic_file

CLIENT_FILE = re.compile(r"^r(\d+)\.pt$")


def metric_dicts(metrics: Mapping[int, Any]) -> Dict[int, Dict[str, Any]]:
    """Flower's per-round MetricRecords as plain dicts (what a checkpoint can hold)."""
    return {
        int(r): {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in m.items()} for r, m in metrics.items()
    }


# ---------------------------------------------------------------------------- client side
def _client_files(folder: Path) -> List[tuple]:
    """``(round, path)`` of a client's state files, oldest first."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = CLIENT_FILE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def restore_client_state(state: RecordDict, folder: Path, keys: List[str], resumed_at: int) -> bool:
    """Put a client's kept state (``keys`` of ``context.state``) back from ``folder`` after a restart.

    Only when ``state`` holds none of ``keys`` (the client has kept nothing in this run yet): files
    of rounds after ``resumed_at`` (all of them if the server started afresh) are the stopped run's
    and are deleted; the newest remaining one is loaded. Returns whether anything was restored.
    """
    if any(k in state for k in keys):
        return False
    # nothing kept in this run yet, so files of rounds after the restart point are the stopped run's
    for r, p in _client_files(folder):
        if r > resumed_at or resumed_at < 1:
            p.unlink(missing_ok=True)
    usable = [(r, p) for r, p in _client_files(folder) if r <= resumed_at]
    if not usable:
        return False
    saved = torch.load(usable[-1][1], map_location="cpu", weights_only=True)
    for key, value in saved.items():
        if key not in keys:
            continue
        if value["kind"] == "arrays":
            state[key] = ArrayRecord(value["tensors"])
        else:
            state[key] = ConfigRecord(value["values"])
    return True


def save_client_state(state: RecordDict, folder: Path, keys: List[str], server_round: int, checkpointed: int) -> None:
    """Write the client's kept state after round ``server_round`` (0: the rule's initial round), then
    drop the files no restart can use: those older than the newest one of a checkpointed round."""
    out: Dict[str, Any] = {}
    for key in keys:
        if key not in state:
            continue
        rec = state[key]
        if isinstance(rec, ArrayRecord):
            out[key] = {"kind": "arrays", "tensors": rec.to_torch_state_dict()}
        else:
            out[key] = {"kind": "config", "values": dict(rec)}
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_file(folder / f"r{int(server_round)}.pt", "wb") as f:
        torch.save(out, f)
    files = _client_files(folder)
    covered = [r for r, _ in files if r <= checkpointed]
    if covered:
        for r, p in files:
            if r < covered[-1]:
                p.unlink(missing_ok=True)


def client_folder(root: str, tag: str, client_id: int) -> Optional[Path]:
    """Where client ``client_id`` of the strategy tagged ``tag`` writes its state (None: no checkpoints)."""
    if not root:
        return None
    return Path(root) / tag / "clients" / f"client{int(client_id)}"


def server_folder(root: str, tag: str) -> Optional[Path]:
    """Where the server of the strategy tagged ``tag`` checkpoints (None: no checkpoints)."""
    if not root:
        return None
    return Path(root) / tag / "server"
