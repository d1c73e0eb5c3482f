"""The client-batched benchmark's settings: the models in their papers' settings, the modes a round
runs in, FedNAR's hyperparameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

HP: Dict[str, Any] = dict(lr=0.05, weight_decay=5e-4, max_norm=10.0)  # FedNAR's, in every mode
SEQ, VMAP, PLAIN, DEFAULTS, FUSED, REPLAY = (
    "sequential",
    "batched-vmap",
    "batched-plain-torch",
    "batched-fused-default",
    "batched-fused",
    "batched-fused-replay",
)
CHUNKED = "batched-fused-chunked"
MODES = (SEQ, VMAP, PLAIN, DEFAULTS, FUSED, REPLAY, CHUNKED)
BATCHED = (DEFAULTS, FUSED, REPLAY, CHUNKED)  # the simulator's client-batched step in its forms


@dataclass(frozen=True)
class ModelSetting:
    """A model in a paper's setting: what the table states about it."""

    model: str  # build_model name
    shape: Tuple[int, ...]
    classes: int
    batch: int
    steps: int  # the bench's default K
    paper: str  # where the setting comes from, with the paper's local steps
    clients: Dict[str, List[int]] = field(default_factory=dict)  # default C per device type
    kwargs: Dict[str, Any] = field(default_factory=dict)


SETTINGS: Dict[str, ModelSetting] = {
    "small-cnn": ModelSetting(
        "cnn",
        (1, 8, 8),
        10,
        10,
        10,
        "the simulator's toy (8x8 digits), K=10",
        {"cpu": [10, 50, 200], "cuda": [10, 50, 200, 1000]},
    ),
    "fedavg-cnn": ModelSetting(
        "fedavg-cnn",
        (1, 28, 28),
        10,
        10,
        10,
        "McMahan et al. 2017, MNIST CNN: B=10, E=5 (300 local steps); timed K=10",
        {"cpu": [5, 20], "cuda": [10, 100, 200]},
    ),
    "char-lstm": ModelSetting(
        "char-lstm",
        (80,),
        80,
        10,
        10,
        "LEAF Shakespeare (Caldas et al. 2018): B=10, 1 local epoch; timed K=10",
        {"cpu": [5, 20], "cuda": [10, 200]},
    ),
    "resnet18-gn": ModelSetting(
        "resnet18-gn",
        (3, 32, 32),
        10,
        50,
        20,
        "FedNAR (Li et al. 2023), CIFAR-10: B=50, 20 local steps",
        {"cpu": [2, 4], "cuda": [4, 16, 32]},
    ),
}
CPU_STEPS = {"resnet18-gn": 2}  # a CPU round of 20 ResNet steps takes minutes per client
