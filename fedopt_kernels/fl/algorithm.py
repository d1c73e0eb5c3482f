"""One descriptor per algorithm, registered once, read by every layer (docs/dispatch.md).

An ``Algorithm`` holds what the FL layer knows about one local-step algorithm: the op it runs on,
its per-client optimizer class and client-batched form, its catalogue option sets (what the tests,
the self-check and the benchmark run), the FL variants the simulator and the Flower strategies
offer on it (``fedavg``, ``fedprox``, ``scaffold``, ... each with its server rule), its own run
settings (``Setting``: fields of ``FLConfig`` and ``fedopt-sim`` options), which shared settings
apply to it and their defaults, and its client side of a round: how a client builds the optimizer
from a run's settings, starts a round, takes a local step, clips, and what it hands back.

Each algorithm's descriptor module (``fl/algorithms/<name>.py``) declares it and registers it when
it is imported (``register``); everything else reads ``ALGORITHMS`` / ``VARIANTS`` when it needs
them (the command line, the catalogue, the benchmark and the Flower strategies are generated from
them), so no layer keeps its own list of algorithm names. The benchmark's rows and the Flower
strategy names are declared in those layers (``bench/cases.py``, ``fedopt_kernels/flower/paper_names.py``),
by algorithm or variant name. The descriptor reads run settings through ``RunSettings``, the fields
it needs of ``fedopt_kernels.fl.config.FLConfig`` (the simulator's ``SimConfig`` is one):
``config.py`` imports this module to validate a run's algorithm, so this one names the settings by
their shape and imports neither it, the simulator nor Flower.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Dict,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Type,
)

import torch

from ..core.ops import OpSpec

if TYPE_CHECKING:  # for the annotations only: core.optimizer's imports are not needed here at run time
    from ..core.optimizer import FedOptimizer

Tensors = List[torch.Tensor]


class RunSettings(Protocol):
    """The settings of a run a descriptor reads: what ``FLConfig`` holds (its docs say what each means)."""

    # a dataclass (``check`` walks its fields)
    __dataclass_fields__: ClassVar[Dict[str, Any]]
    algorithm: str
    rounds: int
    local_steps: int
    lr: Optional[float]
    lr_scale: float
    server_lr: Optional[float]
    beta: Optional[float]
    decay_schedule: str
    decay_every: int
    momentum: float
    weight_decay: float
    prox_mu: Optional[float]
    clip_norm: Optional[float]
    round_decay: Optional[float]
    # an algorithm's own settings (``Setting``) are fields too, read by that algorithm's descriptor

    @property
    def sampled_per_round(self) -> int: ...


@dataclass(frozen=True)
class Variant:
    """One FL algorithm as the simulator and the Flower strategies name it (``fedopt-sim --algorithm``).

    ``server``: its server rule ("avg", "scaffold", "padamfed", "feddyn", ...); ``prox``: the
    FedProx term is on (``prox_mu``); ``beta``: a decay factor the name fixes (fedavg: 1, fedsgd: 0);
    ``options``: constructor keywords the name fixes (padamfed-vr: ``variance_reduction=True``);
    ``defaults``: run-setting defaults of this name (feddecay: ``beta=0.5``).
    """

    name: str
    server: str
    prox: bool = False
    beta: Optional[float] = None
    options: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    doc: str = ""
    algorithm: str = ""  # filled by ``register``


@dataclass(frozen=True)
class Setting:
    """A run setting an algorithm declares in its own module: a field of ``FLConfig`` (and so of the
    simulator's ``SimConfig``) and a ``fedopt-sim`` option ``--name-with-dashes``.

    ``default``: None means "the algorithm's default" (its ``hparams`` fills it in); ``low`` ..
    ``high_open``: the range ``FLConfig.validate`` checks; ``choices``: the allowed values instead.
    Only the declaring algorithm (and any that lists it in ``settings``) takes it; a run of another
    algorithm refuses it when it is set.
    """

    name: str
    kind: type
    default: Any
    help: str
    low: float = 0.0
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    choices: Optional[Tuple[Any, ...]] = None


class Algorithm:
    """The descriptor of one algorithm; subclasses override the client-side hooks that differ.

    ``closure_step`` (class attribute; a capability): a step takes two gradients, the second
    computed by the closure of ``step(closure)`` at the parameters the step's first part moved to
    (FedSAM). Every front end steps an optimizer through ``local_step``, which reads it, so an
    algorithm that sets it needs nothing else of the simulator, its client-batched trainer or Flower.

    Attributes set by the constructor: ``name`` (the catalogue's name), ``optimizer`` (the
    per-client class), ``batched`` (its client-batched form), ``options`` / ``full`` (catalogue
    option sets, in ``catalogue.Config``'s keyword format, and the one that exercises every role),
    ``variants``, ``settings`` (the run settings that only some algorithms take, ``FLConfig``'s
    fields marked ``some``, that this one takes; another one given to a run is refused, with
    ``refusals[setting]`` as the reason where one is given), ``round_outputs`` (optimizer methods a
    client calls after training for what it hands back, e.g. PAdaMFed's ``local_control``),
    ``run_settings`` (its own ``Setting`` declarations).
    """

    closure_step = False

    def __init__(
        self,
        name: str,
        optimizer: Type[FedOptimizer],
        batched: Type[FedOptimizer],
        *,
        options: Mapping[str, Mapping[str, Any]],
        full: str,
        variants: Sequence[Variant],
        settings: Sequence[str] = (),
        refusals: Optional[Mapping[str, str]] = None,
        round_outputs: Sequence[str] = (),
        title: str = "",
        run_settings: Sequence[Setting] = (),
    ):
        if full not in options:
            raise ValueError(f"algorithm {name!r}: option {full!r} is not one of its options {tuple(options)}")
        self.name, self.optimizer, self.batched = name, optimizer, batched
        self.options, self.full = dict(options), full
        self.variants = tuple(Variant(**{**v.__dict__, "algorithm": name}) for v in variants)
        self.run_settings = tuple(run_settings)
        self.settings = tuple(settings) + tuple(s.name for s in run_settings if s.name not in settings)
        self.refusals = dict(refusals or {})
        self.round_outputs = tuple(round_outputs)
        self.title = title

    @property
    def op(self) -> OpSpec:
        """The (per-client) op its optimizer runs on."""
        return self.optimizer.op_spec()

    def __repr__(self) -> str:
        return f"Algorithm({self.name!r}, op={self.op.name!r}, variants={[v.name for v in self.variants]})"

    # ------------------------------------------------------------------ run settings
    def hparams(self, cfg: RunSettings, variant: Variant) -> Dict[str, Any]:
        """lr, server_lr, beta, prox_mu, clip_norm, round_decay (+ ``dyn_alpha``) with defaults applied."""
        beta = variant.beta if variant.beta is not None else variant.defaults.get("beta", 1.0)
        return {
            "lr": (0.05 if cfg.lr is None else cfg.lr) * cfg.lr_scale,
            "server_lr": 1.0 if cfg.server_lr is None else cfg.server_lr,
            "beta": beta if cfg.beta is None else cfg.beta,
            "prox_mu": (0.01 if cfg.prox_mu is None else cfg.prox_mu) if variant.prox else 0.0,
            "clip_norm": cfg.clip_norm,
            "round_decay": 1.0 if cfg.round_decay is None else cfg.round_decay,
        }

    def check(self, cfg: RunSettings, variant: Variant) -> None:
        """Refuse (ValueError naming it) a run setting that does not apply to this algorithm."""
        for f in dataclasses.fields(cfg):
            name = f.name
            if not f.metadata.get("some") or name in self.settings or not _given(cfg, name):
                continue
            why = self.refusals.get(name)
            raise ValueError(f"{name} does not apply to algorithm={cfg.algorithm!r}" + (f" ({why})" if why else ""))
        if _given(cfg, "prox_mu") and not variant.prox:
            provers = [v.name for a in ALGORITHMS.values() for v in a.variants if v.prox]
            raise ValueError(f"prox_mu only applies to {' and '.join(provers)}, not {cfg.algorithm!r}")
        if variant.beta is not None and cfg.beta is not None and cfg.beta != variant.beta:
            raise ValueError(
                f"beta={cfg.beta} contradicts algorithm={cfg.algorithm!r} (beta={variant.beta}); "
                f"use another algorithm name for other decay factors"
            )

    # ------------------------------------------------------------------ the client side of a round
    def make(
        self,
        params: Sequence[torch.Tensor],
        cfg: RunSettings,
        variant: Variant,
        hp: Mapping[str, Any],
        backend: str,
        batched: bool = False,
    ) -> torch.optim.Optimizer:
        """This run's client optimizer on ``params`` (its client-batched form with ``batched``)."""
        raise NotImplementedError

    def state_copies(self, cfg: RunSettings, variant: Variant) -> int:
        """Optimizer state tensors per parameter per client (the client-batched memory estimate)."""
        raise NotImplementedError

    def local_step(self, opt: Any, recompute: Callable[[], Any], **step_inputs: Any) -> Any:
        """One local step of ``opt``, whose gradients are in ``p.grad``: how every front end steps a
        client (the simulator's sequential round, its client-batched trainer and step graph, the
        Flower client). ``recompute()`` computes the loss and gradients again on the same batch at
        the parameters as they are then; an algorithm with ``closure_step`` gets it as the step's
        closure (FedSAM's second gradient, at the perturbed model), the others never call it.
        ``step_inputs``: the step's keywords (PAdaMFed-VR's ``anchor_grads``, a client-batched
        step's ``active``). Returns what ``step`` returns."""
        if self.closure_step:
            return opt.step(recompute, **step_inputs)
        return opt.step(**step_inputs)

    def calibrate(
        self, model: torch.nn.Module, data: Optional[Sequence[Tuple[torch.Tensor, torch.Tensor]]], cfg: RunSettings
    ) -> Dict[str, Any]:
        """Round inputs a client computes from the received model on its own data (FedNLR's scales);
        ``data`` is None for a client with no data to give."""
        return {}

    def clip_norm(self, hp: Mapping[str, Any]) -> Optional[float]:
        """Gradient clipping (``clip_grad_norm_``) before each step, or None (clipping in the step or none)."""
        return None

    def lr_sum(self, opt: Any, hp: Mapping[str, Any], t: int, steps: int) -> float:
        """Sum of the nominal per-step learning rates of the round just trained (SCAFFOLD option II)."""
        raise ValueError(f"SCAFFOLD is not defined for client optimizer {type(self.optimizer).__name__!r}")

    def needs_anchor(self, variant: Variant) -> bool:
        """Do its steps also take the same batch's gradient at the round's starting model (``anchor_grads``)?"""
        return False

    def step_inputs(self, kwargs: Mapping[str, Any], params: Sequence[torch.Tensor], seed: int) -> Dict[str, Any]:
        """``step()`` keyword inputs for a catalogue option set with constructor keywords ``kwargs`` on
        ``params``, from ``seed`` (PAdaMFed-VR's anchor gradients; a closure where a step takes one)."""
        return {}

    def present(self, kwargs: Mapping[str, Any], correction: bool, scales: Any) -> Tuple[str, ...]:
        """The optional roles of the op a catalogue option set's steps use (traffic figures)."""
        names = []
        if kwargs.get("momentum", 0):
            names.append("momentum_buffer")
        if kwargs.get("prox_mu", 0):
            names.append("x0")
        if correction:
            names.append("correction")
        if scales:
            names.append("neuron_scale")
        return tuple(names)


def end_round(opt: Any) -> None:
    """End the round on an optimizer that updates per-client state after local training (FedDyn's
    ``end_round``); nothing for the others. Called once per optimizer and round, before its round outputs."""
    finish = getattr(opt, "end_round", None)
    if finish is not None:
        finish()


def _given(cfg: Any, name: str) -> bool:
    """Was run setting ``name`` set away from its neutral value (None, 0, or the dataclass default)?"""
    value = getattr(cfg, name, None)
    if value is None:
        return False
    default = type(cfg).__dataclass_fields__[name].default
    return value != default


# ---------------------------------------------------------------------------- the registry
ALGORITHMS: Dict[str, Algorithm] = {}
VARIANTS: Dict[str, Variant] = {}
SETTINGS: Dict[str, Setting] = {}  # every algorithm's own run settings, by name
_config_fields: List[str] = []  # the own settings FLConfig was built with (``settings_for_config``)


def register(algo: Algorithm) -> Algorithm:
    """Add ``algo`` (and its variants and own settings) to the registry; called once by its own module."""
    if algo.name in ALGORITHMS:
        raise ValueError(f"algorithm {algo.name!r} is registered twice")
    clash = [v.name for v in algo.variants if v.name in VARIANTS]
    if clash:
        raise ValueError(f"algorithm {algo.name!r}: variant names {clash} are taken")
    taken = [s.name for s in algo.run_settings if s.name in SETTINGS]
    if taken:
        raise ValueError(f"algorithm {algo.name!r}: run settings {taken} are declared by another algorithm")
    late = [s.name for s in algo.run_settings if _config_fields and s.name not in _config_fields]
    if late:
        raise ValueError(
            f"algorithm {algo.name!r} declares run settings {late} after FLConfig was made: register an "
            f"algorithm with run settings of its own before fedopt_kernels.fl.config is first imported"
        )
    ALGORITHMS[algo.name] = algo
    for v in algo.variants:
        VARIANTS[v.name] = v
    for st in algo.run_settings:
        SETTINGS[st.name] = st
    return algo


def unregister(name: str) -> None:
    """Remove algorithm ``name`` and its variants (a test's algorithm; its settings stay declared)."""
    algo = ALGORITHMS.pop(name)
    for v in algo.variants:
        VARIANTS.pop(v.name, None)


def settings_for_config() -> List[Setting]:
    """The own settings of every registered algorithm, for ``FLConfig``'s fields (called once, by
    ``fl/config.py``, when it makes the class: later registrations may not add settings)."""
    _config_fields[:] = list(SETTINGS)
    return list(SETTINGS.values())


def variant(name: str) -> Variant:
    """The variant called ``name`` (ValueError listing the known ones)."""
    v = VARIANTS.get(name)
    if v is None:
        raise ValueError(f"algorithm must be one of {tuple(VARIANTS)}, got {name!r}")
    return v


def of(name: str) -> Algorithm:
    """The descriptor of variant ``name``'s algorithm."""
    return ALGORITHMS[variant(name).algorithm]


def of_optimizer(cls: type) -> Algorithm:
    """The descriptor whose per-client or client-batched class is ``cls``."""
    for a in ALGORITHMS.values():
        if cls in (a.optimizer, a.batched):
            return a
    raise KeyError(f"{cls.__name__} is not a registered algorithm's optimizer")
