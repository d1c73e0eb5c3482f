"""The benchmark's goal verdicts do not turn with the machine's load: the rows a goal compares are timed
interleaved, a figure taken under other processes' load is judged "disturbed", and a goal whose
counterpart rows were not run is "n/a" with the reason, never "miss"."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.timing as timing  # noqa: E402
from bench.step_goals import judge_rows  # noqa: E402

QUIET, BUSY = 0.0, 1.2  # cores other processes used


def _row(backend="cpu", speedup=6.0, load=QUIET, against=QUIET, device="cpu", size="resnet18"):
    return dict(
        algorithm="fednar",
        backend=backend,
        size=size,
        device_type=device,
        speedup_ref=speedup,
        other_load_cores=load,
        against_load={"speedup_ref": against},
    )


def _verdict(rows, device="cpu", skipped=None, key=">=5x ref"):
    (goal,) = [g for g in judge_rows(rows, device, skipped) if key in g["goal"]]
    return goal


@pytest.mark.parametrize(
    "speedup,load,against,expected",
    [
        (6.0, QUIET, QUIET, "pass"),
        (3.77, QUIET, QUIET, "miss"),  # the check can fail: a quiet miss is a miss
        (6.0, QUIET, BUSY, "disturbed"),  # the reference slowed by load: the ratio flatters the row
        (3.77, BUSY, QUIET, "disturbed"),  # the row slowed by load
    ],
)
def test_a_figure_taken_under_load_is_neither_pass_nor_miss(speedup, load, against, expected):
    rows = [_row(speedup=speedup, load=load, against=against)]
    goal = _verdict(rows)
    assert goal["verdict"] == expected and rows[0]["goals"]["cpu: >=5x ref"] == expected
    assert goal["disturbed"] == (["fednar/cpu/resnet18"] if expected == "disturbed" else [])


def test_a_quiet_miss_outweighs_a_disturbed_row():
    rows = [_row(speedup=3.77), _row(speedup=6.0, against=BUSY, size="large")]
    assert _verdict(rows)["verdict"] == "miss"


def test_a_goal_whose_counterpart_was_not_run_is_na_with_the_reason():
    """The GPU check leaves the reference rows out on purpose: ">= 10x over reference" has no figure."""
    rows = [_row(backend=b, speedup=None, device="cuda") for b in ("cuda", "triton", "cuda eager")]
    goal = _verdict(rows, "cuda", {"reference": "not requested"}, key=">=10x ref")
    assert goal["verdict"] == "n/a" and goal["missed"] == [] and goal["judged"] == 0
    assert goal["reason"] == "the reference rows were not timed (not requested)"
    assert {r["goals"]["gpu: >=10x ref"] for r in rows} == {"n/a"}
    # the same rows with the reference timed are judged (this check can fail)
    for r in rows:
        r["speedup_ref"] = 4.0
    assert _verdict(rows, "cuda", {}, key=">=10x ref")["verdict"] == "miss"


def test_a_goal_none_of_whose_rows_ran_is_na():
    goal = _verdict([_row(size="small_cnn")])
    assert goal["verdict"] == "n/a" and "were run" in goal["reason"]


class _Clock:
    """bench.timing's ``time`` on a fake clock: a call of case ``name`` takes ``base[name]`` seconds,
    three times that while a burst of other load lasts (``burst``, in fake seconds)."""

    def __init__(self, base, burst):
        self.now, self.base, self.burst, self.log = 0.0, base, burst, []

    def perf_counter(self):
        return self.now

    def in_burst(self, t):
        return self.burst[0] <= t < self.burst[1]

    def call(self, name):
        self.log.append(name)
        self.now += self.base[name] * (3 if self.in_burst(self.now) else 1)


def test_interleaved_rounds_keep_the_ratio_through_a_burst_of_load(monkeypatch):
    clock = _Clock({"a": 1e-3, "b": 4e-3}, burst=(0.3, 0.9))

    starts = []  # where each timed block begins in the clock's log of calls

    class Load:
        def __enter__(self):
            self.start = clock.now
            starts.append(len(clock.log))
            return self

        def __exit__(self, *exc):
            hit = clock.in_burst(self.start) or clock.in_burst(clock.now) or self.start < clock.burst[0] < clock.now
            self.cores = BUSY if hit else QUIET

    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(timing, "OtherLoad", Load)
    budget = timing.Budget(warmup=1, min_reps=3, max_reps=100, min_time_s=0.25)
    a, b = timing.time_interleaved([lambda: clock.call("a"), lambda: clock.call("b")], torch.device("cpu"), budget)
    assert timing.median(b.times) / timing.median(a.times) == pytest.approx(4.0)
    assert a.other_load == QUIET and b.other_load == QUIET  # the burst's blocks were dropped
    blocks = [clock.log[i] for i in starts]
    rounds = [blocks[i : i + 2] for i in range(0, len(blocks), 2)]
    assert all(sorted(r) == ["a", "b"] for r in rounds)  # one block of each case per round
    assert timing.BLOCKS < len(rounds) <= timing.MAX_BLOCKS  # the burst's rounds were made up for
    assert {r[0] for r in rounds} == {"a", "b"}  # neither always first


def test_a_case_that_fails_is_reported_and_the_others_are_timed():
    def broken():
        raise RuntimeError("no kernel for this dtype")

    ok, bad = timing.time_interleaved([lambda: None, broken], torch.device("cpu"), timing.Budget(1, 3, 3, 0.0))
    assert len(ok.times) >= 3 and ok.error is None
    assert bad.times == [] and bad.error == "RuntimeError: no kernel for this dtype"


def _clients_result(fused_rate, seq_load=QUIET):
    """A client-batched run of the small CNN at C=50: the sequential mode at 1,000 client-steps/s."""

    def mode(name, rate, load=QUIET):
        return dict(model="small-cnn", clients=50, mode=name, client_steps_per_s=rate, other_load_cores=load)

    rows = [mode("sequential", 1000.0, seq_load)]
    if fused_rate is not None:
        rows += [mode("batched-fused", fused_rate), mode("batched-fused-default", fused_rate)]
    meta = dict(device_type="cpu", models=["small-cnn"], clients={"small-cnn": [50]})
    return {"meta": meta, "rows": rows, "models": {}, "peak": []}


@pytest.mark.parametrize(
    "fused_rate,seq_load,expected",
    [
        (9000.0, QUIET, "pass"),
        (7000.0, QUIET, "miss"),  # the check can fail: 7x sequential, quiet
        (9000.0, BUSY, "disturbed"),  # the sequential round ran under load
        (None, QUIET, "n/a"),  # no batched-fused row at C=50
    ],
)
def test_client_batched_goals_have_the_same_verdicts(fused_rate, seq_load, expected):
    from bench.clients.goals import judge

    goals = {g["goal"]: g for g in judge(_clients_result(fused_rate, seq_load))}
    goal = goals["small-cnn: batched-fused >= 8x sequential at C=50"]
    assert goal["verdict"] == expected and (goal["reason"] is None) == (expected in ("pass", "miss"))
    assert goal["value"] == (None if fused_rate is None else pytest.approx(fused_rate / 1000.0))


def test_other_processes_load_disturbs_cpu_figures_only():
    """The mechanism every benchmark's goals use: a figure under load is disturbed on a CPU; on a GPU
    the CPU's other load does not time the device, and the figure is judged."""
    from bench.goals import Figure, Goal

    goal = Goal("k", "k", "rows", 2.0, lambda figures: figures)
    loaded, quiet = Figure("a", 3.0, (BUSY,)), Figure("b", 1.0, (QUIET, None))
    assert [goal.verdict(f, "cpu") for f in (loaded, quiet)] == ["disturbed", "miss"]
    assert [goal.verdict(f, "cuda") for f in (loaded, quiet)] == ["pass", "miss"]
    assert goal.judge([loaded, quiet], "cpu").verdict == "miss"  # a quiet miss outweighs a disturbed figure
    assert goal.judge([loaded], "cpu").verdict == "disturbed" and goal.judge([loaded], "cuda").verdict == "pass"
    assert goal.judge([], "cpu").reason == "none of its rows (rows) were run"


def _choice_result(fused_times, default_times, chosen, default):
    """The small CNN at C=50, K=10: both batched modes' interleaved rounds, and the search's choice."""

    def mode(name, times):
        rate = 500 / min(times)  # the report's rate: the best round
        return dict(model="small-cnn", clients=50, steps=10, mode=name, round_times_s=times, client_steps_per_s=rate)

    rows = [
        dict(model="small-cnn", clients=50, choice={"formulations": chosen}, default_formulations=default),
        mode("batched-fused", fused_times),
        mode("batched-fused-default", default_times),
    ]
    meta = dict(device_type="cpu", models=["small-cnn"], clients={"small-cnn": [50]})
    return {"meta": meta, "rows": rows, "models": {}, "peak": []}


CHOSEN_GOAL = "small-cnn: chosen formulations >= the defaults at C=50 (median rounds; 1 where it kept the defaults)"


def test_chosen_formulations_equal_to_the_defaults_are_the_same_computation():
    """Kept defaults: exactly 1 (the same kernels), whatever a lucky best round of either mode says."""
    from bench.clients.goals import judge

    same = {"conv": "grouped-nhwc"}
    goal = {g["goal"]: g for g in judge(_choice_result([0.15, 0.16, 0.15], [0.11, 0.16, 0.17], same, same))}
    assert goal[CHOSEN_GOAL]["value"] == 1.0 and goal[CHOSEN_GOAL]["verdict"] == "pass"


@pytest.mark.parametrize(
    "fused,default,expected",
    [
        ([0.10, 0.11, 0.12], [0.13, 0.12, 0.14], "pass"),
        ([0.13, 0.14, 0.10], [0.11, 0.12, 0.12], "miss"),  # a lucky best round does not hide a slower median
    ],
)
def test_other_formulations_are_judged_on_median_rounds(fused, default, expected):
    from bench.clients.goals import judge

    result = _choice_result(fused, default, {"conv": "im2col"}, {"conv": "grouped-nhwc"})
    goal = {g["goal"]: g for g in judge(result)}[CHOSEN_GOAL]
    assert goal["verdict"] == expected
    assert goal["value"] == pytest.approx(sorted(default)[1] / sorted(fused)[1])


def test_a_missed_goal_reads_as_information():
    """The main job runs the quick benchmark: a miss there is a figure about the machine, and the report
    says so above the verdicts."""
    import json

    from bench.goals import INFORMATION
    from bench.step_report import markdown

    result = json.loads((ROOT / "bench" / "results" / "cpu-amd-epyc-2c-2026-11-26-quick.json").read_text())
    result["goals"] = [dict(g, verdict="miss") for g in judge_rows(result["rows"], "cpu")]
    goals = markdown(result).split("## Goals", 1)[1]
    assert "**miss**" in goals
    assert goals.index(INFORMATION) < goals.index("**miss**")
    assert "not a test" in INFORMATION and "exits 0" in INFORMATION
