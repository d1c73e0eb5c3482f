"""The optimizers on DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): docs/sharded.md.

A sharded optimizer's step runs the same op, through the same kernels, on each rank's local
shards: parameters, gradients and every state tensor are DTensors placed like their parameter,
and the plan hands the kernels their local tensors. Element-wise algorithms need nothing more.
A global norm (FedNAR, PAdaMFed) must cover the whole logical tensors: between its two passes
the kernel gives this rank's float64 sums of squares (per tensor; per program on Triton),
replicated tensors are counted on one rank of their replicas only (weight 0 elsewhere), and one
all-reduce over the mesh sums the ranks. Ordinary tensors never reach this module's per-step code
(``ShardedPlan`` is used only when the optimizer holds DTensors).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from .between_passes import reducing
from .plan import StepPlan
from .plan_inputs import PlanInputs

# how errors name flat parameter ``i`` (of ``params`` when given): the optimizer's ``name_of``
NameOf = Callable[..., str]

# backends whose norm ops take a cross-rank reduction between their passes
NORM_BACKENDS = ("reference", "cpu", "triton")


def _dtensor_type() -> Optional[type]:
    # no import here: while torch.distributed.tensor is not loaded, no tensor can be a DTensor
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the very tensor the DTensor wraps, so writes reach it); ``t`` otherwise."""
    return t._local_tensor if is_dtensor(t) else t


def _describe(t: torch.Tensor) -> str:
    if is_dtensor(t):
        return f"a DTensor with placements {tuple(t.placements)} on {t.device_mesh}"
    return f"a plain {type(t).__name__}"


def check_params(name_of: NameOf, params: Sequence[torch.Tensor]) -> bool:
    """True when ``params`` are DTensors (all of them, on one mesh, not Partial); False when none is.

    A mix, two meshes or a Partial placement is refused naming the parameter."""
    flags = [is_dtensor(p) for p in params]
    if not any(flags):
        return False
    first = flags.index(True)
    mesh = params[first].device_mesh
    for i, p in enumerate(params):
        if not flags[i]:
            raise TypeError(
                f"{name_of(i, list(params))} is a plain tensor but {name_of(first, list(params))} "
                f"is a DTensor; a sharded optimizer needs every parameter as a DTensor on one mesh"
            )
        if p.device_mesh != mesh:
            raise ValueError(
                f"{name_of(i, list(params))} lives on {p.device_mesh} but "
                f"{name_of(first, list(params))} on {mesh}; all parameters of one optimizer must "
                f"share a device mesh (its global norm is reduced over that mesh)"
            )
        for pl in p.placements:
            if pl.is_partial():
                raise ValueError(
                    f"{name_of(i, list(params))} has a Partial placement; parameters must be Shard or Replicate"
                )
        if mesh.get_coordinate() is None:
            raise RuntimeError(f"this rank is not part of the device mesh of {name_of(i, list(params))}")
    return True


def check_placed_like(name: str, t: torch.Tensor, p: torch.Tensor, pname: str) -> None:
    """A per-parameter input (correction, control, anchor gradient, state) must be placed as ``p`` is."""
    td, pd = is_dtensor(t), is_dtensor(p)
    if not td and not pd:
        return
    if td != pd:
        hint = (
            (
                " (make it one with torch.distributed.tensor.distribute_tensor(t, p.device_mesh, p.placements), "
                "or DTensor.from_local with this rank's shard)"
            )
            if pd
            else ""
        )
        raise TypeError(f"{name} entry for {pname} is {_describe(t)} but the parameter is {_describe(p)}{hint}")
    if t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements):
        raise ValueError(
            f"{name} entry for {pname} is {_describe(t)} but the parameter is {_describe(p)}; "
            f"it must be placed like its parameter"
        )


def misplaced(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Would ``check_placed_like`` refuse ``t`` for ``p``?"""
    td, pd = is_dtensor(t), is_dtensor(p)
    return td != pd or (td and (t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements)))


# ------------------------------------------------------------------------- per-row (neuron) scales
def row_placements(p: torch.Tensor, pname: str) -> tuple:
    """Placements of a per-output-row vector ``[shape[0]]`` of DTensor ``p``: dim 0 sharded like ``p``'s
    rows, replicated where ``p`` is sharded along another dim or replicated."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for pl in p.placements:
        if type(pl) is Shard and pl.dim == 0:
            out.append(Shard(0))
        elif pl.is_replicate() or (isinstance(pl, Shard) and pl.dim != 0):
            out.append(Replicate())
        else:
            raise ValueError(
                f"neuron scale for {pname}: the parameter's placement {pl} does not keep whole output "
                f"rows on a rank, so a per-row scale cannot be sliced to it"
            )
    return tuple(out)


def check_row_scale(p: torch.Tensor, r: torch.Tensor, pname: str) -> None:
    """A plain ``[M]`` scale (the whole vector, the same on every rank) or a DTensor placed as ``row_placements``."""
    if not is_dtensor(p):
        if is_dtensor(r):
            raise TypeError(f"neuron scale for {pname} is a DTensor but the parameter is a plain tensor")
        return
    want = row_placements(p, pname)
    if is_dtensor(r) and (r.device_mesh != p.device_mesh or tuple(r.placements) != want):
        raise ValueError(
            f"neuron scale for {pname} is {_describe(r)}; expected a plain tensor with the whole "
            f"vector or a DTensor on the parameter's mesh with placements {want}"
        )


def row_scale(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``r`` as a DTensor of ``p``'s rows (``row_placements``): a plain whole vector is sliced on each
    rank without communication."""
    if not is_dtensor(p) or is_dtensor(r):
        return r
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(r, p.device_mesh, row_placements(p, "parameter"), src_data_rank=None)


def divided(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``t / k`` for a one-element counter ``k`` on ``t``'s device (a DTensor divides its local shard)."""
    if is_dtensor(t):
        from torch.distributed.tensor import DTensor

        out = t._local_tensor / k.to(t.dtype)
        return DTensor.from_local(out, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return t / k.to(t.dtype)


# ------------------------------------------------------------------------------ state_dict
def check_loadable(sharded: bool, name_of: NameOf, state_dict: dict) -> None:
    """Before ``load_state_dict`` changes anything: DTensor state is refused by an unsharded optimizer."""
    if sharded:
        return
    saved = [k for g in state_dict["param_groups"] for k in g["params"]]
    for i, key in enumerate(saved):
        st = state_dict["state"].get(key)
        for name, v in st.items() if isinstance(st, dict) else ():
            if is_dtensor(v):
                raise ValueError(
                    f"state {name!r} of {name_of(i)} is a DTensor but the parameter is a plain "
                    f"tensor; save it with torch.distributed.checkpoint.state_dict."
                    f"get_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True)) "
                    f"to load it unsharded"
                )


def place_loaded_state(params: Sequence[torch.Tensor], state: Any, name_of: NameOf) -> None:
    """After ``load_state_dict`` into a sharded optimizer: state saved unsharded (plain tensors of the
    whole parameter) becomes DTensors placed like the parameters (each rank keeps its slice, no
    communication). ``state``: the optimizer's ``state`` (parameter -> dict), changed in place."""
    from_full = None
    for i, p in enumerate(params):
        st = state.get(p)
        if not st:
            continue
        for key, v in list(st.items()):
            if not isinstance(v, torch.Tensor):
                continue
            if is_dtensor(v):
                continue  # placed as saved; the step plan checks it against the parameter
            if from_full is None:
                from torch.distributed.tensor import distribute_tensor as from_full
            if v.shape == p.shape:
                st[key] = from_full(v, p.device_mesh, p.placements, src_data_rank=None)
            elif p.dim() > 0 and v.shape == (p.shape[0],):
                st[key] = from_full(v, p.device_mesh, row_placements(p, name_of(i)), src_data_rank=None)
            else:
                raise ValueError(
                    f"state {key!r} of {name_of(i)} has shape {tuple(v.shape)}, which fits neither "
                    f"the parameter {tuple(p.shape)} nor its rows"
                )


# ------------------------------------------------------------------------------ the step
def _reduce_groups(mesh) -> list:
    """Process groups whose all-reduces, one after the other, sum over every rank of ``mesh``: the
    mesh's own group (1-D), the whole world or the flattened mesh (one all-reduce); else one per mesh dim."""
    import torch.distributed as dist

    if mesh.ndim == 1:
        return [mesh.get_group()]
    if mesh.size() == dist.get_world_size():
        return [dist.group.WORLD]
    if mesh.mesh_dim_names:
        return [mesh._flatten().get_group()]
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def _owner(p: torch.Tensor) -> bool:
    """Does this rank count ``p``'s local elements? Not when it is a copy: along every mesh dim where
    ``p`` is replicated only coordinate 0 counts."""
    coord = p.device_mesh.get_coordinate()
    return all(c == 0 for c, pl in zip(coord, p.placements, strict=True) if pl.is_replicate())


class ShardedPlan(StepPlan):
    """The step plan of an optimizer whose parameters are DTensors: the kernels get local shards.

    Built like ``StepPlan`` on the DTensors (so row groups, hp rows and state are the same), then every
    placement is checked and the argument lists are replaced by the local tensors. A norm op's
    implementation is wrapped so that its sums of squares are all-reduced between its passes.
    """

    @staticmethod
    def refuse(spec, owner: str) -> None:
        if spec.batched:
            raise TypeError(
                f"{owner} takes no DTensor parameters: a client-batched optimizer stacks clients "
                f"along dim 0 of each tensor; shard per-client optimizers instead"
            )

    def __init__(self, inputs: PlanInputs):
        self.refuse(inputs.spec, inputs.owner)
        super().__init__(inputs)
        spec = self.spec
        self.mesh = self.all_params[0].device_mesh if self.all_params else None
        names = self.name
        for idx, p in zip(self.order, self.params, strict=True):
            check_placed_like("gradient", p.grad, p, names(idx))
        cursor = {name: 0 for name in self.lists}
        for b, idx in zip(self.row_of, self.order, strict=True):
            p = self.all_params[idx]
            for role in spec.optional:
                if role.name in self.step_roles or not self.present[b] & spec.bit(role.name):
                    continue
                t = self.lists[role.name][cursor[role.name]]
                cursor[role.name] += 1
                if role.per_row:
                    if not is_dtensor(t) or tuple(t.placements) != row_placements(p, names(idx)):
                        raise ValueError(
                            f"{role.name} of {names(idx)} is {_describe(t)}; expected placements "
                            f"{row_placements(p, names(idx))} (set it with set_neuron_scales)"
                        )
                else:
                    check_placed_like(f"state {role.name!r}", t, p, names(idx))
        self.params = [local(p) for p in self.params]
        self._dgrads = [self.all_params[i].grad for i in self.order]  # the gradient DTensors last seen
        self._local_grads = [local(g) for g in self._dgrads]
        self.lists = {name: [local(t) for t in ts] for name, ts in self.lists.items()}
        self.local_ptrs = [p._local_tensor.data_ptr() for p in self.all_params]
        # per step, only what does not come from this plan can be a DTensor: per-step inputs
        # (anchor gradients) and parameters handed in by torch.compile's op
        outside = (0,) + tuple(i for i, r in enumerate(spec.roles) if r.name in self.step_roles)
        own_params = self.params
        inner = self.fn

        def localized(args: tuple) -> list:
            args = list(args)
            for i in outside:
                if i or args[0] is not own_params:
                    args[i] = [local(t) for t in args[i]]
            return args

        if not spec.norm:

            def step(*args, cache=None):
                inner(*localized(args), cache=cache)
        else:
            if self.backend not in NORM_BACKENDS:
                raise RuntimeError(
                    f"{inputs.owner} with DTensor parameters needs backend 'cpu', 'triton' or "
                    f"'reference': the cross-rank global norm is not implemented for backend "
                    f"{self.backend!r}"
                )
            weights = [1.0 if _owner(p) else 0.0 for p in (self.all_params[i] for i in self.order)]
            groups = _reduce_groups(self.mesh)
            if self.backend == "triton":
                # its norm pass leaves sums per program, each over tiles of several tensors: one
                # weight for all of this rank's tensors
                # decided from the placements, the same on every rank (a refusal on one rank only
                # would leave the others waiting in the all-reduce)
                if len({tuple(pl.is_replicate() for pl in self.all_params[i].placements) for i in self.order}) > 1:
                    raise RuntimeError(
                        f"{inputs.owner} on backend 'triton' needs every parameter placed alike "
                        f"along the mesh dims where any is replicated (e.g. all Shard, as FSDP2 "
                        f"places them); use backend 'cpu' or 'reference' for this mix"
                    )
                reduce = _slot_reduce(weights[0] if weights else 1.0, groups)
            else:
                if self.backend == "cpu":
                    # the C++ kernels hand over one sum per non-empty tensor (zero-size ones make no entry)
                    weights = [w for w, p in zip(weights, self.params, strict=True) if p.numel() > 0]
                reduce = _norm_reduce(torch.tensor(weights, dtype=torch.float64), groups)
            step = _with_reduce(inner, reduce, self.backend, localized)
        self.fn = step

    def current_grads(self) -> List[torch.Tensor]:
        return self._local_grads

    def still_valid(self, groups: list) -> Union[bool, List[int]]:
        verdict = super().still_valid(groups)
        if verdict is False:
            return False
        grads = [self.all_params[i].grad for i in self.order]
        if any(
            a is not b for a, b in zip(grads, self._dgrads, strict=True)
        ):  # a new gradient DTensor: the base plan took it as given
            for i, g in zip(self.order, grads, strict=True):
                if (
                    not isinstance(g, torch.Tensor)
                    or not is_dtensor(g)
                    or g.device_mesh != self.mesh
                    or g.placements != self.all_params[i].placements
                ):
                    return False  # rebuilt, which names the misplaced gradient
            self._dgrads = grads
            self._local_grads = [local(g) for g in grads]
        return verdict if [p._local_tensor.data_ptr() for p in self.all_params] == self.local_ptrs else False


def _norm_reduce(weights: torch.Tensor, groups: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """sums (float64 ``[n]``: this rank's sum of squares per tensor) -> the sum over every rank (float64 ``[1]``)."""
    import torch.distributed as dist

    def reduce(sums: torch.Tensor) -> torch.Tensor:
        if sums.numel() != weights.numel():
            raise RuntimeError(f"fedopt_kernels: the norm pass gave {sums.numel()} sums for {weights.numel()} tensors")
        total = torch.dot(sums, weights.to(sums.device)).reshape(1)
        for group in groups:
            dist.all_reduce(total, group=group)
        return total

    return reduce


def _slot_reduce(weight: float, groups: list) -> Callable[[torch.Tensor], None]:
    """slots (float64 ``[n]`` on the device, this rank's norm pass) -> slot 0 holds the weighted sum
    over every rank, the others 0: on the device, no host synchronisation."""
    import torch.distributed as dist

    def reduce(slots: torch.Tensor) -> None:
        total = (slots.sum() * weight).reshape(1)
        for group in groups:
            dist.all_reduce(total, group=group)
        if slots.numel():
            slots.zero_()
            slots[:1].copy_(total)

    return reduce


def _with_reduce(inner: Callable, reduce: Callable, backend: str, localized: Callable) -> Callable:
    if backend == "cpu":
        from .backends.cpu import extension as cpu_extension

        def step(*args, cache=None):
            args = localized(args)
            cpu_extension.run_with_norm_reduce(reduce, lambda: inner(*args, cache=cache))
    else:  # reference, triton

        def step(*args, cache=None):
            args = localized(args)
            with reducing(reduce):
                inner(*args, cache=cache)

    return step


def plan_class(sharded: bool) -> type:
    return ShardedPlan if sharded else StepPlan
