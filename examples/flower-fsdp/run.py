"""Flower simulation: 2 clients, each training locally as an FSDP2 job over 2 CPU processes with FedNAR.

    python run.py                       # 3 rounds through Flower's simulation engine
    python run.py --rounds 5 --ranks 2  # more rounds

Each client's ``fit`` starts a 2-process gloo world (``flower_fsdp.task.train_on_ranks``) and
returns the updated weights; the server averages them with Flower's FedAvg (docs/sharded.md).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# the simulation's client processes (and their training processes) import flower_fsdp too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402
from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.common import ConfigRecord, Context, ndarrays_to_parameters  # noqa: E402
from flwr.server import ServerApp, ServerAppComponents, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from flower_fsdp.task import evaluate, get_weights, make_model, train_on_ranks  # noqa: E402

HP = dict(lr=0.1, weight_decay=1e-3, max_norm=1.0, prox_mu=0.01)


class ShardedClient(NumPyClient):
    """Local training = an FSDP2 job over ``ranks`` processes; the FedNAR state_dict is kept between rounds."""

    def __init__(self, cid: int, ranks: int, steps: int, context: Context):
        self.cid, self.ranks, self.steps, self.context = cid, ranks, steps, context

    def fit(self, parameters, config):
        # the optimizer's full state_dict from this client's last round, kept in the node's state
        record = self.context.state.get("fednar")
        opt_state: Optional[Dict[str, Any]] = None
        if record is not None:
            opt_state = torch.load(io.BytesIO(record["state_dict"]), weights_only=True)
        weights, opt_state, t = train_on_ranks(parameters, self.cid, self.ranks, self.steps, 16, HP, opt_state)
        buf = io.BytesIO()
        torch.save(opt_state, buf)
        self.context.state["fednar"] = ConfigRecord({"state_dict": buf.getvalue()})
        print(f"client {self.cid}: {self.steps} FedNAR steps on {self.ranks} FSDP2 ranks, round index {t}", flush=True)
        return weights, 256, {"round_index": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="processes per client's FSDP2 job")
    ap.add_argument("--steps", type=int, default=20, help="local steps per round")
    args = ap.parse_args()
    cids = list(range(args.clients))

    def client_fn(context: Context):
        cid = int(context.node_config["partition-id"])
        return ShardedClient(cid, args.ranks, args.steps, context).to_client()

    def server_fn(context: Context):
        def central(rnd, parameters, config):
            loss, acc = evaluate(parameters, cids)
            print(f"round {rnd}: loss {loss:.4f}, accuracy {acc:.3f} on the clients' data", flush=True)
            return loss, {"accuracy": acc}

        strategy = FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=args.clients,
            min_available_clients=args.clients,
            evaluate_fn=central,
            initial_parameters=ndarrays_to_parameters(get_weights(make_model())),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=args.rounds))

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=args.clients,
        backend_config={"client_resources": {"num_cpus": 1}},
    )


if __name__ == "__main__":
    main()
