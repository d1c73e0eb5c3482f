"""Formulations chosen by measurement (sim/batched/choose.py) and the file that keeps them (choice_cache.py).

The search's logic is tested with a stand-in clock (``Timer.measure`` replaced by a function of the
trial it runs), so that which candidate wins is known; that every formulation computes the
same gradients is tests/test_sim_layers_engine.py's job, and the chosen one is checked here in float64.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List

import pytest
import torch
from torch import nn

from fedopt_kernels.sim.batched import choose
from fedopt_kernels.sim.batched.choice_cache import ChoiceCache
from fedopt_kernels.sim.batched.choose import Chooser, SearchBudget, chunk_sizes, search
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.models.build import build_model


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn", (1, 8, 8), 10)


def _inputs(model: nn.Module, B: int = 4, dtype=torch.float32):
    def make(C: int):
        g = torch.Generator().manual_seed(C)
        params = [p.detach().to(dtype).unsqueeze(0).repeat(C, *([1] * p.dim())) for p in model.parameters()]
        x = torch.randn(C, B, 1, 8, 8, generator=g, dtype=dtype)
        y = torch.randint(0, 10, (C, B), generator=g)
        w = torch.full((C, B), 1.0 / B, dtype=dtype)
        return params, x, y, w

    return make


@pytest.fixture(autouse=True)
def _fresh_process_cache(monkeypatch):
    monkeypatch.setattr(choose, "_PROCESS", {})


def _clock(monkeypatch, cost: Dict[str, Dict[str, float]], step_extra=None) -> List[tuple]:
    """Replace the timer's clock: a layer alone costs ``cost[path][formulation]`` (1.0 if not given); a
    step the sum of its layers' costs, plus ``step_extra(assignment, C)``. Returns the trials run."""
    trials: List[tuple] = []

    def measure(self, trial):
        trials.append(trial)
        if trial[0] == "alone":
            return cost.get(trial[1], {}).get(trial[2], 1.0)
        forms = self.assignments[trial[1]]
        extra = 0.0 if step_extra is None else step_extra(forms, self.x.shape[0])
        return sum(cost.get(p, {}).get(f, 1.0) for p, f in forms.items()) + extra

    monkeypatch.setattr(choose.Timer, "measure", measure)
    return trials


def test_search_takes_the_fastest_candidate_of_every_layer(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)
    _clock(monkeypatch, {"features.0": {"loop": 0.1}, "features.2": {"grouped-nhwc": 0.2}, "head": {"loop": 0.3}})
    choice = search(engine, *_inputs(model)(6), SearchBudget())
    assert choice.formulations == {"features.0": "loop", "features.2": "grouped-nhwc", "head": "loop"}
    assert all("measured fastest" in why for why in choice.why.values()), choice.why
    params, x, y, w = _inputs(model)(6)
    engine.grads(params, x, y, w)
    assert engine.layers_net.formulations() == choice.formulations  # the engine now runs the choice


def test_a_candidate_must_beat_the_default_by_the_margin(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)
    default = choose.defaults(engine, *_inputs(model)(6)[:2])
    slow = {p: {f: 1.0 for f in ("grouped", "grouped-nhwc", "loop", "bmm")} for p in default}
    for p, f in default.items():
        other = "loop" if f != "loop" else "bmm" if p == "head" else "grouped"
        slow[p][other] = 0.99  # 1% faster: within the 5% margin, noise as far as the search knows
    _clock(monkeypatch, slow)
    choice = search(engine, *_inputs(model)(6), SearchBudget())
    assert choice.formulations == default
    assert all("kept" in why for why in choice.why.values()), choice.why


def test_the_whole_step_overrules_the_layers_alone(monkeypatch):
    """Faster alone, slower in the step (what neighbours share): the defaults stay, and say why."""
    model = _cnn()
    engine = LayersLoss(model)
    default = choose.defaults(engine, *_inputs(model)(6)[:2])
    _clock(
        monkeypatch, {"features.0": {"loop": 0.1}}, step_extra=lambda forms, C: 5.0 * (forms["features.0"] == "loop")
    )
    choice = search(engine, *_inputs(model)(6), SearchBudget())
    assert choice.formulations == default
    assert "not in the whole step" in choice.why["features.0"], choice.why
    # without the penalty in the step, the same alone times choose loop
    _clock(monkeypatch, {"features.0": {"loop": 0.1}})
    assert search(engine, *_inputs(model)(6), SearchBudget()).formulations["features.0"] == "loop"


def test_a_change_slower_in_the_step_does_not_take_the_others_down(monkeypatch):
    """Two layers faster alone; together slower in the step because of one of them: the other is
    kept, tried alone in the whole step (the larger gain alone first)."""
    model = _cnn()
    engine = LayersLoss(model)
    default = choose.defaults(engine, *_inputs(model)(6)[:2])
    alone = {"features.0": {"loop": 0.1}, "head": {"loop": 0.5}}  # features.0 gains 0.9 s alone, head 0.5 s
    trials = _clock(monkeypatch, alone, step_extra=lambda forms, C: 5.0 * (forms["features.0"] == "loop"))
    choice = search(engine, *_inputs(model)(6), SearchBudget())
    assert choice.formulations == {**default, "head": "loop"}, choice.why
    assert "not in the whole step" in choice.why["features.0"]
    assert "and in the whole step" in choice.why["head"]
    steps = [trial for trial in trials if trial[0] == "step"]
    assert len({name for _, name in steps}) == 4  # together vs defaults, then each change with vs without


def test_layers_with_one_signature_share_one_measurement(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3))
    engine = LayersLoss(model)
    trials = _clock(monkeypatch, {"0": {"loop": 0.1}, "2": {"loop": 0.1}, "4": {"loop": 0.5}})

    def inputs(C):
        params = [p.detach().unsqueeze(0).repeat(C, *([1] * p.dim())) for p in model.parameters()]
        return params, torch.randn(C, 3, 5), torch.randint(0, 3, (C, 3)), torch.full((C, 3), 1 / 3)

    choice = search(engine, *inputs(4), SearchBudget(rounds=1))
    # 0 and 2: Linear(5, 5) on 5 features, one group; 4: Linear(5, 3), its own
    assert choice.formulations == {"0": "loop", "2": "loop", "4": "loop"}
    assert len(choice.times_s) == 2
    assert {t[1] for t in trials if t[0] == "alone"} == {"0", "4"}


def test_no_budget_left_keeps_the_defaults_and_says_why(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)
    trials = _clock(monkeypatch, {"features.0": {"loop": 0.01}})
    choice = search(engine, *_inputs(model)(6), SearchBudget(seconds=0.0))
    assert not [t for t in trials if t[0] == "alone"]
    assert choice.formulations == choose.defaults(engine, *_inputs(model)(6)[:2])
    assert all("budget" in why for p, why in choice.why.items()), choice.why


def test_a_candidate_out_of_memory_is_dropped(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)
    _clock(monkeypatch, {"features.2": {"loop": 0.001}})
    fake = choose.Timer.measure

    def measure(self, trial):
        if trial == ("alone", "features.2", "loop"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fake(self, trial)

    monkeypatch.setattr(choose.Timer, "measure", measure)
    choice = search(engine, *_inputs(model)(6), SearchBudget(rounds=1))
    assert choice.formulations["features.2"] != "loop"
    params, x, _, _ = _inputs(model)(6)
    layer_input = choose.layer_inputs(engine, params, x)["features.2"][0]
    assert "loop" not in choice.times_s[choose.layer_signature(engine, "features.2", layer_input)]


def test_another_error_is_not_swallowed(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)

    def measure(self, trial):
        raise RuntimeError("a bug in a formulation")

    monkeypatch.setattr(choose.Timer, "measure", measure)
    with pytest.raises(RuntimeError, match="a bug"):
        search(engine, *_inputs(model)(6), SearchBudget(rounds=1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_layer_alone_runs_its_forward_and_backward(precision):
    """The real timer: each candidate of every layer runs alone without error, on the step's input
    (under bf16 that input is bfloat16: the layer alone runs under the step's autocast too)."""
    model = _cnn()
    engine = LayersLoss(model, precision=precision)
    params, x, y, w = _inputs(model)(5)
    timer = choose.Timer(engine, params, x, y, w, SearchBudget(rounds=1))
    timer.inputs = choose.layer_inputs(engine, params, x)
    assert timer.inputs["features.0"][1] is False and timer.inputs["features.2"][1] is True
    for path, layer in engine.layers_net.layers.items():
        for form in choose.candidates(layer, timer.inputs[path][0]):
            assert timer.measure(("alone", path, form)) > 0
        assert layer.params == {}  # nothing left behind


@pytest.mark.parametrize(
    "sampled, fit, sizes",
    [
        (100, 100, [100, 50, 25, 13]),
        (1000, 250, [250, 125, 63, 32]),
        (5, 64, [5, 3, 2, 1]),
        (1, 1, [1]),
        (10, 3, [3, 2, 1]),
    ],
)
def test_chunk_sizes_are_equal_chunks_that_fit(sampled, fit, sizes):
    got = chunk_sizes(sampled, fit)
    assert got == sizes
    assert all(n <= fit for n in got)
    for n in got:  # equal chunks: the last one at most one client short
        chunks = math.ceil(sampled / n)
        assert n * chunks - sampled < chunks


def test_plan_takes_the_size_with_the_shortest_round(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)
    # a step costs 0.05 s per client on top of its layers (3 s): more clients at once is faster per
    # round until a collapse past 30 clients (0.5 s per client), as a library slows for many groups
    _clock(monkeypatch, {}, step_extra=lambda forms, C: 0.05 * C + (0.5 * C if C > 30 else 0.0))
    chooser = Chooser(engine, _inputs(model), mode="measure")
    n, choice = chooser.plan(100, 100, steps_per_run=10)
    # sizes 100, 50, 25, 13: rounds 1 x 58, 2 x 30.5, 4 x 4.25, 8 x 3.65
    assert n == 25 and choice.clients == 25


def test_default_mode_measures_nothing(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)

    def measure(self, trial):
        raise AssertionError("default mode must not time anything")

    monkeypatch.setattr(choose.Timer, "measure", measure)
    chooser = Chooser(engine, _inputs(model), mode="default")
    n, choice = chooser.plan(40, 16, steps_per_run=1000)
    assert n == 14  # the fewest equal chunks that fit: 40 in 3 chunks of 14
    assert choice.formulations == choose.defaults(engine, *_inputs(model)(14)[:2])
    assert chooser.spent_s == 0.0


def test_default_mode_takes_the_next_size_when_one_runs_out_of_memory_and_records_it(monkeypatch):
    from fedopt_kernels.core import fallbacks

    model = _cnn()
    engine = LayersLoss(model)
    real = engine.grads
    tried: List[int] = []

    def grads(params, x, y, w):
        tried.append(x.shape[0])
        if x.shape[0] > 8:
            raise torch.OutOfMemoryError(f"out of memory at {x.shape[0]} clients")
        return real(params, x, y, w)

    monkeypatch.setattr(engine, "grads", grads)
    since = fallbacks.mark()
    n, choice = Chooser(engine, _inputs(model), mode="default").plan(40, 16, steps_per_run=1000)
    assert tried == [14, 7] and n == 7 == choice.clients  # 40 in 3 chunks of 14, then in 6 of 7
    [taken] = fallbacks.taken(since)
    assert taken["choice"] == "14 clients at once" and "out of memory at 14 clients" in taken["error"]


def test_an_out_of_memory_while_sizes_are_searched_is_recorded(monkeypatch):
    from fedopt_kernels.core import fallbacks

    model = _cnn()
    engine = LayersLoss(model)
    _clock(monkeypatch, {})
    real = choose.Chooser._size

    def size(self, n, *rest):
        if n == 100:
            raise torch.OutOfMemoryError("out of memory at 100 clients")
        return real(self, n, *rest)

    monkeypatch.setattr(choose.Chooser, "_size", size)
    since = fallbacks.mark()
    n, _ = Chooser(engine, _inputs(model), mode="measure").plan(100, 100, steps_per_run=10)
    assert n != 100
    assert [t["choice"] for t in fallbacks.taken(since)] == ["100 clients at once"]


def test_auto_spends_a_share_of_the_runs_estimated_time(monkeypatch):
    model = _cnn()
    engine = LayersLoss(model)
    calls = _clock(monkeypatch, {})  # every step "takes" 3 s (three layers at 1 s)
    budgets: List[float] = []
    real = choose.search

    def spy(engine, params, x, y, w, budget, *rest):
        budgets.append(budget.seconds)
        return real(engine, params, x, y, w, budget, *rest)

    monkeypatch.setattr(choose, "search", spy)
    Chooser(engine, _inputs(model), mode="auto").plan(10, 10, steps_per_run=5000, fixed=10)
    # one round of 1 chunk, 5000 steps of 3 s: 2% of 15,000 s
    assert budgets == [pytest.approx(choose.AUTO_SHARE * 3.0 * 5000)]
    assert calls


def test_auto_reuses_a_choice_made_in_the_process(monkeypatch):
    model = _cnn()
    _clock(monkeypatch, {"features.0": {"loop": 0.1}})
    first = Chooser(LayersLoss(model), _inputs(model), mode="measure")
    first.plan(6, 6, steps_per_run=10**6, fixed=6)
    calls = _clock(monkeypatch, {"features.0": {"grouped": 0.1}})  # another device state: would differ
    second = Chooser(LayersLoss(model), _inputs(model), mode="auto")
    _, choice = second.plan(6, 6, steps_per_run=10**6, fixed=6)
    assert choice.formulations["features.0"] == "loop" and choice.source == "process"
    assert not calls


def test_the_cache_file_keeps_choices_across_processes(monkeypatch, tmp_path):
    model = _cnn()
    path = tmp_path / "choices.json"
    _clock(monkeypatch, {"features.0": {"loop": 0.1}})
    Chooser(LayersLoss(model), _inputs(model), mode="measure", cache=ChoiceCache(path)).plan(6, 6, 10**6, fixed=6)
    saved = json.loads(path.read_text())  # plain data
    assert saved["format"] == 1 and len(saved["entries"]) == 1
    monkeypatch.setattr(choose, "_PROCESS", {})  # a new process
    calls = _clock(monkeypatch, {"features.0": {"grouped": 0.1}})
    _, choice = Chooser(LayersLoss(model), _inputs(model), mode="auto", cache=ChoiceCache(path)).plan(
        6, 6, 10**6, fixed=6
    )
    assert choice.formulations["features.0"] == "loop" and choice.source == "cache"
    assert "cache file" in choice.why["features.0"]
    assert not calls
    # another batch size is another key: measured
    _, other = Chooser(LayersLoss(model), _inputs(model, B=5), mode="auto", cache=ChoiceCache(path)).plan(
        6, 6, 10**6, fixed=6
    )
    assert other.source == "measured" and other.formulations["features.0"] == "grouped"
    assert len(json.loads(path.read_text())["entries"]) == 2
    assert not list(tmp_path.glob(".choices.json.*"))  # no temporary file left behind


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # cut short
        lambda text: "[1, 2, 3]",  # JSON, but no cache
        lambda text: text.replace('"loop"', '"no-such-formulation"'),  # names what does not exist
        lambda text: text.replace('"clients": 6', '"clients": 7'),  # stored under another key
    ],
)
def test_a_damaged_cache_is_ignored_and_measured_again(monkeypatch, tmp_path, damage):
    model = _cnn()
    path = tmp_path / "choices.json"
    _clock(monkeypatch, {"features.0": {"loop": 0.1}})
    Chooser(LayersLoss(model), _inputs(model), mode="measure", cache=ChoiceCache(path)).plan(6, 6, 10**6, fixed=6)
    path.write_text(damage(path.read_text()))
    monkeypatch.setattr(choose, "_PROCESS", {})
    calls = _clock(monkeypatch, {"features.0": {"grouped-nhwc": 0.1}})
    with pytest.warns(RuntimeWarning, match="formulation cache"):
        _, choice = Chooser(LayersLoss(model), _inputs(model), mode="auto", cache=ChoiceCache(path)).plan(
            6, 6, 10**6, fixed=6
        )
    assert calls and choice.source == "measured"
    assert choice.formulations["features.0"] == "grouped-nhwc"


def test_the_chosen_formulations_compute_per_client_gradients(monkeypatch):
    """End to end in float64: whatever the clock says, the chosen step equals per-client autograd."""
    model = _cnn().double()
    engine = LayersLoss(model)
    _clock(monkeypatch, {"features.0": {"loop": 0.1}, "features.2": {"grouped-nhwc": 0.1}, "head": {"loop": 0.1}})
    params, x, y, w = _inputs(model, dtype=torch.float64)(3)
    Chooser(engine, _inputs(model, dtype=torch.float64), mode="measure").plan(3, 3, 10, fixed=3)
    grads, _ = engine.grads(params, x, y, w)
    for c in range(3):
        with torch.no_grad():
            for p, s in zip(model.parameters(), params):
                p.copy_(s[c])
        model.zero_grad()
        out = model(x[c])
        (torch.nn.functional.cross_entropy(out, y[c], reduction="none") * w[c]).sum().backward()
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(g[c], p.grad, rtol=1e-12, atol=1e-14)


def test_bad_mode_is_refused_by_name():
    model = _cnn()
    with pytest.raises(ValueError, match="formulations must be one of"):
        Chooser(LayersLoss(model), _inputs(model), mode="fastest")


@pytest.mark.slow
def test_a_resumed_run_takes_back_the_measured_choice(monkeypatch, tmp_path):
    """The checkpoint records the clients at once and the formulations; a resumed run measuring
    otherwise (another process, another moment) still computes what the uninterrupted run did."""
    from test_sim_resume import comparable, make, same_floats, tiny_config

    cfg = tiny_config("fedavg", client_batched="auto", formulations="measure", rounds=3)
    _clock(monkeypatch, {"features.0": {"loop": 0.01}, "features.2": {"loop": 0.01}})
    whole = make(cfg)
    expected = whole.run()
    assert expected["client_batched"]["formulations"]["features.0"] == "loop", expected["client_batched"]

    first = make(cfg, folder=tmp_path / "ck")
    for t in range(2):
        first.run_round(t)
    first.save_checkpoint()
    monkeypatch.setattr(choose, "_PROCESS", {})
    calls = _clock(monkeypatch, {"features.0": {"grouped": 0.01}, "features.2": {"grouped": 0.01}})
    again = make(cfg, folder=tmp_path / "ck")
    got = again.run(resume=True)
    assert not calls  # nothing measured: the checkpoint's choice came back
    assert got["client_batched"]["formulations"] == expected["client_batched"]["formulations"]
    assert got["client_batched"]["size"] == expected["client_batched"]["size"]
    assert same_floats(comparable(got), comparable(expected))


def test_the_compiled_step_is_kept_only_when_faster(monkeypatch):
    from fedopt_kernels.sim.batched.compiled import CompiledLayersLoss

    model = _cnn()
    trials = _clock(monkeypatch, {})
    fake = choose.Timer.measure
    factor = {"compiled": 0.5}

    def measure(self, trial):
        t = fake(self, trial)
        return t * factor["compiled"] if isinstance(self.engine, CompiledLayersLoss) else t

    monkeypatch.setattr(choose.Timer, "measure", measure)
    choice = search(LayersLoss(model), *_inputs(model)(4), SearchBudget(rounds=1), compile_step=True)
    assert choice.compiled and "compiled with torch.compile" in choice.compile_note
    assert choice.step_s == pytest.approx(1.5)  # three layers at 1 s, halved
    factor["compiled"] = 0.97  # 3% faster: within the margin
    choice = search(LayersLoss(model), *_inputs(model)(4), SearchBudget(rounds=1), compile_step=True)
    assert not choice.compiled and "not 5% faster" in choice.compile_note
    assert trials


def test_a_step_that_does_not_compile_is_not_a_candidate(monkeypatch):
    from fedopt_kernels.sim.batched.compiled import CompiledLayersLoss, NotCompilable

    model = _cnn()
    _clock(monkeypatch, {})
    fake = choose.Timer.measure

    def measure(self, trial):
        if isinstance(self.engine, CompiledLayersLoss):
            raise NotCompilable("torch.compile (inductor) cannot compute SmallCNN: a stand-in failure")
        return fake(self, trial)

    monkeypatch.setattr(choose.Timer, "measure", measure)
    choice = search(LayersLoss(model), *_inputs(model)(4), SearchBudget(rounds=1), compile_step=True)
    assert not choice.compiled and "stand-in failure" in choice.compile_note


@pytest.mark.slow
def test_a_run_whose_search_chose_the_compiled_step_trains_through_it(monkeypatch):
    """The simulator swaps its engine for the compiled one, and the run still equals the eager run."""
    from test_sim_resume import comparable, make, same_floats, tiny_config

    from fedopt_kernels.sim.batched.compiled import CompiledLayersLoss

    base = tiny_config("fedavg", client_batched=3, rounds=2)
    eager = make(base.replace(formulations="default")).run()
    _clock(monkeypatch, {})
    fake = choose.Timer.measure
    monkeypatch.setattr(
        choose.Timer,
        "measure",
        lambda self, trial: fake(self, trial) * (0.5 if isinstance(self.engine, CompiledLayersLoss) else 1.0),
    )
    monkeypatch.setattr(choose.Chooser, "__init__", _with_compile(choose.Chooser.__init__))
    sim = make(base.replace(formulations="measure"))
    got = sim.run()
    assert isinstance(sim.batched.loss, CompiledLayersLoss) and got["client_batched"]["compiled"]
    # the stand-in clock chose the defaults' formulations: compiled or not, the same math to rounding
    for a, b in zip(comparable(got)["history"], comparable(eager)["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    assert same_floats(got["history"][0]["clients"], eager["history"][0]["clients"])


def _with_compile(init):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.compile_step = True

    return patched
