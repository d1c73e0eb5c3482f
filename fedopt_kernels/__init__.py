"""fedopt_kernels: fused optimizer kernels for federated learning, as torch.optim classes.

Public names (docs/algorithms.md): FedDecaySGD, WithinRoundDecay, NeuronLRSGD, neuron_lr_scales, FedNAR,
PAdaMFed, theory_hparams, FedDyn, FedSAM, available_backends; the server optimizers FedAvgM, FedAdam,
FedYogi, FedAdagrad, FedExP.
"""

from .core.registry import available_backends

# each algorithm's module registers its descriptor (fedopt_kernels.fl.algorithm) on import, in this order
# (the order of fedopt_kernels.fl.algorithm.ALGORITHMS and of the simulator's choices): not sorted
# isort: off
from .optim.feddecay import FedDecaySGD, WithinRoundDecay
from .optim.neuron_lr import NeuronLRSGD, neuron_lr_scales
from .optim.fednar import FedNAR
from .optim.padamfed import PAdaMFed, theory_hparams
from .optim.feddyn import FedDyn
from .optim.fedsam import FedSAM

# isort: on
from .optim.fedadam import FedAdagrad, FedAdam, FedYogi
from .optim.fedavgm import FedAvgM
from .optim.fedexp import FedExP

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
