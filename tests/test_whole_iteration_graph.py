"""A whole training iteration (zero_grad, forward, loss, backward, step) in one CUDA graph, and under
``torch.compile(mode="reduce-overhead")`` (docs/replay.md, "A whole iteration in one graph").

For every algorithm of the catalogue (its full option set, round inputs included) a small MLP is
trained for ``WARMUP`` eager iterations, one iteration is captured, and the graph is replayed for
``REPLAYS`` more batches copied into the static input; parameters, every state tensor, the step
counter and the losses must equal those of the same iterations run eagerly, **bitwise**: a replay runs
the same kernels (the model's and the optimizer's) on the same values, so there is no rounding to
allow for. FedSAM's graph holds its whole step: first_step, a second forward and backward,
second_step. Gradients are either made by the captured backward after ``zero_grad(set_to_none=True)``
(PyTorch's recipe), or kept from the warm-up and zeroed inside the graph (``set_to_none=False``),
which the triton backend needs: it refuses gradients made inside the capture, with an error that says so.

What a replay does not redo is refused or made harmless, and checked here on the CPU with a stand-in
for the graph (``graph_stand_in.py``, over the cpu backend and Triton's interpreter) as well as on a GPU:
a decay table that would end before the round does (``prepare_capture``), an LR scheduler stepping a
float lr, a graph replayed after ``start_round()`` (its steps turn the parameters into NaN), a round
that took more steps than its decay table covers. ``torch.compile``'s step op keeps out of inductor's
CUDA graphs (it is tagged ``cudagraph_unsafe``), so a compiled whole step with ``reduce-overhead``
takes the eager steps, round starts and hyperparameter edits included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
from backends import require
from graph_stand_in import StandInGraph, install
from torch import nn

import fedopt_kernels as fk
from fedopt_kernels.core.stepper import FedStepper
from fedopt_kernels.fl import algorithm, catalogue

ALGOS = list(catalogue.ALGOS)
WARMUP = 3  # eager iterations before the capture (a round's first step with new momentum buffers is its own)
REPLAYS = 5
BATCH = 8
gpu = pytest.mark.gpu


# ------------------------------------------------------------------ one client's training
class Client:
    """A small MLP, one catalogue option set's optimizer on it in its first round, and what one
    training iteration does (FedSAM: both gradients)."""

    def __init__(self, cfg: catalogue.Config, backend: str, device: str, dims=(6, 5, 3)):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.ReLU(), nn.Linear(dims[1], dims[2])).to(device)
        self.params = list(self.model.parameters())
        self.cfg = cfg
        self.opt = cfg.build(self.params, backend)
        self.order = [p for g in self.opt.param_groups for p in g["params"]]
        self.opt.start_round(**cfg.round_inputs(self.order, 0))
        self.sam = isinstance(self.opt, fk.FedSAM)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x), y)

    def iteration(self, x, y, set_to_none: bool = True, model: Optional[Callable] = None) -> torch.Tensor:
        """zero_grad, forward, loss, backward, step; ``model(fn, params)`` runs the forward and backward
        (a stand-in graph's hook; by default just ``fn()``). Returns the loss (of the first forward)."""
        run = model or (lambda fn, params: fn())
        opt = self.opt

        def forward_backward() -> torch.Tensor:
            loss = self.loss(x, y)
            loss.backward()
            return loss.detach()

        opt.zero_grad(set_to_none=set_to_none)
        loss = run(forward_backward, self.params)
        if isinstance(opt, fk.FedSAM):
            opt.first_step()
            opt.zero_grad(set_to_none=set_to_none)
            run(forward_backward, self.params)
            opt.second_step()
        else:
            opt.step()
        return loss


def batches(n: int, device: str, dims=(6, 5, 3), seed: int = 7) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(BATCH, dims[0], generator=g)
        out.append((x.to(device), torch.randint(0, dims[-1], (BATCH,), generator=g).to(device)))
    return out


def eager_run(client: Client, data) -> List[torch.Tensor]:
    return [client.iteration(x, y) for x, y in data]


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the stand-in's interface; warm-up on a side stream, as PyTorch asks."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self):
        return torch.cuda.graph(self.graph)

    def model(self, fn, params):
        return fn()

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    def warm(iterations: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            iterations()
        torch.cuda.current_stream().wait_stream(side)


class Graphed:
    """``client`` trained on ``data``: ``WARMUP`` eager iterations, one captured into ``graph``, the
    rest replayed with each batch copied into the static input."""

    def __init__(self, client: Client, graph: Any, set_to_none: bool, steps_per_round: Optional[int]):
        self.client, self.graph, self.set_to_none = client, graph, set_to_none
        self.steps_per_round = steps_per_round
        self.static: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.loss: Optional[torch.Tensor] = None

    def warm(self, data) -> List[torch.Tensor]:
        x0, y0 = data[0]
        if self.static is None:
            self.static = (x0.clone(), y0.clone())
        sx, sy = self.static
        losses = []

        def iterations() -> None:
            for x, y in data:
                sx.copy_(x)
                sy.copy_(y)
                losses.append(self.client.iteration(sx, sy, self.set_to_none).clone())

        getattr(self.graph, "warm", lambda f: f())(iterations)
        return losses

    def capture(self) -> None:
        if self.steps_per_round is not None:
            self.client.opt.prepare_capture(self.steps_per_round)
        assert self.static is not None  # warm() made it
        sx, sy = self.static
        # held through the capture: a CUDA graph allocates from a pool of its own, so the gradients its
        # backward makes never land where the warm-up's were (on the CPU they would)
        held = [p.grad for p in self.client.params]
        with self.graph.capture():
            self.loss = self.client.iteration(sx, sy, self.set_to_none, self.graph.model)
        del held

    def replay(self, data) -> List[torch.Tensor]:
        assert self.static is not None and self.loss is not None  # warm() and capture() made them
        sx, sy = self.static
        losses = []
        for x, y in data:
            sx.copy_(x)
            sy.copy_(y)
            self.graph.replay()
            losses.append(self.loss.clone())
        return losses

    def run(self, data) -> List[torch.Tensor]:
        losses = self.warm(data[:WARMUP])
        self.capture()
        return losses + self.replay(data[WARMUP:])


def assert_same(a: Client, b: Client, what: str, losses: Optional[Tuple[list, list]] = None) -> None:
    """Parameters, every state tensor, the step counter and the losses: the same bits."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(a.params, b.params)):
        assert torch.equal(p.detach(), q.detach()), f"{what}: parameter {i}"
        sa, sb = a.opt.state.get(p, {}), b.opt.state.get(q, {})
        assert set(sa) == set(sb), f"{what}: state keys of parameter {i}: {sorted(sa)} vs {sorted(sb)}"
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, sb[key]), f"{what}: state {key} of parameter {i}"
    assert a.opt.round_step == b.opt.round_step, f"{what}: round step {a.opt.round_step} vs {b.opt.round_step}"
    if losses is not None:  # exactly equal (a NaN loss, of a batch with an inf, equals NaN)
        for k, (x, y) in enumerate(zip(*losses)):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=f"{what}: loss of iteration {k}")


def graphed_against_eager(
    algo: str, backend: str, device: str, set_to_none: bool, make_graph: Callable[[], Any], dims=(6, 5, 3)
) -> Graphed:
    cfg = catalogue.config(algo)
    data = batches(WARMUP + REPLAYS, device, dims)
    eager = Client(cfg, backend, device, dims)
    eager_losses = eager_run(eager, data)
    run = Graphed(Client(cfg, backend, device, dims), make_graph(), set_to_none, WARMUP + REPLAYS)
    graphed_losses = run.run(data)
    assert_same(eager, run.client, f"{algo} on {backend}", (eager_losses, graphed_losses))
    # what the round hands back reads the same state (FedDyn's end_round, PAdaMFed's local control)
    for c in (eager, run.client):
        algorithm.end_round(c.opt)
    assert_same(eager, run.client, f"{algo} on {backend}, after end_round")
    a, b = eager.opt, run.client.opt
    if isinstance(a, fk.PAdaMFed) and isinstance(b, fk.PAdaMFed):
        for x, y in zip(a.local_control(), b.local_control()):
            assert torch.equal(x, y), f"{algo} on {backend}: local control"
    return run


# ------------------------------------------------------------------ on the CPU: the stand-in graph
@pytest.fixture
def stand_in(monkeypatch):
    install(monkeypatch)


CPU_BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("triton", id="triton")]


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "kept_grads"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
def test_a_graphed_iteration_takes_the_eager_steps(algo, backend, set_to_none, stand_in):
    """The optimizer's host side runs once, at the capture; the replays advance its counter and state on
    the "device" only, and every replayed iteration equals the eager one."""
    require(backend, "cpu")
    if backend == "triton" and set_to_none:
        pytest.skip("the triton backend refuses gradients made inside the capture (the next test)")
    run = graphed_against_eager(algo, backend, "cpu", set_to_none, StandInGraph)
    kinds = [r[0] for r in run.graph.records]
    assert kinds.count("kernel") >= 1 and kinds.count("model") == (2 if run.client.sam else 1), kinds


@pytest.mark.slow  # Triton's interpreter
@pytest.mark.parametrize("algo", ["feddecay", "fedsam"])
def test_triton_refuses_gradients_made_inside_the_capture(algo, stand_in):
    require("triton", "cpu")
    client = Client(catalogue.config(algo), "triton", "cpu")
    run = Graphed(client, StandInGraph(), set_to_none=True, steps_per_round=20)
    run.warm(batches(WARMUP, "cpu"))
    before = [p.detach().clone() for p in client.params]
    with pytest.raises(RuntimeError, match=r"pointer tables.*zero_grad\(set_to_none=False\)"):
        run.capture()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, client.params))
    assert not [r for r in run.graph.records if r[0] == "kernel"], "a kernel was recorded before the refusal"


def test_the_comparison_can_fail(stand_in):
    """A replay that reads a stale input (the static input not refreshed for one batch) is caught."""
    require("cpu", "cpu")
    cfg = catalogue.config("fednar")
    data = batches(WARMUP + REPLAYS, "cpu")
    eager = Client(cfg, "cpu", "cpu")
    eager_losses = eager_run(eager, data)
    run = Graphed(Client(cfg, "cpu", "cpu"), StandInGraph(), True, None)
    losses = run.warm(data[:WARMUP])
    run.capture()
    stale = list(data[WARMUP:])
    stale[2] = stale[1]  # batch WARMUP + 2 never reaches the graph
    losses += run.replay(stale)
    with pytest.raises(AssertionError, match="parameter|loss"):
        assert_same(eager, run.client, "stale input", (eager_losses, losses))


def test_a_float_lr_edited_between_replays_is_not_read_by_them(stand_in):
    """What the stand-in must get right to stand in for a graph: the Python of step() does not run in a
    replay, so an lr assigned between replays reaches none of them (docs/replay.md: a tensor lr does)."""
    require("cpu", "cpu")
    cfg = catalogue.config("fednar")
    data = batches(WARMUP + 2, "cpu")
    run = Graphed(Client(cfg, "cpu", "cpu"), StandInGraph(), True, None)
    run.warm(data[:WARMUP])
    run.capture()
    params = [p.detach().clone() for p in run.client.params]
    run.client.opt.param_groups[0]["lr"] = 0.0  # not seen by the graph
    run.replay(data[WARMUP:])
    assert not all(torch.equal(a, p.detach()) for a, p in zip(params, run.client.params))


# ------------------------------------------------------------------ refusals (host side: CPU)
def _warm_client(algo: str, stand_in_graph: Optional[StandInGraph] = None, **kwargs: Any) -> Graphed:
    require("cpu", "cpu")
    cfg = catalogue.config(algo)
    if kwargs:
        cfg = dataclasses.replace(cfg, kwargs={**cfg.kwargs, **kwargs})
    run = Graphed(Client(cfg, "cpu", "cpu"), stand_in_graph or StandInGraph(), True, None)
    run.warm(batches(WARMUP, "cpu"))
    return run


def test_a_decay_table_that_ends_before_the_round_is_refused_at_capture(stand_in):
    """FedDecaySGD's s(k // decay_every) comes from a device table the kernels read at k, which replays
    advance unseen: a schedule that is not constant past its table needs prepare_capture(steps)."""
    run = _warm_client("feddecay")  # beta 0.6, exponential
    opt = run.client.opt
    k, before = opt.round_step, [p.detach().clone() for p in run.client.params]
    with pytest.raises(RuntimeError, match=r"prepare_capture\(steps\)"):
        run.capture()
    assert opt.round_step == k and all(torch.equal(a, p.detach()) for a, p in zip(before, run.client.params))
    run.graph = StandInGraph()
    run.steps_per_round = WARMUP + REPLAYS
    run.capture()  # prepared: captured
    # constant schedules need nothing: s = 1 (beta 1), or s reaching 0 inside the table
    for beta, schedule in ((1.0, "exponential"), (0.0, "exponential"), (0.4, "linear")):
        _warm_client("feddecay", beta=beta, schedule=schedule).capture()


def test_prepare_capture_takes_a_positive_step_count():
    opt = Client(catalogue.config("feddecay"), "reference", "cpu").opt
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="steps_per_round"):
            opt.prepare_capture(bad)
    opt.prepare_capture(3000)
    assert opt.schedule.length(torch.device("cpu")) * opt.schedule.decay_every >= 3000


def test_a_tensor_schedule_shorter_than_the_round_is_refused_by_prepare_capture():
    cfg = catalogue.config("feddecay")
    kwargs = {**cfg.kwargs, "schedule": torch.tensor([1.0, 0.5, 0.25])}
    opt = fk.FedDecaySGD([nn.Parameter(torch.zeros(3))], **kwargs)
    opt.prepare_capture(3)
    with pytest.raises(ValueError, match="schedule tensor has length 3"):
        opt.prepare_capture(4)


def test_a_round_longer_than_the_captured_decay_table_is_an_error_at_the_next_round(stand_in):
    """A callable schedule is tabulated as far as asked (a built-in one 1024 entries ahead)."""
    run = _warm_client("feddecay", schedule=lambda j: 0.9**j)
    run.steps_per_round = WARMUP + 2  # the table covers WARMUP + 2 steps; the graph takes 4 more
    run.capture()
    run.replay(batches(4, "cpu", seed=9))
    opt = run.client.opt
    with pytest.raises(RuntimeError, match=rf"took {WARMUP + 4} steps.*covers {WARMUP + 2}"):
        opt.start_round()
    opt.start_round()  # said once: the next round starts
    assert opt.round_step == 0


def test_an_lr_scheduler_on_a_float_lr_is_refused_at_capture(stand_in):
    run = _warm_client("fednar")
    torch.optim.lr_scheduler.StepLR(run.client.opt, step_size=2)
    with pytest.raises(RuntimeError, match=r"LR scheduler.*tensor lr"):
        run.capture()
    _warm_client("fednar").capture()  # the same without a scheduler: captured


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_a_graph_replayed_after_the_round_it_was_captured_in_turns_the_parameters_into_nan(algo, stand_in):
    """start_round() retires the plan the graph reads: later replays compute NaN, not plausible numbers."""
    run = _warm_client(algo)
    run.steps_per_round = 20
    run.capture()
    run.replay(batches(2, "cpu", seed=3))
    assert all(torch.isfinite(p).all() for p in run.client.params)
    algorithm.end_round(run.client.opt)
    run.client.opt.start_round(**run.client.cfg.round_inputs(run.client.order, 1))
    run.replay(batches(1, "cpu", seed=4))
    assert all(torch.isnan(p).all() for p in run.client.params), algo


@pytest.mark.parametrize("how", ["start_round", "load_state_dict", "end_round", "add_param_group"])
def test_new_state_retires_the_graph(how, stand_in):
    run = _warm_client("feddyn")
    run.steps_per_round = 20
    run.capture()
    opt = run.client.opt
    if how == "load_state_dict":
        opt.load_state_dict(opt.state_dict())
    elif how == "add_param_group":
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    else:
        getattr(opt, how)()
    run.replay(batches(1, "cpu", seed=4))
    assert all(torch.isnan(p).all() for p in run.client.params)


def test_the_nan_check_can_fail(stand_in, monkeypatch):
    """Without the retirement the stale replay steps on with plausible numbers (what the NaN prevents)."""
    monkeypatch.setattr(FedStepper, "retire_graph", lambda self: None)
    run = _warm_client("fednar")
    run.capture()
    run.client.opt.start_round()
    run.replay(batches(1, "cpu", seed=4))
    assert all(torch.isfinite(p).all() for p in run.client.params)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_a_graph_captured_in_each_round_takes_the_eager_rounds(algo, stand_in):
    """Two rounds, each warmed up and captured anew after its start_round (the recipe of
    docs/replay.md): the same bits as the two rounds eagerly."""
    require("cpu", "cpu")
    cfg = catalogue.config(algo)
    rounds = [batches(WARMUP + REPLAYS, "cpu", seed=s) for s in (1, 2)]
    eager, graphed = Client(cfg, "cpu", "cpu"), Client(cfg, "cpu", "cpu")
    for rnd, data in enumerate(rounds):
        if rnd:
            for c in (eager, graphed):
                algorithm.end_round(c.opt)
                c.opt.start_round(**cfg.round_inputs(c.order, rnd))
        eager_run(eager, data)
        Graphed(graphed, StandInGraph(), True, WARMUP + REPLAYS).run(data)
    assert_same(eager, graphed, f"{algo}, two rounds")


# ------------------------------------------------------------------ torch.compile: the op and inductor's graphs
def _graph_calling(target, *args: Any) -> torch.fx.GraphModule:
    """An FX graph calling ``target`` with ``args``, its one input where an arg (or list item) is "x"."""
    g = torch.fx.Graph()
    x = g.placeholder("x")

    def arg(a: Any) -> Any:
        return [arg(b) for b in a] if isinstance(a, list) else x if a == "x" else a

    g.call_function(target, tuple(arg(a) for a in args))
    g.output(None)
    return torch.fx.GraphModule(nn.Module(), g)


def test_the_compiled_step_op_keeps_out_of_inductors_cuda_graphs():
    """A graph inductor would replay from a CUDA graph skips it when it holds the op, so every compiled
    step runs the optimizer's host side; an untagged op (aten.add) is not skipped: the check can fail."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    op = torch.ops.fedopt.optimizer_step.default
    assert torch.Tag.cudagraph_unsafe in op.tags
    assert get_first_incompatible_cudagraph_node(_graph_calling(op, ["x"], ["x"], [], None, None, 1)) is not None
    assert get_first_incompatible_cudagraph_node(_graph_calling(torch.ops.aten.neg.default, "x")) is None


# ------------------------------------------------------------------ on a GPU
GPU_DIMS = (64, 32, 10)


@gpu
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "kept_grads"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", ALGOS)
def test_a_whole_iteration_cuda_graph_takes_the_eager_steps(algo, backend, set_to_none):
    require(backend, "cuda")
    if backend == "triton" and set_to_none:
        client = Client(catalogue.config(algo), backend, "cuda", GPU_DIMS)
        run = Graphed(client, CudaGraph(), True, 20)
        run.warm(batches(WARMUP, "cuda", GPU_DIMS))
        with pytest.raises(RuntimeError, match=r"pointer tables.*zero_grad\(set_to_none=False\)"):
            run.capture()
        return
    graphed_against_eager(algo, backend, "cuda", set_to_none, CudaGraph, GPU_DIMS)


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", ALGOS)
def test_a_stale_cuda_graph_turns_the_parameters_into_nan(algo, backend):
    require(backend, "cuda")
    client = Client(catalogue.config(algo), backend, "cuda", GPU_DIMS)
    run = Graphed(client, CudaGraph(), False, 20)
    run.warm(batches(WARMUP, "cuda", GPU_DIMS))
    run.capture()
    run.replay(batches(2, "cuda", GPU_DIMS, seed=3))
    assert all(torch.isfinite(p).all() for p in client.params)
    algorithm.end_round(client.opt)
    client.opt.start_round(**client.cfg.round_inputs(client.order, 1))
    run.replay(batches(1, "cuda", GPU_DIMS, seed=4))
    assert all(torch.isnan(p).all() for p in client.params), algo


def _scaled(client: Client, scaler: torch.amp.GradScaler) -> Callable:
    """One iteration under GradScaler (FedSAM takes none: its two steps are called by hand)."""

    def iteration(x, y, set_to_none=True, model=None):
        client.opt.zero_grad(set_to_none=set_to_none)
        loss = client.loss(x, y)
        scaler.scale(loss).backward()
        scaler.step(client.opt)
        scaler.update()
        return loss.detach()

    return iteration


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", ["feddecay", "fednar", "padamfed"])
def test_grad_scaler_inside_the_graph_skips_the_steps_eager_skips(algo, backend):
    """GradScaler's scale, found-inf flag and its update are device tensors the graph recomputes: a
    replay with an inf in its batch skips its step and halves the scale, as the eager iteration does."""
    require(backend, "cuda")
    cfg = catalogue.config(algo)
    data = batches(WARMUP + REPLAYS, "cuda", GPU_DIMS)
    data[WARMUP + 2][0][0, 0] = float("inf")
    runs = []
    for graphed in (False, True):
        client = Client(cfg, backend, "cuda", GPU_DIMS)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8, growth_interval=2)
        client.iteration = _scaled(client, scaler)
        if graphed:
            losses = Graphed(client, CudaGraph(), False, 20).run(data)
        else:
            losses = eager_run(client, data)
        runs.append((client, losses, scaler))
    (a, la, sa), (b, lb, sb) = runs
    assert_same(a, b, f"{algo} under GradScaler on {backend}", (la, lb))
    assert sa.get_scale() == sb.get_scale()
    assert a.opt.round_step == WARMUP + REPLAYS - 1  # the step with an inf was skipped


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_tensor_lr_stepped_by_a_scheduler_between_replays_reaches_them(backend):
    require(backend, "cuda")
    cfg = catalogue.config("feddecay", "momentum_wd")
    data = batches(WARMUP + REPLAYS, "cuda", GPU_DIMS)
    runs = []
    for graphed in (False, True):
        lr = torch.tensor(0.05, dtype=torch.float64, device="cuda")
        client = Client(dataclasses.replace(cfg, kwargs={**cfg.kwargs, "lr": lr}), backend, "cuda", GPU_DIMS)
        sched = torch.optim.lr_scheduler.LambdaLR(client.opt, lambda e: 0.8**e)
        run = Graphed(client, CudaGraph(), False, 20)
        for k, batch in enumerate(data):
            if not graphed:
                client.iteration(*batch)
            elif k < WARMUP:
                run.warm([batch])
            else:
                if k == WARMUP:
                    run.capture()
                run.replay([batch])
            sched.step()  # fills the tensor lr in place
        runs.append(client)
    assert_same(runs[0], runs[1], f"tensor lr and LambdaLR on {backend}")


# two compiles of tens of seconds each on a GPU per case: the step's two forms (one launch, FedSAM's
# two) run in bench/gpu_check.sh's test phase, the other algorithms after the benchmarks (long_compile)
COMPILED_FIRST = ("feddecay", "fedsam")
COMPILED_ALGOS = [
    a if a in COMPILED_FIRST else pytest.param(a, marks=[pytest.mark.long_compile, pytest.mark.slow]) for a in ALGOS
]


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algo", COMPILED_ALGOS)
def test_reduce_overhead_compile_of_the_whole_step_takes_the_eager_steps(algo, backend):
    """``torch.compile(train, mode="reduce-overhead")`` of forward, loss, backward and step, against the
    same model compiled alone with the step eager (inductor's model kernels are not the eager ones, so
    the model is compiled alike in both runs and the optimizer step is what differs): the same bits,
    over two rounds with an lr edit in each; a step inductor replayed from its own CUDA graph would
    miss the round start and the edits."""
    require(backend, "cuda")
    cfg = catalogue.config(algo)
    rounds = [batches(6, "cuda", GPU_DIMS, seed=s) for s in (1, 2)]
    runs = []
    for whole in (False, True):
        torch._dynamo.reset()
        client = Client(cfg, backend, "cuda", GPU_DIMS)
        opt = client.opt
        loss_of = client.loss if whole else torch.compile(client.loss, mode="reduce-overhead")

        def train(x, y, loss_of=loss_of, client=client, opt=opt):  # zero_grad is called before it
            loss = loss_of(x, y)
            loss.backward()
            if client.sam:
                opt.first_step()
                opt.zero_grad(set_to_none=True)
                loss_of(x, y).backward()
                opt.second_step()
            else:
                opt.step()
            return loss.detach()

        step = torch.compile(train, mode="reduce-overhead") if whole else train
        losses = []
        for rnd, data in enumerate(rounds):
            if rnd:
                algorithm.end_round(opt)
                opt.start_round(**cfg.round_inputs(client.order, rnd))
            for k, (x, y) in enumerate(data):
                if k == 3:
                    opt.param_groups[0]["lr"] *= 0.5
                opt.zero_grad(set_to_none=True)
                losses.append(step(x, y).clone())
        runs.append((client, losses))
    (a, la), (b, lb) = runs
    assert_same(a, b, f"{algo} on {backend} under reduce-overhead", (la, lb))
