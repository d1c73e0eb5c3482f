"""Replayed steps (docs/replay.md): a GPU step recorded in a CUDA graph and replayed is the eager step.

On any machine: the recording policy (record when a launch key repeats, replay while it holds, two
recordings, back off after wasted ones) with a stand-in for the CUDA graph, the launch key, and the
switch (constructor argument, ``FEDOPT_REPLAY``). On a GPU (marked ``gpu``), for every algorithm
and option set of the catalogue on ``cuda`` and ``triton``: an optimizer that replays and one that
never does (``replay=False``) take the same steps - across lr and param-group edits, round
boundaries, a state_dict load, gradients that move and come back, GradScaler with a skipped step,
a tensor lr changed on the device and on the host, client-batched steps with changing active
masks - and end with the same bits in parameters and state, the replaying one having replayed.
"""

from __future__ import annotations

import gc
from typing import Any, List

import pytest
import torch
from backends import require
from child import ending, run_child
from no_sync import no_host_sync
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

import fedopt_kernels
from fedopt_kernels.core import grad_watch as _grad_watch
from fedopt_kernels.core import replay as _replay
from fedopt_kernels.core.replay import StepReplay
from fedopt_kernels.fl import catalogue

CASES = [(a, o) for a, algo in catalogue.ALGOS.items() for o in algo.options]
_REAL_RECORD = StepReplay._record  # before any test puts a stand-in there
HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------ policy (any machine)
class _FakeGraph:
    """Stands in for a CUDA graph: replaying runs the launch it recorded."""

    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(StepReplay, "_record", lambda self, device, run: _FakeGraph(run))


def _drive(rep: StepReplay, keys: List[Any]) -> List[int]:
    """Launch step i with key keys[i]; return which step's launch ran at each step."""
    ran: List[int] = []
    for i, key in enumerate(keys):
        rep.launch(key, torch.device("cpu"), lambda i=i: ran.append(i), None)
    return ran


def test_a_repeated_key_is_recorded_then_replayed(fake_graphs):
    rep = StepReplay()
    ran = _drive(rep, ["A"] * 5)
    assert ran == [0, 1, 1, 1, 1]  # step 1 recorded (and run by its replay), then the recording replays
    assert rep.stats == {"eager": 1, "recorded": 1, "replayed": 3, "wasted": 0}


def test_a_key_that_never_repeats_is_never_recorded(fake_graphs):
    rep = StepReplay()
    ran = _drive(rep, [f"k{i}" for i in range(8)])
    assert ran == list(range(8))
    assert rep.stats["recorded"] == 0 and rep.stats["eager"] == 8


def test_a_key_that_comes_back_within_the_history_is_recorded(fake_graphs):
    """The caching allocator often gives a loop's gradients two address sets in turn (A B A B): both
    are recorded on their second visit; a key back only after more than HISTORY others is not."""
    rep = StepReplay()
    ran = _drive(rep, ["A", "B"] * 4)
    assert ran == [0, 1, 2, 3, 2, 3, 2, 3]
    assert rep.stats == {"eager": 2, "recorded": 2, "replayed": 4, "wasted": 0}
    period = _replay.HISTORY + 1
    rep = StepReplay()
    ran = _drive(rep, [f"k{i % period}" for i in range(3 * period)])
    assert ran == list(range(3 * period)) and rep.stats["recorded"] == 0


def test_two_alternating_address_sets_both_replay(fake_graphs):
    rep = StepReplay()
    ran = _drive(rep, ["A", "A", "B", "B", "A", "B", "A", "B"])
    assert ran == [0, 1, 2, 3, 1, 3, 1, 3]
    assert rep.stats["recorded"] == 2 and rep.stats["replayed"] == 4


def test_the_least_recently_used_recording_goes_first(fake_graphs):
    rep = StepReplay()
    ran = _drive(rep, ["A", "A", "B", "B", "A", "C", "C", "B", "A"])
    # C's recording evicts B (A was used after B); B then runs eagerly, A still replays
    assert ran == [0, 1, 2, 3, 1, 5, 6, 7, 1]
    assert set(rep.recordings) == {"A", "C"}


def test_wasted_recordings_back_off(fake_graphs):
    """Addresses that repeat once and move on: each recording is wasted; after WASTE_LIMIT in a row the
    optimizer waits 1, 2, 4, ... steps before recording again, so recordings grow like a log."""
    rep = StepReplay()
    keys = [f"k{i // 2}" for i in range(400)]  # each key twice in a row, then never again
    _drive(rep, keys)
    assert rep.stats["replayed"] == 0
    assert rep.stats["recorded"] < 20, rep.stats
    # and a key that then holds is recorded and replayed again once the wait is over
    ran = _drive(rep, ["Z"] * 5000)
    assert rep.stats["replayed"] > 0 and ran[-1] != 4999


def test_a_recording_that_fails_turns_replay_off_with_a_warning(monkeypatch):
    def failing(self, device, run):
        self.off_reason = "RuntimeError: not capturable"
        return None

    monkeypatch.setattr(StepReplay, "_record", failing)
    rep = StepReplay()
    ran = _drive(rep, ["A"] * 4)
    assert ran == [0, 1, 2, 3]  # every step still ran, eagerly
    assert rep.stats["recorded"] == 0 and rep.off_reason


def test_the_switch(monkeypatch):
    p = [torch.nn.Parameter(torch.zeros(3))]
    cfg = catalogue.config("feddecay", next(iter(catalogue.ALGOS["feddecay"].options)))
    assert cfg.build(p, "reference").replay_stats()["on"]
    assert not cfg.build(p, "reference", replay=False).replay_stats()["on"]
    monkeypatch.setenv(_replay.ENV, "0")
    assert not cfg.build(p, "reference").replay_stats()["on"]
    assert cfg.build(p, "reference", replay=True).replay_stats()["on"]
    with pytest.raises(TypeError, match="replay must be True, False or None"):
        cfg.build(p, "reference", replay="yes")


def test_copies_keep_the_switch_and_no_recording():
    import copy
    import pickle

    p = [torch.nn.Parameter(torch.zeros(3))]
    cfg = catalogue.config("fednar", next(iter(catalogue.ALGOS["fednar"].options)))
    for replay in (True, False):
        opt = cfg.build(p, "reference", replay=replay)
        for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
            assert twin.replay_stats()["on"] is replay
            assert twin.replay_stats()["recordings"] == 0


def test_a_layout_is_one_int_in_the_key_shared_by_equal_layouts(monkeypatch):
    """The key carries an interned id, not the tensors' layouts (hashing 62 shapes and strides every
    step cost more than the rest of the key): equal layouts share an id, other layouts and a layout
    forgotten and seen again get new ones."""
    monkeypatch.setattr(_replay, "_INTERNED", type(_replay._INTERNED)())
    monkeypatch.setattr(_replay, "_MAX_INTERNED", 2)
    a, b = _replay._intern(("x", (3,), (1,))), _replay._intern(("x", (3,), (1,)))
    assert a == b and isinstance(a, int)
    c = _replay._intern(("y",))
    assert c != a
    _replay._intern(("z",))  # the table holds 2: ("x", ...) is forgotten
    assert _replay._intern(("x", (3,), (1,))) not in (a, c)
    # a plan rebuilt with the same tensors keeps its id, so its recordings still match
    params, opt = _two_fednar_steps()
    first = _key_of(opt)
    opt._stepper.plan = None  # rebuilt at the next step
    opt.step()
    assert _key_of(opt)[0] == first[0] and isinstance(first[0], int)


def test_load_state_dict_drops_recordings_but_keeps_counts_and_off_reason():
    """Loaded state lives in new tensors, so recordings go; how earlier steps ran (and why replay
    was turned off) stays, as replay_stats promises for the optimizer's life."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    cfg = catalogue.config("feddecay", next(iter(catalogue.ALGOS["feddecay"].options)))
    opt = cfg.build(p, "reference")
    rep = opt._stepper.replay
    rep.stats["eager"] = 3
    rep.off_reason = "RuntimeError: not capturable"
    rep.recordings["k"] = object()
    rep.recent.append("k")
    opt.load_state_dict(opt.state_dict())
    assert opt._stepper.replay is rep and not rep.recordings and not rep.recent
    stats = opt.replay_stats()
    assert stats["eager"] == 3 and not stats["on"] and stats["off_reason"] == "RuntimeError: not capturable"


def _two_fednar_steps():
    """Two parameters with gradients and a FedNAR optimizer past its first steps (its plan settled)."""
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2, 3))]
    cfg = catalogue.config("fednar", next(iter(catalogue.ALGOS["fednar"].options)))
    opt = cfg.build(params, "reference")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    return params, opt


def _key_of(opt) -> tuple:
    plan = opt.step_plan
    k = opt._stepper.counter(plan.device)
    return opt._stepper.replay.key(plan, [], plan.hp, k, opt._stepper.one(plan.device), 1, (False, False), None)


def test_the_key_follows_addresses_not_values():
    """Values written in place keep the key (the graph reads them); a gradient at another address
    or a new hp tensor changes it."""
    params, opt = _two_fednar_steps()
    key = _key_of(opt)
    for p in params:
        p.grad.mul_(2.0)
    opt.step()
    assert _key_of(opt) == key
    params[1].grad = params[1].grad.clone()  # same values, another address
    opt.step()
    assert _key_of(opt) != key
    key = _key_of(opt)
    group = opt.param_groups[0]
    group["max_norm"] = group["max_norm"] * 2  # new hp values: written into the same hp tensor
    opt.step()
    assert _key_of(opt) == key


@pytest.mark.parametrize("replay", [False, True], ids=["eager", "replaying"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_client", "batched"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_the_optimizers_own_step_work_allocates_no_tensor(algo, batched, replay, cpu_replay):
    """On a GPU a tensor allocated in every step moves where the caching allocator puts the next
    gradients, and steps stop replaying. The step's Python side is the same on every backend; on the
    cpu backend (whose kernels allocate nothing) the profiler sees every allocation it makes, the
    replay machinery's included (its key, records and replays, with a stand-in graph). The gradients
    alternate between two address sets, as a loop with zero_grad(set_to_none=True) gives; the
    client-batched form takes an active mask that changes in place."""
    from torch.profiler import ProfilerActivity, profile

    require("cpu", "cpu")
    cpu_replay(lambda run: _NullGraph())
    cfg = catalogue.config(algo, catalogue.ALGOS[algo].full)
    g = torch.Generator().manual_seed(0)
    C = 3
    params = [torch.nn.Parameter(torch.randn(((C,) if batched else ()) + s, generator=g)) for s in SHAPES]
    opt = (cfg.build_batched if batched else cfg.build)(params, "cpu", replay=replay)
    order = [p for gr in opt.param_groups for p in gr["params"]]
    if batched:
        views = [[p[c] for p in order] for c in range(C)]
        opt.start_round(round_index=[0] * C, **cfg.batched_round_inputs(views, order, 0))
        step_inputs, active = _StepInputs(cfg.batched_step_inputs), torch.ones(C, dtype=torch.bool)
    else:
        opt.start_round(**cfg.round_inputs(order, 0))
        step_inputs = _StepInputs(cfg.step_inputs)
    sets = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    allocated = []
    for k in range(7):
        for p, s in zip(params, sets[k % 2]):
            s.copy_(torch.randn(s.shape, generator=g))
            p.grad = s
        inputs = step_inputs(views if batched else order, k)
        if "closure" in inputs:  # FedSAM: the optimizer's work, not the closure's (which makes gradients)
            inputs = dict(inputs, closure=lambda: None)
        if batched:
            active.fill_(True)
            active[1] = k % 2 == 0
            inputs = dict(inputs, active=active)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt.step(**inputs)
        allocated.append(sum(1 for e in prof.events() if e.name.startswith("aten::empty") and e.cpu_memory_usage > 0))
    assert allocated[3:] == [0, 0, 0, 0], f"tensors allocated per step: {allocated}"
    assert not replay or opt.replay_stats()["replayed"] > 0


# ------------------------------------------------------------------ the replay path on CPU tensors
class _NullGraph:
    """Stands in for a CUDA graph where only references matter: it holds nothing, replays nothing."""

    def replay(self):
        pass


@pytest.fixture
def cpu_replay(monkeypatch):
    """Steps on CPU tensors take the replay path (key, record, replay) on the cpu and reference
    backends, with a stand-in for the graph; ``cpu_replay(graph_of_run)`` picks the stand-in."""
    monkeypatch.setattr(_replay, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(_replay, "BACKENDS", ("cuda", "triton", "cpu", "reference"))

    def use(make=lambda run: _FakeGraph(run)):
        monkeypatch.setattr(StepReplay, "_record", lambda self, device, run: make(run))

    use()
    return use


def _optimizer(algo: str, backend: str, shapes, replay: bool = True, seed: int = 0):
    """``algo``'s full option set over parameters of ``shapes`` in its first round, and a function
    that hands out step ``k``'s inputs."""
    cfg = catalogue.config(algo, catalogue.ALGOS[algo].full)
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = cfg.build(params, backend, replay=replay)
    order = [p for gr in opt.param_groups for p in gr["params"]]
    opt.start_round(**cfg.round_inputs(order, 0))
    step_inputs = _StepInputs(cfg.step_inputs)
    return params, opt, lambda k: step_inputs(order, k)


def _fill_grads(params, slots, g: torch.Generator) -> None:
    """Random values into ``slots``, which become the parameters' gradients."""
    for p, s in zip(params, slots):
        s.copy_(torch.randn(s.shape, generator=g))
        p.grad = s


@pytest.mark.parametrize("replay", [False, True], ids=["eager", "replaying"])
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_no_gradient_outlives_its_step(algo, backend, replay, cpu_replay):
    """After step() the optimizer holds no gradient: zero_grad(set_to_none=True) frees every one. A
    reference kept until the next step (as the plan once did) keeps its block from the caching
    allocator, so the next backward puts its gradients elsewhere: a loop's address sets then
    alternate or drift (FedNAR on ResNet-18, H100: 20 in 20 iterations) and no step replays."""
    require(backend, "cpu")
    cpu_replay(lambda run: _NullGraph())
    params, opt, inputs = _optimizer(algo, backend, SHAPES, replay=replay)
    g = torch.Generator().manual_seed(1)
    gc.disable()  # no cycle collection: what is freed is freed by reference counting
    try:
        for k in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step(**inputs(k))
            refs = [StorageWeakRef(p.grad.untyped_storage()) for p in params]
            opt.zero_grad(set_to_none=True)
            kept = [i for i, r in enumerate(refs) if not r.expired()]
            assert not kept, f"step {k}: the gradients of parameters {kept} outlived zero_grad"
    finally:
        gc.enable()
    assert not replay or opt.replay_stats()["on"]


class _TensorAccesses(TorchFunctionMode):
    """Counts the tensor methods and properties called from Python (p.grad, data_ptr(), ...)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _replayed_step_calls(n: int, algo: str) -> tuple:
    """(Python function calls, tensor accesses from Python) of one replayed step over ``n`` tensors."""
    import sys

    params, opt, inputs = _optimizer(algo, "cpu", [(1,)] * n)
    for p in params:
        p.grad = torch.randn_like(p)
    for _k in range(4):
        opt.step(**inputs(0))
    assert (
        type(opt.step_plan.watch).__name__ == "GradWatch" and type(opt.step_plan.watch) is not _grad_watch.PyGradWatch
    )
    calls = [0]

    def count(frame, event, arg):
        calls[0] += event == "call"

    before = opt.replay_stats()["replayed"]
    sys.setprofile(count)
    try:
        opt.step(**inputs(0))
    finally:
        sys.setprofile(None)
    with _TensorAccesses() as accesses:
        opt.step(**inputs(0))
    assert opt.replay_stats()["replayed"] == before + 2
    return calls[0], accesses.n


@pytest.mark.parametrize("algo", ["feddecay", "fednar"])
def test_a_replayed_step_costs_the_same_for_6_and_62_tensors(algo, cpu_replay):
    """The launch key is checked without a Python-level walk over the tensors: one call to the
    compiled GradWatch checks every gradient and storage and names the gradients' address set. (With
    the previous Python walk: 26 and 194 tensor accesses; 50 Python calls either way.)"""
    if _grad_watch._native_module() is None:
        pytest.skip("no compiled extension with GradWatch here (the Python fallback walks the tensors)")
    cpu_replay(lambda run: _NullGraph())
    six, sixty_two = _replayed_step_calls(6, algo), _replayed_step_calls(62, algo)
    assert six == sixty_two, f"(Python calls, tensor accesses) for 6 tensors {six}, for 62 {sixty_two}"


@pytest.fixture(params=["native", "python"])
def watch_impl(request, monkeypatch):
    """The compiled GradWatch (skipped where none is built) and the Python fallback."""
    if request.param == "native":
        if _grad_watch._native_module() is None:
            pytest.skip("no compiled extension with GradWatch here")
    else:
        monkeypatch.setattr(_grad_watch, "_native", None)
    return request.param


def test_the_gradient_watch(watch_impl):
    """One call: the id of the gradients' (address, strides) set while every gradient fits its
    parameter; -1 when the plan must look (a gradient appeared or went, a parameter's storage
    changed, a gradient the quick check does not take); no gradient kept alive."""
    ps = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2))]
    for p in ps[:2]:
        p.grad = torch.randn_like(p)
    watch = _grad_watch.make(ps, [1, 0])
    assert (type(watch) is _grad_watch.PyGradWatch) == (watch_impl == "python")
    first = watch.accept()
    assert first >= 0 and watch.check() == first and watch.check() == first
    set_a = [p.grad for p in ps[:2]]
    ps[0].grad = torch.randn(4, 4)  # a new tensor at a new address (the old one is alive)
    second = watch.check()
    assert second >= 0 and second != first and watch.check() == second
    ps[0].grad = set_a[0]  # back to the first address set: its id again
    del set_a
    assert watch.check() == first
    ps[0].grad = torch.randn(4, 4).t()  # same shape, other strides
    assert watch.check() not in (first, second, -1)
    with torch.no_grad():
        ps[0].grad.t_()  # strides changed in place, same tensor: a new id (its pointer table differs)
    ids = watch.check()
    assert ids >= 0
    ref = StorageWeakRef(ps[1].grad.untyped_storage())
    ps[1].grad = None
    assert ref.expired(), "the watch kept a gradient alive"
    assert watch.check() == -1  # a gradient went
    ps[1].grad = torch.randn(5)
    assert watch.check() >= 0
    ps[2].grad = torch.randn(2)  # a parameter without a gradient at the start has one
    assert watch.check() == -1
    ps[2].grad = None
    assert watch.check() >= 0
    ps[1].grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (5,), check_invariants=True)
    assert watch.check() == -1  # not a gradient the kernels take as they took the last one
    ps[1].grad = torch.randn(5)
    assert watch.check() >= 0
    with torch.no_grad():
        ps[1].data = torch.randn(5)  # new storage: a new plan
    assert watch.check() == -1
    assert watch.accept() >= 0 and watch.check() >= 0


@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_replayed_steps_with_moving_gradients_are_the_eager_bits(algo, cpu_replay, watch_impl):
    """The replay key follows the gradients' addresses: gradient tensors that alternate between two
    address sets, a new set now and then, and one gradient replaced by itself transposed in memory;
    the stand-in graph re-runs the recorded launch with the tensors it recorded, so a key that
    matched the wrong addresses would read another step's gradients."""
    runs = []
    for replay in (False, True):
        params, opt, inputs = _optimizer(algo, "cpu", SHAPES, replay=replay)
        g = torch.Generator().manual_seed(5)
        sets = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        alive = []
        for k in range(16):
            if k in (6, 11):
                slots = [torch.zeros_like(p) for p in params]
                alive.append(slots)
            else:
                slots = sets[k % 2]
            if k == 9:
                slots = list(slots)
                slots[0] = torch.zeros(SHAPES[0][::-1]).t()  # other strides
                alive.append(slots)
            _fill_grads(params, slots, g)
            step_inputs = inputs(k)
            if "closure" in step_inputs:  # FedSAM: its second gradient into the same tensors (their addresses)
                step_inputs = dict(step_inputs, closure=lambda params=params: [q.grad.add_(q.detach()) for q in params])
            opt.step(**step_inputs)
        runs.append((params, opt))
    (a, ea), (b, eb) = runs
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.detach(), y.detach()), f"{algo}: parameter {i}"
        for key, value in ea.state[x].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, eb.state[y][key]), (i, key)
    assert eb.replay_stats()["replayed"] > 4, eb.replay_stats()


def _fedsam_run(batched: bool, replay: bool, steps: int = 8):
    """FedSAM's full option set (per-client, or 3 clients with a mask changed in place) stepped with
    gradients at fixed addresses and the catalogue's closure, which writes the second gradients where
    the first are (as a backward does with the caching allocator); returns (params, optimizer,
    replay stats after each step)."""
    cfg = catalogue.config("fedsam", catalogue.ALGOS["fedsam"].full)
    C = 3
    g = torch.Generator().manual_seed(3)
    shapes = [s for s in SHAPES if s != ()] if batched else SHAPES
    params = [torch.nn.Parameter(torch.randn(((C,) if batched else ()) + s, generator=g)) for s in shapes]
    opt = (cfg.build_batched if batched else cfg.build)(params, "cpu", replay=replay)
    order = [p for gr in opt.param_groups for p in gr["params"]]
    active = torch.ones(C, dtype=torch.bool)
    if batched:
        views = [[p[c] for p in order] for c in range(C)]
        opt.start_round(round_index=[0] * C, **cfg.batched_round_inputs(views, order, 0))
    else:
        opt.start_round(**cfg.round_inputs(order, 0))
    slots = [torch.zeros_like(p) for p in params]
    stats = []
    for k in range(steps):
        _fill_grads(params, slots, g)
        if batched:
            active[2] = k % 3 != 1
            opt.step(active=active, **cfg.batched_step_inputs(views, k, stacked=order))
        else:
            opt.step(**cfg.step_inputs(order, k))
        stats.append(dict(opt.replay_stats()))
    return params, opt, stats


def _fedsam_replays_to_the_eager_bits(batched: bool) -> None:
    runs = [_fedsam_run(batched, replay) for replay in (False, True)]
    (a, ea, _), (b, eb, stats) = runs
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.detach(), y.detach()), f"parameter {i}"
        for key, value in ea.state[x].items():
            assert torch.equal(value, eb.state[y][key]), (i, key)
    # past the warm-up (a fresh-momentum step, a new plan, the recordings) every launch replays:
    # the ascent's and the descent's (with the restore recorded in it), two per step
    for before, after in zip(stats[3:], stats[4:]):
        assert after["replayed"] - before["replayed"] == 2 and after["eager"] == before["eager"], (before, after)


@pytest.mark.parametrize("batched", [False, True], ids=["per_client", "batched"])
def test_fedsam_replays_both_of_its_launches_to_the_eager_bits(batched, cpu_replay):
    """On the H200 FedSAM recorded once and replayed none of its steps: its ascent had no replay of
    its own, and its descent's gradients (the test's closure made new ones) moved every step. Now
    the ascent has its launch key and recordings, the restore runs inside the descent's launch, and
    a step at fixed addresses replays both; the stand-in graph re-runs the recorded launch, so a
    recording without the restore, or a key that matched the wrong tensors, would show in the bits."""
    _fedsam_replays_to_the_eager_bits(batched)


def test_the_fedsam_replay_check_can_fail(cpu_replay, monkeypatch):
    """Not vacuous: a descent replayed without its restore (x left at x + e) fails the check above."""
    replaying = [False]

    class WithoutRestore(_FakeGraph):
        def replay(self):
            replaying[0] = True
            try:
                self.run()
            finally:
                replaying[0] = False

    run = _replay.Prologue.run
    monkeypatch.setattr(_replay.Prologue, "run", lambda self: None if replaying[0] else run(self))
    cpu_replay(WithoutRestore)
    with pytest.raises(AssertionError, match="parameter"):
        _fedsam_replays_to_the_eager_bits(False)


def test_the_ascent_key_repeats_and_the_restore_is_in_the_descent_key(cpu_replay):
    """The launch keys FedSAM's replays hang on: the ascent's is the same at every step at fixed
    addresses (its counter, hp rows and plan are kept); the descent's carries the restore's tensors
    (the moved parameters and their saved x), so another restore never replays this recording."""
    params, opt, _ = _fedsam_run(False, True, steps=4)
    ascent, restore, descent = opt.step_plans
    assert restore is opt._restore.prologue(None) and restore.key == opt._restore.key
    runner = opt._stepper.runners["ascent"]
    rep = runner.replay

    def key_of():
        k = runner.k[ascent.device]
        return rep.key(ascent, (), ascent.hp, k, opt._stepper.one(ascent.device), 1, (False, False), None)

    first = key_of()
    assert first in rep.recordings
    other = _replay.Prologue(_replay.tensors_id([params[0]], [torch.zeros_like(params[0])]), restore.fn, ())
    k, one = opt._stepper.counter(descent.device), opt._stepper.one(descent.device)
    keys = [
        opt._stepper.replay.key(descent, [], descent.hp, k, one, 1, (False, False), None, pro.key)
        for pro in (restore, other)
    ]
    assert keys[0] != keys[1] and keys[0] in opt._stepper.replay.recordings
    opt.step(lambda: None)
    assert key_of() == first


def test_a_new_plan_records_a_key_only_after_its_own_eager_step(cpu_replay):
    """A rebuilt plan (a round start) has new backend caches: a key seen eagerly under the old plan is
    not recorded at once (a triton recording would have to build its pointer tables inside the
    capture, which fails), but once the new plan ran it eagerly."""
    params, opt, inputs = _optimizer("fednar", "cpu", SHAPES)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.start_round()
    opt.step()
    assert opt.replay_stats()["recorded"] == 0 and opt.replay_stats()["eager"] == 2
    opt.step()
    assert opt.replay_stats()["recorded"] == 1


# ------------------------------------------------------------------ a recording that fails
class _Graph:
    """Stands in for torch.cuda.CUDAGraph: ``fail`` says which call raises."""

    def __init__(self, fail: str = "", capturing_after_end_failure: bool = False):
        self.fail = fail
        self.calls: List[str] = []
        self.capturing = False
        self.stay = capturing_after_end_failure

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.calls.append(f"begin {pool} {capture_error_mode}")
        if self.fail == "begin":
            raise RuntimeError("CUDA error: begin failed")
        self.capturing = True

    def capture_end(self):
        self.calls.append("end")
        if self.fail == "end" and not (self.stay and self.calls.count("end") > 1):
            self.capturing = self.stay
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.capturing = False


def _pool_calls(ended_by_torch: bool = False):
    log: List[tuple] = []

    def end_pool(index, pool):
        log.append(("end", index, pool))
        return not ended_by_torch

    def release_pool(index, pool):
        log.append(("release", index, pool))

    return log, end_pool, release_pool


@pytest.mark.parametrize("fail", ["", "run", "begin", "end", "end-stays-capturing", "end-torch-cleans"])
def test_a_failed_capture_leaves_no_capture_open_and_no_pool_behind(fail):
    """torch's capture_end raises on the driver's error (a capture it invalidated) before it ends the
    caching allocator's routing into the graph's pool, and never releases that pool: left so, every
    later MemPool's destructor aborts the process at exit (H100: five pytest workers). ``capture``
    ends the capture (again, if the stream still captures) and ends and releases the pool, unless
    torch did (newer torch ends it itself, and then releases it too)."""
    graph = _Graph(
        fail="end" if fail.startswith("end") else fail, capturing_after_end_failure=fail == "end-stays-capturing"
    )
    log, end_pool, release_pool = _pool_calls(ended_by_torch=fail == "end-torch-cleans")
    ran = []

    def run():
        ran.append(1)
        if fail == "run":
            raise RuntimeError("refused inside the capture")

    failure = _replay.capture(graph, (0, 7), 0, run, lambda: graph.capturing, end_pool, release_pool)
    assert not graph.capturing
    if fail == "":
        assert failure is None and log == [] and graph.calls == ["begin (0, 7) thread_local", "end"]
    elif fail == "run":  # the capture ended normally: torch's reset releases the pool with the graph
        assert "refused" in str(failure) and log == [] and graph.calls[-1] == "end"
    elif fail == "begin":
        assert "begin failed" in str(failure) and not ran
        assert log == [("end", 0, (0, 7)), ("release", 0, (0, 7))]  # torch may have routed before failing
    elif fail == "end-torch-cleans":
        assert "previous error" in str(failure) and log == [("end", 0, (0, 7))]
    else:
        assert "previous error" in str(failure)
        assert log == [("end", 0, (0, 7)), ("release", 0, (0, 7))]
        assert graph.calls.count("end") == (2 if fail == "end-stays-capturing" else 1)


def test_a_recording_that_fails_in_capture_end_leaves_the_eager_bits(cpu_replay, monkeypatch):
    """The optimizer's side: a recording whose capture the driver invalidated turns replay off with a
    warning, ends and releases the graph's pool once, and every step (that one included) is the
    eager step."""
    log, end_pool, release_pool = _pool_calls()

    def failing_capture(self, device, run):
        graph = _Graph(fail="end")
        # a capture records the launch without running it: the stand-in runs nothing either
        return graph, _replay.capture(graph, (0, 3), 0, lambda: None, lambda: graph.capturing, end_pool, release_pool)

    monkeypatch.setattr(StepReplay, "_record", _REAL_RECORD)
    monkeypatch.setattr(StepReplay, "_capture", failing_capture)
    runs = []
    for replay in (False, True):
        params, opt, inputs = _optimizer("feddecay", "cpu", SHAPES, replay=replay)
        g = torch.Generator().manual_seed(2)
        slots = [torch.zeros_like(p) for p in params]
        with pytest.warns(RuntimeWarning, match="could not be recorded") if replay else _nothing():
            for k in range(6):
                _fill_grads(params, slots, g)
                opt.step(**inputs(k))
        runs.append((params, opt))
    (a, _), (b, opt) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    stats = opt.replay_stats()
    assert not stats["on"] and "previous error" in stats["off_reason"] and stats["replayed"] == 0
    assert log == [("end", 0, (0, 3)), ("release", 0, (0, 3))]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_child_process_harness_tells_an_abort_from_an_exit():
    """What the GPU check below relies on: a child that aborts (as at exit after a failed recording)
    is told from one that exits normally."""
    import signal

    ok = run_child("import fedopt_kernels; print('ok')", timeout=120)
    assert ok.returncode == 0 and "ok" in ok.stdout, ending(ok)
    aborted = run_child("import os; os.abort()", timeout=60)
    assert aborted.returncode == -signal.SIGABRT and "SIGABRT" in ending(aborted)


_FAILING_RECORDING = """
import warnings, torch, fedopt_kernels as fk
ps = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (1000, 7, 4097)]
opt = fk.FedDecaySGD(ps, lr=0.1, beta=1.0, backend={backend!r})
for p in ps:
    p.grad = torch.randn_like(p)
opt.step()  # eager: the plan and its caches are built
real = opt.step_plan.fn
def failing(*args, **kwargs):
    real(*args, **kwargs)
    if torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()  # illegal inside a capture: the driver invalidates it
opt.step_plan.fn = failing
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(5):
        opt.step()
stats = opt.replay_stats()
assert not stats["on"] and stats["replayed"] == 0, stats
assert any("could not be recorded" in str(w.message) for w in caught), [str(w.message) for w in caught]
pool = torch.cuda.MemPool()  # a pool whose destructor runs at exit, as the triton backend's does
with torch.cuda.use_mem_pool(pool):
    x = torch.empty(4096, device="cuda")
del x
torch.cuda.synchronize()
print("done:", stats["off_reason"])
"""


# ------------------------------------------------------------------ on a GPU
gpu = pytest.mark.gpu
SHAPES = [(1000, 37), (7,), (64, 3, 3, 3), (0,), (513, 3), ()]


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_failed_recording_never_aborts_the_process(backend):
    """A recording the driver invalidates (an illegal call inside the capture) turns replay off and
    the process still ends with exit status 0: no capture left open, no memory pool left "being
    captured into" (on an H100 such a pool made five pytest workers abort at exit, in the
    destructor of a MemPool)."""
    require(backend, "cuda")
    proc = run_child(_FAILING_RECORDING.format(backend=backend), timeout=240)
    assert proc.returncode == 0 and "done:" in proc.stdout, ending(proc)


def _params(seed: int = 0, device: str = "cuda") -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _grads(params, step: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in params]


class _StepInputs:
    """The catalogue's per-step inputs (PAdaMFed-VR's anchor gradients) copied into tensors kept
    across steps, as a client would keep them: their addresses are part of the launch key."""

    def __init__(self, make):
        self.make = make
        self.kept = None

    def __call__(self, *args):
        fresh = self.make(*args)
        if self.kept is None:
            self.kept = fresh
        else:
            for key, ts in fresh.items():
                if callable(ts):  # a closure (FedSAM's second gradient): the fresh one
                    self.kept[key] = ts
                    continue
                for a, b in zip(self.kept[key], ts):
                    a.copy_(b)
        return self.kept


def _same_bits(a_params, a_opt, b_params, b_opt, what: str) -> None:
    if a_params[0].is_cuda:
        torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert torch.equal(a.detach(), b.detach()), f"{what}: parameter {i}"
        for key, value in a_opt.state[a].items():
            other = b_opt.state[b][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"{what}: state {key} of parameter {i}"
    assert a_opt.round_step == b_opt.round_step


def _run_script(cfg, backend: str, replay: bool):
    """Rounds of steps with everything §12 says may change between steps, the same for both twins."""
    params = _params()
    opt = cfg.build(params, backend, replay=replay)
    order = [p for g in opt.param_groups for p in g["params"]]
    fixed = [torch.zeros_like(p) for p in params]  # gradients at fixed addresses
    other = [torch.zeros_like(p) for p in params]  # a second address set, alternating with the first
    step_inputs = _StepInputs(cfg.step_inputs)
    step = 0
    for rnd in range(3):
        opt.start_round(**cfg.round_inputs(order, rnd))
        for k in range(7):
            grads = _grads(params, step)
            if rnd == 2 and k % 2:  # round 2: the two address sets alternate
                slots = other
            elif rnd == 1 and k >= 4:  # round 1 ends with new tensors every step (set_to_none=True)
                slots = [torch.empty_like(p) for p in params]
            else:
                slots = fixed
            for p, s, g in zip(params, slots, grads):
                s.copy_(g)
                p.grad = s
            if k == 3:  # a scheduler's float lr, and an edit of another hyperparameter
                opt.param_groups[0]["lr"] *= 0.5
            if k == 5 and rnd == 0 and "weight_decay" in opt.param_groups[-1]:
                opt.param_groups[-1]["weight_decay"] = opt.param_groups[-1]["weight_decay"] + 1e-3
            opt.step(**step_inputs(order, step))
            step += 1
            if rnd == 1 and k == 2:  # a checkpoint reloaded mid-round
                opt.load_state_dict(opt.state_dict())
    return params, opt


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo,option", CASES)
def test_replayed_steps_are_the_eager_bits(backend, algo, option):
    require(backend, "cuda")
    cfg = catalogue.config(algo, option)
    eager_params, eager = _run_script(cfg, backend, replay=False)
    params, opt = _run_script(cfg, backend, replay=True)
    _same_bits(eager_params, eager, params, opt, f"{algo}/{option} on {backend}")
    stats = opt.replay_stats()
    assert stats["replayed"] > 0 and stats["recorded"] > 0, stats
    assert eager.replay_stats()["replayed"] == 0


def _grad_scaler_runs(algo: str, backend: str, device: str) -> None:
    """Ten steps under GradScaler, two of them with an inf gradient (skipped, the scale halves), by an
    optimizer that replays and one that never does: the same bits, and replays. FedSAM as its users
    call it under AMP (torch refuses a closure under GradScaler): ``scaler.unscale_(opt)`` by hand,
    the step skipped when GradScaler's own check finds an inf (as ``scaler.step`` skips it), else
    ``first_step()``, the second forward and backward (the catalogue's closure), ``second_step()``."""
    cfg = catalogue.config(algo, catalogue.ALGOS[algo].full)
    runs = []
    for replay in (False, True):
        params = _params(device=device)
        opt = cfg.build(params, backend, replay=replay)
        order = [p for g in opt.param_groups for p in g["params"]]
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
        opt.start_round(**cfg.round_inputs(order, 0))
        slots = [torch.zeros_like(p) for p in params]
        step_inputs = _StepInputs(cfg.step_inputs)
        for k in range(10):
            grads = _grads(params, k)
            if k in (4, 7):
                grads[0].view(-1)[3] = float("inf")  # found_inf = 1: skipped, the scale halves
            for p, s, g in zip(params, slots, grads):
                s.copy_(scaler.scale(g))
                p.grad = s
            inputs = dict(step_inputs(order, k))
            closure = inputs.pop("closure", None)
            if closure is None:
                scaler.step(opt, **inputs)
            else:
                scaler.unscale_(opt)
                if not sum(v.item() for v in scaler._found_inf_per_device(opt).values()):
                    sam: Any = opt  # FedSAM: its two steps
                    sam.first_step(**inputs)
                    closure()
                    sam.second_step()
            scaler.update()
        runs.append((params, opt, scaler.get_scale()))
    (a, ea, sa), (b, eb, sb) = runs
    assert sa == sb
    _same_bits(a, ea, b, eb, f"{algo} under GradScaler on {backend}")
    assert eb.replay_stats()["replayed"] > 0


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_grad_scaler_with_a_skipped_step_replays_to_the_eager_bits(backend, algo):
    require(backend, "cuda")
    _grad_scaler_runs(algo, backend, "cuda")


@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_grad_scaler_runs_of_the_gpu_test_on_the_cpu(algo, cpu_replay):
    """The GPU test above, on the cpu backend with a stand-in graph that re-runs the launch: its
    logic (FedSAM's AMP steps included) is checked on every machine."""
    require("cpu", "cpu")
    _grad_scaler_runs(algo, "cpu", "cpu")


@gpu
@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_tensor_lr_changed_in_place_reaches_replayed_steps(backend, where):
    require(backend, "cuda")
    cfg = catalogue.config("feddecay", catalogue.ALGOS["feddecay"].full)
    runs = []
    for replay in (False, True):
        params = _params()
        kwargs = dict(cfg.kwargs, lr=torch.tensor(0.05, dtype=torch.float64, device=where))
        opt = cfg.cls(cfg.param_groups(params), backend=backend, replay=replay, **kwargs)
        order = [p for g in opt.param_groups for p in g["params"]]
        opt.start_round(**cfg.round_inputs(order, 0))
        slots = [torch.zeros_like(p) for p in params]
        for k in range(8):
            for p, s, g in zip(params, slots, _grads(params, k)):
                s.copy_(g)
                p.grad = s
            opt.step()
            for g in opt.param_groups:
                if isinstance(g["lr"], torch.Tensor):
                    g["lr"].mul_(0.9)  # as torch's schedulers do with a tensor lr
        runs.append((params, opt))
    _same_bits(*runs[0], *runs[1], f"tensor lr on {where}, {backend}")
    assert runs[1][1].replay_stats()["replayed"] > 0


def _client_batched_runs(algo: str, backend: str, device: str) -> None:
    """Two rounds of client-batched steps, client 1 sitting out the last steps of each, by an optimizer
    that replays and one that never does: the same bits, and replays. Every step gets the catalogue's
    step inputs: FedSAM's its closure (``BatchedFedSAM.step`` takes no step without one)."""
    cfg = catalogue.config(algo, catalogue.ALGOS[algo].full)
    C = 3
    runs = []
    for replay in (False, True):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn((C,) + s, generator=g).to(device)) for s in SHAPES if s != (0,)]
        opt = cfg.build_batched(params, backend, replay=replay)
        order = [p for gr in opt.param_groups for p in gr["params"]]
        views = [[p[c] for p in order] for c in range(C)]
        slots = [torch.zeros_like(p) for p in params]
        active = torch.ones(C, dtype=torch.bool, device=device)
        step_inputs = _StepInputs(cfg.batched_step_inputs)
        for rnd in range(2):
            opt.start_round(round_index=[rnd] * C, **cfg.batched_round_inputs(views, order, rnd))
            for k in range(6):
                for s, p in zip(slots, params):
                    s.copy_(torch.randn(p.shape, generator=g).to(device))
                    p.grad = s
                active.fill_(True)
                if k >= 4:
                    active[1] = False  # client 1 sits out the round's last steps
                opt.step(active=active, **step_inputs(views, rnd * 6 + k))
        runs.append((params, opt))
    if device == "cuda":
        torch.cuda.synchronize()
    (a, ea), (b, eb) = runs
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.detach(), y.detach()), f"{algo} batched on {backend}: parameter {i}"
        for key, value in ea.state[x].items():
            assert torch.equal(value, eb.state[y][key]), (i, key)
    assert eb.replay_stats()["replayed"] > 0


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_client_batched_steps_replay_to_the_eager_bits(backend, algo):
    require(backend, "cuda")
    _client_batched_runs(algo, backend, "cuda")


@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_client_batched_runs_of_the_gpu_test_on_the_cpu(algo, cpu_replay):
    """The GPU test above on the cpu backend, with a stand-in graph that re-runs the launch."""
    require("cpu", "cpu")
    _client_batched_runs(algo, "cpu", "cpu")


def _steps_at_fixed_addresses(algo: str, backend: str, replay: bool):
    """An optimizer of ``algo``'s full option set in its first round, and ``next_step(k)``, which
    writes step ``k``'s gradients into tensors kept at fixed addresses and returns its step inputs."""
    cfg = catalogue.config(algo, catalogue.ALGOS[algo].full)
    params = _params()
    opt = cfg.build(params, backend, replay=replay)
    order = [p for g in opt.param_groups for p in g["params"]]
    opt.start_round(**cfg.round_inputs(order, 0))
    slots = [torch.zeros_like(p) for p in params]
    step_inputs = _StepInputs(cfg.step_inputs)

    def next_step(k: int):
        for p, s, g in zip(params, slots, _grads(params, k)):
            s.copy_(g)
            p.grad = s
        return step_inputs(order, k)

    return params, opt, next_step


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_replayed_and_recording_steps_never_sync(backend, algo):
    require(backend, "cuda")
    params, opt, next_step = _steps_at_fixed_addresses(algo, backend, replay=True)
    for k in range(6):
        inputs = next_step(k)
        if k < 2:
            opt.step(**inputs)
            continue
        with no_host_sync():  # the recording step (k == 2 or 3) and the replays
            opt.step(**inputs)
    assert opt.replay_stats()["replayed"] > 0


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_users_own_capture_records_the_kernels_not_a_replay(backend):
    """While the caller captures, the optimizer launches its kernels into the caller's graph."""
    require(backend, "cuda")
    cfg = catalogue.config("fednar", catalogue.ALGOS["fednar"].full)
    out = []
    for captured in (False, True):
        params = _params()
        opt = cfg.build(params, backend, replay=True)
        order = [p for g in opt.param_groups for p in g["params"]]
        opt.start_round(**cfg.round_inputs(order, 0))
        slots = [torch.zeros_like(p) for p in params]
        for p, s in zip(params, slots):
            p.grad = s
        for k in range(8):
            for s, g in zip(slots, _grads(params, k)):
                s.copy_(g)
            if captured and k == 4:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    opt.step()
                graph.replay()
            elif captured and k > 4:
                graph.replay()
            else:
                opt.step()
        out.append(params)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(*out)):
        assert torch.equal(a.detach(), b.detach()), i


@gpu
def test_a_step_that_cannot_be_recorded_runs_eagerly_with_a_warning(monkeypatch):
    require("cuda", "cuda")
    cfg = catalogue.config("feddecay", catalogue.ALGOS["feddecay"].full)
    eager_params, eager = _run_script(cfg, "cuda", replay=False)

    def broken_capture_begin(self, *a, **k):
        raise RuntimeError("capture refused for this test")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", broken_capture_begin)
    with pytest.warns(RuntimeWarning, match="could not be recorded"):
        params, opt = _run_script(cfg, "cuda", replay=True)
    _same_bits(eager_params, eager, params, opt, "after a failed recording")
    stats = opt.replay_stats()
    assert not stats["on"] and "capture refused" in stats["off_reason"]


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_an_eager_step_allocates_no_device_memory(backend, algo):
    """Past its first steps an eager step allocates nothing on the GPU: an allocation moves where the
    caching allocator puts the next gradients, so a loop with zero_grad(set_to_none=True) would
    never see an address set again and no step could replay. (On an H200 the cuda backend's FedNAR,
    which allocated its norm scratch every step, replayed 28 of 160 ResNet-18 steps.)"""
    require(backend, "cuda")
    params, opt, next_step = _steps_at_fixed_addresses(algo, backend, replay=False)
    allocated = []
    for k in range(6):
        inputs = next_step(k)
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        opt.step(**inputs)
        allocated.append(torch.cuda.memory_stats()["allocation.all.allocated"] - before)
    assert allocated[3:] == [0, 0, 0], f"device allocations per step: {allocated}"


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("make", ["FedDecaySGD", "FedNAR", "FedSAM"])
def test_a_training_loop_with_set_to_none_replays(backend, make):
    """torch's default loop (zero_grad(set_to_none=True), forward, backward, step): the caching
    allocator brings the gradients back to a few address sets, and most steps replay. On an H200 the
    cuda backend replayed 154 of 159 such steps of the small CNN; the triton backend none, while its
    pointer tables came from the shared memory pool and moved the gradients. FedSAM's closure does
    the same again at x + e: its step allocates nothing, so both of its launches replay."""
    require(backend, "cuda")
    from fedopt_kernels.sim.models.small import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN((1, 8, 8), 10).cuda()
    if make == "FedNAR":
        opt = fedopt_kernels.FedNAR(model.parameters(), lr=0.05, weight_decay=0.01, max_norm=1.0, backend=backend)
    elif make == "FedSAM":
        opt = fedopt_kernels.FedSAM(model.parameters(), lr=0.05, rho=0.05, momentum=0.9, backend=backend)
    else:
        opt = fedopt_kernels.FedDecaySGD(model.parameters(), lr=0.05, beta=1.0, momentum=0.9, backend=backend)
    x, y = torch.randn(32, 1, 8, 8, device="cuda"), torch.randint(0, 10, (32,), device="cuda")

    def closure():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()

    for _ in range(40):
        closure()
        if make == "FedSAM":
            opt.step(closure)
        else:
            opt.step()
    stats = opt.replay_stats()
    assert stats["replayed"] >= (40 if make == "FedSAM" else 20), stats  # FedSAM: two launches a step
