"""DP-FedAvg on a round's fold: clip each reply as it is added, noise the sums once, divide by the
expected number of clients, move the adaptive clip, count the privacy spent."""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..fl.fold import Fold
from .accounting import Accountant, Sampling
from .adaptive import next_clip, update_noise_multiplier
from .batched_clip import clip_sum_batched
from .clip import clip
from .noise import gaussian_like, round_generator

Tensors = List[torch.Tensor]


class DPFedAvg:
    """The server's side of user-level DP (McMahan, Ramage, Talwar, Zhang; ICLR 2018), with adaptive
    clipping (Andrew, Thakkar, McMahan, Ramaswamy; NeurIPS 2021) when ``quantile`` is given.

    A round: ``clip_reply`` each accepted reply (``delta`` and the rule's reply tensors, one vector)
    before it is added to the fold with weight 1, or ``clip_sum`` a chunk of them stacked (the
    client-batched engine: one op for the chunk, its sum added by ``Fold.add_sum``); then
    ``finish_round``: the fold's sums get ``N(0, (z_Delta C)^2)`` per coordinate, added through the
    rule's own ``add`` as one more reply of weight 1 that is not counted (so every sum gets the noise
    its reply coordinates carry: SCAFFOLD's ``dc`` sum its ``1/N`` share), the fold then divides by
    ``expected`` instead of the clients that replied, C moves (adaptive) and the accountant counts
    the round.

    ``noise_multiplier`` z is the whole mechanism's (what the accountant counts); with adaptive
    clipping the replies get ``z_Delta`` and the clip count ``sigma_b`` (default ``expected / 20``).
    Randomness comes from ``round_generator(seed, t)``: the round's clip-count noise first, then the
    sums' in the rule's order.
    """

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        sampling: Sampling,
        seed: int,
        delta: float,
        quantile: Optional[float] = None,
        clip_lr: float = 0.2,
        count_std: Optional[float] = None,
        accountant: str = "rdp",
    ):
        if not (isinstance(clip_norm, (int, float)) and math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"dp_clip must be a finite number > 0, got {clip_norm!r}")
        z = noise_multiplier
        if not (isinstance(z, (int, float)) and math.isfinite(z) and z >= 0):
            raise ValueError(f"dp_noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
        if quantile is not None and not (isinstance(quantile, (int, float)) and 0 <= quantile <= 1):
            raise ValueError(f"dp_adaptive_quantile must be in [0, 1], got {quantile!r}")
        if not (isinstance(clip_lr, (int, float)) and math.isfinite(clip_lr) and clip_lr > 0):
            raise ValueError(f"dp_clip_lr must be a finite number > 0, got {clip_lr!r}")
        self.clip_norm, self.z, self.sampling, self.seed = float(clip_norm), float(noise_multiplier), sampling, seed
        self.quantile, self.clip_lr = quantile, clip_lr
        self.expected = sampling.expected
        self.count_std = self.expected / 20 if count_std is None else float(count_std)
        if quantile is not None and not self.count_std > 0:
            raise ValueError(f"the clip count's noise must be > 0, got {self.count_std!r}")
        self.update_z = self.z if quantile is None else update_noise_multiplier(self.z, self.count_std)
        self.accountant = Accountant(sampling, self.z, delta, accountant)
        self._below = 0  # this round's b_i so far, on the host (``below``)
        self._pending: Optional[torch.Tensor] = None  # chunks' counts on the device, not yet read

    @property
    def below(self) -> int:
        """This round's ``sum_i b_i`` so far: the replies' (read once per reply) and the chunks' (summed
        on the device and read here, once a round)."""
        if self._pending is not None:
            self._below += int(self._pending)
            self._pending = None
        return self._below

    @below.setter
    def below(self, value: int) -> None:
        self._below, self._pending = value, None

    @property
    def rounds(self) -> int:
        return self.accountant.rounds

    def clip_reply(
        self, delta: Sequence[torch.Tensor], reply: Mapping[str, Tensors], names: Sequence[str]
    ) -> Tuple[Tensors, Dict[str, Tensors]]:
        """``delta`` and ``reply[name]`` for ``name`` in ``names``, scaled as one vector by
        ``min(1, C / ||.||)`` (``clip.clip``); counts ``b_i``. Other entries of ``reply`` are kept."""
        parts = [list(delta)] + [list(reply[n]) for n in names]
        flat = [t for part in parts for t in part]
        clipped, _, below = clip(flat, self.clip_norm)
        if self.quantile is not None:
            self.below += int(below)
        out, at = [], 0
        for part in parts:
            out.append(clipped[at : at + len(part)])
            at += len(part)
        return out[0], {**reply, **dict(zip(names, out[1:], strict=True))}

    def clip_sum(
        self,
        delta: Sequence[torch.Tensor],
        reply: Mapping[str, Tensors],
        names: Sequence[str],
        backend: str = "auto",
    ) -> Tuple[Tensors, Dict[str, Tensors]]:
        """A chunk's replies, each tensor stacked ``[C, *shape]`` (row c: client c), each client's
        ``delta`` and ``reply[name]`` for ``name`` in ``names`` scaled as one vector by
        ``min(1, C / ||.||)`` and summed over the clients in order, in one op
        (``clip_sum_batched``); counts the chunk's ``b_i``. Returns the float64 sums of ``delta``
        and of each reply entry: what ``Fold.add_sum`` adds for the chunk's clients."""
        parts = [list(delta)] + [list(reply[n]) for n in names]
        flat = [t for part in parts for t in part]
        _, _, below, sums = clip_sum_batched(flat, self.clip_norm, backend=backend)
        if self.quantile is not None:  # counted on the device: no read until the round's end
            count = below.sum()
            self._pending = count if self._pending is None else self._pending + count
        out, at = [], 0
        for part in parts:
            out.append(sums[at : at + len(part)])
            at += len(part)
        return out[0], dict(zip(names, out[1:], strict=True))

    @torch.no_grad()
    def finish_round(self, fold: Fold, t: int, names: Sequence[str], below: Optional[int] = None) -> Dict[str, Any]:
        """Noise ``fold``'s sums for round ``t``, make it divide by ``expected``, move C, count the round;
        returns the round's record entries (epsilon, the clip used, the next clip). ``below``: the
        round's ``sum_i b_i`` over every rank (default: this process's count)."""
        gen = round_generator(self.seed, t)
        count_noise = float(torch.randn((), generator=gen, dtype=torch.float64)) * self.count_std
        std = self.update_z * self.clip_norm
        noise = gaussian_like(fold.x, std, gen)
        extra = {n: gaussian_like(fold.x, std, gen) for n in names}
        bare = copy.copy(fold)  # the rule adds the noise like a reply, and Fold.add would count it
        fold.rule.add(bare, noise, 1.0, extra)
        # the mean over the expected clients: the rules divide by the weights' sum or the count
        fold.weight, fold.count = fold.scaled(self.expected), self.expected  # type: ignore[assignment]
        used = self.clip_norm
        if self.quantile is not None:
            b = self.below if below is None else below
            self.clip_norm = next_clip(used, b, count_noise, self.expected, self.quantile, self.clip_lr)
        self.below = 0
        eps = self.accountant.step()
        return {"dp_epsilon": eps, "dp_clip": used, "dp_next_clip": self.clip_norm}

    def epsilon_after(self, rounds: int) -> float:
        return self.accountant.epsilon_after(rounds)

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps: the clip norm and the accountant's position (the noise is named by
        the seed and the round, so no generator state)."""
        return {"clip": self.clip_norm, "rounds": self.accountant.rounds}

    @staticmethod
    def check_state(state: Any) -> None:
        """ValueError unless ``state`` is a ``state_dict`` (a checkpoint's is checked before anything changes)."""
        ok = isinstance(state, Mapping) and set(state) == {"clip", "rounds"}
        c, r = (state["clip"], state["rounds"]) if ok else (None, None)
        if not (ok and isinstance(c, float) and math.isfinite(c) and c > 0 and isinstance(r, int) and r >= 0):
            raise ValueError(f"checkpoint's differential-privacy state is not readable: {state!r}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        c, r = state["clip"], state["rounds"]
        self.clip_norm, self.accountant.rounds, self.below = c, r, 0
