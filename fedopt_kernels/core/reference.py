"""The ``reference`` backend: each op's arguments read back by name and handed to its function of
``fedopt_kernels.functional`` (docs/algorithms.md).

It is the ground truth every fused backend is tested against: the algorithms' math in plain
PyTorch, one tensor at a time (the rounding rules are ``functional``'s). Unlike the fused backends
it reads its scalars (hp, k, found_inf) on the host, which synchronises on CUDA. A step on this
backend runs ``FedOptimizer.step`` -> ``FedStepper.run`` -> the plan's arguments -> the op's
function here -> its math, as ``torch.optim.SGD.step`` runs ``sgd()`` -> ``_single_tensor_sgd``.

``OpArgs`` reads an op's positional arguments (``OpSpec.schema``) by name, regrouped into row
groups or one entry per tensor; the triton backend reads them with it too, and the C++ bindings
parse the same layout themselves (``csrc/common/op_args.cpp``). Each op's function is registered
under the op's name; a client-batched op runs its per-client function client by client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import functional
from .between_passes import current as _sharded
from .impl_table import IMPLS, register
from .ops import BATCHED, FEDADAM, FEDEXP, FEDNAR, FRESH, PADAMFED, PER_CLIENT, SAM_ASCENT, SGD, OpSpec


# ------------------------------------------------------------------------------- the arguments, read back
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


# ------------------------------------------------------------------------------- the per-client ops
# A norm op (fednar, padamfed, sam_ascent, fedexp) runs its function over every row group at once:
# each tensor with its row group's hp values, one global norm over them all (sharded parameters:
# every rank's, through ``between_passes.reducing``). A GradScaler inf (``found_inf``) changes
# nothing, ``k`` included.


@register("sgd", "reference")
def sgd_step(*args, cache=None) -> None:
    """FedDecaySGD, NeuronLRSGD, FedDyn, FedAvgM and FedSAM's descent: ``functional.sgd`` on each row
    group. hp row: lr, momentum, dampening, weight_decay, prox_mu, nesterov, maximize. The step's
    learning rate is ``lr * s(j)`` with ``j = min(k // decay_every, len(table) - 1)`` (FedDecay's
    within-round decay, ``k`` read on the host); a fresh momentum buffer arrives zero-filled with
    ``dampening = 0``, which makes ``buf = d`` on the first step exactly as torch does."""
    a = OpArgs.parse(SGD, args)
    if a.found_inf_now():
        return
    j = min(int(a.k.reshape(-1)[0]) // a.decay_every, a.table.numel() - 1)
    s = float(a.table[j])
    for group in a.row_groups():
        lr, momentum, dampening, wd, prox_mu, nesterov, maximize = a.hp[group.row].tolist()
        t = group.tensors
        functional.sgd(
            t["params"],
            t["grads"],
            t.get("momentum_buffer"),  # type: ignore[arg-type]  # a list of buffers, none of them None
            lr=lr * s,
            momentum=momentum,
            dampening=dampening,
            weight_decay=wd,
            nesterov=bool(nesterov),
            maximize=bool(maximize),
            prox_mu=prox_mu,
            x0s=t.get("x0"),
            corrections=t.get("correction"),
            neuron_scales=t.get("neuron_scale"),
            grad_scale=a.grad_scale,
        )
    a.k.add_(1)


@register("fednar", "reference")
def fednar_step(*args, cache=None) -> None:
    """FedNAR (Li et al., NeurIPS 2023, Eq. 3-4 and Alg. 2): ``functional.fednar``. hp row: lr (the
    round's, ``lr * round_decay ** t``: the optimizer's round decay), weight_decay, max_norm, eps,
    prox_mu."""
    a = OpArgs.parse(FEDNAR, args)
    if a.found_inf_now():
        return
    t, hp = a.per_tensor()
    functional.fednar(
        t["params"],  # type: ignore[arg-type]  # params and grads have no None entry
        t["grads"],  # type: ignore[arg-type]
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        max_norm=hp["max_norm"],
        eps=hp["eps"],
        prox_mu=hp["prox_mu"],
        x0s=t["x0"],
        corrections=t["correction"],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)


@register("padamfed", "reference")
def padamfed_step(*args, cache=None) -> None:
    """PAdaMFed ("Problem-Parameter-Free Federated Learning", Alg. 1, Thm. 1-2):
    ``functional.padamfed``. hp row: lr (eta), beta, eps."""
    a = OpArgs.parse(PADAMFED, args)
    if a.found_inf_now():
        return
    t, hp = a.per_tensor()
    functional.padamfed(
        t["params"],  # type: ignore[arg-type]  # every tensor has these roles
        t["grads"],  # type: ignore[arg-type]
        t["D"],  # type: ignore[arg-type]
        t["acc"],  # type: ignore[arg-type]
        lr=hp["lr"],
        beta=hp["beta"],
        eps=hp["eps"],
        anchor_grads=t["anchor_grad"],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)


@register("sam_ascent", "reference")
def sam_ascent_step(*args, cache=None) -> None:
    """FedSAM's ascent (Caldarola et al., ECCV 2022; SAM: Foret et al., ICLR 2021; ASAM: Kwon et al.,
    ICML 2021): ``functional.sam_ascent``; the descent that follows is the ``sgd`` op. hp row: rho,
    eta, eps, adaptive (1.0 or 0.0). The ``saved_x`` role (the optimizer always gives it; a bare op
    call may not) receives ``x`` first."""
    a = OpArgs.parse(SAM_ASCENT, args)
    if a.found_inf_now():
        return
    t, hp = a.per_tensor()
    functional.sam_ascent(
        t["params"],  # type: ignore[arg-type]  # params and grads have no None entry
        t["grads"],  # type: ignore[arg-type]
        t["saved_x"],
        rho=hp["rho"],
        eta=hp["eta"],
        eps=hp["eps"],
        adaptive=[v != 0.0 for v in hp["adaptive"]],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)


@register("fedadam", "reference")
def fedadam_step(*args, cache=None) -> None:
    """FedAdam, FedYogi and FedAdagrad ("Adaptive Federated Optimization", Reddi et al., ICLR 2021,
    Algorithm 2): ``functional.fedadam`` on each row group. hp row: lr, beta1, beta2, tau, rule
    (0 Adam, 1 Yogi, 2 Adagrad), bias_correction (0 or 1). The bias correction's step ``t`` is
    ``k + 1`` (``k`` read on the host)."""
    a = OpArgs.parse(FEDADAM, args)
    if a.found_inf_now():
        return
    step = int(a.k.reshape(-1)[0]) + 1
    for group in a.row_groups():
        lr, beta1, beta2, tau, rule, bias_correction = a.hp[group.row].tolist()
        t = group.tensors
        functional.fedadam(
            t["params"],
            t["grads"],
            t["exp_avg"],
            t["exp_avg_sq"],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            tau=tau,
            rule=functional.ADAPTIVE_RULES[int(rule)],
            step=step,
            bias_correction=bool(bias_correction),
            grad_scale=a.grad_scale,
        )
    a.k.add_(1)


@register("fedexp", "reference")
def fedexp_step(*args, cache=None) -> None:
    """FedExP (Jhunjhunwala, Wang, Joshi, ICLR 2023): ``functional.fedexp``. hp row: lr, eps,
    mean_sq_norm (the round's weighted mean of the clients' squared update norms, which the
    optimizer writes into the column before each step)."""
    a = OpArgs.parse(FEDEXP, args)
    if a.found_inf_now():
        return
    t, hp = a.per_tensor()
    functional.fedexp(
        t["params"],  # type: ignore[arg-type]  # params and grads have no None entry
        t["grads"],  # type: ignore[arg-type]
        mean_sq_norm=hp["mean_sq_norm"],
        eps=hp["eps"],
        lr=hp["lr"],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)


# ------------------------------------------------------------------------------- the client-batched ops
# docs/client_batched.md's definition, which the fused batched kernels are tested against: client
# ``c`` of a batched op runs exactly the per-client op on the ``c``-th slices of every tensor, its own
# hp rows ``hp[:, c]`` and its own counter ``k[c]``; inactive clients are skipped (nothing of theirs
# changes). For ``sgd_batched``, a client at ``k == 0`` in a round whose momentum buffers are new
# (the ``FRESH`` bit) takes the first-step rule ``buf = d``: its rows get ``dampening = 0``, which
# is how the per-client op's first step is formed.
def _per_client(name: str):
    spec = BATCHED[name]
    base = PER_CLIENT[spec.base]

    def step(*args, cache=None) -> None:
        a = OpArgs.parse(spec, args)
        fn = IMPLS[base.name]["reference"]  # read at each call: the per-client function registered now
        active = None if a.active is None else a.active.tolist()
        ks = a.k.tolist()
        damp = base.hps.index("dampening") if "dampening" in base.hps else None
        present = [m & ~FRESH for m in a.present]
        for c in range(a.hp.shape[1]):
            if active is not None and not active[c]:
                continue
            hp = a.hp[:, c, :].clone()
            if damp is not None and ks[c] == 0:
                for b, m in enumerate(a.present):
                    if m & FRESH:
                        hp[b, damp] = 0.0
            lists = [[t[c] for t in a.lists[r.name]] for r in spec.roles]
            fn(
                *lists,
                a.row_of,
                present,
                hp,
                a.k[c : c + 1],
                a.table,
                a.decay_every,
                a.grad_scale,
                a.found_inf,
                "reference",
            )

    step.__name__ = step.__qualname__ = f"{name}_reference"
    return register(name, "reference")(step)


for _name in BATCHED:
    _per_client(_name)
