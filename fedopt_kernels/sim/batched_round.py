"""The client-batched round (``--client-batched N``): the sampled clients' local training, N at a time.

The client side of a round is ``fedopt_kernels.fl.client_round.ClientRound``'s, as in the sequential
loop and the Flower client; this engine supplies where the steps run, a chunk of stacked clients:

* every client's round inputs come from the strategy as sequentially (``strategy.round_inputs``,
  i.e. ``ClientRound.inputs``: SCAFFOLD corrections, PAdaMFed controls and momentum; FedNLR scales
  on the client's data with the received global model) and are stacked ``[C, ...]``; the chunk's
  batched optimizer starts the round once (``ClientRound.start``: the round's lr, the global round
  index ``t``);
* every client draws its batches from its own ``BatchStream`` (``batched/batches.py``), for the
  chunk's largest step count (``ClientRound.steps``; every client's today);
* the batched steps (``BatchedTrainer``, each one ``client_round.take_step``; ``--replay``: replayed
  from a CUDA graph);
* the chunk's optimizer ends the round once (``ClientRound.end``: its round outputs), and every
  client's ``ClientUpdate`` is the strategy's own ``finish`` (``ClientRound.finish``: the client's
  parameters are put into the simulation's model for it, and the optimizer is seen through a
  one-client view), so the fold and the server state are untouched.

The sampled clients are split into equal chunks of at most N; the last chunk may be one client
short, and its empty slot is filled with a copy of its first client, inactive (the batched
optimizers' active mask), so one trainer (and one CUDA graph) serves every chunk.

Clients that differ in their work (``fl/work.py``): a chunk runs its largest step count K, and
client c is inactive after its own K_c steps, so it ends where it would alone. The clients are
put into chunks by their step counts, the largest first (ties by client id; equal counts keep the
order of client ids), so that a chunk's clients take about as many steps as each other and few
slot-steps are idle; an augmenting model keeps client-id order (its draws follow the clients'
order, as sequentially). A chunk so sorted has its active clients first at every step, and the
trainer computes only theirs (``BatchedTrainer.run``): a round's gradient work is then its
clients' own steps, not the chunk's largest count for every slot. ``slot_steps`` and
``client_steps`` count the slot-steps run (idle ones included) and the clients' own steps.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch

from ..core import fallbacks
from ..core.optimizer import FedOptimizer
from .batched.batches import BatchPool, apply_stage
from .batched.choice_cache import ChoiceCache
from .batched.choose import Choice, Chooser
from .batched.compiled import CompiledLayersLoss
from .batched.host_memory import keep_freed_memory
from .batched.layers_engine import LayersLoss
from .batched.loss import client_loss
from .batched.precision import backend_flags
from .batched.size import MAX_AUTO, auto_clients_at_once, free_bytes, state_copies
from .batched.trainer import BatchedTrainer
from .data.image_input import ImageClassifier
from .strategy import ClientUpdate, RoundHost


class _OneClient:
    """The batched optimizer as the strategies' ``finish`` sees a client's optimizer: client ``c`` of it.

    ``outputs``: the algorithm's round outputs (``Algorithm.round_outputs``, e.g. PAdaMFed's
    ``local_control``), computed once for the chunk, stacked ``[C, ...]``; each is a method here.
    """

    def __init__(self, opt: Any, c: int, outputs: Dict[str, Sequence[torch.Tensor]]):
        self._opt, self._c, self._outputs = opt, c, outputs

    def end_round(self) -> None:
        """Nothing: the chunk's optimizer ended the round for every client at once."""

    def __getattr__(self, name: str) -> Any:  # param_groups, schedule (SCAFFOLD's lr_sum), round outputs
        if name in self._outputs:
            # copies: a view would keep the whole [C, ...] tensor alive in the server's state
            return lambda: [t[self._c].clone() for t in self._outputs[name]]
        return getattr(self._opt, name)


def _is_random(model: torch.nn.Module) -> bool:
    """Does the model's input stage draw random numbers in training (augmentation)?"""
    return isinstance(model, ImageClassifier) and model.spec.augment and model.training


def _pad_clients(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` [K, m, ...] with its client axis padded to ``size`` by copies of client 0."""
    m = t.shape[1]
    if m == size:
        return t
    return torch.cat([t, t[:, :1].expand(t.shape[0], size - m, *t.shape[2:])], dim=1)


class BatchedClients:
    """A simulation's client-batched local training (see the module docstring)."""

    def __init__(self, sim: RoundHost):
        self.sim = sim
        cfg = sim.cfg
        self.cfg = cfg
        self._fallbacks_from = fallbacks.mark()  # the run's fallbacks are those recorded from here on
        # ValueError naming what neither engine can batch
        self.loss = client_loss(sim.model, precision=cfg.precision)
        if sim.device.type == "cpu":
            keep_freed_memory()  # [C, ...] tensors are past malloc's mmap ceiling (batched/host_memory.py)
        self.client = sim.strategy.client
        self.opts = self.client.opts
        self.algo = self.client.algo
        self.anchor_model = getattr(sim.strategy, "anchor_model", None)
        self.pool = BatchPool(sim.train_clients, cfg.batch_size, dtype=sim.global_params[0].dtype)
        # the layers engine's formulations (and, for "auto", the clients at once) are chosen at the
        # first round, by measurement on the run's device (batched/choose.py), or taken back from a
        # checkpoint (adopt)
        self.chooser: Optional[Chooser] = None
        if isinstance(self.loss, LayersLoss):
            cache = ChoiceCache(cfg.formulation_cache) if cfg.formulation_cache else None
            self.chooser = Chooser(self.loss, self._sample_inputs, cfg.formulations, cache, precision=cfg.precision)
        self.choice: Optional[Choice] = None
        self._at_once: Optional[int] = None
        self._size: Optional[int] = None
        self._sample: Optional[Tuple[int, Any]] = None
        # "cuda": replay each step from a CUDA graph; tests set "emulate" (batched/trainer_replay.py) before round 0
        self.replay_mode = "cuda" if cfg.replay else None
        self._trainer: Optional[BatchedTrainer] = None  # built at the first round (after the strategy's setup)
        self.slot_steps = 0  # trainer slots x steps run, this process (the work done, idle slots included)
        self.client_steps = 0  # the clients' own steps among them (the work needed)

    # ------------------------------------------------------------------ clients at once
    @property
    def at_once(self) -> int:
        """Clients trained at once: ``client_batched``, or the chosen number for ``auto``."""
        if self._at_once is None:
            self._resolve()
        assert self._at_once is not None
        return self._at_once

    @property
    def size(self) -> int:
        """The trainer's clients: ``at_once`` evened out into equal chunks of the sampled clients."""
        if self._size is None:
            self._resolve()
        assert self._size is not None
        return self._size

    def setting(self) -> Any:
        """What a checkpoint compares: the number of clients at once when the user gave it, else "auto"."""
        return self.cfg.client_batched

    def _resolve(self) -> None:
        cfg, S = self.cfg, self.sim.per_rank
        fixed = None if cfg.client_batched == "auto" else min(int(cfg.client_batched), S)
        if self.chooser is None:
            n = fixed if fixed is not None else self._fit(limit=True)
            size = math.ceil(S / math.ceil(S / n))
        else:
            even = None if fixed is None else math.ceil(S / math.ceil(S / fixed))
            size, self.choice = self.chooser.plan(
                S, self._fit(limit=False) if fixed is None else S, cfg.rounds * self.client.max_steps, even
            )
            n = fixed if fixed is not None else size
            self._use_compiled(self.choice)
        self._at_once, self._size = n, size  # equal chunks: at most one inactive slot in the last
        self._sample = None

    def _fit(self, limit: bool) -> int:
        """Clients that fit in memory (batched/size.py's estimate); ``limit``: at most ``MAX_AUTO`` too."""
        cfg = self.cfg
        client = self.sim.train_clients[0]
        x, y = client.train_x[: cfg.batch_size], client.train_y[: cfg.batch_size]
        budget = free_bytes(self.sim.device)
        cap = MAX_AUTO if limit else None
        return auto_clients_at_once(self.sim.model, x, y, state_copies(cfg), self.sim.per_rank, budget, cap)

    def _sample_inputs(self, C: int) -> Tuple[List[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the chooser times: the global model for C clients and one batch of the first training
        client for each (its model inputs without augmentation: no draw from the run's generators)."""
        if self._sample is not None and self._sample[0] == C:
            return self._sample[1]
        self._sample = None  # one size at a time: [C, ...] copies of the model can be large
        B = self.cfg.batch_size
        client = self.sim.train_clients[0]
        idx = torch.arange(B, device=client.train_x.device) % client.train_x.shape[0]
        x, y = client.train_x[idx], client.train_y[idx]
        stage = self.loss.input_stage
        with torch.no_grad():
            x = x if stage is None else stage(x, False)
        params = [p.detach().unsqueeze(0).repeat(C, *([1] * p.dim())) for p in self.sim.global_params]
        w = torch.full((C, B), 1.0 / B, dtype=self.sim.global_params[0].dtype, device=x.device)
        out = (params, x.unsqueeze(0).repeat(C, *([1] * x.dim())), y.unsqueeze(0).repeat(C, 1), w)
        self._sample = (C, out)
        return out

    def _use_compiled(self, choice: Choice) -> None:
        """Train through ``torch.compile``'s step when the search chose it (not for the anchor
        gradients of PAdaMFed-VR, another graph to compile)."""
        if choice.compiled and self.anchor_model is None and isinstance(self.loss, LayersLoss):
            self.loss = CompiledLayersLoss(
                self.sim.model,
                formulations=choice.formulations,
                order=self.loss.order,
                precision=self.loss.precision,
                fallback=True,  # a step that fails compiled runs eagerly, with a warning
            )

    def adopt(self, saved: Dict[str, Any]) -> None:
        """Take back the clients at once and formulations a checkpoint recorded (``choice_state``), so
        that a resumed run computes what the uninterrupted one did."""
        size, at_once = int(saved["size"]), int(saved["at_once"])
        forms = saved.get("formulations")
        if self.chooser is not None and isinstance(forms, dict):
            self.loss.layers_net.set_formulations(forms)
            compiled = saved.get("compiled") is True
            self.choice = Choice(
                size, dict(forms), {p: "from the checkpoint" for p in forms}, source="checkpoint", compiled=compiled
            )
            self.chooser.choices[size] = self.choice
            self._use_compiled(self.choice)
        self._at_once, self._size = at_once, size

    def choice_state(self) -> Dict[str, Any]:
        """The clients at once and the formulations this run uses (checkpointed, reported), the
        backend switches its passes run under, and the fallbacks it took (``core/fallbacks.py``)."""
        out: Dict[str, Any] = {"at_once": self.at_once, "size": self.size}
        if self.choice is not None:
            # a skipped search names none: what the layers took (their defaults) at their first call
            out["formulations"] = dict(self.choice.formulations or self.loss.layers_net.formulations())
            out["compiled"] = self.choice.compiled
            out["why"] = dict(self.choice.why)
            out["search_s"] = self.chooser.spent_s if self.chooser is not None else 0.0
            out["search_budget_s"] = self.chooser.budget_s if self.chooser is not None else None
            out["search_note"] = self.choice.note
        # as the first gradient pass saw them (the layers engine's), else as the precision sets them
        seen = getattr(self.loss, "flags_seen", None)
        out["precision_flags"] = dict(seen) if seen else backend_flags(self.cfg.precision, self.sim.device)
        out["fallbacks"] = fallbacks.taken(self._fallbacks_from)
        out["slot_steps"], out["client_steps"] = self.slot_steps, self.client_steps
        return out

    @property
    def trainer(self) -> BatchedTrainer:
        if self._trainer is None:
            self._trainer = BatchedTrainer(
                self.loss,
                self.sim.global_params,
                self.size,
                # a client-batched optimizer is a FedOptimizer (Algorithm.make's annotation is torch's class)
                lambda params: cast(FedOptimizer, self.opts.build_on(params, batched=True)),
                steps=self.client.max_steps,
                clip_norm=self.client.clip_norm,
                anchor=self.anchor_model is not None,
                replay=self.replay_mode,
            )
        return self._trainer

    # ------------------------------------------------------------------ one round
    def train(
        self,
        sampled: Sequence[int],
        t: int,
        take: Callable[[ClientUpdate, float], None],
        chunk_done: Optional[Callable[[], None]] = None,
    ) -> None:
        """Local training of ``sampled`` in round ``t``: ``take(update, mean loss)`` for each client as
        soon as its chunk has trained (the update is dropped after it), chunk by chunk, the clients
        sorted by their step counts (``ClientRound.steps``; the module docstring); ``chunk_done()``
        after each chunk's last ``take`` (DP clips a chunk's replies at once: ``dp_chunk.py``)."""
        order = list(sampled)
        if not _is_random(self.sim.model):
            order.sort(key=lambda cid: (-self.client.steps(cid, t), cid))
        for i in range(0, len(order), self.size):
            self.sim.strategy.kept.prefetch(order[i + self.size : i + 2 * self.size])  # the next chunk's state
            self._chunk(order[i : i + self.size], t, take)
            if chunk_done is not None:
                chunk_done()

    def _round_inputs(self, chunk: List[int], t: int, stacked: Sequence[torch.Tensor]) -> Dict[str, Any]:
        """Every client's round inputs, stacked ``[C, ...]`` into tensors made at the first client and
        filled client by client (one client's own inputs alive at a time, not C of them)."""
        sim = self.sim
        index = {id(p): i for i, p in enumerate(sim.model.parameters())}
        out: Dict[str, Any] = {}
        slots: List[Tuple[torch.Tensor, Any]] = []  # (stacked tensor, how to get its row from a client's inputs)
        for c, cid in enumerate(chunk):
            inputs = sim.strategy.round_inputs(cid)  # FedNLR's scales: from the received model
            if c == 0:
                for key, first in inputs.items():
                    if isinstance(first, dict):  # {model parameter: [M]} -> {stacked parameter: [C, M]}
                        out[key] = {}
                        for p, v in first.items():
                            out[key][stacked[index[id(p)]]] = t_ = v.new_empty((self.size, *v.shape))
                            slots.append((t_, (key, p)))
                    elif first is None:
                        out[key] = None
                    else:
                        out[key] = [v.new_empty((self.size, *v.shape)) for v in first]
                        slots += [(t_, (key, j)) for j, t_ in enumerate(out[key])]
            for t_, (key, where) in slots:
                t_[c].copy_(inputs[key][where])
            del inputs
        for t_, _ in slots:  # inactive slots: any valid inputs (the first client's)
            t_[len(chunk) :].copy_(t_[:1].expand(self.size - len(chunk), *t_.shape[1:]))
        return out

    def _chunk(self, chunk: List[int], t: int, take: Callable[[ClientUpdate, float], None]) -> None:
        sim, tr, m = self.sim, self.trainer, len(chunk)
        ks = [self.client.steps(cid, t) for cid in chunk]  # each client's own (ClientRound.steps)
        K = max(ks)  # the chunk runs for its largest count; the others are inactive after their own
        self.slot_steps += K * self.size
        self.client_steps += sum(ks)
        sim.load_global()  # FedNLR's scales read the global model
        inputs = self._round_inputs(chunk, t, tr.stacked)
        tr.load(sim.global_params)
        self.client.start(tr.opt, t, inputs, start=tr.start_round)
        batches = self.pool.draw(sim.streams, chunk, ks)
        x = apply_stage(self.loss.input_stage, batches, _is_random(sim.model))
        anchor_x = None
        if self.anchor_model is not None and _is_random(self.anchor_model):
            anchor_x = apply_stage(self.anchor_model.preprocess, batches, True)  # its own random stream
        active = None
        if m < self.size or self.replay_mode is not None:
            active = torch.arange(self.size, device=sim.device) < m

        def pad(v: torch.Tensor) -> torch.Tensor:
            return _pad_clients(v, self.size)

        own = None  # each slot's steps where they differ (the idle slots' 0: inactive throughout)
        if min(ks) < K:
            own = ks + [0] * (self.size - m)
        total = tr.run(
            pad(x), pad(batches.y), pad(batches.w), None if anchor_x is None else pad(anchor_x), active, steps=own
        )
        outputs = self.client.end(tr.opt)
        params = list(sim.model.parameters())
        losses = [v / k for v, k in zip(total[:m].tolist(), ks, strict=True)]
        for c, cid in enumerate(chunk):
            with torch.no_grad():
                for p, s in zip(params, tr.stacked, strict=True):
                    p.copy_(s[c])
            take(sim.strategy.finish(cid, _OneClient(tr.opt, c, outputs), t), losses[c])
