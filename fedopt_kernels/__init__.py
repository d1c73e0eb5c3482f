"""fedopt_kernels: fused optimizer kernels for federated learning, as torch.optim classes.

Public names (docs/algorithms.md): FedDecaySGD, WithinRoundDecay, NeuronLRSGD, neuron_lr_scales, FedNAR,
PAdaMFed, theory_hparams, available_backends.
"""
from ._registry import available_backends
from .feddecay import FedDecaySGD, WithinRoundDecay
from .fednar import FedNAR
from .neuron_lr import NeuronLRSGD, neuron_lr_scales
from .padamfed import PAdaMFed, theory_hparams

__version__ = "0.1.0"

__all__ = [
    "FedDecaySGD",
    "WithinRoundDecay",
    "NeuronLRSGD",
    "neuron_lr_scales",
    "FedNAR",
    "PAdaMFed",
    "theory_hparams",
    "available_backends",
]
