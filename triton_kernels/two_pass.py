"""The two-pass driver's host side: the launch sequence of a norm op, and the step counter's advance.

``launch`` runs, over the launches of a plan (``plans.py``): pass 1 (``norm_kernel``) for each; for
sharded parameters, the cross-rank reduction of the norm slots between the passes (``reduce``,
given by the backend); for a client-batched plan, ``finalize_kernel`` once over
every client; then pass 2 (``update_kernel``) for each, whose last per-client launch advances ``k``.
What each kernel computes, and why batched plans take a finalize pass, is ``two_pass_kernels.py``'s.
Each launch goes through ``launcher.launch`` (bound after its first). ``advance`` (``advance_kernel``)
is ``k += 1`` on the device alone: the one-pass ops' step counter, and that of a norm op with no
tensors to launch over.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import triton.language as tl

from . import two_pass_kernels as kernels
from .jit_mode import interpreted
from .launcher import launch as run_launch
from .launcher import launch_bound, launch_options
from .plans import Launch, LaunchPlan

# Block of slots reduced per loop iteration in the update pass.
SLOT_BLOCK = 1024
# clients per program of advance_kernel
ADVANCE_BLOCK = 1024
# finalize_kernel under the interpreter: (clients per program, slots per lane block); compiled it runs
# one program per client over SLOT_BLOCK lanes
FINALIZE_INTERP = (128, 64)


def _dtype_args(op: str, lau: Launch) -> Dict[str, Any]:
    """The constexprs of ``lau`` for ``op``, computed once per launch (a step's Python work)."""
    out = lau.consts.get(op)
    if out is None:
        out = lau.consts[op] = _compute_dtype_args(op, lau)
    return out


def _compute_dtype_args(op: str, lau: Launch) -> Dict[str, Any]:
    _, mod = kernels.OPS[op]
    roles = mod.ROLES
    dt = [lau.dtypes.get(r, tl.float32) for r in roles] + [tl.float32] * (5 - len(roles))
    pres = [len(roles) > i and roles[i] in lau.present for i in (2, 3, 4)]
    return dict(
        NR=lau.meta.shape[1],
        HPN=mod.HPN,
        DT0=dt[0],
        DT1=dt[1],
        DT2=dt[2],
        DT3=dt[3],
        DT4=dt[4],
        P2=pres[0],
        P3=pres[1],
        P4=pres[2],
        BATCHED=lau.batched,
        ALIGNED=lau.aligned,
        ROWS=lau.rows,
        BLOCK=lau.block,
    )


def launch(
    op: str,
    plan: LaunchPlan,
    hp: torch.Tensor,
    k: torch.Tensor,
    amp: Dict[str, Any],
    active: Optional[torch.Tensor] = None,
    step_key: Optional[tuple] = None,
    reduce: Optional[Callable[[torch.Tensor], None]] = None,
) -> None:
    """Both passes of ``op`` over every launch of ``plan`` and k += 1 (on the device); for a batched
    plan, the finalize pass between them (which advances each active client's k). ``step_key``: what
    of the arguments besides the plan's may change between steps (``launcher.launch``); ``reduce``:
    rewrites this rank's float64 norm slots into every rank's, in place (sharded parameters)."""
    code, mod = kernels.OPS[op]
    act = active if active is not None else k
    flags = None
    for lau in plan.launches:
        if launch_bound(lau.bound, "norm", step_key):
            continue
        flags = flags or _flags(amp, active)
        run_launch(
            lau.bound,
            "norm",
            step_key,
            kernels.norm_kernel,
            (lau.norm_programs,),
            (
                lau.meta,
                lau.chunks,
                lau.n_chunks,
                plan.partials,
                lau.slot_base,
                hp,
                lau.row,
                amp["scale"],
                amp["found"],
                act,
            ),
            dict(OP=code, **_dtype_args(op, lau), **flags, **launch_options()),
        )
    if reduce is not None:
        assert plan.partials is not None  # a two-pass op's plan is built with its norm slots
        reduce(plan.partials[: plan.n_slots])
    if plan.clients and not launch_bound(plan.bound, "finalize", step_key):
        per, slot_block = FINALIZE_INTERP if interpreted() else (1, SLOT_BLOCK)
        run_launch(
            plan.bound,
            "finalize",
            step_key,
            kernels.finalize_kernel,
            (-(-plan.clients // per),),
            (
                plan.partials,
                plan.seg,
                len(plan.launches),
                plan.clients,
                plan.factors,
                hp,
                plan.hp_rows,
                amp["found"],
                act,
                k,
            ),
            dict(
                OP=code,
                HPN=mod.HPN,
                SKIPPABLE=amp["SKIPPABLE"],
                HAS_ACTIVE=active is not None,
                CLIENTS=per,
                SLOT_BLOCK=slot_block,
                **launch_options(),
            ),
        )
    factors = plan.factors if plan.factors is not None else plan.partials  # per-client: never read
    last = len(plan.launches) - 1
    for i, lau in enumerate(plan.launches):
        if launch_bound(lau.bound, "update", step_key):
            continue
        flags = flags or _flags(amp, active)
        run_launch(
            lau.bound,
            "update",
            step_key,
            kernels.update_kernel,
            (lau.n_tiles,),
            (
                lau.meta,
                lau.chunks,
                lau.n_chunks,
                plan.partials,
                plan.n_slots,
                factors,
                hp,
                lau.row,
                amp["scale"],
                amp["found"],
                act,
                k,
            ),
            dict(
                OP=code,
                **_dtype_args(op, lau),
                **flags,
                ADVANCE=i == last and not lau.batched,
                SLOT_BLOCK=SLOT_BLOCK,
                **launch_options(),
            ),
        )
    if not plan.launches and not plan.batched:
        advance(k, amp, None, plan.bound, step_key)


def _flags(amp: Dict[str, Any], active: Optional[torch.Tensor]) -> Dict[str, Any]:
    return dict(UNSCALE=amp["UNSCALE"], SKIPPABLE=amp["SKIPPABLE"], HAS_ACTIVE=active is not None)


def advance(
    k: torch.Tensor,
    amp: Dict[str, Any],
    active: Optional[torch.Tensor] = None,
    store: Optional[Dict[str, Any]] = None,
    step_key: Optional[tuple] = None,
) -> None:
    """k += 1 on the device for each (active) client: one client for the per-client ops. ``store``:
    where its bound launch is kept (the plan's), with ``step_key`` (``launcher.launch``)."""
    n = k.numel()
    if n == 0:
        return
    if store is not None and launch_bound(store, "advance", step_key):
        return
    # plain integer arithmetic: triton's helpers are constexpr functions, ~10 us a call on the host
    block = min(ADVANCE_BLOCK, 1 << (n - 1).bit_length())
    run_launch(
        store if store is not None else {},
        "advance",
        step_key if store is not None else None,
        kernels.advance_kernel,
        (-(-n // block),),
        (k, amp["found"], active if active is not None else k, n),
        dict(SKIPPABLE=amp["SKIPPABLE"], HAS_ACTIVE=active is not None, BLOCK=block),
    )
