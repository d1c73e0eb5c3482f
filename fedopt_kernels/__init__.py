"""fedopt_kernels: fused optimizer kernels for federated learning, as torch.optim classes.

Public names (docs/algorithms.md): FedDecaySGD, WithinRoundDecay, NeuronLRSGD, neuron_lr_scales, FedNAR,
PAdaMFed, theory_hparams, FedDyn, FedSAM, available_backends.
"""

from .core.registry import available_backends
from .fl import algorithms as _algorithms  # noqa: F401  (each algorithm's FL descriptor registers on import)
from .optim.feddecay import FedDecaySGD, WithinRoundDecay
from .optim.feddyn import FedDyn
from .optim.fednar import FedNAR
from .optim.fedsam import FedSAM
from .optim.neuron_lr import NeuronLRSGD, neuron_lr_scales
from .optim.padamfed import PAdaMFed, theory_hparams

__version__ = "0.1.0"

__all__ = [
    "FedDecaySGD",
    "WithinRoundDecay",
    "NeuronLRSGD",
    "neuron_lr_scales",
    "FedNAR",
    "PAdaMFed",
    "theory_hparams",
    "FedDyn",
    "FedSAM",
    "available_backends",
]
