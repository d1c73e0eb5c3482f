"""Every kernel op, declared once: its tensor roles, hyperparameters, traffic and torch.library schema.

An op is one local step of one algorithm family over many parameter tensors. Its arguments are the
same for every backend and every caller (the optimizers, ``torch.ops.fedopt.<op>``, torch.compile):

* one tensor list per *role* (``params``, ``grads``, then the op's optional roles such as
  ``momentum_buffer``). Optional role lists are *compacted*: they hold one tensor for each
  parameter whose row group has that role, in parameter order (torch.compile cannot functionalize a
  mutated list with ``None`` holes, so there are none);
* ``row_of``: per parameter, the row of ``hp`` it uses (the parameters sharing a row are a *row
  group*); ``present``: per row group, a bitmask of the optional roles that row group has (bit
  ``i`` = ``spec.optional[i]``);
* ``hp``: float64 ``[row groups, len(spec.hps)]`` on the parameters' device. Values that change from
  step to step travel as tensor data, so a new learning rate recompiles and re-captures nothing;
* ``k``: int32 ``[1]``, the within-round step counter; every op advances it by one on the device
  (by zero when ``found_inf`` is set). ``table``/``decay_every``: the within-round schedule
  ``s(j)``, ``lr_k = lr * table[min(k // decay_every, len(table) - 1)]`` (a ``[1.0]`` table when
  the op has no schedule);
* ``grad_scale``/``found_inf``: optional float32 ``[1]`` tensors of ``torch.amp.GradScaler``:
  gradients are divided by ``grad_scale`` inside the kernel, and when ``found_inf`` is non-zero
  the step changes nothing (parameters, state and ``k``);
* ``backend``: which registered implementation runs (``registry.py``).

Every op also has a *client-batched* form ``<op>_batched`` (docs/client_batched.md): every tensor carries a
leading client dimension ``[C, *shape]`` (FedNLR scales ``[C, M]``), ``hp`` is
``[row groups, C, len(spec.hps)]`` (per-client rows: each client's own lr, round decay, ...), ``k``
is ``[C]`` and an optional bool ``active`` ``[C]`` leaves inactive clients' parameters, state and
``k`` untouched. Global norms are per client. Client ``c``'s result is what the op computes for
client ``c`` alone. ``sgd_batched`` reads one more bit of ``present``: ``FRESH`` (the round
started with new momentum buffers), under which a client at ``k == 0`` takes ``buf = d`` (torch's
first step) instead of ``momentum * buf + (1 - dampening) * d``.

The spec is what the reference and fused implementations, the C++ kernels (``op_table.h`` is
generated from it at build time), the Triton kernels' slots and columns, the benchmark's traffic
table and the optimizers read; adding an op means adding one ``OpSpec`` here (docs/dispatch.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Tuple

import torch

NAMESPACE = "fedopt"


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """dtype of a state-typed role's tensor (control variates, accumulators, scales) for parameter ``p``."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Role:
    """One tensor list of an op.

    ``state_typed``: float32 storage (float64 for float64 parameters) instead of the parameter's
    dtype; ``per_row``: one value per output unit (``[shape[0]]``) instead of one per element;
    ``reads``/``writes``: times each element is read/written per step (docs/benchmarks.md).
    """

    name: str
    short: str
    written: bool = False
    state_typed: bool = False
    per_row: bool = False
    reads: int = 1
    writes: int = 0

    def dtype_for(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of this role's tensor for parameter ``p``."""
        return state_dtype(p) if self.state_typed else p.dtype


@dataclass(frozen=True)
class OpSpec:
    """One op's declaration. ``lr``: the hp column that holds the learning rate (default: the one
    named ``lr``), or None for an op without one (FedSAM's ascent). That column, and no other, is
    what the optimizers scale: by the round decay (``lr * round_decay ** t``), by a client's
    ``lr_scale`` (client-batched), and where a tensor lr is copied on the device; every backend
    reads it by this name."""

    name: str
    roles: Tuple[Role, ...]  # params, grads, then the optional roles
    hps: Tuple[str, ...]  # columns of the hp tensor (float64)
    norm: bool  # two passes: a global L2 norm, then the update
    schedule: bool  # lr_k from the within-round schedule table
    lr: Optional[str] = "lr"  # the learning-rate column (docstring); None: the op has none
    doc: str = ""
    batched: bool = False  # the client-batched form (module docstring)
    base: str = ""  # for a batched op: the per-client op it batches

    # derived once from the fields above (plain attributes: a step reads them without a call)
    optional: Tuple[Role, ...] = field(init=False, repr=False, compare=False)  # the roles after params, grads
    lr_column: Optional[int] = field(init=False, repr=False, compare=False)  # index of ``lr`` in hps, or None

    def __post_init__(self) -> None:
        if self.lr is not None and self.lr not in self.hps:
            raise ValueError(
                f"op {self.name!r}: its lr column {self.lr!r} is not one of its hps {self.hps} "
                f"(declare lr=None for an op without a learning rate)"
            )
        object.__setattr__(self, "optional", self.roles[2:])  # a frozen dataclass sets its own this way
        object.__setattr__(self, "lr_column", None if self.lr is None else self.hps.index(self.lr))

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"op {self.name!r} has no role {name!r}")

    def bit(self, name: str) -> int:
        """The bit of optional role ``name`` in a row group's ``present`` mask."""
        for i, r in enumerate(self.optional):
            if r.name == name:
                return 1 << i
        raise KeyError(f"op {self.name!r} has no optional role {name!r}")

    def hp_index(self, name: str) -> int:
        return self.hps.index(name)

    def schema(self) -> str:
        """The torch.library schema: mutated lists get alias annotations ``(a!)``, ``(b!)``, ..."""
        args, alias = [], iter("abcdefghij")
        for r in self.roles:
            args.append(f"Tensor({next(alias)}!)[] {r.name}" if r.written else f"Tensor[] {r.name}")
        args += [
            "int[] row_of",
            "int[] present",
            "Tensor hp",
            f"Tensor({next(alias)}!) k",
            "Tensor table",
            "int decay_every",
            "Tensor? grad_scale",
            "Tensor? found_inf",
        ]
        if self.batched:
            args.append("Tensor? active")
        args.append("str backend")
        return f"{self.name}({', '.join(args)}) -> ()"

    def bytes_per_element(self, present: Tuple[str, ...] = (), elem: int = 4, state: int = 4) -> int:
        """Minimum bytes moved per parameter element per step (docs/benchmarks.md) with these optional roles.

        ``elem``: the parameters' element size; ``state``: the state dtype's (8 for float64
        parameters). Per-row roles are counted per row by the caller, not here."""
        total = 0
        for r in self.roles[:2] + tuple(r for r in self.optional if r.name in present):
            if not r.per_row:
                total += (state if r.state_typed else elem) * (r.reads + r.writes)
        return total


# Reads/writes per element (docs/benchmarks.md): two-pass ops read their inputs once per pass.
SGD = OpSpec(
    "sgd",
    roles=(
        Role("params", "x", written=True, reads=1, writes=1),
        Role("grads", "g"),
        Role("momentum_buffer", "buf", written=True, reads=1, writes=1),
        Role("x0", "x0"),
        Role("correction", "corr"),
        Role("neuron_scale", "scale", state_typed=True, per_row=True),
    ),
    hps=("lr", "momentum", "dampening", "weight_decay", "prox_mu", "nesterov", "maximize"),
    norm=False,
    schedule=True,
    lr="lr",
    doc="FedDecaySGD / NeuronLRSGD: torch.optim.SGD with lr_k = lr * s(k // decay_every) and per-row scales",
)

FEDNAR = OpSpec(
    "fednar",
    roles=(
        Role("params", "x", written=True, reads=2, writes=1),
        Role("grads", "g", reads=2),
        Role("x0", "x0", reads=2),
        Role("correction", "corr", reads=2),
    ),
    hps=("lr", "weight_decay", "max_norm", "eps", "prox_mu"),
    norm=True,
    schedule=False,
    lr="lr",  # the round's l_t = lr * round_decay ** t
    doc="FedNAR: x -= lr * min(1, max_norm / (||d|| + eps)) * d",
)

PADAMFED = OpSpec(
    "padamfed",
    roles=(
        Role("params", "x", written=True, reads=1, writes=1),
        Role("grads", "g", reads=2),
        Role("D", "D", state_typed=True, reads=2),
        Role("acc", "acc", written=True, state_typed=True, reads=1, writes=1),
        Role("anchor_grad", "H", reads=2),
    ),
    hps=("lr", "beta", "eps"),
    norm=True,
    schedule=False,
    lr="lr",
    doc="PAdaMFed: v = beta*G + D (VR: G + D - (1-beta)*H); acc += G; x -= lr * v / max(||v||, eps)",
)

# FedSAM's ascent (its descent is the sgd op): pass 1 reads g (and x when adaptive), pass 2 reads x
# and g and writes x and the saved x, so 20 bytes per float32 element (+4 adaptive)
SAM_ASCENT = OpSpec(
    "sam_ascent",
    roles=(
        Role("params", "x", written=True, reads=1, writes=1),
        Role("grads", "g", reads=2),
        Role("saved_x", "saved", written=True, reads=0, writes=1),
    ),
    hps=("rho", "eta", "eps", "adaptive"),
    norm=True,
    schedule=False,
    lr=None,
    doc="FedSAM's ascent: w = |x| + eta (adaptive) or 1; saved = x; x += rho * w^2 * g / (||w * g|| + eps)",
)

# ---- the server optimizers' ops (SPEC: server optimizers; FedAvgM runs the sgd op)
# FedAdagrad / FedYogi / FedAdam (Reddi et al., Algorithm 2), told apart by the "rule" column
# (0 Adam, 1 Yogi, 2 Adagrad); the step count t = k + 1 of the bias correction is the op's k
FEDADAM = OpSpec(
    "fedadam",
    roles=(
        Role("params", "x", written=True, reads=1, writes=1),
        Role("grads", "g"),
        Role("exp_avg", "m", written=True, state_typed=True, reads=1, writes=1),
        Role("exp_avg_sq", "v", written=True, state_typed=True, reads=1, writes=1),
    ),
    hps=("lr", "beta1", "beta2", "tau", "rule", "bias_correction"),
    norm=False,
    schedule=False,
    doc="FedAdam/FedYogi/FedAdagrad: m = b1 m + (1-b1) g; v by the rule; x -= lr m / (sqrt(v) + tau)",
)

# FedExP: pass 1 reads g (its global norm), pass 2 reads x and g and writes x: 16 bytes per element
FEDEXP = OpSpec(
    "fedexp",
    roles=(
        Role("params", "x", written=True, reads=1, writes=1),
        Role("grads", "g", reads=2),
    ),
    hps=("lr", "eps", "mean_sq_norm"),
    norm=True,
    schedule=False,
    doc="FedExP: x -= lr * max(1, mean_sq_norm / (2 (||g||^2 + eps))) * g",
)
SERVER_OPS = (FEDADAM, FEDEXP)
# ---- end of the server optimizers' ops

# bit of sgd_batched's present mask: the round started with fresh momentum buffers
FRESH = 1 << 16

PER_CLIENT: Dict[str, OpSpec] = {s.name: s for s in (SGD, FEDNAR, PADAMFED, SAM_ASCENT, *SERVER_OPS)}
BATCHED: Dict[str, OpSpec] = {
    f"{n}_batched": replace(s, name=f"{n}_batched", batched=True, base=n) for n, s in PER_CLIENT.items()
}
OPS: Dict[str, OpSpec] = {**PER_CLIENT, **BATCHED}


# ------------------------------------------------------------------------------- torch.library
def _fake(*args, **kwargs) -> None:
    """Shape propagation: the ops return nothing and only mutate their declared inputs."""
    return None


def _declare() -> torch.library.Library:
    """Declare every op of ``OPS`` under ``torch.ops.fedopt``, with its fake implementation.

    Its kernel, which forwards to the implementation the ``backend`` argument names, is installed
    by ``registry.py`` (imported with the package): the registry imports this module, not the
    other way round.
    """
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for spec in OPS.values():
        lib.define(spec.schema())
        torch.library.register_fake(f"{NAMESPACE}::{spec.name}", _fake, lib=lib)
    return lib


# declared at import (Dynamo must find the ops, not trace their declaration)
_LIB = _declare()


def torch_op(name: str):
    """``torch.ops.fedopt.<name>``."""
    return getattr(getattr(torch.ops, NAMESPACE), name)
