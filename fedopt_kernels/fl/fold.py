"""A server rule as a fold: a round's updates are added to running sums as they arrive, then dropped.

``Fold`` holds a round's sums (each a list of tensors shaped like the model, zero at the start),
the number of updates added and their weights' sum. A rule (``server_rules.ServerRule``) begins a
fold, adds each accepted update to it in client-id order, and finishes it into the new model and
server state. The memory a round needs is then the sums, whatever its number of clients.

Coefficients are fixed before the first update arrives: a rule that averages needs the round's
total weight (FedAvg's ``w_i / sum_j w_j``) or its number of updates (FedDyn's and PAdaMFed's
``1 / S``). ``Expected`` is what the round expects, the sampled clients' count and weights; each
update is added with its final coefficient, so a round where every sampled client is accepted
computes, operation for operation, what the list form of the same rule computes. A round where
some are refused rescales the sum once at the end (a rounding apart).

Sums from several folds with the same ``Expected`` (the ranks of one run) combine by ``merge``:
added in the order given, so every process that merges the same folds in the same order holds
the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

Tensors = List[torch.Tensor]


@dataclass(frozen=True)
class Expected:
    """What a round expects to add: ``count`` updates whose weights sum to ``weight`` once divided by
    ``norm`` (1, unless the plain sum overflows float64; then the largest weight)."""

    count: int
    weight: float
    norm: float = 1.0

    @classmethod
    def of(cls, weights: Sequence[float]) -> Expected:
        """The expectation of updates with exactly these weights (the list form of a rule, or a round
        that has sampled its clients)."""
        if len(weights) == 0:
            raise ValueError("weights is empty: a round expects at least one update")
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"weights must be finite and > 0, got {list(weights)}")
        total = sum(weights)  # in the order given
        norm = 1.0
        if not math.isfinite(total):  # finite weights whose sum overflows: normalise by the largest first
            norm = max(weights)
            total = sum(w / norm for w in weights)
        return cls(len(weights), total, norm)


class Fold:
    """A round's running sums (module docstring). Made by ``ServerRule.begin``; ``add`` each accepted
    update in client order, ``finish`` once."""

    def __init__(
        self,
        rule: Any,
        x: Tensors,
        state: Mapping[str, Tensors],
        hp: Mapping[str, Any],
        num_clients: int,
        local_steps: int,
        expected: Expected,
    ):
        self.rule, self.x, self.state, self.hp = rule, x, state, hp
        self.num_clients, self.local_steps, self.expected = num_clients, local_steps, expected
        self.sums: Dict[str, Tensors] = {name: [torch.zeros_like(v) for v in x] for name in rule.sums}
        self.count = 0
        self.weight = 0.0  # the added updates' weights, divided by expected.norm

    def add(self, delta: Sequence[torch.Tensor], weight: float, reply: Optional[Mapping[str, Tensors]] = None) -> None:
        """Add one accepted update (its model change ``delta``, weight, reply tensors such as ``dc``)."""
        self.rule.add(self, delta, weight, reply or {})
        self.count += 1
        self.weight += weight / self.expected.norm

    def share(self, weight: float) -> float:
        """An update's coefficient in a weighted mean: its weight over the expected total."""
        return (weight / self.expected.norm) / self.expected.weight

    def accumulate(self, name: str, tensors: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
        """``sums[name] += alpha * tensors``, tensor by tensor."""
        for s, t in zip(self.sums[name], tensors, strict=True):
            s.add_(t, alpha=alpha)

    def weighted_mean(self, name: str) -> Tensors:
        """``sums[name]`` (added with ``share``) as the mean over the updates actually added."""
        return self._rescaled(name, self.expected.weight, self.weight)

    def mean(self, name: str) -> Tensors:
        """``sums[name]`` (added with ``1 / expected.count``) as the mean over the updates actually added."""
        return self._rescaled(name, float(self.expected.count), float(self.count))

    def _rescaled(self, name: str, expected: float, got: float) -> Tensors:
        if got == expected:
            return self.sums[name]
        return [s * (expected / got) for s in self.sums[name]]

    def merge(self, others: Sequence[Fold]) -> None:
        """Add the sums, counts and weights of ``others`` (folds of the same round) in the order given."""
        for other in others:
            if other.expected != self.expected or set(other.sums) != set(self.sums):
                raise ValueError("folds of different rounds cannot be merged")
            for name, tensors in other.sums.items():
                self.accumulate(name, tensors)
            self.count += other.count
            self.weight += other.weight

    def finish(self) -> Dict[str, Tensors]:
        """The new model ``"x"`` and server state (``ServerRule.finish``); needs at least one update."""
        if self.count == 0:
            raise ValueError("a fold with no update has nothing to finish: the round keeps the model")
        return self.rule.finish(self)
