"""One simulation's settings: the algorithm's (``FLConfig``) plus data, model and execution, and the
checks that name a bad parameter."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..fl.algorithm import VARIANTS
from ..fl.config import FLConfig, check_choice, check_integer, check_real
from .batched.choose import MODES as FORMULATION_MODES
from .batched.precision import PRECISIONS
from .dp_round import check as dp_check
from .models.build import MODELS, TEXT_MODELS

# What ``--algorithm`` names is a *variant* (fedavg, fedprox, scaffold, ... each an algorithm's
# optimizer on a server rule): every registered one, fedopt_kernels.fl.algorithm.VARIANTS. The
# algorithms themselves (an optimizer and its descriptor) are fedopt_kernels.fl.algorithm.ALGORITHMS.
DATASETS = ("digits", "synthetic", "cifar10", "cifar100", "femnist", "mnist", "fmnist", "shakespeare")
FOLDER_DATASETS = (
    "cifar10",
    "cifar100",
    "femnist",
    "mnist",
    "fmnist",
    "shakespeare",
)  # read from data_dir (see docs/data.md)
NATURAL_DATASETS = ("synthetic", "femnist", "shakespeare")  # their clients are given: partition="natural"
PARTITIONS = ("dirichlet", "shards", "iid", "natural", "classes")
DEVICES = ("auto", "cpu", "cuda")

DIGITS_SIZE = 1797  # samples in scikit-learn's load_digits


def default_dataset() -> str:
    """``fedopt-sim``'s data set when none is named: the digits where scikit-learn (the ``[sim]`` extra)
    is installed, else the synthetic data, which needs nothing beyond torch."""
    import importlib.util

    return "digits" if importlib.util.find_spec("sklearn") is not None else "synthetic"


def default_model(dataset: str) -> str:
    """The model a data set runs with unless one is named: mlp for synthetic's vectors, a character GRU
    for Shakespeare's windows (client-batched too), the small CNN for the images."""
    return {"synthetic": "mlp", "shakespeare": "char-gru"}.get(dataset, "cnn")


CIFAR_SIZE = 60000  # train + test images, pooled before the partition
IDX_SIZE = 70000  # MNIST / Fashion-MNIST train + test images


@dataclass
class SimConfig(FLConfig):
    """Everything that determines a run; two runs with equal configs produce equal results.

    The algorithm's settings are ``FLConfig``'s; ``None`` means "the default" (``hparams()``).
    """

    dataset: str = "digits"
    partition: Optional[str] = None  # digits, cifar: dirichlet; synthetic, femnist: natural
    dirichlet_alpha: float = 0.5
    shards_per_client: int = 2
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    split: Tuple[float, float, float] = (0.6, 0.2, 0.2)
    model: str = ""  # "": default_model(dataset), i.e. mlp (synthetic), char-gru (shakespeare), else cnn
    hidden: Optional[int] = None  # mlp / mlp1 hidden width (default 64 / 25); char models: state size
    context: Optional[int] = None  # char-transformer: read the last `context` characters of a window
    finetune_steps: int = 5
    finetune_lr: float = 0.01
    device: str = "auto"
    eval_every: int = 1
    data_dir: Optional[str] = None  # cifar10/cifar100/femnist: the folder holding their files
    download: bool = False  # cifar: fetch into data_dir with torchvision if missing
    normalize: bool = True  # cifar/femnist: per-channel (x - mean) / std
    augment: bool = False  # cifar: random crop (padding 4) + horizontal flip in training
    client_batched: Any = 1  # clients trained at once, client-batched; "auto": as many as fit; 1: sequential
    replay: bool = False  # client-batched on CUDA: replay each local step from a CUDA graph
    # client-batched: how the layers engine's per-layer formulations are chosen (batched/choose.py):
    # "auto" measures on the device (reusing earlier choices), "measure" always, "default" never
    formulations: str = "auto"
    formulation_cache: Optional[str] = None  # a JSON file keeping measured choices across runs
    precision: str = "fp32"  # forward and backward passes: fp32, tf32 or bf16 (sim/batched/precision.py)
    # client sampling: "fixed" (sampled_per_round of N) or "poisson" (each client with the sample rate)
    sampling: str = "fixed"
    # user-level differential privacy (docs/privacy.md, sim/dp_round.py): off unless dp_clip is given
    dp_clip: Optional[float] = None  # C: each reply's global L2 norm bound (the initial one, adaptive)
    dp_noise_multiplier: Optional[float] = None  # z; or dp_target_epsilon, which calibrates it
    dp_target_epsilon: Optional[float] = None
    dp_delta: Optional[float] = None  # default 1 / N**1.1
    dp_adaptive_quantile: Optional[float] = None  # gamma: adaptive clipping toward this quantile of the norms
    dp_clip_lr: float = 0.2  # eta_C of adaptive clipping
    dp_accountant: str = "rdp"  # or "pld"
    dp_max_epsilon: Optional[float] = None  # stop before a round that would spend more

    def __post_init__(self) -> None:
        if not self.model:
            self.model = default_model(self.dataset)

    # ------------------------------------------------------------------ checks
    def validate(self) -> SimConfig:
        """Raise ValueError naming the first parameter that is out of range; return self."""
        choice, integer, number = check_choice, check_integer, check_real
        choice("algorithm", self.algorithm, VARIANTS)
        choice("dataset", self.dataset, DATASETS)
        choice("model", self.model, MODELS)
        choice("device", self.device, DEVICES)
        choice("precision", self.precision, PRECISIONS)
        if self.partition is not None:
            choice("partition", self.partition, PARTITIONS)
        part = self.resolved_partition
        if self.dataset == "synthetic" and part != "natural":
            raise ValueError(
                f"partition={part!r} does not apply to dataset='synthetic': its clients are the "
                f"generated devices (partition='natural')"
            )
        if self.dataset == "femnist" and part != "natural":
            raise ValueError(
                f"partition={part!r} does not apply to dataset='femnist': its clients are its "
                f"writers (partition='natural'; choose how many with clients)"
            )
        if self.dataset == "shakespeare" and part != "natural":
            raise ValueError(
                f"partition={part!r} does not apply to dataset='shakespeare': its clients are its "
                f"(play, role) pairs (partition='natural'; choose how many with clients)"
            )
        if self.dataset not in NATURAL_DATASETS and part == "natural":
            raise ValueError("partition='natural' only applies to dataset='synthetic', 'femnist' or 'shakespeare'")
        if (self.dataset == "shakespeare") != (self.model in TEXT_MODELS):
            raise ValueError(
                f"model={self.model!r} does not fit dataset={self.dataset!r}: the character models "
                f"{TEXT_MODELS} read Shakespeare's 80-character windows, and only they do"
            )
        if self.context is not None:
            integer("context", self.context, 1)
            if self.model != "char-transformer":
                raise ValueError(f"context only applies to model='char-transformer', not {self.model!r}")
        if self.hidden is not None:
            integer("hidden", self.hidden, 1)
            if self.model not in ("mlp", "mlp1") + TEXT_MODELS:
                raise ValueError(f"hidden only applies to model='mlp', 'mlp1' or {TEXT_MODELS}, not {self.model!r}")
        number("dirichlet_alpha", self.dirichlet_alpha, 0.0, low_open=True)
        integer("shards_per_client", self.shards_per_client, 1)
        if self.dataset == "synthetic" and self.model != "mlp":
            raise ValueError(
                f"model={self.model!r} needs images; dataset='synthetic' has 60-dim vectors (use model='mlp')"
            )
        number("synthetic_alpha", self.synthetic_alpha, 0.0)
        number("synthetic_beta", self.synthetic_beta, 0.0)
        integer("clients", self.clients, 1)
        if self.dataset == "digits":
            per_client = self.shards_per_client if part == "shards" else 1
            if self.clients * per_client > DIGITS_SIZE:
                what = (
                    f"clients * shards_per_client = {self.clients * per_client}"
                    if part == "shards"
                    else f"clients={self.clients}"
                )
                raise ValueError(f"{what} is more than the {DIGITS_SIZE} digits (each needs >= 1 sample)")
        if self.dataset in ("mnist", "fmnist"):
            per_client = self.shards_per_client if part == "shards" else 1
            if self.clients * per_client > IDX_SIZE:
                raise ValueError(
                    f"clients={self.clients} (x {per_client} shards) is more than the {IDX_SIZE} {self.dataset} images"
                )
        if self.dataset in ("cifar10", "cifar100"):
            per_client = self.shards_per_client if part == "shards" else 1
            if self.clients * per_client > CIFAR_SIZE:
                raise ValueError(
                    f"clients={self.clients} (x {per_client} shards) is more than the {CIFAR_SIZE} CIFAR images"
                )
        if self.dataset in FOLDER_DATASETS:
            if not isinstance(self.data_dir, str) or not self.data_dir:
                raise ValueError(
                    f"dataset={self.dataset!r} is read from a local folder: set data_dir "
                    f"(--data-dir DIR); see docs/data.md for the layout"
                )
        elif self.data_dir is not None and not isinstance(self.data_dir, str):
            raise ValueError(f"data_dir must be a string path, got {self.data_dir!r}")
        for name in ("download", "normalize", "augment"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.download and self.dataset not in ("cifar10", "cifar100"):
            extra = " (FEMNIST needs LEAF's preprocessing; see docs/data.md)" if self.dataset == "femnist" else ""
            raise ValueError(f"download only applies to cifar10/cifar100, not dataset={self.dataset!r}{extra}")
        if self.augment and self.dataset not in ("cifar10", "cifar100"):
            raise ValueError(
                f"augment (random crop + horizontal flip) only applies to cifar10/cifar100, not "
                f"dataset={self.dataset!r} (a mirrored handwritten character is another character)"
            )
        finite = all(isinstance(x, (int, float)) and math.isfinite(x) for x in self.split)  # NaN passes < and >
        if (
            len(self.split) != 3
            or not finite
            or self.split[0] <= 0
            or min(self.split) < 0
            or abs(sum(self.split) - 1) > 1e-6
        ):
            raise ValueError(f"split must be (train > 0, val >= 0, test >= 0) summing to 1, got {tuple(self.split)}")
        self.validate_algorithm()
        integer("finetune_steps", self.finetune_steps, 0)
        number("finetune_lr", self.finetune_lr, 0.0)
        integer("eval_every", self.eval_every, 1)
        self._validate_client_batched()
        dp_check(self)
        return self

    def _validate_client_batched(self) -> None:
        if self.client_batched != "auto":
            v = self.client_batched
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"client_batched must be an integer >= 1 or 'auto', got {v!r}")
        if not isinstance(self.replay, bool):
            raise ValueError(f"replay must be True or False, got {self.replay!r}")
        check_choice("formulations", self.formulations, FORMULATION_MODES)
        if self.formulation_cache is not None and (
            not isinstance(self.formulation_cache, str) or not self.formulation_cache
        ):
            raise ValueError(f"formulation_cache must be a file path or None, got {self.formulation_cache!r}")
        if self.replay and self.client_batched == 1:
            raise ValueError(
                "replay captures the client-batched local step: it needs client_batched "
                "(--client-batched N or auto), not the sequential path (client_batched=1)"
            )
        if self.replay and self.device == "cpu":
            raise ValueError("replay needs device='cuda' (CUDA graphs do not exist on the CPU)")

    @property
    def batched(self) -> bool:
        """Are the sampled clients trained client-batched (``client_batched`` other than 1)?"""
        return self.client_batched != 1

    @property
    def client_parallel(self) -> Any:  # deprecated
        """Deprecated: the earlier name of ``client_batched`` (read-only)."""
        warnings.warn("SimConfig.client_parallel is SimConfig.client_batched", DeprecationWarning, stacklevel=2)
        return self.client_batched

    @property
    def cuda_graph(self) -> bool:  # deprecated
        """Deprecated: the earlier name of ``replay`` (read-only)."""
        warnings.warn("SimConfig.cuda_graph is SimConfig.replay", DeprecationWarning, stacklevel=2)
        return self.replay

    # ------------------------------------------------------------------ defaults
    @property
    def resolved_partition(self) -> str:
        if self.partition is not None:
            return self.partition
        return "natural" if self.dataset in NATURAL_DATASETS else "dirichlet"

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["split"] = list(self.split)
        return d


def __getattr__(name: str) -> Any:
    if name == "ALGORITHMS":  # the earlier name of VARIANTS here, which held variants, not algorithms
        warnings.warn(
            "fedopt_kernels.sim.config.ALGORITHMS is fedopt_kernels.sim.VARIANTS (variants, not "
            "algorithms: fedopt_kernels.fl.algorithm.ALGORITHMS holds those)",
            DeprecationWarning,
            stacklevel=2,
        )
        return VARIANTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SimConfig",
    "VARIANTS",
    "DATASETS",
    "PARTITIONS",
    "DEVICES",
    "PRECISIONS",
    "FOLDER_DATASETS",
    "NATURAL_DATASETS",
]
