"""What a step plan is built from: plain data the optimizer gathers (docs/dispatch.md, "The cached step plan").

The optimizer runs its hooks (validation, hp rows, state tensors) and hands the results over in
these records; the plan (``plan.py``) only arranges them into kernel arguments, so it never calls
back into the optimizer. How a param group becomes an op's row of hyperparameters (``row``), how
errors name a parameter and what its gradient must be are here too: the optimizer and the plan
both use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .ops import OpSpec

Factor = Union[float, Tuple[float, ...]]  # one value, or one per client (client-batched optimizers)


class GroupInputs(NamedTuple):
    """One validated param group.

    ``rows``: its hp row per client (one row for a per-client optimizer), a tensor lr read as 0;
    ``lr_factor``: what a tensor lr is multiplied by in the lr column (None: exactly 1);
    ``lr_scale``: per-client factor on the lr column (``OpSpec.lr``) of every row and on a tensor lr (None: none).
    ``keys``/``values``: its hyperparameters as gathered, compared with the group at every step.
    (A named tuple, as ``Member``: one is made per changed group at a step that edits hyperparameters.)
    """

    group: Dict[str, Any]
    keys: Tuple[str, ...]
    values: tuple
    structure: tuple
    rows: Tuple[Tuple[float, ...], ...]
    lr: Optional[torch.Tensor] = None
    lr_factor: Optional[Factor] = None
    lr_scale: Optional[Tuple[float, ...]] = None


class Member(NamedTuple):
    """A parameter with a gradient: its flat index, group, optional-role tensors, per-tensor hp
    overrides and ``present`` bits beyond its roles (the batched SGD's FRESH)."""

    index: int  # type: ignore[assignment]  # the flat index; shadows tuple.index, which nothing calls
    group: int
    tensors: Dict[str, torch.Tensor]
    override: Dict[str, float]
    extra: int = 0


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan needs; ``owner`` (the optimizer's class name) only appears in error messages,
    ``hp_cache`` is the optimizer's ``HpCache`` (plans with equal rows share a device tensor)."""

    spec: OpSpec
    backend: str
    owner: str
    params: List[torch.Tensor]
    groups: Tuple[GroupInputs, ...]
    members: Tuple[Member, ...]
    device: torch.device
    step_roles: Tuple[str, ...]
    clients: Optional[int]
    hp_cache: Any


# ------------------------------------------------------------ a param group's hp row
# By default column ``name`` holds the group's value of the same name, ``float(group[name])``. An
# optimizer (``FedOptimizer._hp_columns``) or a second op it runs (``OtherOp.columns``) maps the
# columns that differ: to another key of the group (FedDyn's ``alpha`` fills the ``sgd`` op's
# ``prox_mu`` column), to a constant (FedSAM has no ``maximize``: 0), or to a function of the group.

# a key of the param group, a constant, or a function of the group
Column = Union[str, float, Callable[[Dict[str, Any]], float]]


def check_columns(spec: OpSpec, columns: Mapping[str, Column], owner: str) -> None:
    """Refuse a mapping that names a column ``spec`` does not have (a typo would fill nothing)."""
    unknown = sorted(set(columns) - set(spec.hps))
    if unknown:
        raise ValueError(f"{owner} maps hp columns {unknown} that op {spec.name!r} does not have (its: {spec.hps})")


def row(spec: OpSpec, columns: Mapping[str, Column], group: Dict[str, Any]) -> List[float]:
    """``group``'s row of ``spec``'s hp tensor, in ``spec.hps`` order (``columns``: where it is not
    the group's value of the column's own name)."""
    return [value(name, columns.get(name, name), group) for name in spec.hps]


def value(name: str, column: Column, group: Dict[str, Any]) -> float:
    """Column ``name``'s value for ``group``. A tensor is refused: reading a device tensor's value
    is a host sync (a tensor lr reaches its column on the device: the caller puts 0 in its place)."""
    v = group[column] if isinstance(column, str) else column(group) if callable(column) else column
    if isinstance(v, torch.Tensor):
        raise TypeError(f"hp column {name!r} got a tensor ({column!r}); only the lr column takes one")
    return float(v)


# ------------------------------------------------------------ naming parameters in errors


def param_name(gi: int, pi: int, p: torch.Tensor, name: Optional[str] = None) -> str:
    named = f" ({name!r})" if name is not None else ""
    return f"parameter {pi}{named} of param group {gi} (shape {tuple(p.shape)})"


def name_of(groups: Sequence[Dict[str, Any]], idx: int, params: List[torch.Tensor]) -> str:
    """How errors name flat parameter ``idx`` of ``groups`` (built only when raising)."""
    base = 0
    for gi, group in enumerate(groups):
        n = len(group["params"])
        if idx < base + n:
            names = group.get("param_names")
            return param_name(gi, idx - base, params[idx], names[idx - base] if names else None)
        base += n
    return param_name(len(groups), idx - base, params[idx])


def check_grad(
    p: torch.Tensor, g: torch.Tensor, idx: int, groups: Sequence[Dict[str, Any]], params: List[torch.Tensor], owner: str
) -> None:
    """Refuse a gradient the kernels cannot take, naming flat parameter ``idx``; ``owner``: the optimizer class."""
    if g.is_sparse:
        raise RuntimeError(
            f"{name_of(groups, idx, params)} has a sparse gradient; {owner} does not support sparse gradients"
        )
    if g.is_complex() or p.is_complex():
        raise TypeError(f"{name_of(groups, idx, params)} is complex; {owner} supports real parameters only")
    if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
        raise RuntimeError(
            f"{name_of(groups, idx, params)}: gradient of shape {tuple(g.shape)}, {g.dtype}, {g.device} "
            f"does not match the parameter ({tuple(p.shape)}, {p.dtype}, {p.device})"
        )
