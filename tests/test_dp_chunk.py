"""The client-batched engine under user-level DP (``fedopt_kernels/sim/dp_chunk.py``): a chunk's
replies are clipped and summed by one ``clip_sum`` call, and the round equals the reply-by-reply
clip to float64 rounding (a derived bound); screened replies stay out, the adaptive clip's count is
the replies' own, and the records are those of the reply-by-reply path."""

from __future__ import annotations

import math

import pytest
import torch
from test_sim_resume import model_fn, tiny_config, tiny_images

from fedopt_kernels.privacy import dp_fedavg
from fedopt_kernels.sim import dp_round
from fedopt_kernels.sim.dp_chunk import ChunkClip
from fedopt_kernels.sim.simulation import Simulation

pytest.importorskip("dp_accounting")
pytestmark = pytest.mark.usefixtures("one_thread")

U = 2.0**-53
CLIP = 0.05


def config(algorithm, **kw):
    base = dict(
        dp_clip=CLIP,
        dp_noise_multiplier=0.0,
        dp_delta=1e-3,
        dp_adaptive_quantile=0.5,
        clients_per_round=5,
        client_batched=2,  # chunks of 2, 2 and 1
        rounds=1,
        backend="auto",
    )
    base.update(kw)
    return tiny_config(algorithm, **base)


def norm64(tensors) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten().tolist()))


def run_one_round(cfg, monkeypatch, chunked: bool):
    """Round 0 in float64: the fold's sums before the noise, the record, the accepted replies' norms."""
    sim = Simulation(cfg, data=tiny_images(), model_fn=model_fn, dtype=torch.float64)
    seen = {}
    norms = []
    if not chunked:
        monkeypatch.setattr(Simulation, "_dp_chunk", lambda self: None)  # the reply-by-reply clip

    def finish(s, fold, t):
        seen["sums"] = {k: [v.clone() for v in vs] for k, vs in fold.sums.items()}
        seen["below"], seen["count"] = s.privacy.below, fold.count
        return original(s, fold, t)

    def take(self, update, size):
        norms.append(norm64(list(update.delta) + [t for n in self.names for t in update.extra[n]]))
        return original_take(self, update, size)

    original, original_take = dp_round.finish, ChunkClip.take
    monkeypatch.setattr(dp_round, "finish", finish)
    monkeypatch.setattr(ChunkClip, "take", take)
    record = sim.run_round(0)
    monkeypatch.undo()
    return seen, record, norms


# a clip near the median of the round's reply norms (this seed's): some replies clipped, some not
@pytest.mark.parametrize("algorithm, clip", [("fedavg", 0.18), ("scaffold", 0.92), ("padamfed", 0.9)])
def test_a_chunk_is_clipped_by_one_call_and_equals_the_reply_by_reply_clip(algorithm, clip, monkeypatch):
    cfg = config(algorithm, dp_clip=clip)
    calls = []
    batched = dp_fedavg.clip_sum_batched

    def spy(tensors, *args, **kw):
        calls.append(tensors[0].shape[0])
        return batched(tensors, *args, **kw)

    monkeypatch.setattr(dp_fedavg, "clip_sum_batched", spy)
    chunked, rec_chunked, norms = run_one_round(cfg, monkeypatch, chunked=True)
    assert calls == [2, 2, 1], calls  # one call per chunk, the chunk's accepted clients at once
    alone, rec_alone, _ = run_one_round(cfg, monkeypatch, chunked=False)
    M = len(rec_alone["clients"])
    assert chunked["count"] == alone["count"] == M and len(norms) == M
    # every term |scaled clipped reply| <= C (scales <= 1: 2**-e, 1/N, 1): the two orders of M float64
    # additions (and the chunk sums' extra one) differ by at most 2 (M + 1) u of M C per element
    bound = 2 * (M + 1) * U * M * clip
    largest = 0.0
    for name, sums in alone["sums"].items():
        for a, b in zip(sums, chunked["sums"][name]):
            assert float((a - b).abs().max()) <= bound, (name, float((a - b).abs().max()), bound)
            largest = max(largest, float(a.abs().max()))
    assert largest > 1e6 * bound  # the sums are not vacuous
    # the adaptive clip's count: the accepted replies whose norm is within the bound
    assert chunked["below"] == alone["below"] == sum(n <= clip for n in norms)
    assert 0 < chunked["below"] < M
    same = ("round", "clients", "train_loss", "dp_epsilon", "dp_clip", "dp_next_clip")
    assert {k: rec_chunked[k] for k in same} == {k: rec_alone[k] for k in same}


def test_a_screened_reply_stays_out_of_the_chunk(monkeypatch):
    cfg = config("scaffold")
    sim = Simulation(cfg, data=tiny_images(), model_fn=model_fn)
    finish = sim.strategy.finish
    bad = {}

    def poisoned(cid, opt, t):
        update = finish(cid, opt, t)
        if not bad:  # the first client's reply diverged
            bad["cid"] = cid
            update.extra["dc"][0].fill_(float("nan"))
        return update

    monkeypatch.setattr(sim.strategy, "finish", poisoned)
    counts = []
    flush = ChunkClip.flush

    def spy(self, fold):
        counts.append(self.rows)
        flush(self, fold)

    monkeypatch.setattr(ChunkClip, "flush", spy)
    record = sim.run_round(0)
    assert [r["client"] for r in record["left_out"]] == [bad["cid"]]
    assert sum(counts) == len(record["clients"]) - 1 and counts[0] == 1  # its chunk clipped its other client
    assert all(bool(torch.isfinite(p).all()) for p in sim.global_params)
    assert all(bool(torch.isfinite(c).all()) for c in sim.strategy.c)


@pytest.mark.parametrize("algorithm, clip", [("fedavg", 0.18), ("scaffold", 0.92)])
def test_client_batched_dp_equals_the_sequential_run_to_rounding(algorithm, clip):
    """The two engines train alike in float64 (``validate``) and clip the same replies (one op per
    chunk against reply by reply); the noise is the same draws. They differ by float64 rounding only:
    the bound of tests/test_sim_batched.py's rounding-only comparisons."""
    from test_sim_batched import ROUNDING_RTOL

    from fedopt_kernels.sim.validate import validate_client_batched

    # z < 2 sigma_b = expected / 10: adaptive clipping leaves noise for the updates
    cfg = config(algorithm, dp_clip=clip, dp_noise_multiplier=0.1, rounds=3)
    v = validate_client_batched(cfg, data=tiny_images(), model_fn=model_fn)
    assert v.passed and v.dtype == "float64" and v.max_rel <= ROUNDING_RTOL, v.report()
