"""How much privacy a run spends: epsilon at delta after R rounds of the subsampled Gaussian mechanism.

Each round of DP-FedAvg releases the clipped replies' sum plus ``N(0, (z C)^2)`` noise per
coordinate over a random subset of the N clients: Poisson sampling (each client joins with
probability q) or fixed-size sampling (M of N without replacement). The guarantee of R such rounds
is computed by Google's ``dp-accounting`` (the ``[privacy]`` extra): Renyi DP ("Renyi Differential
Privacy of the Sampled Gaussian Mechanism", Mironov, Talwar, Zhang 2019) by default, privacy loss
distributions ("Connect the Dots", Doroshenko, Ghazi, Kamath, Kumar, Manurangsi; PETS 2022) on
request. Poisson sampling is accounted for adding or removing one client's data; fixed-size sampling
for replacing one client's (the relation under which its amplification holds; RDP only).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterator

from ..core.extras import MissingExtra

SAMPLINGS = ("fixed", "poisson")
ACCOUNTANTS = ("rdp", "pld")
Z_MAX = 1e3  # the largest noise multiplier calibrate tries: beyond it no model learns anything
Z_MIN = 1e-2  # the smallest (z = 0 divides by zero in the accountants)


def dp_accounting() -> ModuleType:
    """Google's ``dp_accounting``, or :class:`MissingExtra` naming the ``[privacy]`` extra."""
    try:
        import dp_accounting as module
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "dp_accounting":
            raise
        raise MissingExtra(
            "differential privacy (the --dp-* options) counts its privacy spent with dp-accounting, which "
            "is not installed: pip install 'fedopt_kernels[privacy]' (or just: pip install dp-accounting)",
            name="dp_accounting",
        ) from None
    return module


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """RDP orders whose series do not converge are left out of the minimum, with a warning per order
    and call: the result is still an upper bound, so the warnings are held back."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass(frozen=True)
class Sampling:
    """How a round's clients are drawn from ``population``: ``"poisson"`` (each with probability
    ``rate``) or ``"fixed"`` (``per_round`` of them without replacement)."""

    kind: str
    population: int
    per_round: int = 0
    rate: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {self.kind!r}")
        if self.population < 1:
            raise ValueError(f"population must be >= 1, got {self.population}")
        if self.kind == "fixed" and not 1 <= self.per_round <= self.population:
            raise ValueError(f"per_round must be in [1, {self.population}], got {self.per_round}")
        if self.kind == "poisson" and not 0 < self.rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")

    @property
    def expected(self) -> float:
        """The expected number of clients per round: ``q N`` (Poisson) or ``M`` (fixed)."""
        return self.rate * self.population if self.kind == "poisson" else float(self.per_round)


def round_event(sampling: Sampling, noise_multiplier: float) -> Any:
    """One round as a ``dp_accounting`` event: the subsampled Gaussian mechanism with multiplier z."""
    dp = dp_accounting()
    gaussian = dp.GaussianDpEvent(noise_multiplier)
    if sampling.kind == "poisson":
        return dp.PoissonSampledDpEvent(sampling.rate, gaussian)
    return dp.SampledWithoutReplacementDpEvent(sampling.population, sampling.per_round, gaussian)


def fresh_accountant(sampling: Sampling, kind: str = "rdp") -> Any:
    """An empty ``dp_accounting`` accountant of ``kind`` (``"rdp"`` or ``"pld"``) for ``sampling``."""
    dp = dp_accounting()
    if kind not in ACCOUNTANTS:
        raise ValueError(f"dp_accountant must be one of {ACCOUNTANTS}, got {kind!r}")
    fixed = sampling.kind == "fixed"
    if kind == "pld":
        if fixed:
            raise ValueError(
                "dp_accountant='pld' accounts Poisson sampling only; use sampling='poisson' "
                "(--sampling poisson) or dp_accountant='rdp' for fixed-size sampling"
            )
        return dp.pld.PLDAccountant()
    relation = dp.NeighboringRelation.REPLACE_ONE if fixed else dp.NeighboringRelation.ADD_OR_REMOVE_ONE
    return dp.rdp.RdpAccountant(neighboring_relation=relation)


def check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"dp_delta must be in (0, 1), got {delta!r}")


def epsilon(sampling: Sampling, noise_multiplier: float, rounds: int, delta: float, kind: str = "rdp") -> float:
    """epsilon at ``delta`` after ``rounds`` rounds with noise multiplier z (0 rounds: 0; z = 0: inf)."""
    check_delta(delta)
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    dp = dp_accounting()
    acc = fresh_accountant(sampling, kind)
    with _quiet():
        acc.compose(dp.SelfComposedDpEvent(round_event(sampling, noise_multiplier), rounds))
        return float(acc.get_epsilon(delta))


class Accountant:
    """epsilon at delta after each round of one run (``step`` once per round); ``rounds`` is its
    position, all a checkpoint needs to rebuild it (the mechanism is the same every round).

    RDP adds up over rounds, so one round's RDP curve is computed once and each round's epsilon is
    ``dp_accounting``'s conversion of ``rounds`` times it: what composing ``rounds`` rounds computes,
    without recomputing the curve every round. PLD composes afresh at each call."""

    def __init__(self, sampling: Sampling, noise_multiplier: float, delta: float, kind: str = "rdp"):
        check_delta(delta)
        self.sampling, self.z, self.delta, self.kind = sampling, noise_multiplier, delta, kind
        self.rounds = 0
        one = fresh_accountant(sampling, kind)  # the extra is installed and the pair supported: now, not at round 1
        self._curve = None
        if kind == "rdp" and noise_multiplier > 0:
            with _quiet():
                one.compose(round_event(sampling, noise_multiplier))
            orders, rdp = getattr(one, "_orders", None), getattr(one, "_rdp", None)
            if orders is not None and rdp is not None:  # else the composing path below
                self._curve = (orders, rdp)

    def epsilon_after(self, rounds: int) -> float:
        if self._curve is None or rounds == 0:
            return epsilon(self.sampling, self.z, rounds, self.delta, self.kind)
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        orders, rdp = self._curve
        return float(compute_epsilon(orders, rounds * rdp, self.delta)[0])

    def step(self) -> float:
        """Count one more round; its epsilon."""
        self.rounds += 1
        return self.epsilon_after(self.rounds)


def calibrate(sampling: Sampling, target_epsilon: float, rounds: int, delta: float, kind: str = "rdp") -> float:
    """The smallest noise multiplier z in [Z_MIN, Z_MAX] (to ``dp_accounting``'s tolerance) whose
    ``rounds`` rounds spend at most ``target_epsilon`` at ``delta``:
    ``dp_accounting.calibrate_dp_mechanism``'s bisection. ValueError naming ``dp_target_epsilon``
    when even ``z = Z_MAX`` spends more."""
    check_delta(delta)
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"dp_target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 to calibrate a noise multiplier, got {rounds}")
    floor = epsilon(sampling, Z_MAX, rounds, delta, kind)
    if floor > target_epsilon:
        raise ValueError(
            f"dp_target_epsilon={target_epsilon:g} cannot be reached in {rounds} rounds at dp_delta={delta:g}: "
            f"even noise multiplier {Z_MAX:g} spends epsilon {floor:.4g}; raise the target or dp_delta, or run "
            f"fewer rounds"
        )
    if epsilon(sampling, Z_MIN, rounds, delta, kind) <= target_epsilon:
        return Z_MIN  # a target so loose that the smallest multiplier tried meets it
    dp = dp_accounting()

    def event(z: float) -> Any:
        return dp.SelfComposedDpEvent(round_event(sampling, z), rounds)

    with _quiet():
        z = dp.calibrate_dp_mechanism(
            lambda: fresh_accountant(sampling, kind),
            event,
            target_epsilon,
            delta,
            dp.ExplicitBracketInterval(Z_MIN, Z_MAX),
        )
    return float(z)
