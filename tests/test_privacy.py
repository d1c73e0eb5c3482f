"""User-level differential privacy (docs/privacy.md): the clip, the batched clip, the noise, the
adaptive clip and the accounting against float64 and ``dp-accounting`` oracles, then the simulator's
rounds under DP (bound, reproducibility, resume, bad input, the budget stop)."""

import importlib.util
import math
import re

import numpy as np
import pytest
import torch
from scipy import stats

from fedopt_kernels.fl.server_rules import RULES
from fedopt_kernels.privacy import (
    DPFedAvg,
    Sampling,
    add_noise,
    clip,
    clip_sum_batched,
    next_clip,
    round_generator,
    update_noise_multiplier,
)

# the clips need nothing but torch; the noise and adaptive tests run through DPFedAvg, whose accountant
# needs the [privacy] extra
needs_dp = pytest.mark.skipif(importlib.util.find_spec("dp_accounting") is None, reason="dp-accounting missing")

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SHAPES = ((7,), (3, 5), (1,), (13, 3, 2), (129,))


def reply(dtype, g, scale=1.0, noncontiguous=False):
    out = []
    for shape in SHAPES:
        t = (torch.randn(*shape, 2, generator=g, dtype=torch.float64) * scale).to(dtype)
        out.append(t[..., 1] if noncontiguous else t[..., 1].contiguous())  # a strided view, or not
    return out


def norm64(tensors) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten().tolist()))


# ------------------------------------------------------------------------------------------- the clip
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("noncontiguous", [False, True])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_clip_factor_and_clipped_reply_equal_float64(dtype, noncontiguous, scale):
    g = torch.Generator().manual_seed(hash((str(dtype), noncontiguous, scale)) % 2**31)
    tensors = reply(dtype, g, scale, noncontiguous)
    n = norm64(tensors)
    for C in (n / 3, n, 2 * n):  # clipped, at the bound, untouched
        clipped, factor, below = clip(tensors, C)
        want = min(1.0, C / n)
        # the float64 sum of squares: a relative 2^-52 per addition over the elements
        assert abs(float(factor) - want) <= 1e-13 * want
        assert bool(below) == (n <= C) or abs(n - C) <= 1e-13 * C
        for c, t in zip(clipped, tensors):
            assert c.dtype == torch.float64 and c.shape == t.shape
            assert torch.equal(c, t.double() * factor)  # one rounding of the float64 product
        assert norm64(clipped) <= C * (1 + 1e-12)


def test_clip_has_no_overflow_at_the_range_ends():
    big = [torch.full((1000,), 1e30, dtype=torch.float32), torch.full((3,), -1e30, dtype=torch.float32)]
    _, factor, below = clip(big, 1.0)
    assert float(factor) == pytest.approx(1.0 / (1e30 * math.sqrt(1003)), rel=1e-6) and not bool(below)
    tiny = [torch.full((1000,), 1e-30, dtype=torch.float32)]
    _, factor, below = clip(tiny, 1e-28)
    assert float(factor) == 1.0 and bool(below)


def test_clip_refuses_a_bound_that_is_not_positive():
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="dp_clip"):
            clip([torch.ones(3)], bad)


# ------------------------------------------------------------------------------- the batched clip
def oracle_batched(tensors, C, active):
    """Per client alone, in float64 Python: norms, factors, below, and the clipped sum."""
    n_clients = tensors[0].shape[0]
    norms = [norm64([t[c] for t in tensors]) for c in range(n_clients)]
    factors = [min(1.0, C / n) if active[c] else 0.0 for c, n in enumerate(norms)]
    below = [bool(active[c]) and n <= C for c, n in enumerate(norms)]
    sums = [sum(factors[c] * t[c].double() for c in range(n_clients) if active[c]) for t in tensors]
    return norms, factors, below, sums


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("noncontiguous", [False, True])
@pytest.mark.parametrize("clients", [1, 5])
def test_batched_clip_equals_float64_per_client(dtype, noncontiguous, clients):
    g = torch.Generator().manual_seed(clients * 7 + noncontiguous)
    tensors = []
    for shape in SHAPES:
        t = torch.randn(shape + (clients,), generator=g, dtype=torch.float64).to(dtype)
        t = t.movedim(-1, 0)  # [C, *shape], strided
        tensors.append(t if noncontiguous else t.contiguous())
    tensors[1][0].fill_(float("nan")) if clients > 1 else None  # an inactive client's row is never read
    active = torch.tensor([c != 0 for c in range(clients)] if clients > 1 else [True])
    mid = float(np.median([norm64([t[c] for t in tensors]) for c in range(1, clients)] or [1.0]))
    norms, factors, below, sums = clip_sum_batched(tensors, mid, active)
    want = oracle_batched(tensors, mid, active.tolist())
    for c in range(clients):
        if active[c]:
            assert abs(float(norms[c]) - want[0][c]) <= 1e-13 * want[0][c]
        assert abs(float(factors[c]) - want[1][c]) <= 1e-13
        assert bool(below[c]) == want[2][c] or abs(want[0][c] - mid) <= 1e-13 * mid
    for j, (s, w) in enumerate(zip(sums, want[3])):
        assert s.dtype == torch.float64 and s.shape == w.shape
        # C float64 products and C additions, each a relative 2^-53 of the terms' magnitudes
        size = sum(abs(want[1][c]) * tensors[j][c].double().abs() for c in range(clients) if active[c])
        assert bool(((s - w).abs() <= 2 * clients * 2**-52 * size).all())


def test_batched_clip_equals_clipping_each_client_alone():
    """The chunk's call and the per-reply clip (``clip``) then a fold's adds give the same sums."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(4, *s, generator=g) for s in SHAPES]
    _, factors, _, sums = clip_sum_batched(tensors, 2.0)
    alone = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for c in range(4):
        clipped, factor, _ = clip([t[c] for t in tensors], 2.0)
        assert abs(float(factor) - float(factors[c])) <= 1e-15
        for a, x in zip(alone, clipped):
            a.add_(x)
    for s, a in zip(sums, alone):
        assert torch.allclose(s, a, rtol=1e-14, atol=1e-300)


def test_batched_clip_adds_into_given_sums_and_checks_its_input():
    tensors = [torch.ones(2, 3)]
    out = [torch.full((3,), 10.0, dtype=torch.float64)]
    _, _, _, sums = clip_sum_batched(tensors, 100.0, out=out)
    assert sums[0] is out[0] and torch.equal(out[0], torch.full((3,), 12.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="C"):
        clip_sum_batched([torch.ones(2, 3), torch.ones(3, 3)], 1.0)
    with pytest.raises(ValueError, match="active"):
        clip_sum_batched(tensors, 1.0, active=torch.ones(2))
    with pytest.raises(ValueError, match="dp_clip"):
        clip_sum_batched(tensors, 0.0)


# ----------------------------------------------------------------------------------------- the noise
# Under the null hypothesis (the draws are N(0, s^2)), sum x^2 / s^2 over n draws is chi-square with
# n degrees of freedom: the test fails with probability 2 * P_FALSE when the std is right.
P_FALSE = 1e-9


def std_within_chi_square(draws: np.ndarray, std: float) -> bool:
    n = draws.size
    q = float(np.sum((draws / std) ** 2))
    return stats.chi2.ppf(P_FALSE, n) <= q <= stats.chi2.isf(P_FALSE, n)


@needs_dp
def test_noise_std_per_coordinate_is_z_c_over_expected():
    """Through a FedAvg fold with no client: the model moves by exactly the noise / expected clients."""
    z, C, M, n, rounds = 1.3, 0.7, 4, 4099, 40
    x = [torch.zeros(n, dtype=torch.float64), torch.zeros(3, 7, dtype=torch.float64)]
    sampling = Sampling("fixed", 10, per_round=M)
    draws = []
    priv = DPFedAvg(C, z, sampling, seed=5, delta=1e-5)
    for t in range(rounds):
        fold = RULES["avg"].begin(x, {}, {"server_lr": 1.0}, 10, 1, 0)
        priv.finish_round(fold, t, ())
        new = fold.finish()["x"]
        draws.append(torch.cat([v.flatten() for v in new]).numpy())
    draws = np.concatenate(draws)
    std = z * C / M
    assert std_within_chi_square(draws, std)
    assert abs(draws.mean()) <= 6.1 * std / math.sqrt(draws.size)  # two-sided normal at about P_FALSE
    # the check can fail: a std 3% off is outside the interval at this many draws
    assert not std_within_chi_square(draws, std * 1.03) and not std_within_chi_square(draws, std / 1.03)


def test_noise_is_named_by_seed_and_round():
    a, b, c = (torch.zeros(1000, dtype=torch.float64) for _ in range(3))
    add_noise([a], 1.0, round_generator(3, 7))
    add_noise([b], 1.0, round_generator(3, 7))
    add_noise([c], 1.0, round_generator(3, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------------- adaptive clipping
@needs_dp
def test_adaptive_clip_follows_a_float64_replay():
    """Andrew et al.'s geometric update, replayed in Python floats with the same count noise."""
    g = torch.Generator().manual_seed(11)
    norms = (torch.rand(20, generator=g, dtype=torch.float64) * 10).tolist()
    sampling = Sampling("fixed", 20, per_round=20)
    priv = DPFedAvg(1.0, 0.5, sampling, seed=9, delta=1e-5, quantile=0.5, clip_lr=0.2)
    x = [torch.zeros(1, dtype=torch.float64)]
    C, got, want = 1.0, [], []
    for t in range(60):
        fold = RULES["avg"].begin(x, {}, {"server_lr": 1.0}, 20, 1, 0)
        for nm in norms:
            delta, _ = priv.clip_reply([torch.tensor([nm], dtype=torch.float64)], {}, ())
            fold.add(delta, 1.0)
        priv.finish_round(fold, t, ())
        noise = float(torch.randn((), generator=round_generator(9, t), dtype=torch.float64)) * (20 / 20)
        below = sum(n <= C for n in norms)
        C = C * math.exp(-0.2 * ((below + noise) / 20 - 0.5))
        got.append(priv.clip_norm)
        want.append(C)
    assert got == pytest.approx(want, rel=1e-12)
    median = float(np.median(norms))
    assert abs(C - median) < 0.35 * median  # it went from 1 toward the median of the norms


def test_the_update_noise_multiplier_keeps_the_total():
    z, sigma_b = 1.0, 2.0
    zd = update_noise_multiplier(z, sigma_b)
    assert zd**-2 + (2 * sigma_b) ** -2 == pytest.approx(z**-2, rel=1e-14)
    assert update_noise_multiplier(0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="dp_noise_multiplier"):
        update_noise_multiplier(1.0, 0.5)
    assert next_clip(2.0, 3, 0.0, 10.0, 0.3, 0.2) == 2.0  # b = gamma: C stays


# -------------------------------------------------------------------------------------- accounting
@needs_dp
def test_epsilon_after_each_round_equals_dp_accounting():
    """The accountant's per-round epsilon (one RDP curve, scaled) is the library's composition's."""
    import dp_accounting as dp

    from fedopt_kernels.privacy.accounting import Accountant

    sampling = Sampling("poisson", 1000, rate=0.03)
    acc = Accountant(sampling, 1.1, 1e-6)
    for rounds in range(1, 6):
        event = dp.PoissonSampledDpEvent(0.03, dp.GaussianDpEvent(1.1))
        want = dp.rdp.RdpAccountant().compose(dp.SelfComposedDpEvent(event, rounds)).get_epsilon(1e-6)
        assert acc.step() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"algorithm": "fednova"}, "nova_a"),  # the server weighs updates by each client's a_i
        ({"algorithm": "fedavg", "server_optimizer": "exp"}, "server_optimizer='exp'"),  # its mean squared norm
    ],
)
def test_dp_refuses_a_server_that_reads_what_the_noise_does_not_cover(settings, named):
    from fedopt_kernels.sim.config import SimConfig

    cfg = SimConfig(dp_clip=1.0, dp_noise_multiplier=1.0, **settings)
    with pytest.raises(ValueError, match=re.escape(named)):
        cfg.validate()
    SimConfig(dp_clip=1.0, dp_noise_multiplier=1.0, algorithm="fedavg", server_optimizer="adam").validate()
