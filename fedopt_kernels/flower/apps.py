"""A ready ServerApp / ClientApp pair that runs ``fedopt-sim``'s algorithms and data sets on Flower.

The run config (see ``runconfig``) names the algorithm(s) and the simulator options; every node
rebuilds the same users from the seed (``simdata``), and node ``partition-id = i`` is training
client i. The server evaluates the global model on the pooled validation data of the training
clients after every ``eval-every`` rounds (the simulator's ``val_acc``), which it can do because
the data set is public; ``fraction-evaluate > 0`` adds Flower's federated evaluation on the
clients' validation splits. Each round trains the clients ``fedopt-sim`` would sample (a twin
simulator draws them), so a Flower run reproduces the ``fedopt-sim`` run of the same config.
With ``out = "/abs/path.pt"`` the ServerApp saves, per algorithm, every evaluated round's
accuracy, loss and global parameters, and the clients left out.

With ``checkpoint-dir = "/abs/folder"`` the run survives a restart of the ServerApp (and of the
clients): the server checkpoints after every ``checkpoint-every`` rounds (default 1) into
``<folder>/<tag>/server``, each client its kept state after each round it trains into
``<folder>/<tag>/clients/client<id>``, and the same run started again with the same folder
continues after the last checkpointed round (``flower/resume.py``, ``docs/checkpoints.md``).

With ``dp-clip`` (and the other ``dp-*`` keys, ``sampling``) the strategy runs under user-level
differential privacy, as ``fedopt-sim`` does with the same options (``flower/privacy.py``).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Optional

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ..fl.checkpoint import atomic_file
from ..sim.config import SimConfig
from ..sim.evaluate import pooled_metrics
from ..sim.simulation import Simulation
from .client import evaluate_round, init_controls_round, train_round
from .factory import strategy_for
from .privacy import DPFedAvgStrategy
from .records import as_int, from_record, logger, to_record
from .resume import client_folder, restore_client_state, save_client_state, server_folder
from .runconfig import sim_configs
from .settings import CHECKPOINTED, RESUMED_AT, STATE_TAG
from .simdata import batch_stream, check_partition, new_model, simulation_for


def run_algorithm(
    grid: Grid,
    cfg: SimConfig,
    *,
    tag: str,
    fraction_evaluate: float = 0.0,
    timeout: float = 3600.0,
    checkpoint_dir: str = "",
    checkpoint_every: int = 1,
) -> Dict[str, Any]:
    """Run ``cfg.rounds`` rounds of ``cfg.algorithm`` through ``grid``; returns its history.

    ``checkpoint_dir``: checkpoint the server into ``<checkpoint_dir>/<tag>/server`` every
    ``checkpoint_every`` rounds, and continue from the checkpoint found there."""
    sim = simulation_for(cfg)
    names = [n for n, _ in sim.model.named_parameters()]
    model = new_model(sim)
    # a twin simulator draws each round's clients: the same clients as fedopt-sim, round by round
    sampler = Simulation(cfg, data=sim.data)
    strategy = strategy_for(
        cfg,
        fraction_evaluate=fraction_evaluate,
        seed=cfg.seed,
        state_tag=tag,
        timeout=timeout,
        client_sampler=sampler.sample_clients,
    )
    # user-level DP as fedopt-sim runs it (the run config's dp-* keys; flower/privacy.py)
    runner = strategy if cfg.dp_clip is None else DPFedAvgStrategy.from_config(strategy, cfg)
    history = []

    def evaluate(server_round: int, arrays) -> Optional[MetricRecord]:
        if server_round % cfg.eval_every and server_round not in (0, cfg.rounds):
            return None
        params = from_record(arrays, names, sim.global_params, "global arrays")
        with torch.no_grad():
            for p, v in zip(model.parameters(), params, strict=True):
                p.copy_(v)
        val = pooled_metrics(model, sim.train_clients, "val")
        history.append({"round": server_round, "val_acc": val["acc"], "val_loss": val["loss"], "params": params})
        return MetricRecord({"val-acc": val["acc"], "val-loss": val["loss"]})

    def extra_state() -> Dict[str, Any]:
        return {"history": history, "sample_rng": sampler.sample_rng.bit_generator.state}

    def load_extra_state(saved: Dict[str, Any]) -> None:
        history[:] = saved["history"]
        sampler.sample_rng.bit_generator.state = saved["sample_rng"]

    folder = server_folder(checkpoint_dir, tag)
    resumable: Dict[str, Any] = (
        {}
        if folder is None
        else dict(
            checkpoint_dir=folder,
            checkpoint_every=checkpoint_every,
            extra_state=extra_state,
            load_extra_state=load_extra_state,
        )
    )
    start = time.perf_counter()
    result = runner.start(
        grid,
        to_record(names, sim.global_params),
        num_rounds=cfg.rounds,
        timeout=timeout,
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
        evaluate_fn=evaluate,
        **resumable,
    )
    return {
        "config": cfg.to_dict(),
        "hparams": strategy.hp,
        "history": history,
        "train_metrics": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "evaluate_metrics": {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "rejections": [vars(r) for r in strategy.rejections],
        "seconds": time.perf_counter() - start,
    }


def _merged(context: Context, defaults: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    return {**dict(defaults or {}), **dict(context.run_config)}


def server_app(defaults: Optional[Mapping[str, Any]] = None) -> ServerApp:
    """ServerApp: each algorithm of the run config in turn, each with fresh client state and the same seed.

    ``defaults`` fills keys the run config lacks (e.g. when the app runs without a pyproject.toml).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = _merged(context, defaults)
        cfgs = sim_configs(run_config)
        fraction_evaluate = float(run_config.get("fraction-evaluate", 0.0))
        results = {}
        checkpoint_dir = str(run_config.get("checkpoint-dir", ""))
        checkpoint_every = int(run_config.get("checkpoint-every", 1))
        for i, cfg in enumerate(cfgs):
            out = run_algorithm(
                grid,
                cfg,
                tag=f"{i}.{cfg.algorithm}",
                fraction_evaluate=fraction_evaluate,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=checkpoint_every,
            )
            results[cfg.algorithm] = out
            last = out["history"][-1] if out["history"] else {}
            logger.info(
                "%s: val accuracy %.4f after %d rounds (%.1f s), %d replies left out",
                cfg.algorithm,
                last.get("val_acc", float("nan")),
                cfg.rounds,
                out["seconds"],
                len(out["rejections"]),
            )
        path = str(run_config.get("out", ""))
        if path:
            with atomic_file(path, "wb") as f:  # whole or not at all
                torch.save(results, f)
            logger.info("results saved to %s", path)

    return app


def client_app(defaults: Optional[Mapping[str, Any]] = None) -> ClientApp:
    """ClientApp: node ``partition-id = i`` is training client i of the simulator's users (``defaults``: as
    for ``server_app``)."""
    app = ClientApp()

    def node(msg: Message, context: Context):
        cfg = sim_configs(_merged(context, defaults))[0]  # data, model and seeds are the same for every algorithm
        sim = simulation_for(cfg)
        cid = check_partition(cfg, context.node_config)
        return sim, cid, sim.train_clients[cid], str(msg.content["config"].get(STATE_TAG, ""))

    def kept_state(msg: Message, context: Context, cid: int, tag: str):
        """With a checkpointing server: restore the client's kept state after a restart; returns the
        function that writes it after this round (flower/resume.py), or a no-op."""
        config = msg.content["config"]
        folder = client_folder(str(_merged(context, defaults).get("checkpoint-dir", "")), tag, cid)
        if folder is None or RESUMED_AT not in config:
            return lambda: None
        keys = [f"{tag}.control", f"{tag}.batches"]  # client.train_round's and simdata.batch_stream's
        restore_client_state(context.state, folder, keys, as_int(config[RESUMED_AT]))
        rnd = 0 if msg.metadata.message_type.endswith("init_controls") else as_int(config["server-round"])
        return lambda: save_client_state(context.state, folder, keys, rnd, as_int(config[CHECKPOINTED]))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        sim, cid, client, tag = node(msg, context)
        persist = kept_state(msg, context, cid, tag)
        next_batch, save = batch_stream(sim, cid, context.state, tag)
        content = train_round(
            new_model(sim),
            next_batch,
            msg.content,
            context.state,
            num_examples=client.size,
            client_id=cid,
            calibration=(client.train_x, client.train_y),
            backend=sim.backend,
        )
        save()
        persist()
        return Message(content, reply_to=msg)

    @app.train("init_controls")
    def init_controls(msg: Message, context: Context) -> Message:
        sim, cid, client, tag = node(msg, context)
        persist = kept_state(msg, context, cid, tag)
        next_batch, save = batch_stream(sim, cid, context.state, tag)
        content = init_controls_round(
            new_model(sim), next_batch, msg.content, context.state, num_examples=client.size, client_id=cid
        )
        save()
        persist()
        return Message(content, reply_to=msg)

    @app.query("client_id")
    def client_id(msg: Message, context: Context) -> Message:
        _, cid, _, _ = node(msg, context)
        return Message(RecordDict({"metrics": MetricRecord({"client-id": cid})}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        sim, cid, client, _ = node(msg, context)
        return Message(
            evaluate_round(new_model(sim), client.val_x, client.val_y, msg.content, client_id=cid), reply_to=msg
        )

    return app
