"""``auto``'s search spends at most its share of the run (sim/batched/choose.py, timing.py), measured.

A stand-in clock that advances by what each call "takes" makes the accounting exact: the search
stops before a call that would not fit, so what it spent never passes its budget. With the real
clock, what ``Chooser.plan`` took is timed around it: at most the budget and the calls of one round
that took longer than predicted, and a run too short to search (50 steps) spends nothing on it and
says so.
"""

from __future__ import annotations

import time
from typing import Dict, List, Tuple

import pytest
from test_choose import _cnn, _inputs
from test_sim_resume import make, tiny_config

from fedopt_kernels.sim.batched import choose, timing
from fedopt_kernels.sim.batched.choose import AUTO_SHARE, MIN_SHARE_STEPS, Chooser
from fedopt_kernels.sim.batched.layers import FORMULATIONS
from fedopt_kernels.sim.batched.layers_engine import LayersLoss


@pytest.fixture(autouse=True)
def _fresh_process_cache(monkeypatch):
    monkeypatch.setattr(choose, "_PROCESS", {})


def _stand_in_clock(monkeypatch, cost: Dict[Tuple[str, str], float]) -> List[Tuple[float, float]]:
    """``timing.CLOCK`` advanced only by calls: a layer alone costs ``cost[(path, form)]`` (1 s if not
    given), a step its layers' sum. Returns (start, seconds) of every call."""
    now = [0.0]
    calls: List[Tuple[float, float]] = []

    def measure(self, trial):
        if trial[0] == "alone":
            t = cost.get((trial[1], trial[2]), 1.0)
        else:
            t = sum(cost.get((p, f), 1.0) for p, f in self.assignments[trial[1]].items())
        calls.append((now[0], t))
        now[0] += t
        return t

    monkeypatch.setattr(timing, "CLOCK", lambda: now[0])
    monkeypatch.setattr(timing.Timer, "measure", measure)
    return calls


@pytest.mark.parametrize("share_steps", [MIN_SHARE_STEPS, 40, 200])
def test_the_search_never_spends_past_its_budget(monkeypatch, share_steps):
    """Every call costs at most the defaults' step (3 s): the search ends within its budget exactly.
    Its calls: the probe 4 x 3 s, the convolutions' five candidates 4 x 1 s each (two layers), the
    head's two, the whole step 4 x 3 s: 84 s, more than 20 step times (60 s) allow, so there the
    whole step is not timed."""
    model = _cnn()
    calls = _stand_in_clock(monkeypatch, {})
    steps = round(share_steps / AUTO_SHARE)  # one chunk: the budget is share_steps step times
    chooser = Chooser(LayersLoss(model), _inputs(model), mode="auto")
    _, choice = chooser.plan(6, 6, steps_per_run=steps, fixed=6)
    assert chooser.budget_s == pytest.approx(AUTO_SHARE * 3.0 * steps)
    assert chooser.spent_s <= chooser.budget_s
    assert sum(t for _, t in calls) <= chooser.budget_s
    assert (choice.step_s is not None) == (3.0 * share_steps >= 84.0), (choice.step_s, choice.why)


def test_a_call_longer_than_predicted_is_the_only_overrun(monkeypatch):
    """A candidate's first call takes 10 step times where a step was predicted: the search overruns
    by that call at most and makes no call once past its budget."""
    model = _cnn()
    calls = _stand_in_clock(monkeypatch, {("features.0", "loop"): 30.0})
    steps = round(MIN_SHARE_STEPS / AUTO_SHARE)
    chooser = Chooser(LayersLoss(model), _inputs(model), mode="auto")
    chooser.plan(6, 6, steps_per_run=steps, fixed=6)
    budget = chooser.budget_s
    assert budget is not None
    assert chooser.spent_s <= budget + 30.0
    assert all(start < budget for start, _ in calls)  # nothing started past the budget


def test_the_budget_check_can_fail(monkeypatch):
    """Without the prediction (every call fits), the same search spends past the budget."""
    model = _cnn()
    _stand_in_clock(monkeypatch, {})
    monkeypatch.setattr(timing.SearchBudget, "fits", lambda self, seconds: True)
    chooser = Chooser(LayersLoss(model), _inputs(model), mode="auto")
    chooser.plan(6, 6, steps_per_run=round(MIN_SHARE_STEPS / AUTO_SHARE), fixed=6)
    assert chooser.spent_s > chooser.budget_s


def test_a_long_enough_run_searches_within_its_budget_on_the_real_clock(one_thread):
    """The real clock: what plan() took, timed around it, is at most the budget plus one round of the
    longest call (the most a misprediction can add: each call of a round was predicted to fit)."""
    model = _cnn()
    calls: List[float] = []
    real = timing.Timer.measure

    def measure(self, trial):
        t = real(self, trial)
        calls.append(t)
        return t

    chooser = Chooser(LayersLoss(model), _inputs(model), mode="auto")
    timing.Timer.measure = measure
    try:
        t0 = time.perf_counter()
        _, choice = chooser.plan(6, 6, steps_per_run=round(4 * MIN_SHARE_STEPS / AUTO_SHARE), fixed=6)
        took = time.perf_counter() - t0
    finally:
        timing.Timer.measure = real
    assert chooser.budget_s is not None and calls
    candidates = max(len(FORMULATIONS[layer.kind]) for layer in chooser.engine.layers_net.layers.values())
    assert took <= chooser.budget_s + candidates * max(calls), (took, chooser.budget_s, max(calls))
    assert choice.note == "" or "not cached" in choice.note


def test_a_50_step_run_is_not_searched_and_says_so(monkeypatch):
    """50 local steps: 2% of them is one step time, too little for a search: plan() times nothing,
    looks nothing up, builds nothing, takes the defaults, and the results say why (and name the
    defaults the layers took); what it took is timed around it and is under 2% of the run's wall time."""
    took: List[float] = []
    real = Chooser.plan

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = real(self, *args, **kwargs)
        took.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(Chooser, "plan", timed)

    def no_timing(self, trial):
        raise AssertionError("a run too short to search must time nothing")

    monkeypatch.setattr(timing.Timer, "measure", no_timing)
    cfg = tiny_config("fedavg", client_batched=3, formulations="auto", rounds=5, local_steps=10)
    t0 = time.perf_counter()
    result = make(cfg).run()
    wall = time.perf_counter() - t0
    got = result["client_batched"]
    assert "not searched" in got["search_note"] and "50 steps" in got["search_note"]
    assert all("not searched" in why for why in got["why"].values())
    defaults = choose.defaults(LayersLoss(_cnn()), *_inputs(_cnn(), B=cfg.batch_size)(3)[:2])
    assert got["formulations"] == defaults
    assert len(took) == 1 and took[0] <= AUTO_SHARE * wall, (took, wall)
