"""``CompiledLayersLoss``: the layers engine's step through ``torch.compile`` equals per-client autograd in
float64, and what cannot be compiled says so with ``NotCompilable`` (never a wrong answer, never an
input error disguised as one). Compiling takes tens of seconds on a CPU: the full suite runs this file."""

import pytest
import torch
from test_sim_layers_engine import ROUNDING_RTOL, _case, _per_client, _rel

from fedopt_kernels.sim.batched.compiled import CompiledLayersLoss, NotCompilable

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _assert_equal(grads, want):
    for c in range(len(want)):
        for got, ref in zip(grads, want[c]):
            assert got.shape[0] == len(want) and _rel(got[c], ref) <= ROUNDING_RTOL


def test_compiled_gradients_equal_per_client_autograd():
    """Inductor, one graph: the grouped runs' and the batched head's custom autograd Functions included."""
    model, params, x, y, w = _case("cnn")
    want, want_loss = _per_client(model, params, x, y, w)
    engine = CompiledLayersLoss(model, formulations={"features.0": "im2col", "features.2": "grouped-nhwc"})
    assert engine.engine == "layers-compiled" and engine.fullgraph is None  # built at the first call
    grads, loss = engine.grads(params, x, y, w)
    assert engine.fullgraph is True
    assert engine.layers_net.formulations() == {"features.0": "im2col", "features.2": "grouped-nhwc", "head": "bmm"}
    assert _rel(loss, want_loss) <= ROUNDING_RTOL
    _assert_equal(grads, want)
    shared = [p[0] for p in params]  # every client's batch at the same parameters (grads_at)
    want_at, _ = _per_client(model, [s.unsqueeze(0).expand(x.shape[0], *s.shape) for s in shared], x, y, w)
    _assert_equal(engine.grads_at(shared, x, y, w)[0], want_at)


def test_a_graph_break_compiles_the_parts_between():
    """nn.LSTM's fused kernel (the loop formulation) is no graph for Dynamo: the step compiles around it."""
    model, params, x, y, w = _case("char-lstm")
    want, _ = _per_client(model, params, x, y, w)
    engine = CompiledLayersLoss(model, formulations={"LSTM": "loop"}, backend="aot_eager")
    _assert_equal(engine.grads(params, x, y, w)[0], want)
    assert engine.fullgraph is False
    for form in ("bmm-fused", "bmm-sequence"):  # other formulations: compiled again, still right
        engine.layers_net.set_formulations({"LSTM": form})
        _assert_equal(engine.grads(params, x, y, w)[0], want)
        assert engine.layers_net.formulations()["lstm"] == form


def test_a_failing_compiler_raises_not_compilable_once():
    calls = []

    def broken(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no C++ compiler on this machine")

    model, params, x, y, w = _case("mlp")
    engine = CompiledLayersLoss(model, backend=broken)
    with pytest.raises(NotCompilable, match=r"torch.compile .* cannot compute MLP: .*no C\+\+ compiler"):
        engine.grads(params, x, y, w)
    n = len(calls)
    with pytest.raises(NotCompilable, match="no C"):  # at once, without compiling again
        engine.grads_at([p[0] for p in params], x, y, w)
    assert len(calls) == n >= 1


def test_an_input_error_is_raised_as_the_eager_engine_raises_it():
    model, params, x, y, w = _case("mlp")
    engine = CompiledLayersLoss(model, backend="eager")
    with pytest.raises(RuntimeError, match="Expected size for first two dimensions of batch2") as info:
        engine.grads(params, x[..., :5], y, w)  # one pixel short
    assert not isinstance(info.value, NotCompilable)
    want, _ = _per_client(model, params, x, y, w)  # and the engine still works
    _assert_equal(engine.grads(params, x, y, w)[0], want)


def test_past_the_recompile_limit_it_raises_rather_than_run_eagerly(monkeypatch):
    """Compiled in parts (``fullgraph=False``), Dynamo alone would run a step past its recompile limit
    eagerly, without a word: timed as the compiled candidate, that would be the eager engine's time."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    model, params, x, y, w = _case("mlp")
    engine = CompiledLayersLoss(model, backend="eager", fullgraph=False)
    want, _ = _per_client(model, params, x, y, w)
    _assert_equal(engine.grads(params, x, y, w)[0], want)
    assert engine.fullgraph is False
    with pytest.raises(NotCompilable, match="RecompileLimit"):
        engine.grads([p[:2] for p in params], x[:2], y[:2], w[:2])  # two clients: another shape
