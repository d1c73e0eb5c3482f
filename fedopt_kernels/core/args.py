"""An op's positional arguments (``ops.OpSpec.schema``) by name, regrouped into row groups, or one
entry per tensor.

The Python implementations (reference, triton) read their arguments through ``OpArgs``; the C++
bindings parse the same layout themselves (``csrc/common/op_args.cpp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .ops import OpSpec


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
