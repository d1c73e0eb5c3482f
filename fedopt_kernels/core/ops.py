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

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

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

    def __post_init__(self) -> None:
        if self.lr is not None and self.lr not in self.hps:
            raise ValueError(
                f"op {self.name!r}: its lr column {self.lr!r} is not one of its hps {self.hps} "
                f"(declare lr=None for an op without a learning rate)"
            )

    @property
    def optional(self) -> Tuple[Role, ...]:
        return self.roles[2:]

    @property
    def lr_column(self) -> Optional[int]:
        """The index of the ``lr`` column in ``hps``, or None for an op without one."""
        return None if self.lr is None else self.hps.index(self.lr)

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


# ------------------------------------------------------------------------------- the arguments, read back
# An op's positional arguments (``OpSpec.schema``) by name, regrouped into row groups, or one entry
# per tensor. The Python implementations (reference, triton) read their arguments through
# ``OpArgs``; the C++ bindings parse the same layout themselves (``csrc/common/op_args.cpp``).
@dataclass
class RowGroup:
    """The parameters of one ``hp`` row: every tensor list is full (one tensor per parameter)."""

    row: int  # row of hp
    tensors: Dict[str, List[torch.Tensor]]  # role name -> list aligned with tensors["params"]


@dataclass
class OpArgs:
    spec: OpSpec
    lists: Dict[str, List[torch.Tensor]]
    row_of: List[int]  # per parameter, its row group (row of hp)
    present: List[int]
    hp: torch.Tensor
    k: torch.Tensor
    table: torch.Tensor
    decay_every: int
    grad_scale: Optional[torch.Tensor]
    found_inf: Optional[torch.Tensor]
    backend: str
    active: Optional[torch.Tensor] = None  # batched ops: [C] bool

    @classmethod
    def parse(cls, spec: OpSpec, args: Sequence, checked: bool = False) -> OpArgs:
        """``checked``: the caller's step plan fixes the lists' structure and an earlier call with it
        passed ``check()`` (the optimizers' cached path): the per-step check is skipped."""
        n = len(spec.roles)
        want = n + 9 + int(spec.batched)
        if len(args) != want:
            raise TypeError(f"fedopt::{spec.name} takes {want} arguments, got {len(args)}")
        # the optimizer's cached path hands over its plan's lists: read as they are (never changed)
        lists = {
            r.name: (a if checked and type(a) is list else list(a)) for r, a in zip(spec.roles, args[:n], strict=True)
        }
        rest = list(args[n:])
        active = rest.pop(8) if spec.batched else None
        row_of, present, hp, k, table, decay_every, grad_scale, found_inf, backend = rest
        out = cls(
            spec,
            lists,
            list(row_of),
            list(present),
            hp,
            k,
            table,
            int(decay_every),
            grad_scale,
            found_inf,
            backend,
            active,
        )
        if not checked:
            out.check()
        return out

    def check(self) -> None:
        """Raise ValueError when the lists do not fit ``row_of``/``present`` (bad direct op calls)."""
        spec, n = self.spec, len(self.lists["params"])
        if len(self.lists["grads"]) != n or len(self.row_of) != n:
            raise ValueError(
                f"fedopt::{spec.name}: {n} params but {len(self.lists['grads'])} grads and "
                f"{len(self.row_of)} row indices (row_of)"
            )
        dims = 3 if spec.batched else 2
        rows = self.hp.shape[0] if self.hp.dim() == dims else -1
        if self.hp.dim() != dims or self.hp.shape[-1] != len(spec.hps) or self.hp.dtype != torch.float64:
            what = "[row groups, clients, " if spec.batched else "[row groups, "
            raise ValueError(
                f"fedopt::{spec.name}: hp must be float64 {what}{len(spec.hps)}] "
                f"({', '.join(spec.hps)}), got {self.hp.dtype} {tuple(self.hp.shape)}"
            )
        if spec.batched:
            C = self.hp.shape[1]
            if self.k.shape != (C,):
                raise ValueError(
                    f"fedopt::{spec.name}: k must have one counter per client ({C}), got shape {tuple(self.k.shape)}"
                )
            if self.active is not None and (self.active.shape != (C,) or self.active.dtype != torch.bool):
                raise ValueError(
                    f"fedopt::{spec.name}: active must be a bool tensor of shape ({C},), got "
                    f"{self.active.dtype} {tuple(self.active.shape)}"
                )
            for name, ts in self.lists.items():
                for t in ts:
                    if t.dim() == 0 or t.shape[0] != C:
                        raise ValueError(
                            f"fedopt::{spec.name}: every {name} tensor must have a leading client "
                            f"dimension of {C}, got shape {tuple(t.shape)}"
                        )
        if len(self.present) != rows or any(not 0 <= b < rows for b in self.row_of):
            raise ValueError(
                f"fedopt::{spec.name}: row indices (row_of) must lie in [0, {rows}) and present needs "
                f"one mask per hp row ({rows}), got {len(self.present)}"
            )
        for i, role in enumerate(spec.optional):
            want = sum(1 for b in self.row_of if self.present[b] >> i & 1)
            if len(self.lists[role.name]) != want:
                raise ValueError(
                    f"fedopt::{spec.name}: {role.name} has {len(self.lists[role.name])} tensors "
                    f"but present/row_of ask for {want}"
                )
        if self.decay_every < 1:
            raise ValueError(f"fedopt::{spec.name}: decay_every must be >= 1, got {self.decay_every}")

    def row_groups(self) -> List[RowGroup]:
        """The parameters split by hp row, every optional role expanded, in first-seen row order. The
        lists may be the caller's own (one hp row): read them, never change them."""
        spec, row_of, present, lists = self.spec, self.row_of, self.present, self.lists
        optional = [(j, r.name) for j, r in enumerate(spec.optional)]
        if row_of and all(b == row_of[0] for b in row_of):  # one hp row: every list is already that row's
            mask = present[row_of[0]]
            names = ["params", "grads"] + [name for j, name in optional if mask >> j & 1]
            return [RowGroup(row_of[0], {name: lists[name] for name in names})]
        cursors = {name: 0 for _, name in optional}
        out: Dict[int, RowGroup] = {}
        for i, b in enumerate(row_of):
            group = out.get(b)
            mask = present[b]
            if group is None:
                names = ["params", "grads"] + [name for j, name in optional if mask >> j & 1]
                group = out[b] = RowGroup(b, {name: [] for name in names})
            tensors = group.tensors
            tensors["params"].append(lists["params"][i])
            tensors["grads"].append(lists["grads"][i])
            for j, name in optional:
                if mask >> j & 1:
                    tensors[name].append(lists[name][cursors[name]])
                    cursors[name] += 1
        return list(out.values())

    def per_tensor(self) -> Tuple[Dict[str, List[Optional[torch.Tensor]]], Dict[str, List[float]]]:
        """The parameters one by one, row group by row group (``row_groups``' order): each role's
        tensor (None where its row group lacks the role), and each hp column's value for each tensor
        (read on the host)."""
        lists: Dict[str, List[Optional[torch.Tensor]]] = {r.name: [] for r in self.spec.roles}
        columns: Dict[str, List[float]] = {h: [] for h in self.spec.hps}
        for group in self.row_groups():
            n = len(group.tensors["params"])
            for name, out in lists.items():
                out += group.tensors.get(name, [None] * n)
            for h, v in zip(self.spec.hps, self.hp[group.row].tolist(), strict=True):
                columns[h] += [v] * n
        return lists, columns

    def found_inf_now(self) -> bool:
        """GradScaler found an inf: ``found_inf`` read on the host (a host sync on a GPU)."""
        return self.found_inf is not None and float(self.found_inf.reshape(-1)[0]) != 0.0

    @property
    def device(self) -> torch.device:
        return self.k.device


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
