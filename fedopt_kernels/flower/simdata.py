"""The simulator's world for a Flower node: data partition, initial model and each client's batch stream.

A ``fedopt_kernels.sim.Simulation`` built from the run's config is the single source of truth: its
seeding gives the data partition, the initial model and every client's mini-batch generator, so a
Flower client sees exactly the samples and batch order of the same client in ``fedopt-sim``. It is
built once per process (Ray actors serve many clients; a deployment's ClientApp process serves
one message) and never trained.

A client's position in its batch stream survives between rounds in ``context.state`` as the
number of batches drawn so far; the stream is rebuilt from its seed and replayed to that point.
Replaying is cheap here (indexing a few small tensors) and depends only on ``BatchStream.next``.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from typing import Any, Callable, Dict, Tuple

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from ..sim.config import SimConfig
from ..sim.data.clients import BatchStream
from ..sim.simulation import Simulation
from .records import as_int


@lru_cache(maxsize=4)
def _simulation(key: str) -> Simulation:
    settings: Dict[str, Any] = {k: (tuple(v) if k == "split" else v) for k, v in json.loads(key).items()}
    return Simulation(SimConfig(**settings))


def simulation_for(cfg: SimConfig) -> Simulation:
    """The (cached, untrained) Simulation of ``cfg``: treat it as read-only."""
    return _simulation(json.dumps(cfg.to_dict(), sort_keys=True))


def check_partition(cfg: SimConfig, node_config: dict) -> int:
    """This node's client id (its ``partition-id``), checked against the run's number of training clients."""
    n = cfg.num_train_clients
    hint = (
        f"this run has {n} training clients (clients={cfg.clients}, holdout-fraction={cfg.holdout_fraction}): "
        f'simulate it with `flwr run . --federation-config "num-supernodes={n}"`, or start SuperNodes with '
        f'--node-config "partition-id=<0..{n - 1}> num-partitions={n}"'
    )
    if "partition-id" not in node_config:
        raise ValueError(f"node_config has no partition-id; {hint}")
    pid, parts = node_config["partition-id"], node_config.get("num-partitions", n)
    if parts != n or not isinstance(pid, int) or not 0 <= pid < n:
        raise ValueError(f"partition-id={pid!r}, num-partitions={parts!r} do not fit: {hint}")
    return pid


def new_model(sim: Simulation) -> torch.nn.Module:
    """A private copy of the simulation's model (same architecture and device) to train or evaluate on."""
    return copy.deepcopy(sim.model)


def batch_stream(sim: Simulation, cid: int, state: RecordDict, tag: str) -> Tuple[Callable, Callable[[], None]]:
    """``(next_batch, save)``: client ``cid``'s stream where ``state`` left it; ``save()`` records the new position."""
    key = f"{tag}.batches"
    drawn = as_int(state[key]["drawn"]) if key in state else 0
    rng = np.random.default_rng()
    rng.bit_generator.state = copy.deepcopy(sim.streams[cid].rng.bit_generator.state)  # the unused initial state
    client = sim.train_clients[cid]
    stream = BatchStream(client.train_x, client.train_y, sim.cfg.batch_size, rng)
    for _ in range(drawn):
        stream.next()
    count = [drawn]

    def next_batch():
        count[0] += 1
        return stream.next()

    def save() -> None:
        state[key] = ConfigRecord({"drawn": count[0]})

    return next_batch, save
