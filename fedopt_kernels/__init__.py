"""fedopt_kernels: fused optimizer kernels for federated learning, as torch.optim classes.

Public names (docs/algorithms.md): FedDecaySGD, WithinRoundDecay, NeuronLRSGD, neuron_lr_scales, FedNAR,
PAdaMFed, theory_hparams, FedDyn, FedSAM, available_backends; the server optimizers FedAvgM, FedAdam,
FedYogi, FedAdagrad, FedExP.
"""

from .core.registry import available_backends
from .fl import algorithms as _algorithms  # noqa: F401  (each algorithm's FL descriptor registers on import)
from .optim.fedadam import FedAdagrad, FedAdam, FedYogi
from .optim.fedavgm import FedAvgM
from .optim.feddecay import FedDecaySGD, WithinRoundDecay
from .optim.feddyn import FedDyn
from .optim.fedexp import FedExP
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
    "FedAvgM",
    "FedAdam",
    "FedYogi",
    "FedAdagrad",
    "FedExP",
    "available_backends",
]
