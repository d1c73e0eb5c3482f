"""Every GPU-only path that can fail falls back to the proven one, says why once, and the run goes on.

The faults are injected on the CPU where the GPU would raise them: a formulation or a timed call
that raises cuDNN's error, a chunk size past a 32-bit index, a compiler that fails, a CUDA graph
capture that the driver refuses, a bound Triton launch whose call does not match. Each test checks
that the run finishes on the fallback, that one warning names the choice and the error, that the
results record it, and that an error of the proven path (the user's) still raises.
"""

from __future__ import annotations

import functools
import warnings
from typing import List

import pytest
import torch
from test_choose import _cnn, _inputs
from test_sim_resume import comparable, make, same_floats, tiny_config

from fedopt_kernels.core import fallbacks, graph_pools
from fedopt_kernels.sim.batched import choose, layers, search, timing
from fedopt_kernels.sim.batched.choose import Chooser, SearchBudget
from fedopt_kernels.sim.batched.compiled import CompiledLayersLoss
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.trainer_replay import TrainerReplay

CUDNN = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
INDEX = "RuntimeError: Expected canUse32BitIndexMath(input) to be true, but got false."


@pytest.fixture(autouse=True)
def _quick_search(monkeypatch):
    """Real calls, as few as a comparison allows: one warm-up and MIN_ROUNDS rounds each."""
    monkeypatch.setattr(choose, "_PROCESS", {})
    monkeypatch.setattr(timing, "MIN_CALL_S", 0.0)
    monkeypatch.setattr(timing, "MAX_ROUNDS", timing.MIN_ROUNDS)


def _clock(monkeypatch, cost, fail=None) -> List[tuple]:
    """The timer's clock replaced: a layer alone costs ``cost[(path, form)]`` (1.0 if not given), a
    step the sum of its layers'; ``fail(trial, n)`` may raise at the n-th call of a trial."""
    calls: List[tuple] = []

    def measure(self, trial):
        calls.append(trial)
        if fail is not None:
            fail(trial, calls.count(trial))
        if trial[0] == "alone":
            return cost.get((trial[1], trial[2]), 1.0)
        return sum(cost.get((p, f), 1.0) for p, f in self.assignments[trial[1]].items())

    monkeypatch.setattr(timing.Timer, "measure", measure)
    return calls


def _warnings(record) -> List[str]:
    return [
        str(w.message) for w in record if issubclass(w.category, RuntimeWarning) and "fedopt_kernels:" in str(w.message)
    ]


# ------------------------------------------------------------------ the search
@pytest.mark.parametrize("at_call", [1, 3], ids=["warm-up", "timed-round"])
def test_a_candidate_that_raises_cudnns_error_is_dropped_for_the_run(monkeypatch, at_call):
    """Its warm-up or one of its timed rounds raises: it is dropped with one warning naming it and
    the error, the search goes on, and a later size does not try it again."""
    model = _cnn()
    engine = LayersLoss(model)

    def fail(trial, n):
        if trial == ("alone", "features.2", "loop") and n >= at_call:
            raise RuntimeError(CUDNN)

    calls = _clock(monkeypatch, {("features.2", "loop"): 0.01}, fail)
    chooser = Chooser(engine, _inputs(model), mode="measure")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        chooser.at(6, SearchBudget())
        n_before = calls.count(("alone", "features.2", "loop"))
        choice = chooser.at(3, SearchBudget())
    said = _warnings(record)
    assert len(said) == 1 and "formulation 'loop' of features.2" in said[0] and "CUDNN_STATUS_NOT_SUPPORTED" in said[0]
    assert choice.formulations["features.2"] != "loop"
    assert calls.count(("alone", "features.2", "loop")) == n_before  # not tried at 3 clients
    assert "loop failed: RuntimeError: cuDNN error" in chooser.choices[6].why["features.2"]


def test_the_proven_formulations_error_is_the_users_and_raises(monkeypatch):
    """The default formulation's error is what training would meet: raised, not swallowed."""
    model = _cnn()
    engine = LayersLoss(model)
    default = choose.defaults(engine, *_inputs(model)(6)[:2])["features.2"]

    def fail(trial, n):
        if trial == ("alone", "features.2", default):
            raise RuntimeError("shapes cannot be multiplied (a bad model)")

    _clock(monkeypatch, {}, fail)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        Chooser(engine, _inputs(model), mode="measure").at(6, SearchBudget())


def test_out_of_memory_in_a_timed_round_drops_the_candidate_silently(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)

    def fail(trial, n):
        if trial == ("alone", "head", "loop") and n == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    _clock(monkeypatch, {("head", "loop"): 0.01}, fail)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        choice = Chooser(engine, _inputs(model), mode="measure").at(6, SearchBudget())
    assert not _warnings(record)
    assert choice.formulations["head"] != "loop" and "loop out of memory" in choice.why["head"]


def test_a_real_formulation_raising_leaves_the_run_on_the_others(monkeypatch):
    """End to end, the real timer: im2col raises cuDNN's error wherever it runs; the simulation
    finishes, its results record the fallback, and im2col is never the choice."""

    def broken(*args, **kwargs):
        raise RuntimeError(CUDNN)

    monkeypatch.setattr(layers, "im2col_conv2d", broken)
    cfg = tiny_config("fedavg", client_batched=3, formulations="measure", rounds=1)
    with pytest.warns(RuntimeWarning, match="formulation 'im2col'"):
        result = make(cfg).run()
    got = result["client_batched"]
    assert "im2col" not in got["formulations"].values()
    assert any("im2col" in f["choice"] and "CUDNN_STATUS_NOT_SUPPORTED" in f["error"] for f in got["fallbacks"])


def test_a_chunk_size_that_fails_is_dropped_for_a_smaller_one(monkeypatch):
    """The largest size's step raises a 32-bit index error: the next size is taken, with one warning;
    a size the user fixed has no other to take, so its error is raised."""
    model = _cnn()
    engine = LayersLoss(model)

    real = timing.Timer.measure

    def measure(self, trial):
        if self.x.shape[0] == 12:
            raise RuntimeError(INDEX)
        return real(self, trial)

    monkeypatch.setattr(timing.Timer, "measure", measure)
    with pytest.warns(RuntimeWarning, match="12 clients at once failed") as record:
        n, choice = Chooser(engine, _inputs(model), mode="measure").plan(12, 12, steps_per_run=10)
    assert n < 12 and choice.clients == n
    assert len(_warnings(record)) == 1
    with pytest.raises(RuntimeError, match="canUse32BitIndexMath"):
        Chooser(engine, _inputs(model), mode="measure").plan(12, 12, steps_per_run=10, fixed=12)


def test_auto_takes_a_smaller_size_when_the_largest_runs_out_of_memory(monkeypatch):
    """auto sizes its budget from the defaults' step at the largest size: out of memory there is that
    size's outcome (silent), and the budget comes from the next size instead of being unlimited."""
    model = _cnn()
    _clock(monkeypatch, {})
    timed = timing.Timer.measure

    def measure(self, trial):
        if self.x.shape[0] == 12:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return timed(self, trial)

    monkeypatch.setattr(timing.Timer, "measure", measure)
    chooser = Chooser(LayersLoss(model), _inputs(model), mode="auto")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        n, _ = chooser.plan(12, 12, steps_per_run=10**5)
    assert n < 12 and not _warnings(record)
    assert chooser.budget_s is not None and chooser.budget_s < float("inf")


def test_a_compiled_step_that_fails_when_timed_is_not_taken(monkeypatch):
    """Not NotCompilable (the compiler's "cannot"), a cuBLAS error of the compiled step's timed call:
    the eager step stays, with one warning."""
    model = _cnn()
    _clock(monkeypatch, {})
    real = timing.Timer.measure

    def measure(self, trial):
        if isinstance(self.engine, CompiledLayersLoss):
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm")
        return real(self, trial)

    monkeypatch.setattr(timing.Timer, "measure", measure)
    with pytest.warns(RuntimeWarning, match="the compiled step"):
        choice = search.search(LayersLoss(model), *_inputs(model)(4), SearchBudget(), compile_step=True)
    assert not choice.compiled and "CUBLAS_STATUS_EXECUTION_FAILED" in choice.compile_note


def test_a_training_step_that_fails_compiled_runs_eagerly_to_the_eager_bits():
    """The engine a run trains through (fallback=True): its compiler fails, one warning, and every
    step from then on is the eager engine's, bit for bit; the inputs' own error still raises."""
    model = _cnn()

    class Failing(CompiledLayersLoss):  # its compiled step fails at its first call, as inductor may
        def _build(self, fullgraph: bool) -> None:
            def compiled(*args):
                raise RuntimeError("inductor: a stand-in for a compiler that fails on this device")

            self._compiled, self.fullgraph = compiled, fullgraph

    compiled = Failing(model, fallback=True)
    eager = LayersLoss(model)
    params, x, y, w = _inputs(model)(3)
    with pytest.warns(RuntimeWarning, match="the compiled step") as record:
        got = [compiled.grads(params, x, y, w) for _ in range(2)]
    assert len(_warnings(record)) == 1 and "stand-in for a compiler" in compiled.fallback_reason
    want = eager.grads(params, x, y, w)
    for g, _ in got:
        assert all(torch.equal(a, b) for a, b in zip(g, want[0]))
    with pytest.raises(RuntimeError):
        compiled.grads(params, x[:, :, :, :4], y, w)  # a bad shape: the eager engine's error


# ------------------------------------------------------------------ captures
def _replay_config():
    """Two rounds of three steps: the capture (after two warm-up steps) takes a round's last step."""
    return tiny_config("fedavg", client_batched=3, formulations="default", rounds=2, local_steps=3)


@functools.lru_cache(maxsize=1)
def _eager_run() -> dict:
    """The run the replayed runs must equal: the same, with every step eager (deterministic)."""
    return make(_replay_config()).run()


def _replayed_run(monkeypatch, fault: str):
    """A client-batched FedAvg run whose step is emulated-replayed, with ``fault`` injected."""
    if fault == "cuda-capture":  # the "cuda" path on CPU tensors: the driver refuses the capture
        from fedopt_kernels.sim.batched import trainer_replay

        def refused(device, body):
            return None, RuntimeError("CUDA error: operation not permitted when stream is capturing")

        monkeypatch.setattr(trainer_replay, "capture_graph", refused)
        init = TrainerReplay.__init__

        def as_cuda(self, trainer, mode="cuda", warmup=2):
            init(self, trainer, mode="emulate", warmup=warmup)
            self.mode = "cuda"

        monkeypatch.setattr(TrainerReplay, "__init__", as_cuda)
    elif fault == "refused-before":  # a torch that refuses the capture before it runs anything

        def refuse(self):
            self.tr.opt.prepare_capture(self.tr.steps + 1)
            raise RuntimeError("CUDA graphs are not supported by this driver")

        monkeypatch.setattr(TrainerReplay, "_capture", refuse)
    elif fault == "after-the-step":  # the emulated capture ran the step, then its check failed
        real_capture = TrainerReplay._capture

        def rebuilt(self):
            real_capture(self)
            raise RuntimeError("the optimizer rebuilt its step plans during capture; take more warm-up steps")

        monkeypatch.setattr(TrainerReplay, "_capture", rebuilt)
    sim = make(_replay_config())
    assert sim.batched is not None
    sim.batched.replay_mode = "emulate"
    return sim.run()


@pytest.mark.parametrize("fault", ["cuda-capture", "refused-before", "after-the-step"])
def test_a_capture_that_fails_leaves_the_run_on_eager_steps(monkeypatch, fault):
    """The simulator's captured step: a capture that raises (on the CUDA path, before it ran, or after
    an emulated capture took the step) turns replay off for the run with one warning; every step is
    taken exactly once, so the run is bitwise the eager one, and its results say why."""
    eager = _eager_run()
    with pytest.warns(RuntimeWarning, match="captured in a CUDA graph") as record:
        got = _replayed_run(monkeypatch, fault)
    assert len(_warnings(record)) == 1
    assert same_floats(comparable(got), comparable(eager))
    (fb,) = got["client_batched"]["fallbacks"]
    assert fb["instead"] == "eager steps" and "capture" in fb["choice"]


def test_the_capture_fallback_check_can_fail(monkeypatch):
    """A capture failing after an emulated step, taken again eagerly, would take that step twice."""
    real = TrainerReplay._try_capture

    def twice(self):
        real(self)
        return False  # "the step is still to take": wrong after an emulated capture ran it

    monkeypatch.setattr(TrainerReplay, "_try_capture", twice)
    eager = _eager_run()
    with pytest.warns(RuntimeWarning):
        got = _replayed_run(monkeypatch, "after-the-step")
    assert not same_floats(comparable(got), comparable(eager))


# ------------------------------------------------------------------ private torch calls
def test_private_allocator_calls_only_on_a_checked_torch(monkeypatch):
    low, high = graph_pools.PRIVATE_CHECKED
    assert graph_pools.private("_cuda_releasePool", low) is getattr(torch._C, "_cuda_releasePool", None)
    assert graph_pools.private("_cuda_releasePool", (high[0], high[1] + 1)) is None
    assert graph_pools.private("_cuda_releasePool", (low[0], low[1] - 1)) is None
    assert graph_pools.torch_version("2.11.0+cu130") == (2, 11) and graph_pools.torch_version("nightly") == (0, 0)
    monkeypatch.setattr(graph_pools, "torch_version", lambda text=None: (high[0] + 1, 0))
    # the public path: nothing private is called, and the capture check is torch's public one
    assert graph_pools.end_pool(0, (0, 1)) is False
    graph_pools.release_pool(0, (0, 1))
    assert graph_pools.stream_capturing() is torch.cuda.is_current_stream_capturing


# ------------------------------------------------------------------ the record
def test_a_fallback_warns_once_and_is_recorded():
    start = fallbacks.mark()
    with pytest.warns(RuntimeWarning, match=r"fedopt_kernels: a thing failed \(ValueError: first\); the other"):
        fallbacks.fall_back("a thing", ValueError("first\nsecond line"), "the other")
    assert fallbacks.taken(start) == [{"choice": "a thing", "error": "ValueError: first", "instead": "the other"}]


# ------------------------------------------------------------------ a bound Triton launch
class _RefusingCompiled:
    """What a GPU launch returns (a compiled kernel) whose ``run`` does not take the call a bound
    launch makes (another triton's signature)."""

    function, packed_metadata = "function", ("metadata",)

    def run(self, *args):
        raise TypeError(f"function takes {len(args) - 1} positional arguments but {len(args)} were given")


class _Kernel:
    """The real (interpreted) kernel, returning a compiled stand-in as a GPU launch does."""

    def __init__(self, real):
        self.real, self.arg_names = real, real.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.real[grid](*args, **kwargs)
            return _RefusingCompiled()

        return launch


def test_a_bound_triton_launch_that_fails_takes_tritons_own_path(monkeypatch):
    """The second step's bound launch raises: one warning, binding off for the process, and that
    launch and every later one go through triton's own path: the same bits as a run never bound."""
    from fedopt_kernels.core import registry

    if registry.unavailable_reason("triton", torch.device("cpu")) is not None:
        pytest.skip("the triton backend is not available here")
    import fedopt_kernels as fk
    from fedopt_kernels.triton_kernels import launcher, plans, sgd

    def run(bind: bool) -> List[torch.Tensor]:
        plans.clear_cache()
        monkeypatch.setattr(launcher, "_BIND", bind)
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((5, 3), (7,))]
        opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, momentum=0.9, backend="triton", replay=False)
        for p in ps:  # gradients at fixed addresses: the plan (and its bound launch) is the same each step
            p.grad = torch.zeros_like(p)
        for _ in range(3):
            for p in ps:
                grad = p.grad
                assert grad is not None
                grad.copy_(torch.randn(p.shape, generator=g))
            opt.step()
        return [p.detach().clone() for p in ps]

    want = run(bind=False)
    monkeypatch.setattr(launcher, "_stream", lambda: 0)
    monkeypatch.setattr(sgd, "sgd_kernel", _Kernel(sgd.sgd_kernel))
    with pytest.warns(RuntimeWarning, match="bound Triton launch") as record:
        got = run(bind=True)
    assert len(_warnings(record)) == 1 and "TypeError" in _warnings(record)[0]
    assert launcher._BIND is False
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_triton_is_bound_only_on_the_versions_whose_run_was_read(monkeypatch):
    from fedopt_kernels.core import registry

    if registry.unavailable_reason("triton", torch.device("cpu")) is not None:
        pytest.skip("the triton backend is not available here")
    from fedopt_kernels.triton_kernels import launcher

    low, high = launcher.BIND_CHECKED
    assert launcher.bind_allowed(f"{low[0]}.{low[1]}.0") and launcher.bind_allowed(f"{high[0]}.{high[1]}.1")
    assert not launcher.bind_allowed(f"{high[0]}.{high[1] + 1}.0") and not launcher.bind_allowed("3.1.0")
    monkeypatch.setenv("FEDOPT_TRITON_BIND", "0")
    assert not launcher.bind_allowed(f"{low[0]}.{low[1]}.0")
