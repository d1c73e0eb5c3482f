"""An op's positional arguments (``_ops.OpSpec.schema``) by name, and regrouped into uniform batches.

The Python implementations (reference, triton) read their arguments through ``OpArgs``; the C++
bindings parse the same layout themselves (``csrc/common/op_args.cpp``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ._ops import OpSpec


@dataclass
class Batch:
    """The parameters of one ``hp`` row: every tensor list is full (one tensor per parameter)."""

    index: int                        # row of hp
    tensors: Dict[str, List[torch.Tensor]]  # role name -> list aligned with tensors["params"]


@dataclass
class OpArgs:
    spec: OpSpec
    lists: Dict[str, List[torch.Tensor]]
    batch: List[int]
    present: List[int]
    hp: torch.Tensor
    k: torch.Tensor
    table: torch.Tensor
    decay_every: int
    grad_scale: Optional[torch.Tensor]
    found_inf: Optional[torch.Tensor]
    backend: str

    @classmethod
    def parse(cls, spec: OpSpec, args: Sequence) -> "OpArgs":
        n = len(spec.roles)
        if len(args) != n + 9:
            raise TypeError(f"fedopt::{spec.name} takes {n + 9} arguments, got {len(args)}")
        lists = {r.name: list(a) for r, a in zip(spec.roles, args[:n])}
        batch, present, hp, k, table, decay_every, grad_scale, found_inf, backend = args[n:]
        out = cls(spec, lists, list(batch), list(present), hp, k, table, int(decay_every), grad_scale, found_inf,
                  backend)
        out.check()
        return out

    def check(self) -> None:
        """Raise ValueError when the lists do not fit ``batch``/``present`` (bad direct op calls)."""
        spec, n = self.spec, len(self.lists["params"])
        if len(self.lists["grads"]) != n or len(self.batch) != n:
            raise ValueError(f"fedopt::{spec.name}: {n} params but {len(self.lists['grads'])} grads and "
                             f"{len(self.batch)} batch indices")
        rows = self.hp.shape[0] if self.hp.dim() == 2 else -1
        if self.hp.dim() != 2 or self.hp.shape[1] != len(spec.hps) or self.hp.dtype != torch.float64:
            raise ValueError(f"fedopt::{spec.name}: hp must be float64 [batches, {len(spec.hps)}] "
                             f"({', '.join(spec.hps)}), got {self.hp.dtype} {tuple(self.hp.shape)}")
        if len(self.present) != rows or any(not 0 <= b < rows for b in self.batch):
            raise ValueError(f"fedopt::{spec.name}: batch indices must lie in [0, {rows}) and present needs "
                             f"one mask per hp row ({rows}), got {len(self.present)}")
        for i, role in enumerate(spec.optional):
            want = sum(1 for b in self.batch if self.present[b] >> i & 1)
            if len(self.lists[role.name]) != want:
                raise ValueError(f"fedopt::{spec.name}: {role.name} has {len(self.lists[role.name])} tensors "
                                 f"but present/batch ask for {want}")
        if self.decay_every < 1:
            raise ValueError(f"fedopt::{spec.name}: decay_every must be >= 1, got {self.decay_every}")

    def batches(self) -> List[Batch]:
        """The parameters split by hp row, every optional role expanded, in first-seen row order."""
        spec = self.spec
        cursors = {r.name: 0 for r in spec.optional}
        out: Dict[int, Batch] = {}
        for i, b in enumerate(self.batch):
            bat = out.get(b)
            if bat is None:
                names = ["params", "grads"] + [r.name for j, r in enumerate(spec.optional) if self.present[b] >> j & 1]
                bat = out[b] = Batch(b, {name: [] for name in names})
            bat.tensors["params"].append(self.lists["params"][i])
            bat.tensors["grads"].append(self.lists["grads"][i])
            for j, r in enumerate(spec.optional):
                if self.present[b] >> j & 1:
                    bat.tensors[r.name].append(self.lists[r.name][cursors[r.name]])
                    cursors[r.name] += 1
        return list(out.values())

    @property
    def device(self) -> torch.device:
        return self.k.device
