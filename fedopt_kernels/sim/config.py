"""One simulation's settings, their per-algorithm defaults, and the checks that name a bad parameter."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .models import MODELS, TEXT_MODELS

# algorithm -> (server rule, client optimizer, uses prox_mu). fedsgd is FedDecay with beta = 0: only
# the first of the local steps moves (the others have lr 0), so it sees the same batches as any beta.
ALGORITHMS: Dict[str, Tuple[str, str, bool]] = {
    "fedavg": ("avg", "decay", False),
    "fedsgd": ("avg", "decay", False),
    "feddecay": ("avg", "decay", False),
    "fedprox": ("avg", "decay", True),
    "scaffold": ("scaffold", "decay", False),
    "fednlr": ("avg", "nlr", False),
    "fednar": ("avg", "nar", False),
    "fednar-fedprox": ("avg", "nar", True),
    "fednar-scaffold": ("scaffold", "nar", False),
    "padamfed": ("padamfed", "padamfed", False),
    "padamfed-vr": ("padamfed", "padamfed", False),
}
DATASETS = ("digits", "synthetic", "cifar10", "cifar100", "femnist", "mnist", "fmnist", "shakespeare")
FOLDER_DATASETS = ("cifar10", "cifar100", "femnist", "mnist", "fmnist", "shakespeare")  # read from data_dir (see docs/data.md)
NATURAL_DATASETS = ("synthetic", "femnist", "shakespeare")  # their clients are given: partition="natural"
PARTITIONS = ("dirichlet", "shards", "iid", "natural", "classes")
DEVICES = ("auto", "cpu", "cuda")

# FedDecay's beta fixed by the algorithm's name (feddecay and the rest take --beta)
_FIXED_BETA = {"fedavg": 1.0, "fedsgd": 0.0}
DIGITS_SIZE = 1797  # samples in scikit-learn's load_digits
CIFAR_SIZE = 60000  # train + test images, pooled before the partition
IDX_SIZE = 70000  # MNIST / Fashion-MNIST train + test images


@dataclass
class SimConfig:
    """Everything that determines a run; two runs with equal configs produce equal results.

    ``None`` means "the algorithm's default" (see ``resolved()``).
    """

    algorithm: str = "fedavg"
    dataset: str = "digits"
    partition: Optional[str] = None          # digits, cifar: dirichlet; synthetic, femnist: natural
    dirichlet_alpha: float = 0.5
    shards_per_client: int = 2
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    clients: int = 50                        # all users, held-out new users included
    holdout_fraction: float = 0.2            # new users: never train, evaluated after fine-tuning
    split: Tuple[float, float, float] = (0.6, 0.2, 0.2)
    model: str = "cnn"
    hidden: Optional[int] = None             # mlp / mlp1 hidden width (default 64 / 25); char models: state size
    context: Optional[int] = None            # char-transformer: read the last `context` characters of a window
    rounds: int = 50
    local_steps: int = 10
    batch_size: int = 10
    sample_rate: float = 0.2                 # fraction of the training clients sampled per round
    clients_per_round: Optional[int] = None  # overrides sample_rate
    lr: Optional[float] = None               # client lr (PAdaMFed: eta); default 0.05, PAdaMFed theory
    lr_scale: float = 1.0                    # multiplies the client lr (for lr-robustness sweeps)
    server_lr: Optional[float] = None        # default 1.0; PAdaMFed: theory gamma
    beta: Optional[float] = None             # FedDecay decay factor / PAdaMFed momentum parameter
    decay_schedule: str = "exponential"
    decay_every: int = 1
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: Optional[float] = None          # FedProx variants: default 0.01
    clip_norm: Optional[float] = None        # FedNAR max_norm (default 10); SGD: gradient clipping if set
    round_decay: Optional[float] = None      # client lr *= round_decay ** t; FedNAR default 0.998, else 1
    nlr_mu0: float = 1.0
    nlr_c1: float = 1.0
    nlr_c2: float = 1.0
    finetune_steps: int = 5
    finetune_lr: float = 0.01
    backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    eval_every: int = 1
    data_dir: Optional[str] = None           # cifar10/cifar100/femnist: the folder holding their files
    download: bool = False                   # cifar: fetch into data_dir with torchvision if missing
    normalize: bool = True                   # cifar/femnist: per-channel (x - mean) / std
    augment: bool = False                    # cifar: random crop (padding 4) + horizontal flip in training
    client_parallel: Any = 1                 # clients trained at once (vmap); "auto": as many as fit; 1: sequential
    cuda_graph: bool = False                 # client-parallel on CUDA: replay each local step from a CUDA graph

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_holdout(self) -> int:
        return int(round(self.holdout_fraction * self.clients))

    @property
    def num_train_clients(self) -> int:
        return self.clients - self.num_holdout

    @property
    def sampled_per_round(self) -> int:
        if self.clients_per_round is not None:
            return self.clients_per_round
        return max(1, int(round(self.sample_rate * self.num_train_clients)))

    @property
    def server_rule(self) -> str:
        return ALGORITHMS[self.algorithm][0]

    @property
    def client_optimizer(self) -> str:
        return ALGORITHMS[self.algorithm][1]

    # ------------------------------------------------------------------ checks
    def validate(self) -> "SimConfig":
        """Raise ValueError naming the first parameter that is out of range; return self."""
        def choice(name: str, value: Any, options) -> None:
            if value not in options:
                raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")

        def integer(name: str, value: Any, low: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

        def number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False,
                   high_open: bool = False) -> None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
            if not ok:
                lo = f"{'>' if low_open else '>='} {low}"
                hi = "" if high == math.inf else f" and {'<' if high_open else '<='} {high}"
                raise ValueError(f"{name} must be a finite number {lo}{hi}, got {value!r}")

        choice("algorithm", self.algorithm, ALGORITHMS)
        choice("dataset", self.dataset, DATASETS)
        choice("model", self.model, MODELS)
        choice("device", self.device, DEVICES)
        choice("decay_schedule", self.decay_schedule, ("exponential", "linear"))
        if self.partition is not None:
            choice("partition", self.partition, PARTITIONS)
        part = self.resolved_partition
        if self.dataset == "synthetic" and part != "natural":
            raise ValueError(f"partition={part!r} does not apply to dataset='synthetic': its clients are the "
                             f"generated devices (partition='natural')")
        if self.dataset == "femnist" and part != "natural":
            raise ValueError(f"partition={part!r} does not apply to dataset='femnist': its clients are its "
                             f"writers (partition='natural'; choose how many with clients)")
        if self.dataset == "shakespeare" and part != "natural":
            raise ValueError(f"partition={part!r} does not apply to dataset='shakespeare': its clients are its "
                             f"(play, role) pairs (partition='natural'; choose how many with clients)")
        if self.dataset not in NATURAL_DATASETS and part == "natural":
            raise ValueError("partition='natural' only applies to dataset='synthetic', 'femnist' or 'shakespeare'")
        if (self.dataset == "shakespeare") != (self.model in TEXT_MODELS):
            raise ValueError(f"model={self.model!r} does not fit dataset={self.dataset!r}: the character models "
                             f"{TEXT_MODELS} read Shakespeare's 80-character windows, and only they do")
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
            raise ValueError(f"model={self.model!r} needs images; dataset='synthetic' has 60-dim vectors "
                             f"(use model='mlp')")
        number("synthetic_alpha", self.synthetic_alpha, 0.0)
        number("synthetic_beta", self.synthetic_beta, 0.0)
        integer("clients", self.clients, 1)
        if self.dataset == "digits":
            per_client = self.shards_per_client if part == "shards" else 1
            if self.clients * per_client > DIGITS_SIZE:
                what = f"clients * shards_per_client = {self.clients * per_client}" if part == "shards" \
                    else f"clients={self.clients}"
                raise ValueError(f"{what} is more than the {DIGITS_SIZE} digits (each needs >= 1 sample)")
        if self.dataset in ("mnist", "fmnist"):
            per_client = self.shards_per_client if part == "shards" else 1
            if self.clients * per_client > IDX_SIZE:
                raise ValueError(f"clients={self.clients} (x {per_client} shards) is more than the {IDX_SIZE} "
                                 f"{self.dataset} images")
        if self.dataset in ("cifar10", "cifar100"):
            per_client = self.shards_per_client if part == "shards" else 1
            if self.clients * per_client > CIFAR_SIZE:
                raise ValueError(f"clients={self.clients} (x {per_client} shards) is more than the {CIFAR_SIZE} "
                                 f"CIFAR images")
        if self.dataset in FOLDER_DATASETS:
            if not isinstance(self.data_dir, str) or not self.data_dir:
                raise ValueError(f"dataset={self.dataset!r} is read from a local folder: set data_dir "
                                 f"(--data-dir DIR); see docs/data.md for the layout")
        elif self.data_dir is not None and not isinstance(self.data_dir, str):
            raise ValueError(f"data_dir must be a string path, got {self.data_dir!r}")
        for name in ("download", "normalize", "augment"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.download and self.dataset not in ("cifar10", "cifar100"):
            extra = " (FEMNIST needs LEAF's preprocessing; see docs/data.md)" if self.dataset == "femnist" else ""
            raise ValueError(f"download only applies to cifar10/cifar100, not dataset={self.dataset!r}{extra}")
        if self.augment and self.dataset not in ("cifar10", "cifar100"):
            raise ValueError(f"augment (random crop + horizontal flip) only applies to cifar10/cifar100, not "
                             f"dataset={self.dataset!r} (a mirrored handwritten character is another character)")
        number("holdout_fraction", self.holdout_fraction, 0.0, 1.0, high_open=True)
        if len(self.split) != 3 or self.split[0] <= 0 or min(self.split) < 0 or abs(sum(self.split) - 1) > 1e-6:
            raise ValueError(f"split must be (train > 0, val >= 0, test >= 0) summing to 1, got {tuple(self.split)}")
        if self.num_train_clients < 1:
            raise ValueError(f"clients={self.clients} with holdout_fraction={self.holdout_fraction} leaves no "
                             f"training clients")
        integer("rounds", self.rounds, 1)
        integer("local_steps", self.local_steps, 1)
        integer("batch_size", self.batch_size, 1)
        number("sample_rate", self.sample_rate, 0.0, 1.0, low_open=True)
        if self.clients_per_round is not None:
            integer("clients_per_round", self.clients_per_round, 1)
            if self.clients_per_round > self.num_train_clients:
                raise ValueError(f"clients_per_round={self.clients_per_round} is more than the "
                                 f"{self.num_train_clients} training clients ({self.clients} clients, "
                                 f"{self.num_holdout} held out as new users)")
        if self.lr is not None:
            number("lr", self.lr, 0.0)
        number("lr_scale", self.lr_scale, 0.0, low_open=True)
        if self.server_lr is not None:
            number("server_lr", self.server_lr, 0.0, low_open=True)
        if self.beta is not None:
            number("beta", self.beta, 0.0, 1.0)
            fixed = _FIXED_BETA.get(self.algorithm)
            if fixed is not None and self.beta != fixed:
                raise ValueError(f"beta={self.beta} contradicts algorithm={self.algorithm!r} (beta={fixed}); "
                                 f"use algorithm='feddecay' for other decay factors")
            if self.client_optimizer in ("nlr", "nar"):
                raise ValueError(f"beta does not apply to algorithm={self.algorithm!r}")
        integer("decay_every", self.decay_every, 1)
        number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        if self.momentum and self.client_optimizer in ("nar", "padamfed"):
            raise ValueError(f"momentum does not apply to algorithm={self.algorithm!r} (its optimizer has none)")
        number("weight_decay", self.weight_decay, 0.0)
        if self.weight_decay and self.client_optimizer == "padamfed":
            raise ValueError("weight_decay does not apply to PAdaMFed (its client step has no weight decay term)")
        if self.prox_mu is not None:
            number("prox_mu", self.prox_mu, 0.0)
            if not ALGORITHMS[self.algorithm][2]:
                raise ValueError(f"prox_mu only applies to fedprox and fednar-fedprox, not {self.algorithm!r}")
        if self.clip_norm is not None:
            number("clip_norm", self.clip_norm, 0.0, low_open=True)
            if self.client_optimizer == "padamfed":
                raise ValueError("clip_norm does not apply to PAdaMFed (its steps are normalized)")
        if self.round_decay is not None:
            number("round_decay", self.round_decay, 0.0, 1.0, low_open=True)
            if self.client_optimizer == "padamfed":
                raise ValueError("round_decay does not apply to PAdaMFed (its step sizes come from theory_hparams)")
        number("nlr_mu0", self.nlr_mu0, 0.0)
        number("nlr_c1", self.nlr_c1, 0.0)
        number("nlr_c2", self.nlr_c2, 0.0)
        integer("finetune_steps", self.finetune_steps, 0)
        number("finetune_lr", self.finetune_lr, 0.0)
        if not isinstance(self.backend, str):
            raise ValueError(f"backend must be a string, got {self.backend!r}")
        integer("seed", self.seed, 0)
        integer("eval_every", self.eval_every, 1)
        self._validate_client_parallel()
        return self

    def _validate_client_parallel(self) -> None:
        if self.client_parallel != "auto":
            v = self.client_parallel
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"client_parallel must be an integer >= 1 or 'auto', got {v!r}")
        if self.client_parallel != 1 and self.model == "char-lstm":
            raise ValueError("client_parallel (--client-parallel) cannot train model='char-lstm': torch.func.vmap "
                             "cannot batch nn.LSTM's fused kernel over client copies. Use model='char-gru' or "
                             "'char-transformer' (plain tensor ops) or client_parallel=1 (the sequential path)")
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {self.cuda_graph!r}")
        if self.cuda_graph and self.client_parallel == 1:
            raise ValueError("cuda_graph captures the client-parallel local step: it needs client_parallel "
                             "(--client-parallel N or auto), not the sequential path (client_parallel=1)")
        if self.cuda_graph and self.device == "cpu":
            raise ValueError("cuda_graph needs device='cuda' (CUDA graphs do not exist on the CPU)")

    @property
    def parallel(self) -> bool:
        """Are the sampled clients trained client-batched (``client_parallel`` other than 1)?"""
        return self.client_parallel != 1

    # ------------------------------------------------------------------ defaults
    @property
    def resolved_partition(self) -> str:
        if self.partition is not None:
            return self.partition
        return "natural" if self.dataset in NATURAL_DATASETS else "dirichlet"

    def hparams(self) -> Dict[str, float]:
        """Client lr, server lr, beta, prox_mu, clip_norm, round_decay with per-algorithm defaults applied."""
        from .. import theory_hparams

        algo = self.algorithm
        if self.server_rule == "padamfed":
            eta, gamma, beta = theory_hparams(self.sampled_per_round, self.local_steps, self.rounds,
                                              variance_reduction=algo.endswith("-vr"))
        else:
            eta, gamma, beta = 0.05, 1.0, _FIXED_BETA.get(algo, 0.5 if algo == "feddecay" else 1.0)
        nar = self.client_optimizer == "nar"
        return {
            "lr": (eta if self.lr is None else self.lr) * self.lr_scale,
            "server_lr": gamma if self.server_lr is None else self.server_lr,
            "beta": beta if self.beta is None else self.beta,
            "prox_mu": (0.01 if self.prox_mu is None else self.prox_mu) if ALGORITHMS[algo][2] else 0.0,
            "clip_norm": (10.0 if nar else None) if self.clip_norm is None else self.clip_norm,
            "round_decay": (0.998 if nar else 1.0) if self.round_decay is None else self.round_decay,
        }

    def replace(self, **changes: Any) -> "SimConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["split"] = list(self.split)
        return d
