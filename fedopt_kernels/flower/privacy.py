"""User-level differential privacy on Flower: DP-FedAvg with adaptive clipping over the package's strategies.

``DPFedAvgStrategy(strategy, dp_clip=C, dp_noise_multiplier=z, ...)`` wraps one of the package's
strategies (``strategy_for``, ``ScaffoldStrategy``, ...) the way Flower's own DP wrappers wrap
theirs, and makes its aggregation the simulator's (``fedopt-sim --dp-clip``; docs/privacy.md):
each accepted reply, the model update and the rule's reply tensors (SCAFFOLD's and PAdaMFed's
``dc``) as one vector, is clipped to norm C with weight 1 before the fold adds it; the round's
sums get Gaussian noise once, drawn from a generator seeded by ``(seed, round)``, and are divided
by the expected number of clients; C follows a quantile of the norms when asked; the privacy spent
is counted by ``dp-accounting``. The pieces are ``fedopt_kernels.privacy.DPFedAvg``'s and the
settings are checked by the simulator's own checks (``sim/dp_round.py``), so a setting the
simulator refuses (FedNova's reported weights, FedExP's server step) is refused here too.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..fl.fold import Fold
from ..privacy.dp_fedavg import DPFedAvg
from ..sim import dp_round
from ..sim.config import SimConfig
from .arguments import check_count
from .base import ClientResult, FedOptStrategy
from .records import logger

# the round record's entries (DPFedAvg.finish_round) as the round's Flower metrics
METRICS = {"dp_epsilon": "dp-epsilon", "dp_clip": "dp-clip", "dp_next_clip": "dp-next-clip"}


class DPFedAvgStrategy(Strategy):
    """``strategy`` under user-level DP: DP-FedAvg ("Learning Differentially Private Recurrent Language
    Models", McMahan, Ramage, Talwar, Zhang; ICLR 2018) with adaptive clipping ("Differentially Private
    Learning with Adaptive Clipping", Andrew, Thakkar, McMahan, Ramaswamy; NeurIPS 2021).

    A round, for the replies the strategy accepts, in client order, with ``E`` the expected number of
    clients per round (``q N`` under Poisson sampling, ``M`` under fixed-size sampling)::

        r_i   = (delta_i, reply tensors_i) * min(1, C / ||(delta_i, reply tensors_i)||)   (weight 1)
        sums  = sum_i r_i + N(0, (z_Delta C)^2)  per coordinate, drawn from (seed, round)
        mean  = sums / E                          (the rule then steps as it does without DP)
        C    <- C exp(-eta_C ((sum_i 1[||.|| <= C] + N(0, sigma_b^2)) / E - gamma))   (adaptive)

    ``z_Delta = z`` without adaptive clipping, else ``(z^-2 - (2 sigma_b)^-2)^(-1/2)`` with
    ``sigma_b = E / 20``, so the round is worth the Gaussian mechanism of multiplier z, which the
    accountant counts. Each round's metrics add ``dp-epsilon`` (at ``dp_delta``, after this round),
    ``dp-clip`` (the C used) and ``dp-next-clip``; the strategy's checkpoints (``start(...,
    checkpoint_dir=...)``) keep the clip and the rounds counted, so a restarted run goes on bit for bit.

    Settings (the names of ``fedopt-sim``'s ``--dp-*`` options): ``dp_clip`` C > 0; exactly one of
    ``dp_noise_multiplier`` z >= 0 and ``dp_target_epsilon`` (then ``rounds``, the rounds planned, is
    needed: z is calibrated for them); ``dp_delta`` in (0, 1), default ``1 / N^1.1``;
    ``dp_adaptive_quantile`` gamma in [0, 1] and ``dp_clip_lr`` eta_C; ``dp_accountant`` "rdp" or
    "pld" (Poisson only). ``sampling``: "fixed" samples ``M`` of the nodes (the strategy's
    ``clients_per_round``, else ``round(fraction_train * N)``), "poisson" each node with probability
    ``clients_per_round / N``, else ``fraction_train``; a strategy with a ``client_sampler`` draws its
    own clients, which must follow ``sampling``. ``num_clients`` N: the population the accountant
    counts (default the strategy's ``num_clients``). ``seed`` names the noise; give each run its own.
    A ValueError names the first setting out of range, before anything is built.

    The noise is pseudo-random and reproducible from the seed: a simulation's, not the secure
    randomness a deployment needs (docs/privacy.md). Every other attribute is the wrapped strategy's.
    """

    def __init__(
        self,
        strategy: FedOptStrategy,
        *,
        dp_clip: float,
        dp_noise_multiplier: Optional[float] = None,
        dp_target_epsilon: Optional[float] = None,
        rounds: Optional[int] = None,
        dp_delta: Optional[float] = None,
        dp_adaptive_quantile: Optional[float] = None,
        dp_clip_lr: float = 0.2,
        dp_accountant: str = "rdp",
        sampling: str = "fixed",
        num_clients: Optional[int] = None,
        seed: int = 0,
    ):
        if not isinstance(strategy, FedOptStrategy):
            raise TypeError(
                f"strategy must be one of fedopt_kernels.flower's strategies (strategy_for(cfg), ...), got "
                f"{type(strategy).__name__}; Flower's own strategies take Flower's DP wrappers (docs/privacy.md)"
            )
        if strategy.privacy is not None:
            raise ValueError("strategy is already under differential privacy: wrap it once")
        if dp_clip is None:
            raise ValueError("dp_clip must be a number > 0 (each reply's norm bound), got None")
        n = strategy.num_clients if num_clients is None else num_clients
        if n is None:
            raise ValueError(
                "num_clients must be given (here or to the strategy): the accountant counts a population of N clients"
            )
        check_count("num_clients", n, optional=False)
        if strategy.num_clients not in (None, n):
            raise ValueError(f"num_clients={n} differs from the strategy's num_clients={strategy.num_clients}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        fixed = strategy.clients_per_round or max(1, int(round(strategy.fraction_train * n)))
        if sampling == "fixed" and fixed > n:
            raise ValueError(f"clients_per_round={fixed} is more than num_clients={n}")
        cfg = strategy.cfg
        # the simulator's settings by the simulator's names: its checks and its DPFedAvg, unchanged
        settings = SimpleNamespace(
            algorithm=cfg.algorithm,
            server_rule=cfg.server_rule,
            server_optimizer=cfg.server_optimizer,
            sampling=sampling,
            num_train_clients=n,
            clients_per_round=strategy.clients_per_round,
            sample_rate=strategy.fraction_train,
            sampled_per_round=fixed,
            seed=seed,
            rounds=rounds,
            dp_clip=dp_clip,
            dp_noise_multiplier=dp_noise_multiplier,
            dp_target_epsilon=dp_target_epsilon,
            dp_delta=dp_delta,
            dp_adaptive_quantile=dp_adaptive_quantile,
            dp_clip_lr=dp_clip_lr,
            dp_accountant=dp_accountant,
            dp_max_epsilon=None,
        )
        dp_round.check(settings)
        if dp_target_epsilon is not None:  # z is calibrated for the rounds planned
            check_count("rounds", rounds, optional=False)
        dp = dp_round.build(settings)
        assert dp is not None  # dp_clip is given
        self.dp: DPFedAvg = dp
        self._settings = {
            "dp_clip": float(dp_clip),
            "noise_multiplier": dp.z,
            "dp_delta": dp.accountant.delta,
            "dp_adaptive_quantile": dp_adaptive_quantile,
            "dp_clip_lr": dp_clip_lr,
            "dp_accountant": dp_accountant,
            "sampling": dataclasses.asdict(dp.sampling),
            "seed": seed,
        }
        self._record: Dict[str, float] = {}
        strategy.num_clients = n
        strategy.privacy = self  # the strategy's aggregation calls back: clip, finish, sample, state
        self.strategy = strategy

    @classmethod
    def from_config(cls, strategy: FedOptStrategy, cfg: SimConfig) -> DPFedAvgStrategy:
        """``strategy`` under the ``dp_*`` settings of a simulator config (``cfg.dp_clip`` given): the
        privacy ``fedopt-sim`` runs ``cfg`` with. ``dp_max_epsilon`` is the simulator's alone."""
        if cfg.dp_clip is None:
            raise ValueError("dp_clip must be a number > 0 (each reply's norm bound), got None: the config has no DP")
        if cfg.dp_max_epsilon is not None:
            raise ValueError(
                "dp_max_epsilon stops fedopt-sim's runs; a Flower run states its rounds instead (num_rounds): leave "
                "dp_max_epsilon out and give dp_target_epsilon to calibrate z for them"
            )
        return cls(
            strategy,
            dp_clip=cfg.dp_clip,
            dp_noise_multiplier=cfg.dp_noise_multiplier,
            dp_target_epsilon=cfg.dp_target_epsilon,
            rounds=cfg.rounds,
            dp_delta=cfg.dp_delta,
            dp_adaptive_quantile=cfg.dp_adaptive_quantile,
            dp_clip_lr=cfg.dp_clip_lr,
            dp_accountant=cfg.dp_accountant,
            sampling=cfg.sampling,
            num_clients=cfg.num_train_clients,
            seed=cfg.seed,
        )

    # ------------------------------------------------------------------ what the strategy calls back
    def sample(self, nodes: List[int], rng: np.random.Generator) -> List[int]:
        """The round's nodes: each with probability q (Poisson; one uniform draw per node, in node order),
        or M of them without replacement (fixed)."""
        s = self.dp.sampling
        if s.kind == "poisson":
            return [node for node, u in zip(nodes, rng.random(len(nodes)), strict=True) if u < s.rate]
        if s.per_round >= len(nodes):
            return list(nodes)
        return sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=s.per_round, replace=False))

    def clip(self, result: ClientResult) -> ClientResult:
        """``result`` with its update and reply tensors clipped as one vector (``DPFedAvg.clip_reply``), weight 1."""
        reply = {} if result.dc is None else {"dc": result.dc}
        delta, reply = self.dp.clip_reply(result.delta, reply, self.strategy.rule.reply)
        return dataclasses.replace(result, delta=delta, dc=reply.get("dc"), weight=1.0)

    def finish(self, fold: Fold, server_round: int) -> None:
        """Round ``server_round``'s noise, divisor, clip update and epsilon (``DPFedAvg.finish_round``; the
        simulator's round ``t = server_round - 1``); Flower logs them with the round's metrics."""
        self._record = self.dp.finish_round(fold, server_round - 1, self.strategy.rule.reply)

    def metrics(self) -> Dict[str, float]:
        return {METRICS[k]: float(v) for k, v in self._record.items()}

    def checkpoint_settings(self) -> Dict[str, Any]:
        """What a checkpoint must have been saved with to continue: the settings, z as calibrated."""
        return dict(self._settings)

    def state_dict(self) -> Dict[str, Any]:
        return self.dp.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.dp.load_state_dict(state)

    # ------------------------------------------------------------------ Flower's Strategy: the wrapped one's
    @property
    def epsilon(self) -> float:
        """The privacy spent so far: epsilon at ``dp_delta`` after the rounds run (0 before the first)."""
        return self.dp.epsilon_after(self.dp.rounds)

    def __getattr__(self, name: str) -> Any:  # global_params, rejections, server_state(), ...
        strategy = self.__dict__.get("strategy")
        if strategy is None:
            raise AttributeError(name)
        return getattr(strategy, name)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()
        self._say_settings()

    def _say_settings(self) -> None:
        s = self.dp.sampling
        logger.info(
            "\t└── user-level DP: clip %g%s, noise multiplier %.4g, delta %.3g, %s sampling (expected %g of %d), %s",
            self._settings["dp_clip"],
            "" if self.dp.quantile is None else f" (adaptive, quantile {self.dp.quantile:g})",
            self.dp.z,
            self.dp.accountant.delta,
            s.kind,
            s.expected,
            s.population,
            self.dp.accountant.kind,
        )

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """The wrapped strategy's ``start`` (Flower's, or with ``checkpoint_dir`` the resumable one)."""
        self._say_settings()  # the wrapped start logs the strategy's own summary
        return self.strategy.start(grid, initial_arrays, *args, **kwargs)
