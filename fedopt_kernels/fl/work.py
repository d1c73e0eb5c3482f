"""The round's plan of work: how many local steps each sampled client takes in round t.

Four run settings decide it (``FLConfig``):

* ``local_steps`` K: every client takes K steps (the default; the only plan before these options);
* ``local_epochs`` E: client i takes ``E * ceil(n_i / B)`` steps, E passes over its ``n_i`` training
  samples in batches of ``B = batch_size`` (FedNova's and FedProx's "E local epochs");
* ``local_steps_range`` (a, b): each client's steps are drawn per round uniformly from the
  integers a..b;
* ``stragglers`` f: ``round(f * S)`` of a round's S sampled clients, drawn, stop early: a straggler
  with K_i nominal steps takes ``max(1, floor(u * K_i))`` of them, u uniform in [0, 1) (FedNova's
  and FedProx's "partial work"; every straggler takes fewer than its K_i when K_i >= 2).

The draws of round t come from a stream of their own, ``SeedSequence(seed, spawn_key=(WORK_STREAM,
t))``: no other stream of a run advances for them (a run without these options draws nothing and
keeps its bits), and a round's plan depends only on the seed, the round and its sampled clients, so
every rank of a run, a resumed run and a Flower strategy compute the same plan without saving it.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .server_rules import RULES

WORK_STREAM = 0x776F726B  # "work": the plan's spawn key, far from the simulator's streams (0..4)

__all__ = ["WorkPlan", "check_work_options", "histogram", "is_uneven", "own_steps"]


def is_uneven(cfg: Any) -> bool:
    """Do the run's settings give clients other step counts than ``local_steps`` for all?"""
    return cfg.local_epochs is not None or cfg.local_steps_range is not None or cfg.stragglers != 0


def check_work_options(cfg: Any) -> None:
    """ValueError naming the first of ``local_epochs``, ``local_steps_range``, ``stragglers`` that is out
    of range or contradicts another setting (``FLConfig.validate`` calls it)."""
    e = cfg.local_epochs
    if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
        raise ValueError(f"local_epochs must be an integer >= 1, got {e!r}")
    r = cfg.local_steps_range
    if r is not None:
        ok = isinstance(r, (tuple, list)) and len(r) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in r)
        if not ok:
            raise ValueError(f"local_steps_range must be two integers a <= b, both >= 1, got {r!r}")
        if r[0] > r[1]:
            raise ValueError(f"local_steps_range must be (a, b) with a <= b, got a={r[0]} > b={r[1]}")
    f = cfg.stragglers
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 <= f < 1.0):
        raise ValueError(f"stragglers must be a fraction in [0, 1), got {f!r}")
    if e is not None and r is not None:
        raise ValueError(
            "local_epochs (--local-epochs) and local_steps_range (--local-steps-range) contradict each other: "
            "give one of them"
        )
    if is_uneven(cfg) and not RULES[cfg.variant.server].uneven:
        raise ValueError(
            f"local_epochs (--local-epochs), local_steps_range (--local-steps-range) and stragglers "
            f"(--stragglers) do not apply to algorithm={cfg.algorithm!r}: "
            f"its server step divides by the one local step count K (local_steps) of every client"
        )


class WorkPlan:
    """Each sampled client's local steps in a round (module docstring), from a run's settings ``cfg``
    and every training client's number of training samples ``sizes`` (by client id).

    ValueError naming ``local_epochs`` when a client has no training data under it (it would take 0 steps)."""

    def __init__(self, cfg: Any, sizes: Sequence[int] = ()):
        self.local_steps, self.batch_size, self.seed = cfg.local_steps, cfg.batch_size, cfg.seed
        self.epochs: Optional[int] = cfg.local_epochs
        r = cfg.local_steps_range
        self.range = None if r is None else (int(r[0]), int(r[1]))
        self.stragglers = float(cfg.stragglers)
        self.uneven = is_uneven(cfg)
        self.sizes = [int(n) for n in sizes]
        if self.epochs is not None:
            empty = [cid for cid, n in enumerate(self.sizes) if n < 1]
            if empty:
                raise ValueError(
                    f"local_epochs gives client i local_epochs * ceil(n_i / batch_size) steps, and training "
                    f"clients {empty[:10]}{' ...' if len(empty) > 10 else ''} have no training samples (n_i = 0)"
                )

    def _rng(self, t: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(WORK_STREAM, t)))

    def draw(self, t: int, count: int) -> Tuple[Optional[List[int]], Dict[int, float]]:
        """Round ``t``'s draws for its ``count`` sampled clients, by position: each one's steps from
        ``local_steps_range`` (None without it) and each straggler's fraction u (``stop_early``). What
        a Flower strategy sends its clients, which know their own data size."""
        rng = self._rng(t)
        drawn = None
        if self.range is not None:
            drawn = [int(k) for k in rng.integers(self.range[0], self.range[1] + 1, size=count)]
        late: Dict[int, float] = {}
        if self.stragglers > 0:
            u = rng.random(count)
            for j in sorted(int(i) for i in rng.permutation(count)[: math.floor(self.stragglers * count + 0.5)]):
                late[j] = float(u[j])
        return drawn, late

    def steps(self, t: int, sampled: Sequence[int]) -> Dict[int, int]:
        """Client id -> its local steps in round ``t`` for round t's ``sampled`` clients (in the order
        they are given: the simulator gives them sorted, so the draws do not depend on the draw order)."""
        if not self.uneven:
            return {cid: self.local_steps for cid in sampled}
        drawn, late = self.draw(t, len(sampled))
        if self.epochs is not None:
            nominal = [epoch_steps(self.epochs, self.sizes[cid], self.batch_size) for cid in sampled]
        else:
            nominal = drawn if drawn is not None else [self.local_steps] * len(sampled)
        for j, u in late.items():
            nominal[j] = stop_early(nominal[j], u)
        return dict(zip(sampled, nominal, strict=True))

    def most(self) -> int:
        """An upper bound of any client's steps in a round (a memory or time estimate's K)."""
        if self.epochs is not None:
            return epoch_steps(self.epochs, max(self.sizes, default=1), self.batch_size)
        if self.range is not None:
            return self.range[1]
        return self.local_steps


def epoch_steps(epochs: int, samples: int, batch_size: int) -> int:
    """``epochs * ceil(samples / batch_size)``: the steps of ``epochs`` passes over ``samples``."""
    return epochs * -(-samples // batch_size)


def stop_early(steps: int, u: float) -> int:
    """A straggler's steps: ``max(1, floor(u * steps))`` of its ``steps``, u in [0, 1)."""
    return max(1, math.floor(u * steps))


def own_steps(cfg: Any, samples: int, fraction: Optional[float] = None) -> int:
    """A client's steps where the server sent its ``local_steps`` (a Flower client): ``local_epochs``
    passes over its ``samples`` when set, else ``cfg.local_steps``; a straggler (``fraction`` u)
    stops early. ValueError naming ``local_epochs`` for a client without samples under it."""
    if cfg.local_epochs is not None:
        if samples < 1:
            raise ValueError("local_epochs gives a client local_epochs * ceil(n / batch_size) steps; here n = 0")
        k = epoch_steps(cfg.local_epochs, samples, cfg.batch_size)
    else:
        k = cfg.local_steps
    return k if fraction is None else stop_early(k, fraction)


def histogram(steps: Iterable[int]) -> Dict[str, int]:
    """``{"K": number of clients that took K steps}``, K ascending (a round's record: its size is the
    number of distinct step counts, not of clients)."""
    counts: Dict[int, int] = {}
    for k in steps:
        counts[int(k)] = counts.get(int(k), 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}
