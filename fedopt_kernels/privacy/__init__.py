"""User-level differential privacy for federated rounds: DP-FedAvg with adaptive clipping.

Central DP ("Learning Differentially Private Recurrent Language Models", McMahan, Ramage, Talwar,
Zhang; ICLR 2018): the trusted server clips each accepted client reply to a global L2 norm ``C``
(``clip``), adds Gaussian noise ``N(0, (z C)^2)`` per coordinate to the round's sums once
(``noise``), and divides by the expected number of clients per round, not by the number that
replied. The clip can follow a target quantile of the replies' norms ("Differentially Private
Learning with Adaptive Clipping", Andrew, Thakkar, McMahan, Ramaswamy; NeurIPS 2021;
``adaptive``). The privacy spent is counted by Google's ``dp-accounting`` (``accounting``; the
``[privacy]`` extra). ``DPFedAvg`` (``dp_fedavg``) puts the pieces on a round's fold
(``fedopt_kernels.fl.fold``); ``clip_sum_batched`` (``batched_clip``) is a chunk of clients' clip
and clipped sum in one call. docs/privacy.md says what is protected and what is not.
"""

from .accounting import ACCOUNTANTS, SAMPLINGS, Sampling, calibrate, epsilon
from .adaptive import next_clip, update_noise_multiplier
from .batched_clip import clip_sum_batched
from .clip import clip
from .dp_fedavg import DPFedAvg
from .noise import add_noise, round_generator

__all__ = [
    "ACCOUNTANTS",
    "SAMPLINGS",
    "Sampling",
    "calibrate",
    "epsilon",
    "next_clip",
    "update_noise_multiplier",
    "clip_sum_batched",
    "clip",
    "DPFedAvg",
    "add_noise",
    "round_generator",
]
