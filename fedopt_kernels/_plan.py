"""The cached step plan: everything ``step()`` derives from the param groups, built once and reused.

A plan holds the op's argument lists (parameters with a gradient, their gradients and state tensors,
split into uniform batches), the validated hyperparameters as a device tensor, the resolved
implementation and a cache dict the implementation may keep per-tensor data in (pointer tables).
Per step ``StepPlan.still_valid`` checks, cheaply, what can change behind the optimizer's back:

* a hyperparameter value of a param group (re-validated; a value that changes which tensors the
  step needs, such as momentum 0 -> 0.9, rebuilds the plan, any other only rewrites ``hp``); a
  tensor lr is compared by identity and copied into ``hp`` on the device at every step
  (``load_lrs``), so a scheduler's in-place change takes effect without a host sync;
* a gradient appearing, disappearing or being replaced (a new gradient tensor is checked);
* a parameter's storage (``p.data = ...``, which also covers dtype and device changes).

Everything else that changes the plan goes through the optimizer (``add_param_group``,
``load_state_dict``, ``start_round``, ``set_neuron_scales``), which drops it. A plan whose batches
include freshly created momentum buffers (first step of a round) lives for one step only.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _registry
from ._ops import OpSpec

if TYPE_CHECKING:  # pragma: no cover
    from ._base import FedOptimizer

_versions = itertools.count(1)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without making the host wait (pinned + non_blocking on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on ``device``'s current stream?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _same(a: tuple, b: tuple) -> bool:
    """Hyperparameter values unchanged? Tensors (lr) by identity: comparing values would sync."""
    return len(a) == len(b) and all(
        x is y or not (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)) and x == y for x, y in zip(a, b))


def refuse_in_capture(device: torch.device, what: str) -> None:
    """A host-to-device copy inside a capture would be replayed from a freed host buffer: refuse it."""
    if capturing(device):
        raise RuntimeError(
            f"step() needs to {what} while a CUDA graph is being captured; take eager steps until nothing "
            f"changes (two steps after start_round() when momentum buffers are new, one otherwise), keep "
            f"hyperparameters, gradients and state at fixed addresses while the graph is used, and capture then")


class StepPlan:
    def __init__(self, opt: "FedOptimizer"):
        spec: OpSpec = opt._spec
        self.spec = spec
        self.version = next(_versions)
        self.one_shot = False
        params = opt._params_flat
        self.all_params: List[torch.Tensor] = params
        self.grads_seen: List[Optional[torch.Tensor]] = [p.grad for p in params]
        self.ptrs: List[int] = [p.data_ptr() for p in params]
        self.groups = list(opt.param_groups)
        self.group_params = [g["params"] for g in self.groups]
        self.group_lens = [len(g["params"]) for g in self.groups]
        self.hp_keys: List[Tuple[str, ...]] = []
        self.hp_vals: List[tuple] = []
        self.structure: List[tuple] = []
        rows: List[List[float]] = []
        for gi, group in enumerate(self.groups):
            opt._validate_group(group)
            keys = tuple(k for k in group if k != "params")
            self.hp_keys.append(keys)
            self.hp_vals.append(tuple(group[k] for k in keys))
            self.structure.append(opt._structure(group))
            rows.append(opt._row_of(group))
        self.group_rows = rows

        # batches: (group, present roles, hp overrides) in first-seen order
        batch_of: Dict[tuple, int] = {}
        self.batch_group: List[int] = []
        self.batch_override: List[Dict[str, float]] = []
        self.present: List[int] = []
        self.order: List[int] = []           # index into all_params of each kernel parameter
        members: List[List[Tuple[int, Dict[str, torch.Tensor]]]] = []
        device: Optional[torch.device] = None
        flat = 0
        for gi, group in enumerate(self.groups):
            for p in group["params"]:
                idx, flat = flat, flat + 1
                g = p.grad
                if g is None:
                    continue
                opt._check_grad(p, g, idx)
                if device is None:
                    device = p.device
                elif p.device != device:
                    raise RuntimeError(f"{opt._name_of(idx)} is on {p.device} but other parameters are on {device}; "
                                       f"{type(opt).__name__} needs all parameters on one device")
                st = opt.state.get(p)  # an entry is made only for state the step creates
                fresh = st is None
                if fresh:
                    st = {}
                tensors, override = opt._step_tensors(p, group, st, idx)
                if fresh and st:
                    opt.state[p] = st
                mask = opt._extra_present(tensors)
                for bit, role in enumerate(spec.optional):
                    if role.name in tensors:
                        mask |= 1 << bit
                key = (gi, mask, tuple(sorted(override.items())))
                b = batch_of.get(key)
                if b is None:
                    b = batch_of[key] = len(self.batch_group)
                    self.batch_group.append(gi)
                    self.batch_override.append(override)
                    self.present.append(mask)
                    members.append([])
                    if override:
                        self.one_shot = True
                members[b].append((idx, tensors))
        opt._check_no_overlap()
        self.device = device if device is not None else (params[0].device if params else torch.device("cpu"))

        # argument lists, batch by batch (the norm's summation order is this order: fixed)
        self.params: List[torch.Tensor] = []
        self.batch: List[int] = []
        self.lists: Dict[str, List[torch.Tensor]] = {r.name: [] for r in spec.optional}
        self.step_roles = opt._step_roles()
        self.step_order: Dict[str, List[int]] = {name: [] for name in self.step_roles}
        for b, mem in enumerate(members):
            for idx, tensors in mem:
                self.order.append(idx)
                self.params.append(params[idx])
                self.batch.append(b)
                for name, t in tensors.items():
                    if name not in self.step_roles:  # per-step inputs are filled in at each step
                        self.lists[name].append(t)
                for name in self.step_roles:
                    if self.present[b] & spec.bit(name):
                        self.step_order[name].append(idx)
        self.grads = [params[i].grad for i in self.order]
        self.hp = opt._device_hp(opt._hp_tensor(self), self.device, shared=not self._has_tensor_lr())
        self._bind_lrs(opt)
        self.fn: Callable = _registry.resolve(spec.name, opt.backend, self.device)
        self.backend = _registry.auto_backend(self.device, spec.name) if opt.backend == "auto" else opt.backend
        self.cache: Dict[str, Any] = {}

    def batch_rows(self, row_of) -> List[List[float]]:
        """Each batch's hp row: ``row_of(group index)`` with the batch's overrides applied."""
        rows = []
        for gi, override in zip(self.batch_group, self.batch_override):
            row = list(row_of(gi))
            for name, v in override.items():
                row[self.spec.hp_index(name)] = float(v)
            rows.append(row)
        return rows

    def _hp_host(self) -> torch.Tensor:
        rows = self.batch_rows(lambda gi: self.group_rows[gi])
        if not rows:
            return torch.zeros((0, len(self.spec.hps)), dtype=torch.float64)
        return torch.tensor(rows, dtype=torch.float64)

    # ------------------------------------------------------------------ tensor learning rates
    def _has_tensor_lr(self) -> bool:
        return any(isinstance(g["lr"], torch.Tensor) for g in self.groups)

    def _bind_lrs(self, opt: "FedOptimizer") -> None:
        """For each group with a tensor lr: its slice of hp's lr column and the factors around it."""
        self.tensor_lrs: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        for gi, group in enumerate(self.groups):
            lr = group["lr"]
            if not isinstance(lr, torch.Tensor):
                continue
            rows = [b for b, g in enumerate(self.batch_group) if g == gi]
            if not rows:
                continue
            lo, hi = rows[0], rows[-1] + 1  # a group's batches are consecutive (made group by group)
            a, b = opt._lr_factors(self, gi, hi - lo)
            a, b = (None if f is None else to_device(f, self.device) for f in (a, b))
            self.tensor_lrs.append((lr.detach().reshape(()), self.hp[lo:hi, ..., 0], a, b))

    def load_lrs(self) -> None:
        """Copy every tensor lr into hp (tensor to tensor: no host sync for a device lr)."""
        for lr, col, a, b in self.tensor_lrs:
            if lr.device.type == "cpu" and capturing(self.device):
                raise RuntimeError("a CPU tensor lr cannot be read inside a CUDA graph (it would be replayed "
                                   "frozen); put the lr tensor on the parameters' device")
            col.fill_(lr)  # a CPU 0-d value is read on the host, a device one copied on the device
            if a is not None:
                col.mul_(a)
            if b is not None:
                col.mul_(b)

    # ------------------------------------------------------------------ per-step checks
    def still_valid(self, opt: "FedOptimizer") -> bool:
        """Update what can be updated in place; False when the plan must be rebuilt."""
        if self.one_shot:
            return False
        groups = opt.param_groups
        if len(groups) != len(self.groups):
            return False
        changed = None
        for gi, group in enumerate(groups):
            if group is not self.groups[gi] or group["params"] is not self.group_params[gi] \
                    or len(group["params"]) != self.group_lens[gi]:
                return False
            keys = self.hp_keys[gi]
            try:
                vals = tuple(group[k] for k in keys)
            except KeyError:
                return False
            if len(group) != len(keys) + 1 or not _same(vals, self.hp_vals[gi]):
                changed = [gi] if changed is None else changed + [gi]
        if changed is not None and not self._refresh_hp(opt, changed):
            return False
        params = self.all_params
        grads = [p.grad for p in params]
        seen = self.grads_seen
        if any(a is not b for a, b in zip(grads, seen)):
            for i, (a, b) in enumerate(zip(grads, seen)):
                if a is not b:
                    if (a is None) != (b is None):
                        return False
                    opt._check_grad(params[i], a, i)
            self.grads_seen = grads
            self.grads = [grads[i] for i in self.order]
        if [p.data_ptr() for p in params] != self.ptrs:
            return False
        return True

    def _refresh_hp(self, opt: "FedOptimizer", changed: List[int]) -> bool:
        for gi in changed:  # every changed group validated before anything is updated
            opt._validate_group(self.groups[gi])
            if opt._structure(self.groups[gi]) != self.structure[gi]:
                return False
        for gi in changed:
            group = self.groups[gi]
            self.hp_keys[gi] = tuple(k for k in group if k != "params")
            self.hp_vals[gi] = tuple(group[k] for k in self.hp_keys[gi])
            self.group_rows[gi] = opt._row_of(group)
        self.hp = opt._device_hp(opt._hp_tensor(self), self.device, update=self.hp, shared=not self._has_tensor_lr())
        self._bind_lrs(opt)
        return True

    def refresh_rows(self, opt: "FedOptimizer") -> None:
        """Recompute every group's hp row (the optimizer's derived values changed, e.g. the round)."""
        self._refresh_hp(opt, list(range(len(self.groups))))
