"""How a param group becomes an op's row of hyperparameters: one value per column of ``spec.hps``.

By default column ``name`` holds the group's value of the same name, ``float(group[name])``. An
optimizer (``FedOptimizer._hp_columns``) or a second op it runs (``OtherOp.columns``) maps the
columns that differ: to another key of the group (FedDyn's ``alpha`` fills the ``sgd`` op's
``prox_mu`` column), to a constant (FedSAM has no ``maximize``: 0), or to a function of the group.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Union

import torch

from .ops import OpSpec

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
