"""Adaptive clipping: the clip norm follows a quantile of the clients' reply norms, privately.

"Differentially Private Learning with Adaptive Clipping" (Andrew, Thakkar, McMahan, Ramaswamy;
NeurIPS 2021), Algorithm 1 with the geometric update: each client also reports
``b_i = 1[||reply_i|| <= C]``; the server forms ``b = (sum_i b_i + N(0, sigma_b^2)) / expected`` and
sets ``C <- C exp(-eta_C (b - gamma))``, which moves C toward the gamma-quantile of the norms. The
count is a second Gaussian release; the replies' noise multiplier becomes
``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` so that both together are worth the single mechanism
with multiplier z (the paper's Theorem 1), which is what the accountant counts.
"""

from __future__ import annotations

import math


def update_noise_multiplier(z: float, sigma_b: float) -> float:
    """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``; 0 for z = 0 (no privacy). ValueError naming the options
    when ``2 sigma_b <= z`` (the count's noise alone would spend more than the whole budget)."""
    if z == 0:
        return 0.0
    rest = z**-2 - (2 * sigma_b) ** -2
    if not rest > 0:
        raise ValueError(
            f"dp_noise_multiplier={z:g} leaves no noise for the updates under adaptive clipping: the clip "
            f"count's noise sigma_b={sigma_b:g} needs 2 sigma_b > z; lower the noise multiplier (or raise "
            f"dp_target_epsilon), or sample more clients per round (sigma_b is the expected clients / 20)"
        )
    return rest**-0.5


def next_clip(clip: float, below: float, count_noise: float, expected: float, quantile: float, lr: float) -> float:
    """``C exp(-eta_C (b - gamma))`` with ``b = (below + count_noise) / expected`` (module docstring)."""
    b = (below + count_noise) / expected
    return clip * math.exp(-lr * (b - quantile))
