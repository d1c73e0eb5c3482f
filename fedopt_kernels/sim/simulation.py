"""The round loop shared by every algorithm, and the run around it (setup, evaluation, result).

Randomness comes from one ``numpy.random.SeedSequence(seed)`` split into independent streams for the
data partition, the model initialisation, client sampling, each client's mini-batches and each
user's fine-tuning batches. None of them depends on the optimizer backend, so runs on different
backends with the same seed see the same clients and batches.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from ..core import fallbacks
from ..core import registry as _registry
from ..fl.checkpoint import CheckpointDir
from ..fl.work import WorkPlan, histogram
from . import dp_round
from . import resume as _resume
from .batched.precision import check_supported
from .client_state_files import ClientStateFiles
from .config import SimConfig
from .data.clients import BatchStream, BatchStreams, ClientData
from .dp_chunk import ChunkClip
from .evaluate import EvalCost, evaluate_users
from .federated_data import FederatedData, build_federated_data
from .models.build import build_model
from .rank_round import (
    RANK_CHECK_EVERY,
    check_ranks_agree,
    check_start,
    pooled_validation,
    share_round,
    spread_augmentation,
)
from .ranks import Ranks
from .screen import logger, screen
from .strategy import ClientUpdate, Strategy


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def resolve_backend(cfg: SimConfig, device: torch.device) -> str:
    """The concrete backend the run's optimizers use; ValueError naming it when it cannot run here.

    Client-batched runs use the client-batched form of the op (``<op>_batched``).
    """
    op = cfg.algo.op.name + ("_batched" if cfg.batched else "")
    name = _registry.auto_backend(device, op) if cfg.backend == "auto" else cfg.backend
    why = _registry.unavailable_reason(name, device, op)
    if why is not None:
        raise ValueError(f"backend={cfg.backend!r} cannot be used: {why}")
    if cfg.replay:
        if device.type != "cuda":
            raise ValueError(f"replay needs a CUDA device, but the run is on {device}")
        if name == "reference":
            raise ValueError(
                f"replay needs a fused client-batched backend (cuda or triton); backend="
                f"{cfg.backend!r} is 'reference' here, whose batched ops read step counters on the host"
            )
    return name


class Simulation:
    """One FL run. ``run()`` does everything; ``run_round(t)`` lets a caller step runs side by side.

    ``data`` and ``model_fn`` replace the data set / model built from ``cfg`` (tests use tiny ones).
    ``dtype`` (e.g. ``torch.float64``) casts the model and the floating-point data to it; the
    validations use it to compare two computations of the same mathematics far below any tolerance.

    ``checkpoint_dir``: ``run()`` checkpoints into this folder after every ``checkpoint_every``
    completed rounds and after the last one (``sim.resume`` and ``docs/checkpoints.md``);
    ``run(resume=True)`` first continues from the checkpoint found there, if any.

    ``client_state_dir``: what clients keep between rounds (SCAFFOLD's, PAdaMFed's, FedDyn's) lives
    in files in this folder instead of host memory (``sim/client_state_files.py``).

    ``ranks``: the processes this run is split over (``sim/ranks.py``: ``Ranks.from_environment()``
    under torchrun); each trains its share of a round, and all end every round with the same model
    and server state. Rank 0 alone writes checkpoints. Client state is then in files every rank
    reaches (``client_state_dir``).
    """

    def __init__(
        self,
        cfg: SimConfig,
        data: Optional[FederatedData] = None,
        model_fn: Optional[Callable[[], nn.Module]] = None,
        dtype: Optional[torch.dtype] = None,
        checkpoint_dir: Optional[Union[str, os.PathLike]] = None,
        checkpoint_every: int = 5,
        client_state_dir: Optional[Union[str, os.PathLike]] = None,
        ranks: Optional[Ranks] = None,
    ):
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
        self.checkpoint = (
            None
            if checkpoint_dir is None
            else CheckpointDir(Path(checkpoint_dir), _resume.KIND, _resume.RENAMED_SETTINGS)
        )
        self.checkpoint_every = checkpoint_every
        self.checkpoint_stats: List[Dict[str, float]] = []  # bytes and seconds of each checkpoint this run wrote
        self.resumed_from = 0
        self.cfg = cfg.validate()
        self.hp = cfg.hparams()
        self.ranks = ranks if ranks is not None else Ranks.single()
        self._fallbacks_from = fallbacks.mark()  # the GPU-only paths this run gave up (core/fallbacks.py)
        self.device = self.ranks.device(resolve_device(cfg.device))
        self.backend = resolve_backend(cfg, self.device)
        ss_data, ss_init, ss_sample, ss_batch, ss_tune = np.random.SeedSequence(cfg.seed).spawn(5)
        self.data = data if data is not None else build_federated_data(cfg, np.random.default_rng(ss_data), self.device)
        if dtype is not None:
            self.data = self.data.to_dtype(dtype)
        if len(self.data.train_clients) != cfg.num_train_clients:
            raise ValueError(
                f"data has {len(self.data.train_clients)} training clients, config expects {cfg.num_train_clients}"
            )
        self.work_plan = WorkPlan(cfg, [c.size for c in self.data.train_clients])  # each client's steps
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(ss_init.generate_state(1)[0]))
            model = (
                model_fn()
                if model_fn is not None
                else build_model(
                    cfg.model,
                    self.data.input_shape,
                    self.data.num_classes,
                    self.data.input_spec,
                    cfg.hidden,
                    cfg.context,
                )
            )
        if self.ranks.world > 1:
            spread_augmentation(model, self.ranks.rank)
        self.model = model.to(self.device) if dtype is None else model.to(self.device, dtype)
        check_supported(self.model, cfg.precision, self.device)  # bf16 on a CPU without a kernel for a layer
        self.global_params: List[torch.Tensor] = [p.detach().clone() for p in self.model.parameters()]
        self.initial_model_digest = _resume.tensor_digest(self.global_params)
        self.sample_rng = np.random.default_rng(ss_sample)
        self.streams = BatchStreams(self.train_clients, cfg.batch_size, ss_batch)
        self._tune_seed = ss_tune
        self.strategy = Strategy(self)
        self.privacy = dp_round.build(cfg)  # user-level DP (sim/dp_round.py); None: off
        self.dp_stopped: Optional[str] = None
        self._chunk_clip: Optional[ChunkClip] = None
        self.strategy.client.work = self.work_plan
        self.batched = None
        if cfg.batched:  # --client-batched: the sampled clients train N at a time (batched_round.py)
            from .batched_round import BatchedClients

            self.batched = BatchedClients(self)
        self._settings: Optional[Dict[str, Any]] = None
        self.client_state_dir = None if client_state_dir is None else Path(client_state_dir)
        if self.ranks.world > 1 and self.strategy.rule.keeps and self.client_state_dir is None:
            raise ValueError(
                f"algorithm={cfg.algorithm!r} keeps each client's state between rounds, and a run on "
                f"{self.ranks.world} processes shares it through files: give client_state_dir, a folder "
                f"every rank reaches"
            )
        self.rank_work = [[0, 0.0] for _ in range(self.ranks.world)]  # clients and work each rank trained
        if self.client_state_dir is not None and self.strategy.rule.keeps:
            self.strategy.kept = ClientStateFiles(
                self.client_state_dir,
                self.strategy.kept.layout,
                cfg.num_train_clients,
                self.checkpoint_settings(),
                self.device,
            )
        self.history: List[Dict[str, Any]] = []
        self.final_cost = EvalCost()
        self.eval_log: List[Dict[str, float]] = []  # per evaluated round: seconds and model FLOPs of the pass
        self.setup_done = False
        if self.ranks.world > 1:
            check_start(self)

    @property
    def train_clients(self) -> List[ClientData]:
        return self.data.train_clients

    def load_global(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), self.global_params, strict=True):
                p.copy_(g)

    @torch.no_grad()
    def sync_from(self, other: Simulation) -> None:
        """Take over ``other``'s global model and server state (same config, other backend).

        Client-side state needs no copy: every round starts it afresh (momentum cleared, FedNLR scales
        and PAdaMFed's D recomputed), and sampling and batch streams advance identically in both runs.
        """
        for mine, theirs in zip(self.global_params, other.global_params, strict=True):
            mine.copy_(theirs)
        self.strategy.load_server_state(other.strategy.server_state())
        if self.privacy is not None and other.privacy is not None:  # the adaptive clip norm
            self.privacy.load_state_dict(other.privacy.state_dict())
        self.setup_done = other.setup_done

    def sample_clients(self) -> List[int]:
        if self.cfg.sampling == "poisson":  # each client joins with probability q
            return dp_round.poisson_sample(self.sample_rng, dp_round.sampling_of(self.cfg))
        picked = self.sample_rng.choice(self.cfg.num_train_clients, size=self.cfg.sampled_per_round, replace=False)
        return sorted(int(i) for i in picked)  # sorted: aggregation order does not depend on draw order

    def run_round(self, t: int) -> Dict[str, Any]:
        """Round ``t`` (0-based): local training of the sampled clients, each update screened and
        folded into the aggregate as soon as it exists (``strategy.add``), then the server step."""
        start = time.perf_counter()
        if not self.setup_done:
            self.load_global()
            self.strategy.setup()
            self.setup_done = True
        sampled = self.sample_clients()
        steps = self.work_plan.steps(t, sampled)  # each client's local steps this round
        self.strategy.client.plan(t, steps)  # every engine reads a client's steps there
        shares = self.ranks.split(sampled, lambda c: self.work(c, steps[c]), t)
        mine = shares[self.ranks.rank]
        fold = self.strategy.begin_round(sampled, t)
        refused: List[Tuple[int, str]] = []
        kept: List[Tuple[int, float, float]] = []  # (client, weight, mean loss) of the accepted clients
        chunk = self._dp_chunk() if self.privacy is not None and self.batched is not None else None

        def take(update: ClientUpdate, loss: float) -> None:
            why = screen(update, self.global_params, t)
            if why:
                refused.append((update.client_id, why))
            else:
                if self.privacy is not None:  # clipped as one vector, weight uniform (docs/privacy.md)
                    update.weight = 1.0
                if chunk is not None:  # client-batched DP: clipped and folded with its chunk (dp_chunk.py)
                    assert self.batched is not None
                    chunk.take(update, self.batched.size)
                    self.strategy.keep(update)
                else:
                    if self.privacy is not None:
                        update.delta, update.extra = self.privacy.clip_reply(
                            update.delta, update.extra, self.strategy.rule.reply
                        )
                    self.strategy.add(fold, update)
                kept.append((update.client_id, update.weight, loss))

        if self.batched is not None:
            if mine:
                done = None if chunk is None else (lambda: chunk.flush(fold))
                self.batched.train(mine, t, take, done)
        else:
            for i, cid in enumerate(mine):  # one client at a time on the one model (Strategy.train)
                self.strategy.kept.prefetch(mine[i + 1 : i + 2])
                self.load_global()
                take(*self.strategy.train(cid, t))
        for r, share in enumerate(shares):
            self.rank_work[r][0] += len(share)
            self.rank_work[r][1] += sum(self.work(c, steps[c]) for c in share)
        if self.ranks.world > 1:
            refused, kept = share_round(self, shares, fold, refused, kept, steps)
        private = dp_round.finish(self, fold, t) if self.privacy is not None else {}  # noise once, after the merge
        not_kept = None
        if fold.count:
            not_kept = self.strategy.end_round(fold)
            if not_kept is not None:
                logger.warning("round %d: %s", t + 1, not_kept)
        else:
            logger.warning("round %d: no usable client update; the global model and server state are unchanged", t + 1)
        self.load_global()
        weights = np.array([w for _, w, _ in kept])
        train_loss = float(np.dot(weights, [v for _, _, v in kept]) / weights.sum()) if kept else float("nan")
        record: Dict[str, Any] = {"round": t + 1, "train_loss": train_loss, "clients": sampled, **private}
        if self.work_plan.uneven:  # how many clients took how many local steps
            record["steps"] = histogram(steps.values())
        if refused:
            record["left_out"] = [{"client": cid, "reason": why} for cid, why in refused]
        if not_kept is not None:
            record["refused"] = not_kept
        if (t + 1) % self.cfg.eval_every == 0 or t + 1 == self.cfg.rounds:
            cost = EvalCost()
            val, flops = pooled_validation(self, cost)
            record.update(val_loss=val["loss"], val_acc=val["acc"], eval_flops=flops)
            self.eval_log.append({"round": t + 1, "seconds": cost.seconds, "flops": cost.flops})
        record["seconds"] = time.perf_counter() - start
        self.history.append(record)
        if self.ranks.world > 1 and ((t + 1) % RANK_CHECK_EVERY == 0 or t + 1 == self.cfg.rounds):
            check_ranks_agree(self, t)
        return record

    def _dp_chunk(self) -> ChunkClip:
        """The client-batched engine's DP clip of a chunk at once, its buffers kept for the run."""
        if self._chunk_clip is None:
            assert self.privacy is not None
            self._chunk_clip = ChunkClip(self.privacy, self.strategy.rule.reply, self.backend)
        return self._chunk_clip

    def work(self, cid: int, steps: Optional[int] = None) -> float:
        """A client's training work in a round: its local steps (``local_steps`` unless given) times
        its batches' samples."""
        k = self.cfg.local_steps if steps is None else steps
        return float(k * min(self.cfg.batch_size, self.train_clients[cid].size))

    @property
    def per_rank(self) -> int:
        """The most clients of a round one rank trains."""
        return -(-self.cfg.sampled_per_round // self.ranks.world)

    def final_evaluation(self) -> Dict[str, Any]:
        """The per-user protocol on existing and new users, plus pooled test accuracy of the global model.

        Client-batched runs fine-tune and test the users client-batched, N at a time (``evaluate``);
        ``self.final_cost`` holds its seconds and model FLOPs afterwards.
        """
        users = self.train_clients + self.data.new_clients
        seeds = {u.client_id: s for u, s in zip(users, self._tune_seed.spawn(len(users)), strict=True)}

        def stream(u: ClientData) -> BatchStream:
            return BatchStream(u.train_x, u.train_y, self.cfg.batch_size, np.random.default_rng(seeds[u.client_id]))

        self.final_cost = EvalCost()
        return evaluate_users(  # the pooled test accuracy comes from the same pass as the per-user one
            self.model,
            self.global_params,
            {"existing": self.train_clients, "new": self.data.new_clients},
            self.cfg.finetune_steps,
            self.cfg.finetune_lr,
            stream,
            at_once=None if self.batched is None else self.batched.at_once,
            cost=self.final_cost,
            precision=self.cfg.precision,
            share=None if self.ranks.world == 1 else self.ranks.block,
            gather=None if self.ranks.world == 1 else self.ranks.gather,
        )

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_settings(self) -> Dict[str, Any]:
        """What a checkpoint must have been saved with to continue this run (``resume.run_settings``)."""
        if self._settings is None:
            self._settings = _resume.run_settings(self)
        return self._settings

    def save_checkpoint(self) -> Dict[str, float]:
        """Checkpoint the run after its ``len(history)`` completed rounds; returns its bytes and seconds."""
        if self.checkpoint is None:
            raise ValueError("save_checkpoint needs checkpoint_dir (Simulation(..., checkpoint_dir=...))")
        kept = self.strategy.kept if self.strategy.rule.keeps else None
        position = None
        if kept is not None:  # the store's entries on disk (every rank's), then the checkpoint that names them
            position = kept.checkpoint(self.checkpoint.folder, self.checkpoint_settings())
        self.ranks.barrier()
        stats: Dict[str, float] = {"bytes": 0, "seconds": 0.0}
        if self.ranks.main:
            state = _resume.capture(self)
            if position is not None:
                state["client_state"] = position
            stats = self.checkpoint.save(len(self.history), self.checkpoint_settings(), state)
        self.ranks.barrier()
        if kept is not None:
            kept.committed()
        self.checkpoint_stats.append(stats)
        return stats

    def load_checkpoint(self) -> bool:
        """Continue from the checkpoint in ``checkpoint_dir``: False (nothing changed) if there is none.

        Raises ``fedopt_kernels.fl.checkpoint.CheckpointError`` (a ValueError) naming the reason for a
        checkpoint saved with other settings, or a damaged one; the run is then left untouched.
        """
        if self.checkpoint is None:
            raise ValueError("load_checkpoint needs checkpoint_dir (Simulation(..., checkpoint_dir=...))")
        if not self.checkpoint.exists():
            return False
        rounds, state = self.checkpoint.load(self.checkpoint_settings())
        _resume.restore(self, state)
        self.resumed_from = rounds
        return True

    def _checkpoint_due(self, rounds_done: int) -> bool:
        return self.checkpoint is not None and (
            rounds_done % self.checkpoint_every == 0 or rounds_done == self.cfg.rounds
        )

    def run(self, progress: Optional[Callable[[Dict[str, Any]], None]] = None, resume: bool = False) -> Dict[str, Any]:
        """All rounds, then the final evaluation; returns a JSON-ready result.

        ``resume``: continue from the checkpoint in ``checkpoint_dir`` (if there is one) instead of
        round 1. ``progress(record)`` is called after each round, once its checkpoint (if due) is saved.
        """
        if resume:
            self.load_checkpoint()
        start = time.perf_counter()
        for t in range(len(self.history), self.cfg.rounds):
            self.dp_stopped = dp_round.over_budget(self, t)
            if self.dp_stopped is not None:  # checkpointed first: a larger dp_max_epsilon resumes it
                if self.checkpoint is not None and not self._checkpoint_due(t):
                    self.save_checkpoint()
                dp_round.say_stopped(self.dp_stopped)
                break
            record = self.run_round(t)
            if self._checkpoint_due(t + 1):
                self.save_checkpoint()
            if progress is not None:
                progress(record)
        train_seconds = time.perf_counter() - start
        final = self.final_evaluation()
        return {
            "evaluation": {  # this process's evaluations (a resumed run: since it resumed)
                "rounds_s": sum(e["seconds"] for e in self.eval_log),
                "rounds_flops": sum(e["flops"] for e in self.eval_log),
                "final": self.final_cost.as_dict(),
            },
            "config": self.cfg.to_dict(),
            "hparams": self.hp,
            "backend": self.backend,
            "device": str(self.device),
            "precision": self.cfg.precision,
            "history": self.history,
            "final": final,
            "train_seconds": train_seconds,
            "total_seconds": time.perf_counter() - start,
            "resumed_from_round": self.resumed_from,
            # user-level DP: epsilon at delta after the rounds run, the noise, the clip, why it stopped
            "privacy": dp_round.summary(self, self.dp_stopped),
            # what the client-batched engine ran: clients at once, each layer's formulation and why
            "client_batched": None if self.batched is None else self.batched.choice_state(),
            # every GPU-only path the run gave up and what ran instead (captures, bound launches, ...)
            "fallbacks": fallbacks.taken(self._fallbacks_from),
            # the processes the run was split over, and each one's share of the rounds' clients and work
            "ranks": {
                "world_size": self.ranks.world,
                "clients": [int(c) for c, _ in self.rank_work],
                "work": [w for _, w in self.rank_work],
            },
        }
