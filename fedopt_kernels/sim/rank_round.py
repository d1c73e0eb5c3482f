"""The parts of a round that a run on several processes adds (``sim/ranks.py``): what each rank tells
the others after training its share, the split validation pass, and the check that they agree.

After a round's training every rank holds its share's updates folded into partial sums; then:

* the sums are merged in rank order (``Ranks.merge``), so the server step is the same everywhere;
* which clients were accepted or refused, and their losses, are gathered, so every rank writes the
  same round record;
* every rank advances the batch streams of the clients the others trained (the same draws, no
  samples gathered): a client's next batches do not depend on which rank trains it;
* every rank marks the store entries the others wrote (the store's files are shared).

At the start the ranks compare their settings, clients and initial model (``check_start``), and
every ``RANK_CHECK_EVERY`` rounds their model, state and draws (``check_ranks_agree``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..fl.fold import Fold
from .data.image_input import ImageClassifier
from .evaluate import EvalCost, Scores, split_scores
from .ranks import digest

RANK_CHECK_EVERY = 10  # rounds between the checks that every rank holds the same model and state


def share_round(
    sim: Any,
    shares: Sequence[Sequence[int]],
    fold: Fold,
    refused: List[Tuple[int, str]],
    kept: List[Tuple[int, float, float]],
    steps: Optional[Mapping[int, int]] = None,
) -> Tuple[List[Tuple[int, str]], List[Tuple[int, float, float]]]:
    """Combine the ranks' round (module docstring); every rank's refused and accepted clients, in client
    order. ``steps``: each client's local steps this round (``local_steps`` for all where not given)."""
    ranks = sim.ranks
    mine = set(shares[ranks.rank])
    for r, share in enumerate(shares):
        if r != ranks.rank:
            for cid in share:
                sim.streams[cid].skip(sim.cfg.local_steps if steps is None else steps[cid])
    ranks.merge(fold)
    every = ranks.gather((refused, kept))
    all_refused = sorted(x for rr, _ in every for x in rr)
    all_kept = sorted(x for _, kk in every for x in kk)
    if sim.strategy.rule.keeps:
        sim.strategy.kept.written_elsewhere([cid for cid, _, _ in all_kept if cid not in mine])
    return all_refused, all_kept


def pooled_validation(sim: Any, cost: EvalCost) -> Tuple[Dict[str, float], float]:
    """Loss and accuracy of the global model over every training client's validation split, and the
    pass's model FLOPs: each rank scores a block of the clients, the scores are put back in order."""
    ranks = sim.ranks
    lo, hi = ranks.block(len(sim.train_clients))
    scores = split_scores(sim.model, sim.train_clients[lo:hi], "val", cost, sim.cfg.precision)
    if ranks.world == 1:
        return scores.pooled(), cost.flops
    parts = ranks.gather((scores.loss, scores.correct, scores.count, cost.flops))
    whole = Scores(*(np.concatenate([p[i] for p in parts]) for i in range(3)))
    return whole.pooled(), float(sum(p[3] for p in parts))


def check_start(sim: Any) -> None:
    """``RankMismatch`` unless every rank starts the same run: the same settings, the same clients
    (their sizes, and a digest of every client's samples and labels: each rank's view of the
    partition) and the same initial model. Ranks that differ in these would split rounds differently
    (the split reads the clients' sizes), train a client twice or never, or average other data."""
    settings = dict(sim.checkpoint_settings())
    data, model = settings.pop("data sha256"), settings.pop("initial model sha256")
    sizes = [len(c.train_y) for c in sim.data.train_clients] + [len(c.train_y) for c in sim.data.new_clients]
    parts = {"settings": settings, "client sizes": sizes, "data (every client's samples and labels)": data}
    sim.ranks.check_same({**parts, "the initial model": model}, "at the start")


def check_ranks_agree(sim: Any, t: int) -> None:
    """``RankMismatch`` unless every rank holds the same global model, server state (the server
    optimizer's too) and store position, and has drawn the same: the sampling generator and every
    client's batch stream. The model and state come from the same merged sums on every rank; the
    draws are each rank's own
    (a rank advances the streams of the clients others trained itself), so a rank whose inputs went
    another way is found here even when the merged model still agrees."""
    state = list(sim.global_params)
    for key in sorted(sim.strategy.state):
        state += sim.strategy.state[key]
    state += sim.strategy.server.tensors()
    parts = {"the global model and server state": digest(state)}
    position = getattr(sim.strategy.kept, "current", None)
    if position is not None and sim.strategy.rule.keeps:
        parts["the client-state store's position"] = digest([torch.from_numpy(position.copy())])
    h = hashlib.sha256(json.dumps(sim.sample_rng.bit_generator.state, sort_keys=True).encode())
    parts["client sampling"] = h.hexdigest()[:16]
    h = hashlib.sha256()
    for cid in sim.streams.made():
        stream = sim.streams[cid]
        h.update(json.dumps([cid, stream.rng.bit_generator.state, stream.pending], sort_keys=True).encode())
    parts["the clients' batch streams"] = h.hexdigest()[:16]
    sim.ranks.check_same(parts, f"after round {t + 1}")


def spread_augmentation(model: nn.Module, rank: int) -> None:
    """Give each rank's augmentation its own random stream (ranks train different clients: the same
    stream on every rank would draw the same crops and flips for them)."""
    for m in model.modules():
        if isinstance(m, ImageClassifier):
            m.augment_seed = (m.augment_seed + 0x9E3779B97F4A7C15 * rank) % 2**62
