"""What every strategy of this package shares on Flower: sampling, messages, checking replies, metrics.

A round: ``configure_train`` samples clients (seeded, reproducible) and sends each the global model,
the algorithm's config (``settings.round_config``) and the server-side extras of the algorithm
(control variate, momentum); ``aggregate_train`` checks every reply, leaves out the bad ones (and
logs which client and why), sorts the good ones by client id and applies the algorithm's server
rule from ``fedopt_kernels.fl.server_rules``, the same functions the simulator calls, and the run's
server optimizer (``server-optimizer``; ``fl/server_step.py``), whose state is part of the
strategy's checkpoint.

A reply is left out when the client failed (an error reply), did not answer (dropped out or timed
out), was not sampled or answered twice, answers another round (its group id, which Flower copies
from the instruction, is not this round's), or sent arrays that are missing, extra, misshapen, not
floating point or not finite, or a ``num-examples`` that is not an integer in [1, 2**53] (exact in
float64, so the weights always sum to 1 without overflow). If the new server state would
not be finite (overflow), the round is skipped: the model and server state stay as they were.
Every left-out reply is appended to ``strategy.rejections`` as well as logged.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..fl.checkpoint import CheckpointDir, plain_settings
from ..fl.config import FLConfig
from ..fl.fold import weight_exponent
from ..fl.server_rules import RULES, ServerRule
from ..fl.server_step import ServerStep
from ..fl.work import WorkPlan
from ..sim.server_optimizer import build as build_server_step
from .arguments import check_count, check_fraction
from .records import BadUpdate, Tensors, all_finite, example_count, from_record, get_record, logger, metric, to_record
from .resume import metric_dicts
from .settings import CHECKPOINTED, RESUMED_AT, WORK_FRACTION, round_config

if TYPE_CHECKING:
    from flwr.app import MetricRecordValues

CLIENT_ID_QUERY = f"{MessageType.QUERY}.client_id"  # asks a node which client id it serves
# the initial round of a rule with initial controls (PAdaMFed's): every client's first control
INIT_MESSAGE_TYPE = f"{MessageType.TRAIN}.init_controls"
ClientSampler = Callable[[], Sequence[int]]
CHECKPOINT_KIND = "flower-server"


@dataclass
class ClientResult:
    """One accepted reply: the aggregation weight, the model delta and (SCAFFOLD, PAdaMFed) the control change."""

    node_id: int
    client_id: Optional[int]
    weight: float
    delta: Tensors
    dc: Optional[Tensors] = None
    train_loss: Optional[float] = None
    scalars: Dict[str, float] = field(default_factory=dict)  # the rule's numbers (FedNova's nova_a)


@dataclass
class Rejection:
    """A reply left out of the aggregate (``phase``: "train", "init" or "evaluate")."""

    server_round: int
    phase: str
    node_id: int
    client_id: Optional[int]
    reason: str


def _client_id_of(content: Optional[RecordDict]) -> Optional[int]:
    """The ``client-id`` metric of a reply, or None (never raises: used to name a rejected client)."""
    if content is None:
        return None
    try:
        return int(metric(content, "client-id"))
    except Exception:
        return None


class FedOptStrategy(Strategy):
    """The package's Flower strategy: one algorithm of ``fedopt-sim`` on Flower, its server rule
    read from the rule's descriptor (``fedopt_kernels.fl.server_rules``): the server tensors it keeps
    (``server_state()``; also attributes, e.g. ``strategy.c``), sends with the model, and updates.

    ``cfg`` is an ``FLConfig`` (a simulator ``SimConfig`` is one) naming the algorithm and its
    options; only its algorithm fields are used (and ``cfg.hparams()`` for the defaults). Sampling:
    ``clients_per_round`` nodes if given, else ``max(1, round(fraction_train * connected))`` (the
    simulator's rule), drawn without replacement by a generator seeded with ``seed``.
    ``num_clients`` is the N that control variates are averaged over (default: the number of
    connected nodes at the first round). ``state_tag`` prefixes the clients' state keys (default:
    the algorithm's name); give each strategy of one Flower run its own tag. Federated
    evaluation asks ``fraction_evaluate`` of the nodes (0: none).

    ``client_sampler`` replaces the sampling by client ids: called once per round, it returns the
    ids of the clients to train (e.g. ``Simulation.sample_clients`` of a twin simulator, to draw
    exactly the clients ``fedopt-sim`` draws). Nodes are then asked once, by a
    ``"query.client_id"`` message, which client id they serve (their ``client-id`` metric); a round
    where it picks as many clients as there are nodes just sends to every node.
    """

    def __init__(
        self,
        cfg: FLConfig,
        *,
        fraction_train: float = 1.0,
        clients_per_round: Optional[int] = None,
        fraction_evaluate: float = 0.0,
        min_available_nodes: int = 1,
        num_clients: Optional[int] = None,
        seed: int = 0,
        state_tag: Optional[str] = None,
        timeout: float = 3600.0,
        client_sampler: Optional[ClientSampler] = None,
    ):
        if not isinstance(cfg, FLConfig):
            raise TypeError(f"cfg must be a fedopt_kernels.FLConfig (or a sim.SimConfig), got {type(cfg).__name__}")
        self.cfg = cfg.validate()
        self.rule: ServerRule = RULES[cfg.server_rule]
        if not self._implements(self.rule):
            implemented = tuple(name for name, rule in RULES.items() if self._implements(rule))
            raise ValueError(
                f"algorithm={cfg.algorithm!r} has server rule {cfg.server_rule!r}; "
                f"{type(self).__name__} implements {implemented} (use strategy_for(cfg))"
            )
        self.server_rule = cfg.server_rule
        self.state: Dict[str, Tensors] = {}
        self.server = ServerStep("sgd")  # the run's server optimizer, over a copy of the model (first round)
        check_fraction("fraction_train", fraction_train, allow_zero=False)
        check_fraction("fraction_evaluate", fraction_evaluate, allow_zero=True)
        check_count("clients_per_round", clients_per_round)
        check_count("min_available_nodes", min_available_nodes, optional=False)
        check_count("num_clients", num_clients)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a number > 0, got {timeout!r}")
        self.hp = cfg.hparams()
        self.fraction_train, self.clients_per_round = fraction_train, clients_per_round
        self.fraction_evaluate, self.min_available_nodes = fraction_evaluate, min_available_nodes
        self.num_clients, self.timeout = num_clients, float(timeout)
        self.state_tag = state_tag if state_tag is not None else cfg.algorithm
        train_ss, eval_ss = np.random.SeedSequence(seed).spawn(2)
        self._train_rng, self._eval_rng = np.random.default_rng(train_ss), np.random.default_rng(eval_ss)
        self.names: List[str] = []
        self.global_params: Tensors = []
        self.rejections: List[Rejection] = []
        self._resumed_at: Optional[int] = None  # checkpointing start(): rounds done when it began
        self._checkpointed = 0  # ... and in its newest checkpoint
        self._sent: Dict[Tuple[str, int], List[int]] = {}
        self._setup_done = False
        self.client_sampler = client_sampler
        self._node_of: Dict[int, int] = {}  # client id -> node id (with a client_sampler)
        self._mapped_nodes: List[int] = []
        self._work = WorkPlan(cfg)  # each client's steps, where they differ (the round's draws)
        self.privacy: Optional[Any] = None  # user-level DP: set by DPFedAvgStrategy (flower/privacy.py)

    # ------------------------------------------------------------------ the server rule
    @classmethod
    def _implements(cls, rule: ServerRule) -> bool:
        """Can this class run ``rule``? (every rule; subclasses narrow it)."""
        return True

    def __getattr__(self, name: str):  # the rule's server tensors: strategy.c, strategy.m, ...
        state = self.__dict__.get("state", {})
        if name in state:
            return state[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _setup(self, grid: Grid, nodes: List[int], server_round: int, config: ConfigRecord) -> None:
        """Once, before the first round's sampling: a rule's initial round (every node's first control)."""
        if not self.rule.init_controls:
            return
        # every node, as the simulator initialises every training client
        self._sent[("init", server_round)] = list(nodes)
        content = RecordDict(
            {"arrays": to_record(self.names, self.global_params), "config": self._config(config, server_round)}
        )
        replies = grid.send_and_receive(
            self._messages(content, nodes, INIT_MESSAGE_TYPE, server_round), timeout=self.timeout
        )

        def parse(reply: RecordDict, node: int) -> Tensors:
            return from_record(
                get_record(reply, "control", ArrayRecord, "reply"), self.names, self.global_params, "control"
            )

        controls = self._check_replies(replies, server_round, "init", parse)
        if controls:
            self.state = self.rule.initial_state(controls, self._client_count())
        else:
            logger.error(
                "%s initialisation: no usable client control; starting from zero server state", self.cfg.algorithm
            )
        logger.info(
            "%s initialisation: server state from %d of %d clients", self.cfg.algorithm, len(controls), len(nodes)
        )

    def _round_records(self) -> Dict[str, ArrayRecord]:
        """Server tensors sent with the model (control variate, momentum)."""
        return {rec: to_record(self.names, self.state[key]) for rec, key in self.rule.sent.items()}

    def _server_step(self, results: List[ClientResult], server_round: Optional[int] = None) -> Dict[str, Tensors]:
        """The new server state from the sorted accepted results: {"x": ..., other server tensors}.
        ``server_round``: Flower's round number, which names the round's noise under DP."""
        if self.privacy is not None and server_round is None:
            raise ValueError("server_round is needed under differential privacy: it names the round's noise")
        weights = [r.weight for r in results] or [1.0]  # none: a DP round of noise alone
        fold = self.rule.begin(
            self.global_params,
            self.state,
            self.hp,
            self._client_count(),
            self.cfg.local_steps,
            weight_exponent(weights),
        )
        fold = self.server.begin(fold)
        for r in results:
            reply: Dict[str, Any] = dict(r.scalars)  # the rule's numbers (FedNova's a_i) beside its tensors
            if r.dc is not None:
                reply["dc"] = r.dc
            fold.add(r.delta, r.weight, reply)
        if self.privacy is not None:  # noise once, divide by the expected count, count the round
            assert server_round is not None  # refused above
            self.privacy.finish(fold, server_round)
        out = fold.finish()
        if self.server.optimizer is not None and all(all_finite(v) for v in out.values()):
            before = copy.deepcopy(self.server.state_dict())
            out["x"] = [t.clone() for t in self.server.step(fold, out["x"])]
            if not all_finite(out["x"]):  # the round is skipped (aggregate_train): so is the optimizer's step
                self.server.load_state_dict(before)
        return out

    def _commit(self, state: Dict[str, Tensors]) -> None:
        self.global_params = state["x"]
        self.state = {key: v for key, v in state.items() if key != "x"}

    def server_state(self) -> Dict[str, Tensors]:
        """The server's tensors besides the global model (empty for FedAvg-style rules with ``sgd``): the
        rule's, and the server optimizer's as ``"server_optimizer"`` where the run has one."""
        out = dict(self.state)
        if self.server.optimizer is not None:
            out["server_optimizer"] = self.server.tensors()
        return out

    @property
    def uses_controls(self) -> bool:
        return "dc" in self.rule.reply

    # ------------------------------------------------------------------ checkpoints (flower/resume.py)
    def checkpoint_settings(self, num_rounds: int, initial_arrays: ArrayRecord) -> Dict[str, Any]:
        """What a checkpoint must have been saved with to continue this strategy's run."""
        h = hashlib.sha256()
        for name, arr in initial_arrays.items():
            a = np.ascontiguousarray(arr.numpy())
            h.update(f"{name}{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        return plain_settings(
            {
                "strategy": type(self).__name__,
                "config": dataclasses.asdict(self.cfg),
                "hparams": self.hp,
                "num_rounds": num_rounds,
                "fraction_train": self.fraction_train,
                "clients_per_round": self.clients_per_round,
                "fraction_evaluate": self.fraction_evaluate,
                "configured num_clients": self.num_clients,
                "state_tag": self.state_tag,
                "initial arrays sha256": h.hexdigest()[:16],
                "client sampler": self.client_sampler is not None,
                **({} if self.privacy is None else {"privacy": self.privacy.checkpoint_settings()}),
            }
        )

    def checkpoint_state(self) -> Dict[str, Any]:
        """The server's part of a checkpoint: model, rule state, N, initial round done, generators, rejections."""
        return {
            "names": list(self.names),
            "global": [t.detach().cpu().clone() for t in self.global_params],
            "state": {k: [t.detach().cpu().clone() for t in v] for k, v in self.state.items()},
            "server_optimizer": copy.deepcopy(self.server.state_dict()),
            "num_clients": self.num_clients,
            "setup_done": self._setup_done,
            "train_rng": self._train_rng.bit_generator.state,
            "eval_rng": self._eval_rng.bit_generator.state,
            "rejections": [vars(r) for r in self.rejections],
            "privacy": None if self.privacy is None else self.privacy.state_dict(),
        }

    def load_checkpoint_state(self, saved: Dict[str, Any]) -> None:
        """Take back what ``checkpoint_state`` returned (from a checkpoint of the same settings)."""
        self.names = list(saved["names"])
        self.global_params = list(saved["global"])
        self.state = {k: list(v) for k, v in saved["state"].items()}
        self._make_server_step()
        self.server.load_state_dict(saved.get("server_optimizer", {}))
        self.num_clients = saved["num_clients"]
        self._setup_done = bool(saved["setup_done"])
        self._train_rng.bit_generator.state = saved["train_rng"]
        self._eval_rng.bit_generator.state = saved["eval_rng"]
        self.rejections = [Rejection(**r) for r in saved["rejections"]]
        if self.privacy is not None:
            self.privacy.load_state_dict(saved["privacy"])

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: Optional[ConfigRecord] = None,
        evaluate_config: Optional[ConfigRecord] = None,
        evaluate_fn: Optional[Callable[[int, ArrayRecord], Optional[MetricRecord]]] = None,
        *,
        checkpoint_dir: Optional[Union[str, os.PathLike]] = None,
        checkpoint_every: int = 1,
        extra_state: Optional[Callable[[], Dict[str, Any]]] = None,
        load_extra_state: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> Result:
        """Flower's ``Strategy.start``; with ``checkpoint_dir``, a run that survives a restart.

        The strategy then checkpoints into ``checkpoint_dir`` after every ``checkpoint_every`` rounds
        and after the last one; started again with the same folder and settings, it continues after
        the checkpoint's round (``evaluate_fn`` is not called again for rounds already done). A
        checkpoint of other settings or a damaged one raises ``CheckpointError``. ``extra_state()``
        adds the caller's own plain data and tensors to each checkpoint; ``load_extra_state`` gets
        them back on a restart. Without ``checkpoint_dir`` this is Flower's ``start`` unchanged.
        """
        if checkpoint_dir is None:
            return super().start(
                grid,
                initial_arrays,
                num_rounds=num_rounds,
                timeout=timeout,
                train_config=train_config,
                evaluate_config=evaluate_config,
                evaluate_fn=evaluate_fn,
            )
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
        ckpt = CheckpointDir(Path(checkpoint_dir), CHECKPOINT_KIND)
        settings = self.checkpoint_settings(num_rounds, initial_arrays)
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        arrays, done = initial_arrays, 0
        if ckpt.exists():
            done, saved = ckpt.load(settings)
            self.load_checkpoint_state(saved["strategy"])
            if load_extra_state is not None:
                load_extra_state(saved["extra"])
            arrays = to_record(self.names, self.global_params)
            result.arrays = arrays
            for name in ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp"):
                getattr(result, name).update({r: MetricRecord(m) for r, m in saved["result"][name].items()})
            logger.info("%s: resumed from the checkpoint of round %d in %s", self.cfg.algorithm, done, ckpt.folder)
        elif evaluate_fn is not None:
            res = evaluate_fn(0, initial_arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        self._resumed_at = self._checkpointed = done
        for rnd in range(done + 1, num_rounds + 1):
            logger.info("[ROUND %s/%s]", rnd, num_rounds)
            replies = grid.send_and_receive(self.configure_train(rnd, arrays, train_config, grid), timeout=timeout)
            new_arrays, metrics = self.aggregate_train(rnd, replies)
            if new_arrays is not None:
                result.arrays = arrays = new_arrays
            if metrics is not None:
                result.train_metrics_clientapp[rnd] = metrics
            replies = grid.send_and_receive(
                self.configure_evaluate(rnd, arrays, evaluate_config, grid), timeout=timeout
            )
            metrics = self.aggregate_evaluate(rnd, replies)
            if metrics is not None:
                result.evaluate_metrics_clientapp[rnd] = metrics
            if evaluate_fn is not None:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
            if rnd % checkpoint_every == 0 or rnd == num_rounds:
                ckpt.save(
                    rnd,
                    settings,
                    {
                        "strategy": self.checkpoint_state(),
                        "extra": extra_state() if extra_state is not None else {},
                        "result": {
                            name: metric_dicts(getattr(result, name))
                            for name in (
                                "train_metrics_clientapp",
                                "evaluate_metrics_clientapp",
                                "evaluate_metrics_serverapp",
                            )
                        },
                    },
                )
                self._checkpointed = rnd
        return result

    # ------------------------------------------------------------------ helpers
    def summary(self) -> None:
        logger.info(
            "\t├── fedopt_kernels %s: algorithm=%s, hparams=%s",
            type(self).__name__,
            self.cfg.algorithm,
            {k: v for k, v in self.hp.items() if v is not None},
        )
        logger.info(
            "\t└── local_steps=%d, clients_per_round=%s, fraction_train=%.2f, fraction_evaluate=%.2f",
            self.cfg.local_steps,
            self.clients_per_round,
            self.fraction_train,
            self.fraction_evaluate,
        )

    def _load_global(self, arrays: ArrayRecord) -> None:
        first = not self.names
        if first:
            self.names = list(arrays.keys())
            like = [torch.from_numpy(np.array(arrays[n].numpy())) for n in self.names]
        else:
            like = self.global_params
        try:
            self.global_params = from_record(arrays, self.names, like, "global arrays")
        except BadUpdate as exc:
            raise ValueError(f"the global arrays are unusable: {exc}") from None
        if first:
            self._init_server_tensors()

    def _init_server_tensors(self) -> None:
        """Server tensors before the first round (zeros; a rule's initial round may replace them)."""
        self.state = self.rule.init_state(self.global_params)
        self._make_server_step()

    def _make_server_step(self) -> None:
        """The run's server optimizer, over its own copy of the global model (``global_params`` is
        replaced by each round's arrays)."""
        self.server = build_server_step(self.cfg, [t.detach().clone() for t in self.global_params], self.cfg.backend)

    def _nodes(self, grid: Grid) -> List[int]:
        while len(nodes := sorted(grid.get_node_ids())) < self.min_available_nodes:
            logger.info(
                "Waiting for nodes to connect: %d connected (minimum required: %d).",
                len(nodes),
                self.min_available_nodes,
            )
            time.sleep(1)
        if self.num_clients is None:
            self.num_clients = len(nodes)
        return nodes

    def _client_count(self) -> int:
        """N (``num_clients``): given, or the number of nodes of the first round (``_nodes``)."""
        assert self.num_clients is not None  # every round lists the nodes before its server step
        return self.num_clients

    def _sample(self, nodes: List[int], count: int, rng: np.random.Generator) -> List[int]:
        if count >= len(nodes):
            return list(nodes)
        # draw positions, not ids: Flower's node ids are unsigned 64-bit and numpy would round them to floats
        return sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=count, replace=False))

    def _client_nodes(self, grid: Grid, nodes: List[int]) -> Dict[int, int]:
        """Client id -> node id, asked of every node whenever the set of connected nodes changes."""
        if nodes != self._mapped_nodes:
            content = RecordDict({"config": ConfigRecord({"server-round": 0})})
            replies = grid.send_and_receive(self._messages(content, nodes, CLIENT_ID_QUERY, 0), timeout=self.timeout)
            self._node_of = {}
            for msg in replies:
                node = int(msg.metadata.src_node_id)
                cid = None if msg.has_error() else _client_id_of(msg.content)
                if cid is None or cid in self._node_of:
                    why = (
                        msg.error.reason
                        if msg.has_error()
                        else ("a duplicate client id" if cid is not None else "no client-id")
                    )
                    logger.warning("node %d cannot be mapped to a client id (%s); it is not sampled", node, why)
                    continue
                self._node_of[cid] = node
            self._mapped_nodes = list(nodes)
        return self._node_of

    def _sample_train(self, grid: Grid, nodes: List[int], server_round: int) -> List[int]:
        if self.client_sampler is None:
            if self.privacy is not None:  # DP's sampling: Poisson, or the accountant's fixed count
                return self.privacy.sample(nodes, self._train_rng)
            count = (
                self.clients_per_round
                if self.clients_per_round is not None
                else max(1, int(round(self.fraction_train * len(nodes))))
            )
            return self._sample(nodes, count, self._train_rng)
        cids = [int(c) for c in self.client_sampler()]
        if len(set(cids)) == len(nodes):
            return list(nodes)  # everyone trains: no need to ask who is who (saves a round trip)
        node_of = self._client_nodes(grid, nodes)
        picked = []
        for cid in cids:
            if cid in node_of:
                picked.append(node_of[cid])
            else:
                self.rejections.append(Rejection(server_round, "train", -1, cid, "no node serves this client"))
                logger.warning("round %d: client %d was sampled but no node serves it", server_round, cid)
        return sorted(picked)

    def _config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        out = ConfigRecord(dict(config))  # the caller's keys, then ours (ours win)
        for k, v in round_config(self.cfg, self.hp, server_round - 1, self.state_tag).items():
            out[k] = v
        out["server-round"] = server_round
        if self._resumed_at is not None:  # clients keep their state files by these (flower/resume.py)
            out[RESUMED_AT] = self._resumed_at
            out[CHECKPOINTED] = self._checkpointed
        return out

    def _messages(
        self, content: RecordDict, nodes: Sequence[int], message_type: str, server_round: int
    ) -> List[Message]:
        return [Message(content, dst_node_id=n, message_type=message_type, group_id=str(server_round)) for n in nodes]

    def _reject(self, server_round: int, phase: str, node_id: int, client_id: Optional[int], reason: str) -> None:
        self.rejections.append(Rejection(server_round, phase, node_id, client_id, reason))
        who = f"node {node_id}" + (f" (client {client_id})" if client_id is not None else "")
        logger.warning("round %d %s: left %s out of the aggregate: %s", server_round, phase, who, reason)

    def _check_replies(self, replies: Iterable[Message], server_round: int, phase: str, parse) -> list:
        """Parsed accepted replies, sorted by (client id, node id); every other reply rejected and logged."""
        sent = self._sent.pop((phase, server_round), [])
        accepted, seen, stale = [], set(), set()
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            content = None if msg.has_error() else msg.content
            try:
                if node not in sent:
                    raise BadUpdate("reply from a node that was not asked this round")
                if node in seen:
                    raise BadUpdate("second reply from the same node")
                if msg.metadata.group_id != str(server_round):  # a late reply to an earlier round's instruction
                    stale.add(node)
                    raise BadUpdate(
                        f"reply tagged for round {msg.metadata.group_id!r}, not this round ({server_round}): stale"
                    )
                seen.add(node)
                if msg.has_error():
                    raise BadUpdate(f"the client failed: {msg.error.reason}")
                accepted.append((_client_id_of(content), node, parse(content, node)))
            except BadUpdate as exc:
                self._reject(server_round, phase, node, _client_id_of(content), str(exc))
        for node in sent:
            if node not in seen and node not in stale:  # a stale reply is already this node's logged dropout
                self._reject(server_round, phase, node, None, "no reply: the client dropped out or timed out")
        accepted.sort(key=lambda a: (a[0] is None, a[0] if a[0] is not None else 0, a[1]))
        return [a[2] for a in accepted]

    def _parse_train(self, content: RecordDict, node: int) -> ClientResult:
        weight = example_count(content)
        delta = from_record(get_record(content, "delta", ArrayRecord, "reply"), self.names, self.global_params, "delta")
        dc = None
        if self.uses_controls:
            dc = from_record(get_record(content, "dc", ArrayRecord, "reply"), self.names, self.global_params, "dc")
        loss = None
        if "metrics" in content and "train-loss" in content["metrics"]:
            loss = metric(content, "train-loss")
        scalars = {name: metric(content, name.replace("_", "-")) for name in self.rule.scalars}
        for name, v in scalars.items():
            if not v > 0:
                raise BadUpdate(f"metrics: {name.replace('_', '-')!r} must be > 0, got {v!r}")
        return ClientResult(node, _client_id_of(content), weight, delta, dc, loss, scalars)

    # ------------------------------------------------------------------ Strategy API: training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._load_global(arrays)
        nodes = self._nodes(grid)
        if not self._setup_done:
            self._setup(grid, nodes, server_round, config)
            self._setup_done = True
        sampled = self._sample_train(grid, nodes, server_round)
        self._sent[("train", server_round)] = sampled
        logger.info(
            "configure_train: %d of %d nodes train round %d (%s)",
            len(sampled),
            len(nodes),
            server_round,
            self.cfg.algorithm,
        )
        content = RecordDict(
            {
                "arrays": to_record(self.names, self.global_params),
                "config": self._config(config, server_round),
                **self._round_records(),
            }
        )
        if self._work.uneven:
            return self._work_messages(content, sampled, server_round)
        return self._messages(content, sampled, MessageType.TRAIN, server_round)

    def _work_messages(self, content: RecordDict, nodes: Sequence[int], server_round: int) -> List[Message]:
        """Clients that differ in their work (``fl/work.py``): each sampled node's message with its own
        ``local_steps`` (drawn from ``local_steps_range``) and, for a straggler, the fraction of its
        steps it takes (``work-fraction``); a client under ``local_epochs`` counts its own steps."""
        drawn, late = self._work.draw(server_round - 1, len(nodes))
        out: List[Message] = []
        for j, node in enumerate(nodes):
            config = ConfigRecord(dict(cast(ConfigRecord, content["config"])))
            if drawn is not None:
                config["local_steps"] = drawn[j]
            if j in late:
                config[WORK_FRACTION] = late[j]
            own = RecordDict({**{k: v for k, v in content.items() if k != "config"}, "config": config})
            out += self._messages(own, [node], MessageType.TRAIN, server_round)
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        results: List[ClientResult] = self._check_replies(replies, server_round, "train", self._parse_train)
        left_out = sum(1 for r in self.rejections if r.server_round == server_round and r.phase == "train")
        if self.privacy is not None:  # each reply clipped as one vector, weight 1 (flower/privacy.py)
            results = [self.privacy.clip(r) for r in results]
        if not results and self.privacy is None:
            logger.warning(
                "round %d: no usable client update; the global model and server state are unchanged", server_round
            )
            return to_record(self.names, self.global_params), MetricRecord(
                {"clients-used": 0, "clients-left-out": left_out}
            )
        state = self._server_step(results, server_round)
        if not all(all_finite(v) for v in state.values()):
            logger.error(
                "round %d: the aggregate is not finite (overflow?); round skipped, state unchanged", server_round
            )
            self.rejections.append(Rejection(server_round, "train", -1, None, "aggregate not finite: round skipped"))
        else:
            self._commit(state)
        metrics: Dict[str, MetricRecordValues] = {"clients-used": len(results), "clients-left-out": left_out}
        with_loss = [(r.weight, r.train_loss) for r in results if r.train_loss is not None]
        if with_loss:
            total = sum(w for w, _ in with_loss)
            metrics["train-loss"] = sum(w * loss for w, loss in with_loss) / total
        if self.privacy is not None:
            metrics.update(self.privacy.metrics())
        return to_record(self.names, self.global_params), MetricRecord(metrics)

    # ------------------------------------------------------------------ Strategy API: evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.fraction_evaluate == 0:
            return []
        self._load_global(arrays)
        nodes = self._nodes(grid)
        sampled = self._sample(nodes, max(1, int(round(self.fraction_evaluate * len(nodes)))), self._eval_rng)
        self._sent[("evaluate", server_round)] = sampled
        content = RecordDict(
            {"arrays": to_record(self.names, self.global_params), "config": self._config(config, server_round)}
        )
        return self._messages(content, sampled, MessageType.EVALUATE, server_round)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        def parse(content: RecordDict, node: int) -> Tuple[float, Dict[str, float]]:
            n = example_count(content, allow_zero=True)
            values = {
                k: metric(content, k) for k in content["metrics"].keys() if k not in ("num-examples", "client-id")
            }
            return n, values

        results = [r for r in self._check_replies(replies, server_round, "evaluate", parse) if r[0] > 0]
        if not results:
            return None
        total = sum(n for n, _ in results)
        keys = sorted(set().union(*(v.keys() for _, v in results)))
        return MetricRecord(
            {k: sum(n * v[k] for n, v in results if k in v) / sum(n for n, v in results if k in v) for k in keys}
            | {"num-examples": int(total)}
        )
