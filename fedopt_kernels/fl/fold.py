"""A server rule as a fold: a round's updates are added to running sums as they arrive, then dropped.

``Fold`` holds a round's sums (each a list of tensors shaped like the model, zero at the start),
the number of updates added and their weights' sum. A rule (``server_rules.ServerRule``) begins a
fold, adds each accepted update to it in client-id order, and finishes it into the new model and
server state. The memory a round needs is then the sums, whatever its number of clients.

A weighted mean keeps ``sum_i w_i delta_i`` and ``sum_i w_i`` and divides once, at the end; a
plain mean keeps ``sum_i delta_i`` and the count. So a round in which a client is refused (a
dropout) computes bit for bit what it computes without that client, and no coefficient needs to
be known before the first update arrives. The weights are first scaled by a power of two
(``weight_exponent``: exact, so it changes no bit of the mean) that keeps ``w_i delta_i`` in
range whatever the weights' size.

The sums are kept in float64 (``sum_dtype``) and rounded to the model's dtype once, when the fold
finishes: ``w_i delta_i`` of float32 or narrower values is then exact, and the few roundings of the
sum are 2**-29 of a float32 unit, so the mean hardly depends on the order the updates were added
in. One process adding a round's clients one by one and several ranks each adding theirs, then
merging, round to the same model but on the rare element whose exact mean lies that close to a
float32 rounding boundary; summed in float32, every element would differ by a unit or so each
round, which many rounds of training grow into a different run.

A server optimizer that reads the clients' squared update norms (FedExP's, ``server_step.py``) has
the fold also keep ``sums["sq_norm"]``, one float64 scalar ``sum_i w_i ||delta_i||^2`` (weights
scaled as above), added per update and merged like the other sums (``keep_sq_norms``).

Sums from several folds with the same exponent (the ranks of one run) combine by ``merge``:
added in the order given, so every process that merges the same folds in the same order holds
the same bits.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

Tensors = List[torch.Tensor]


def sum_dtype(like: torch.Tensor) -> torch.dtype:
    """The dtype of a running sum of tensors like ``like``: float64 for floating-point values (module
    docstring), except on a device without float64 (Apple's MPS), which keeps ``like``'s."""
    if like.is_floating_point() and like.device.type != "mps":
        return torch.float64
    return like.dtype


def finished(out: Dict[str, Tensors], like: Mapping[str, Tensors]) -> Dict[str, Tensors]:
    """``out`` with each list in the dtypes of ``like``'s list of the same name (the model, the server
    state): the one rounding of a fold's float64 sums."""
    return {
        name: [t.to(r.dtype) for t, r in zip(tensors, like[name], strict=True)] if name in like else tensors
        for name, tensors in out.items()
    }


def sq_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_j ||tensors[j]||^2`` as a 0-d tensor in the sums' dtype (float64: exact squares), on the device."""
    dt = sum_dtype(tensors[0])
    return torch.stack([t.to(dt).square().sum() for t in tensors]).sum()


def weight_exponent(weights: Sequence[float]) -> int:
    """``e`` with ``max(weights) / 2**e`` in [0.5, 1): the scale of a round's weights (``Fold``).

    ValueError naming ``weights`` unless every weight is finite and > 0."""
    if len(weights) == 0:
        raise ValueError("weights is empty: a round expects at least one update")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be finite and > 0, got {list(weights)}")
    return math.frexp(max(weights))[1]


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
        exponent: int = 0,
    ):
        self.rule, self.x, self.state, self.hp = rule, x, state, hp
        self.num_clients, self.local_steps, self.exponent = num_clients, local_steps, exponent
        self.sums: Dict[str, Tensors] = {
            name: [torch.zeros_like(v, dtype=sum_dtype(v)) for v in x] for name in rule.sums
        }
        self.count = 0
        self.weight = 0.0  # the added updates' weights, each divided by 2**exponent

    def add(self, delta: Sequence[torch.Tensor], weight: float, reply: Optional[Mapping[str, Any]] = None) -> None:
        """Add one accepted update (its model change ``delta``, weight, reply tensors such as ``dc`` and
        numbers such as FedNova's ``nova_a``)."""
        self.rule.add(self, delta, weight, reply or {})
        if "sq_norm" in self.sums:
            self.sums["sq_norm"][0].add_(sq_norm(delta), alpha=self.scaled(weight))
        self.count += 1
        self.weight += self.scaled(weight)

    def add_sum(self, delta: Sequence[torch.Tensor], count: int, reply: Optional[Mapping[str, Any]] = None) -> None:
        """Add ``count`` updates of weight 1 at once by their sums (``delta``, and ``reply``'s tensor
        lists): a chunk's clipped replies summed by one op (``privacy.DPFedAvg.clip_sum``). A rule's
        ``add`` is linear in the update, so this is ``count`` calls of ``add`` up to the order of the
        float64 additions. A fold that keeps each update's squared norm (FedExP's) refuses it."""
        if "sq_norm" in self.sums:
            raise ValueError("this fold sums each update's squared norm: add the updates one by one")
        self.rule.add(self, delta, 1.0, reply or {})
        self.count += count
        self.weight += count * self.scaled(1.0)  # exact: a power of two times a count

    def keep_sq_norms(self) -> None:
        """Also sum ``w_i ||delta_i||^2`` over the updates (module docstring); before the first ``add``."""
        like = self.x[0]
        self.sums["sq_norm"] = [torch.zeros((), dtype=sum_dtype(like), device=like.device)]

    def scaled(self, weight: float) -> float:
        """``weight / 2**exponent``: exact, so the weighted sum is ``sum_i w_i delta_i`` to the bit, scaled."""
        return math.ldexp(weight, -self.exponent)

    def accumulate(self, name: str, tensors: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
        """``sums[name] += alpha * tensors``, tensor by tensor."""
        for s, t in zip(self.sums[name], tensors, strict=True):
            s.add_(t, alpha=alpha)

    def merge(self, others: Sequence[Fold]) -> None:
        """Add the sums, counts and weights of ``others`` (folds of the same round) in the order given."""
        for other in others:
            if other.exponent != self.exponent or set(other.sums) != set(self.sums):
                raise ValueError("folds of different rounds cannot be merged")
            for name, tensors in other.sums.items():
                self.accumulate(name, tensors)
            self.count += other.count
            self.weight += other.weight

    def finish(self) -> Dict[str, Tensors]:
        """The new model ``"x"`` and server state (``ServerRule.finish``); needs at least one update."""
        if self.count == 0:
            raise ValueError("a fold with no update has nothing to finish: the round keeps the model")
        return finished(self.rule.finish(self), {**self.state, "x": self.x})
