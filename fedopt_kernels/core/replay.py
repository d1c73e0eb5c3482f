"""Replayed steps on a GPU (docs/replay.md): the launches of one ``step()`` recorded in a CUDA graph
and replayed for later steps whose launch inputs are the same.

A graph replays the kernels it recorded with the arguments they had, so a replay is bitwise the
eager step when every address the kernels read or write is the one they had at recording and
every value that changes between steps lives in device memory (hp rows, step counters, decay
tables, tensor lrs, AMP scale and found-inf). The optimizer does everything else eagerly before
the launch (plan checks, hp updates, lr copies), exactly as for an eager step, then asks here for a
replay and, when there is none, hands over the launch. The *launch key* is what the graph baked in:
the plan's kernel and its own tensors' layouts (one id per plan), the gradients' address set (one id,
from the plan's ``GradWatch``, which computes it in the call that checks the gradients), the per-step
tensors, the scalars, and which optional AMP inputs exist; its cost does not grow with the number of
tensors. A step whose key has a recording replays it; a step whose key equals one of the last
``HISTORY`` eager steps' keys of the same plan (the backends' caches are warm for it) is recorded and
replayed; any other step runs eagerly. Looking back more than one step matters: the caching allocator
may hand a loop's gradients a few address sets in turn. Recordings hold no reference to parameters,
gradients or state: a key matches only while the current tensors sit at the recorded addresses.

Gradients that move every step (``zero_grad(set_to_none=True)`` with an allocator that does not
hand back the same blocks) never match a recent step's key, so nothing is recorded and such a
loop pays only the key (a few microseconds). A loop whose addresses repeat only for a while can
waste recordings (one recorded, never replayed): after ``WASTE_LIMIT`` of them in a row the
optimizer waits ``2**n`` steps before it records again.

A recording that fails (an exception in the launch, a capture the driver invalidated) turns replay
off for that optimizer with a warning and leaves nothing open behind it (``capture``).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from . import fallbacks, graph_pools
from .impl_table import HISTORY
from .plan import StepPlan

ENV = "FEDOPT_REPLAY"
BACKENDS: Tuple[str, ...] = ("cuda", "triton")  # the fused backends that run on CUDA tensors
# where steps are recorded (the tests add "cpu", with a stand-in for the graph)
DEVICE_TYPES: Tuple[str, ...] = ("cuda",)
MAX_RECORDINGS = 2  # per optimizer: two alternating gradient address sets both replay
# HISTORY (impl_table.py): eager keys remembered; a key seen again among them is recorded
WASTE_LIMIT = 2  # recordings never replayed, in a row, before backing off
MAX_BACKOFF = 1 << 12  # steps


def default_on() -> bool:
    """``FEDOPT_REPLAY`` unset or truthy: optimizers replay steps unless told ``replay=False``."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def resolve_switch(replay: Optional[bool]) -> bool:
    """The constructor's ``replay`` argument (None: the environment's default)."""
    if replay is None:
        return default_on()
    if not isinstance(replay, bool):
        raise TypeError(f"replay must be True, False or None (the {ENV} default), got {type(replay).__name__}")
    return replay


_INTERNED: OrderedDict[tuple, int] = OrderedDict()
_MAX_INTERNED = 1024
_next_id = 0


def _intern(layout: tuple) -> int:
    """A small int standing for ``layout`` (equal layouts, equal ints): a launch key holds it instead
    of the layout, so a step hashes and compares one int, not every tensor's shape and strides.
    Ids are never reused; a layout forgotten (least recently interned) and seen again gets a new one."""
    global _next_id
    ident = _INTERNED.get(layout)
    if ident is None:
        ident = _INTERNED[layout] = _next_id
        _next_id += 1
        if len(_INTERNED) > _MAX_INTERNED:
            _INTERNED.popitem(last=False)
    return ident


def _layout(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _list_layout(ts: Sequence[torch.Tensor]) -> tuple:
    return tuple([_layout(t) for t in ts])


def tensors_id(*lists: Sequence[torch.Tensor]) -> int:
    """One interned id for the layouts (address, shape, strides, dtype) of ``lists``' tensors."""
    return _intern(tuple([_list_layout(ts) for ts in lists]))


def capture(
    graph: Any,
    pool: Any,
    index: int,
    run: Callable[[], None],
    still_capturing: Callable[[], bool],
    end_pool: Callable[[int, Any], bool] = graph_pools.end_pool,
    release_pool: Callable[[int, Any], None] = graph_pools.release_pool,
) -> Optional[BaseException]:
    """Record ``run()`` into ``graph`` on the current stream, the graph's memory in ``pool`` (on device
    ``index``). None when the graph holds the launch; else what went wrong, and then no capture is
    left open and the allocator neither routes into nor keeps ``pool``.

    torch's ``CUDAGraph.capture_end`` raises on the driver's ``cudaStreamEndCapture`` error before it
    ends the allocator's routing into the graph's pool, and its ``reset`` releases the pool only after
    a capture that ended: when the driver invalidated the capture (an illegal call inside it), the
    pool stays "being captured into" for the life of the process, and at exit the destructor of any
    ``torch.cuda.MemPool`` (the triton backend keeps one) aborts the process on
    ``captures_underway.empty()``. So after a failed ``capture_end`` this ends the capture once more
    if ``still_capturing()`` (it failed before it asked the driver), then ends and releases the pool
    unless torch already did (a torch that does, ``end_pool`` says, releases it too)."""

    def end_and_release() -> None:
        if end_pool(index, pool):
            try:
                release_pool(index, pool)
            except RuntimeError:
                pass

    try:
        # thread_local: other threads (data loaders) may keep using CUDA while this records
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    except Exception as exc:  # noqa: BLE001 - any failure means "not recordable here"
        end_and_release()  # it may have failed after routing the allocator into the pool
        return exc
    failure: Optional[BaseException] = None
    try:
        run()
    except Exception as exc:  # noqa: BLE001
        failure = exc
    try:
        graph.capture_end()
    except Exception as exc:  # noqa: BLE001
        failure = failure or exc
        if still_capturing():
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001, S110 - the first failure is the one to report
                pass
        end_and_release()
    return failure


def replayable(plan: Any) -> bool:
    """Can this plan's steps be recorded (docs/replay.md, "Always eager")? Decided once per plan:
    a plain ``StepPlan`` (not a sharded one) that no step changes, on a fused backend, on a GPU."""
    ok = plan.replayable
    if ok is None:
        ok = plan.replayable = (
            not plan.one_shot
            and type(plan) is StepPlan
            and plan.backend in BACKENDS
            and plan.device.type in DEVICE_TYPES
        )
    return ok


class Prologue:
    """Work a step runs right before its op, in the same launch, so a recording holds both (FedSAM's
    restore of ``x`` before its descent). ``key``: what its launches bake in (its tensors' addresses,
    computed once), which joins the step's launch key; ``fn(*args)`` runs it, ``fn`` read when it
    runs (a caller that records launches, sim/batched/trainer_replay.py, may stand in for it)."""

    __slots__ = ("key", "fn", "args")

    def __init__(self, key: Hashable, fn: Callable[..., Any], args: tuple):
        self.key = key
        self.fn = fn
        self.args = args

    def run(self) -> None:
        self.fn(*self.args)


class _Recording:
    __slots__ = ("graph", "keep", "replays")

    def __init__(self, graph: torch.cuda.CUDAGraph, keep: Dict[str, Any]):
        self.graph = graph
        self.keep = keep  # the backend's cache entries the graph reads (pointer tables, staging buffers)
        self.replays = 0


class StepReplay:
    """One optimizer's recordings and counters (``FedOptimizer.replay_stats``)."""

    def __init__(self) -> None:
        self.recordings: OrderedDict[tuple, _Recording] = OrderedDict()
        self.recent: List[tuple] = []  # the last HISTORY eager steps' keys of plan ``plan_version``, newest last
        self.plan_version = -1
        self.stats = {"eager": 0, "recorded": 0, "replayed": 0, "wasted": 0}
        self.wasted_in_row = 0
        self.backoff = 0  # steps left before recording is tried again
        self.backoff_len = 1
        self.off_reason: Optional[str] = None
        self._amp: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}

    # ------------------------------------------------------------------ keys
    @staticmethod
    def plan_layout(plan: Any) -> int:
        """What a plan fixes for its lifetime: the kernel and its own tensors' layouts (computed and
        interned once per plan; plans rebuilt with the same layout share the id, and the recordings)."""
        sig = getattr(plan, "replay_layout", None)
        if sig is None:
            lists = tuple(_list_layout(plan.lists[name]) for name in sorted(plan.lists))
            sig = plan.replay_layout = _intern(
                (
                    plan.fn,
                    plan.backend,
                    plan.device,
                    _list_layout(plan.params),
                    lists,
                    tuple(plan.row_of),
                    tuple(plan.present),
                )
            )
        return sig

    def key(
        self,
        plan: Any,
        per_step: Sequence[List[torch.Tensor]],
        hp: torch.Tensor,
        k: torch.Tensor,
        table: torch.Tensor,
        every: int,
        amp: Tuple[bool, bool],
        active: Optional[torch.Tensor],
        prologue: Hashable = None,
    ) -> tuple:
        """``plan``'s launch key for this step. The gradients enter as ``plan.grad_set``, the id of their
        (address, strides) set that the plan's ``still_valid`` computed for this step (their shapes and
        dtypes are the parameters', checked there); ``prologue``: the key of a ``Prologue`` the launch
        runs first. A new plan starts a new history of eager keys: a key is recorded only when the
        plan's own caches (the backend's tables) are warm for it."""
        if plan.version != self.plan_version:
            self.plan_version = plan.version
            self.recent.clear()
        layout = plan.replay_layout
        return (
            layout if layout is not None else self.plan_layout(plan),
            plan.grad_set,
            tuple([_list_layout(ts) for ts in per_step]) if per_step else (),
            hp.data_ptr(),
            hp.shape,
            k.data_ptr(),
            table.data_ptr(),
            table.numel(),
            every,
            amp,
            None if active is None else active.data_ptr(),
            prologue,
        )

    # ------------------------------------------------------------------ AMP inputs
    def amp_buffers(
        self, device: torch.device, grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """GradScaler hands over new tensors each step: their values go into buffers the graph reads."""
        if grad_scale is None and found_inf is None:
            return None, None
        bufs = self._amp.get(device)
        if bufs is None:
            bufs = self._amp[device] = (
                torch.ones(1, dtype=torch.float32, device=device),
                torch.zeros(1, dtype=torch.float32, device=device),
            )
        scale, found = bufs
        if grad_scale is not None:
            scale.copy_(grad_scale.reshape(1))
        if found_inf is not None:
            found.copy_(found_inf.reshape(1))
        return (scale if grad_scale is not None else None), (found if found_inf is not None else None)

    # ------------------------------------------------------------------ the launch
    def drop(self) -> None:
        """Forget every recording (a plan that will not come back, a device change)."""
        for rec in self.recordings.values():
            self._retire(rec)
        self.recordings.clear()
        self.recent.clear()

    def forget(self) -> None:
        """Forget the recordings without counting them wasted (loaded state: new state tensors)."""
        self.recordings.clear()
        self.recent.clear()

    def _retire(self, rec: _Recording) -> None:
        if rec.replays == 0:
            self.stats["wasted"] += 1
            self.wasted_in_row += 1
            if self.wasted_in_row >= WASTE_LIMIT:
                self.backoff = self.backoff_len
                self.backoff_len = min(2 * self.backoff_len, MAX_BACKOFF)

    def replay(self, key: tuple) -> bool:
        """Replay ``key``'s recording, if there is one (True): that is the step."""
        rec = self.recordings.get(key)
        if rec is None:
            return False
        self.recordings.move_to_end(key)
        rec.graph.replay()
        rec.replays += 1
        self.stats["replayed"] += 1
        self.wasted_in_row = 0
        self.backoff_len = 1
        return True

    def launch(self, key: tuple, device: torch.device, run, cache: Optional[Dict[str, Any]]) -> None:
        """Run ``run()`` (the plan's launch) as a replay of ``key``'s recording, eagerly, or recorded."""
        if self.replay(key):
            return
        recent = self.recent
        if key not in recent or self.off_reason is not None or self.backoff > 0:
            if self.backoff > 0:
                self.backoff -= 1
            recent.append(key)
            if len(recent) > HISTORY:
                del recent[0]
            self.stats["eager"] += 1
            run()
            return
        recent.remove(key)
        graph = self._record(device, run)
        if graph is None:  # could not be recorded: this step runs eagerly
            self.stats["eager"] += 1
            run()
            return
        rec = _Recording(graph, dict(cache) if cache is not None else {})
        self.recordings[key] = rec
        while len(self.recordings) > MAX_RECORDINGS:
            self._retire(self.recordings.popitem(last=False)[1])
        self.stats["recorded"] += 1
        rec.graph.replay()  # recording runs nothing: this replay is the step (not counted as a reuse)

    def _record(self, device: torch.device, run) -> Optional[Any]:
        """The graph of ``run()``'s launches, or None (and replay off for good, with a warning)."""
        graph, failure = self._capture(device, run)
        if failure is None:
            return graph
        self.off_reason = f"{type(failure).__name__}: {failure}"
        fallbacks.record("a step recorded in a CUDA graph", failure, "eager steps")
        failure.__traceback__ = None  # its frames hold the step's tensors (gradients)
        warnings.warn(
            f"fedopt_kernels: a step could not be recorded in a CUDA graph ({self.off_reason}); "
            f"this optimizer takes eager steps from now on",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    def _capture(self, device: torch.device, run) -> Tuple[Any, Optional[BaseException]]:
        """``capture`` on this optimizer's side stream of ``device``, into a pool of our own making (its id
        is known even when the capture fails), ordered after and before the current stream's work."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        index = device.index if device.index is not None else torch.cuda.current_device()
        pool = graph_pools.new_pool()
        with torch.cuda.stream(stream):
            failure = capture(graph, pool, index, run, torch.cuda.is_current_stream_capturing)
        current.wait_stream(stream)
        return graph, failure
