"""The cached step plan: everything ``step()`` derives from the param groups, built once and reused.

A plan is built from ``PlanInputs`` (``plan_inputs.py``), plain data the optimizer gathers with its
hooks; it never calls back into the optimizer. It holds the op's argument lists (parameters with a
gradient, their gradients and state tensors, split into row groups: the parameters sharing one hp
row), the hyperparameter rows as a device tensor, the resolved implementation and a cache dict the
implementation may keep per-tensor data in (pointer tables). Per step ``StepPlan.still_valid`` checks, cheaply, what can
change behind the optimizer's back:

* a hyperparameter value of a param group: the plan names the groups whose values changed and the
  optimizer hands their re-validated ``GroupInputs`` to ``update_groups``, which rewrites ``hp``
  (or refuses, when the change alters which tensors the step needs, such as momentum 0 -> 0.9:
  the plan is rebuilt); a tensor lr is compared by identity and copied into ``hp`` on the device
  at every step (``load_lrs``), so a scheduler's in-place change takes effect without a host sync;
* a gradient appearing, disappearing or being replaced (a new gradient tensor is checked);
* a parameter's storage (``p.data = ...``, which also covers dtype and device changes).

The gradients and storages are checked by a ``grad_watch.GradWatch`` in one call, which also names
the gradients' address set for the replay key; the plan holds no gradient between steps (the
watch's docstring says why).

Everything else that changes the plan goes through the optimizer (``add_param_group``,
``load_state_dict``, ``start_round``, ``set_neuron_scales``), which drops it. A plan whose row groups
include freshly created momentum buffers (first step of a round) lives for one step only.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from . import grad_watch as _grad_watch
from . import graph_pools
from . import registry as _registry
from .plan_inputs import GroupInputs, PlanInputs, check_grad, name_of

_versions = itertools.count(1)
_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr


def _values_of(keys: Tuple[str, ...]) -> Callable[[Dict[str, Any]], tuple]:
    """A C-level getter of a param group's values for ``keys``, always a tuple."""
    get = operator.itemgetter(*keys)
    return get if len(keys) > 1 else (lambda group: (get(group),))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without making the host wait (pinned + non_blocking on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# torch.cuda.is_current_stream_capturing's own C call where checked (one Python call less a step)
_stream_capturing = graph_pools.stream_capturing()


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on ``device``'s current stream?"""
    return device.type == "cuda" and _stream_capturing()


def _same(a: tuple, b: tuple) -> bool:
    """Hyperparameter values unchanged? Tensors (lr) by identity: comparing values would sync."""
    return len(a) == len(b) and all(
        x is y or not (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)) and x == y
        for x, y in zip(a, b, strict=True)
    )


def refuse_in_capture(device: torch.device, what: str) -> None:
    """A host-to-device copy inside a capture would be replayed from a freed host buffer: refuse it."""
    if capturing(device):
        raise RuntimeError(
            f"step() needs to {what} while a CUDA graph is being captured; take eager steps until nothing "
            f"changes (two steps after start_round() when momentum buffers are new, one otherwise), keep "
            f"hyperparameters, gradients and state at fixed addresses while the graph is used, and capture then"
        )


class HpCache:
    """An optimizer's last hp rows on the host and their device copy.

    Plans rebuilt with the same rows (every round start, mostly) share one device tensor, so a
    rebuild costs no host-to-device copy, and none is made while a CUDA graph is captured.
    """

    def __init__(self) -> None:
        self.host: Optional[torch.Tensor] = None
        self.device: Optional[torch.Tensor] = None

    def keep(self, host: Optional[torch.Tensor], dev: Optional[torch.Tensor]) -> None:
        self.host, self.device = host, dev

    def device_hp(
        self, host: torch.Tensor, device: torch.device, update: Optional[torch.Tensor] = None, shared: bool = True
    ) -> torch.Tensor:
        """The hp tensor on ``device`` holding ``host``; copied only when the values changed.
        ``shared=False``: the plan writes tensor lrs into its hp, so it neither takes nor leaves one."""
        dev = self.device
        if (
            shared
            and dev is not None
            and dev.device == device
            and self.host is not None
            and self.host.shape == host.shape
            and torch.equal(self.host, host)
        ):
            return dev
        refuse_in_capture(device, "copy new hyperparameter values to the device")
        if update is not None and update.shape == host.shape and update.device == device:
            # in place: a CUDA graph captured earlier reads this tensor; a fresh pinned buffer per
            # copy, because the previous copy may still be in flight
            update.copy_(host.pin_memory() if device.type == "cuda" else host, non_blocking=True)
            dev = update
        else:
            dev = to_device(host, device)
        self.keep(*((host, dev) if shared else (None, None)))
        return dev


class StepPlan:
    """The kernel arguments of one optimizer's step, arranged from ``PlanInputs``."""

    @staticmethod
    def refuse(spec, owner: str) -> None:
        """Raise before anything is gathered when this kind of plan cannot serve the op (ShardedPlan)."""

    def __init__(self, inputs: PlanInputs):
        spec = self.spec = inputs.spec
        self.version = next(_versions)
        self.one_shot = False
        self.owner = inputs.owner
        self.clients = inputs.clients
        self.hp_cache = inputs.hp_cache
        params = self.all_params = inputs.params
        self.had_grad: List[bool] = [p.grad is not None for p in params]
        self.ptrs: List[int] = [p.data_ptr() for p in params]
        self.group_inputs: List[GroupInputs] = list(inputs.groups)
        self.groups = [g.group for g in self.group_inputs]
        self.group_params = [g["params"] for g in self.groups]
        self.group_lens = [len(g["params"]) for g in self.groups]
        self.hp_keys: List[Tuple[str, ...]] = [g.keys for g in self.group_inputs]
        self.hp_vals: List[tuple] = [g.values for g in self.group_inputs]
        self.hp_get = [_values_of(keys) for keys in self.hp_keys]

        # row groups (one hp row each): (param group, present roles, hp overrides) in first-seen order
        row_group_of: Dict[tuple, int] = {}
        self.row_param_group: List[int] = []
        self.row_override: List[Dict[str, float]] = []
        self.present: List[int] = []
        self.order: List[int] = []  # index into all_params of each kernel parameter
        members: List[list] = []
        for m in inputs.members:
            mask = m.extra
            for bit, role in enumerate(spec.optional):
                if role.name in m.tensors:
                    mask |= 1 << bit
            key = (m.group, mask, tuple(sorted(m.override.items())))
            b = row_group_of.get(key)
            if b is None:
                b = row_group_of[key] = len(self.row_param_group)
                self.row_param_group.append(m.group)
                self.row_override.append(m.override)
                self.present.append(mask)
                members.append([])
                if m.override:
                    self.one_shot = True
            members[b].append(m)
        self.device = inputs.device

        # argument lists, row group by row group (the norm's summation order is this order: fixed)
        self.params: List[torch.Tensor] = []
        self.row_of: List[int] = []
        self.lists: Dict[str, List[torch.Tensor]] = {r.name: [] for r in spec.optional}
        self.step_roles = inputs.step_roles
        self.step_order: Dict[str, List[int]] = {name: [] for name in self.step_roles}
        for b, mem in enumerate(members):
            for m in mem:
                self.order.append(m.index)
                self.params.append(params[m.index])
                self.row_of.append(b)
                for name, t in m.tensors.items():
                    if name not in self.step_roles:  # per-step inputs are filled in at each step
                        self.lists[name].append(t)
                for name in self.step_roles:
                    if self.present[b] & spec.bit(name):
                        self.step_order[name].append(m.index)
        self.watch = _grad_watch.make(params, self.order)
        self.grad_set = self.watch.accept()  # the gradients' address set id (the replay key's)
        self.hp = self.hp_cache.device_hp(self.hp_rows(), self.device, shared=not self._has_tensor_lr())
        self._bind_lrs()
        self.fn: Callable = _registry.resolve(spec.name, inputs.backend, self.device)
        self.backend = _registry.auto_backend(self.device, spec.name) if inputs.backend == "auto" else inputs.backend
        self.cache: Dict[str, Any] = {}
        self.replayable: Optional[bool] = None  # decided by the optimizer at the first step (core/replay.py)
        self.replay_layout: Optional[int] = None  # the replay key's id of this plan's layout

    def hp_rows(self, groups: Optional[List[GroupInputs]] = None) -> torch.Tensor:
        """The op's hp tensor on the host: each row group's rows (one per client for a client-batched op)
        with its overrides applied, for ``groups`` (default: the plan's)."""
        groups = self.group_inputs if groups is None else groups
        H = len(self.spec.hps)
        batched = self.clients is not None
        if not self.row_param_group:
            return torch.zeros((0, self.clients, H) if self.clients is not None else (0, H), dtype=torch.float64)
        out: List[Any] = []  # per row group: a row, or one row per client
        for gi, override in zip(self.row_param_group, self.row_override, strict=True):
            g = groups[gi]
            if not override and g.lr_scale is None:  # the rows as gathered (the common case)
                out.append(g.rows if batched else g.rows[0])
                continue
            per_client = []
            for c, base in enumerate(g.rows):
                row = list(base)
                for name, v in override.items():
                    row[self.spec.hp_index(name)] = float(v)
                if g.lr_scale is not None:
                    row[self.spec.lr_column] *= g.lr_scale[c]  # type: ignore[index]  # an op with a lr
                per_client.append(row)
            out.append(per_client if batched else per_client[0])
        return torch.tensor(out, dtype=torch.float64)

    # ------------------------------------------------------------------ tensor learning rates
    def _has_tensor_lr(self) -> bool:
        return any(g.lr is not None for g in self.group_inputs)

    def _bind_lrs(self) -> None:
        """For each group with a tensor lr: its slice of hp's lr column and the factors around it."""
        self.tensor_lrs: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        for gi, g in enumerate(self.group_inputs):
            if g.lr is None:
                continue
            rows = [b for b, bg in enumerate(self.row_param_group) if bg == gi]
            if not rows:
                continue
            lo, hi = rows[0], rows[-1] + 1  # a param group's row groups are consecutive (made group by group)
            scale = None if g.lr_scale is None or all(v == 1.0 for v in g.lr_scale) else g.lr_scale
            # (lr * factor) * scale, in the order and rounding of the rows' own computation
            a, b = (
                None if f is None else to_device(torch.tensor([f] * (hi - lo), dtype=torch.float64), self.device)
                for f in (g.lr_factor, scale)
            )
            col = self.spec.lr_column  # the op's declared lr column (ops.py)
            self.tensor_lrs.append((g.lr.detach().reshape(()), self.hp[lo:hi, ..., col], a, b))

    def load_lrs(self) -> None:
        """Copy every tensor lr into hp (tensor to tensor: no host sync for a device lr)."""
        for lr, col, a, b in self.tensor_lrs:
            if lr.device.type == "cpu" and capturing(self.device):
                raise RuntimeError(
                    "a CPU tensor lr cannot be read inside a CUDA graph (it would be replayed "
                    "frozen); put the lr tensor on the parameters' device"
                )
            col.fill_(lr)  # a CPU 0-d value is read on the host, a device one copied on the device
            if a is not None:
                col.mul_(a)
            if b is not None:
                col.mul_(b)

    # ------------------------------------------------------------------ per-step checks
    def still_valid(self, groups: List[Dict[str, Any]]) -> Union[bool, List[int]]:
        """True when the plan serves this step as it is; False when it must be rebuilt; else the
        indexes of the groups whose hyperparameter values changed: the caller hands their new
        ``GroupInputs`` to ``update_groups`` before the step. Sets ``grad_set``, the id of the
        gradients' address set."""
        if self.one_shot:
            return False
        if len(groups) != len(self.groups):
            return False
        changed = None
        for gi, group in enumerate(groups):
            if (
                group is not self.groups[gi]
                or group["params"] is not self.group_params[gi]
                or len(group["params"]) != self.group_lens[gi]
            ):
                return False
            try:
                vals = self.hp_get[gi](group)
            except KeyError:
                return False
            old = self.hp_vals[gi]
            # the same objects (no edit since): no value is compared, so a tensor lr is never read
            if len(group) != len(vals) + 1 or not (all(map(operator.is_, vals, old)) or _same(vals, old)):
                changed = [gi] if changed is None else changed + [gi]
        grad_set = self.watch.check()  # every gradient and parameter storage, in one call
        if grad_set < 0:
            grad_set = self._look()
            if grad_set < 0:
                return False
        self.grad_set = grad_set
        return True if changed is None else changed

    def _look(self) -> int:
        """What the watch could not settle: -1 when a gradient appeared or went or a parameter's
        storage changed (the plan is rebuilt); an error naming the parameter for a gradient the
        kernels cannot take; else the gradients are taken as seen."""
        params = self.all_params
        grads = list(map(_GRAD, params))
        if [g is not None for g in grads] != self.had_grad or list(map(_DATA_PTR, params)) != self.ptrs:
            return -1
        for i in self.order:
            check_grad(params[i], grads[i], i, self.groups, params, self.owner)
        return self.watch.accept()

    def current_grads(self) -> List[torch.Tensor]:
        """The gradients in kernel order, read now: the plan keeps none between steps."""
        return list(map(_GRAD, self.params))

    def args(
        self,
        params: List[Any],
        lists: Dict[str, Any],
        k: torch.Tensor,
        table: torch.Tensor,
        every: int,
        grad_scale: Optional[torch.Tensor],
        found_inf: Optional[torch.Tensor],
        active: Optional[torch.Tensor],
    ) -> tuple:
        """``fn``'s arguments for one launch, in the op's schema order (``ops.OpSpec.schema``):
        ``params`` (the plan's, or the tensors torch.compile hands over), the gradients read now,
        one list per optional role from ``lists``, the plan's row_of, present and hp, then the step's own."""
        spec = self.spec
        return (
            params,
            self.current_grads(),
            *[lists[r.name] for r in spec.optional],
            self.row_of,
            self.present,
            self.hp,
            k,
            table,
            every,
            grad_scale,
            found_inf,
            *((active,) if spec.batched else ()),
            self.backend,
        )

    def update_groups(self, new: Dict[int, GroupInputs]) -> bool:
        """Take re-validated groups (``still_valid``'s list); False when one needs other tensors (rebuild).
        Nothing changes when the new rows cannot be copied to the device (during a capture)."""
        groups = list(self.group_inputs)
        for gi, g in new.items():
            if g.structure != groups[gi].structure:
                return False
            groups[gi] = g
        tensor_lr = any([g.lr is not None for g in groups])
        self.hp = self.hp_cache.device_hp(self.hp_rows(groups), self.device, update=self.hp, shared=not tensor_lr)
        self.group_inputs = groups
        for gi, g in new.items():
            self.hp_keys[gi] = g.keys
            self.hp_get[gi] = _values_of(g.keys)
            self.hp_vals[gi] = g.values
        if tensor_lr or self.tensor_lrs:
            self._bind_lrs()
        return True

    def name(self, idx: int) -> str:
        """How errors name flat parameter ``idx``."""
        return name_of(self.groups, idx, self.all_params)
