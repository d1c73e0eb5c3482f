"""The Gaussian noise of a DP round: drawn once per round from a generator named by (seed, round)."""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

STREAM = 0x44505F46  # this stream's key among the run's seeded streams ("DP_F"): its own draws


def round_generator(seed: int, t: int) -> torch.Generator:
    """A CPU ``torch.Generator`` for round ``t`` of the run seeded ``seed``: the same bits on every rank
    and after a resume (nothing to checkpoint but the round), independent of every other stream.

    A simulation's pseudo-random generator is not the secure randomness a deployment needs: this
    noise is reproducible by anyone who knows the seed (docs/privacy.md)."""
    state = np.random.SeedSequence(seed, spawn_key=(STREAM, t)).generate_state(1, np.uint64)[0]
    g = torch.Generator(device="cpu")
    g.manual_seed(int(state) & (2**63 - 1))
    return g


@torch.no_grad()
def gaussian_like(tensors: Sequence[torch.Tensor], std: float, generator: torch.Generator) -> List[torch.Tensor]:
    """``N(0, std^2)`` per coordinate, one tensor like each of ``tensors`` (float64, on its device), drawn
    on the CPU in order: the same numbers whatever the device."""
    out = []
    for t in tensors:
        n = torch.randn(t.shape, generator=generator, dtype=torch.float64)
        out.append(n.mul_(std).to(t.device))
    return out


@torch.no_grad()
def add_noise(sums: Sequence[torch.Tensor], std: float, generator: torch.Generator) -> None:
    """``sums += N(0, std^2)`` per coordinate, in place (``gaussian_like``'s draws)."""
    for s, n in zip(sums, gaussian_like(sums, std, generator), strict=True):
        s.add_(n.to(s.dtype))
