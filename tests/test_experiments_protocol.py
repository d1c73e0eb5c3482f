"""experiments/run_protocol.py: its arguments, the protocol's rules (equal grids, per-epoch decay,
selection, the verdict), and a one-round smoke run of every experiment on the built-in digits."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "run_protocol.py"
spec = importlib.util.spec_from_file_location("run_protocol", SCRIPT)
assert spec is not None and spec.loader is not None
rp = importlib.util.module_from_spec(spec)
sys.modules["run_protocol"] = rp  # dataclasses look their module up there
spec.loader.exec_module(rp)

EXPS = rp.experiments("digits", None)


def test_defaults():
    args = rp.parse_args(["feddecay"])
    assert args.seeds == [0, 1, 2, 3, 4] and args.jobs == 1 and args.dataset == "fmnist"
    assert args.out.endswith("protocol") and not args.quick


def test_quick_keeps_the_first_seed():
    assert rp.parse_args(["fednar", "--quick", "--seeds", "3", "4"]).seeds == [3]


@pytest.mark.parametrize(
    "argv",
    [
        ["nosuch"],
        ["feddyn", "--jobs", "0"],
        ["feddyn", "--seeds", "1", "1"],
        ["feddyn", "--seeds", "-1"],
        ["feddyn", "--seeds", str(rp.PILOT_SEED)],
        ["feddyn", "--dataset", "cifar10"],
        ["feddyn", "--client-parallel", "0"],
        ["feddyn", "--device", "tpu"],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        rp.parse_args(argv)


def test_all_is_every_experiment():
    assert "all" in rp.parse_args(["all"]).experiment
    assert set(EXPS) == {"feddecay", "fednlr-shards", "fednlr-dir", "fednar", "padamfed", "feddyn", "fednlr-drift"}


PILOTS = {"fednar": {"max_norm": 1.0}, "padamfed": {"eta": 0.01, "gamma": 0.1, "beta": 0.5}, "feddyn": {"target": 0.5}}


@pytest.mark.parametrize("name", sorted(EXPS))
def test_method_and_baseline_grids_are_equal_in_size(name):
    exp = EXPS[name]
    methods = exp.methods(PILOTS.get(name, {}))
    for method, baseline, _, _how in exp.comparisons:
        if baseline is None:  # a claim about one method's own number (against zero)
            continue
        if method == "PAdaMFed (theory)":  # the paper's claim itself: untuned against tuned
            assert len(methods[method]) == 1
            continue
        assert len(methods[method]) == len(methods[baseline]), (method, baseline)


def test_baseline_lr_grid_contains_the_methods_lrs():
    """The method's knob buys the baseline extra lr points over the same range, not another range."""
    for name in ("feddecay", "fednlr-dir"):
        methods = EXPS[name].methods({})
        method_lrs = {cfg["lr"] for cfg in methods[next(iter(methods))].values()}
        base_lrs = {cfg["lr"] for cfg in methods["FedAvg"].values()}
        assert method_lrs <= base_lrs and min(base_lrs) == min(method_lrs) and max(base_lrs) == max(method_lrs)


def test_device_and_client_parallel_reach_every_run_but_fednar():
    exps = rp.experiments("digits", None, "cuda", 8)
    for name, exp in exps.items():
        assert exp.base["device"] == "cuda"
        assert exp.base["client_parallel"] == (1 if name in ("fednar", "fednlr-drift") else 8)


def test_feddecay_decays_per_epoch():
    base = EXPS["feddecay"].base
    assert base["decay_every"] > 1 and base["local_steps"] == 3 * base["decay_every"]  # K = 3 epochs
    assert base["finetune_steps"] == base["decay_every"]  # fine-tuning: one epoch


def test_padamfed_sweep_scales_eta_and_gamma_together():
    pilot = PILOTS["padamfed"]
    sweep = EXPS["padamfed"].methods(pilot)["PAdaMFed (tuned)"]
    ratios = {round(cfg["server_lr"] / cfg["lr"], 12) for cfg in sweep.values()}
    assert ratios == {round(pilot["gamma"] / pilot["eta"], 12)} and len(sweep) == 5


def test_select_takes_the_best_validation_score_and_the_first_on_ties():
    runs = {"a": {0: {"val_score": 0.5}}, "b": {0: {"val_score": 0.7}}, "c": {0: {"val_score": 0.7}}}
    assert rp.select(["a", "b", "c"], runs, 0) == "b"
    rounds = {
        "a": {0: {"val_score": [-30, 0.8]}},
        "b": {0: {"val_score": [-20, 0.7]}},
        "c": {0: {"val_score": [-20, 0.75]}},
    }
    assert rp.select(["a", "b", "c"], rounds, 0) == "c"  # fewer rounds, then the higher final accuracy


def test_verdict_rule():
    assert rp.verdict([1.0, 1.2, 0.8, 1.1, 0.9], +1)["verdict"] == "reproduced"
    assert rp.verdict([1.0, 1.2, 0.8, 1.1, 0.9], -1)["verdict"] == "contradicted"
    assert rp.verdict([1.0, -1.0, 0.5, -0.5, 0.1], +1)["verdict"] == "not resolved"
    # the bar itself: just under two standard errors is not enough, just over is
    d = [0.0, 0.0, 0.0, 0.0, 1.0]
    v = rp.verdict(d, +1)
    assert math.isclose(v["se"], math.sqrt(0.2) / math.sqrt(5))
    shift = 2 * v["se"] - v["mean"]  # shifting every d moves the mean, not the SE
    assert rp.verdict([x + shift - 1e-9 for x in d], +1)["verdict"] == "not resolved"
    assert rp.verdict([x + shift + 1e-9 for x in d], +1)["verdict"] == "reproduced"
    assert rp.verdict([0.3], +1)["verdict"] == "not resolved"  # one seed resolves nothing


@pytest.mark.parametrize("name", sorted(EXPS))
def test_one_round_smoke_run(name, tmp_path):
    rp.main([name, "--quick", "--dataset", "digits", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.md").read_text().startswith(f"### {name}")
    assert len(payload["summary"]["comparisons"]) == len(EXPS[name].comparisons)
    runs = list((tmp_path / name / "runs").glob("*.json"))
    assert len(runs) == len({k for g in payload["methods"].values() for k in g})
    for c in payload["summary"]["comparisons"]:
        assert c["verdict"] == "not resolved"  # one seed
    if name == "fednlr-drift":
        for key, per_seed in payload["summary"]["points"].items():
            for r in per_seed.values():
                assert r["pairs"] == len(r["pair_changes"]) and 0 < r["pairs"] <= 90, key
                assert r["drift_size"] >= abs(r["change"]) - 1e-12, key
    if name == "fednar":
        assert payload["pilot"]["max_norm"] > 0
        for m in payload["summary"]["methods"].values():
            assert all(0.0 <= f <= 1.0 for f in m["extras"]["clipped_fraction"])
    # a second call finds every run on disk and trains nothing
    rp.main([name, "--quick", "--dataset", "digits", "--out", str(tmp_path)])
    assert json.loads((tmp_path / f"{name}.json").read_text())["timing"]["runs_done_this_call"] == 0


def test_drift_methods_differ_only_in_their_client():
    """§6: one point per method, the same lr and data; FedNLR at the two selected mu0."""
    methods = EXPS["fednlr-drift"].methods({})
    assert {m: len(g) for m, g in methods.items()} == {"FedAvg": 1, "FedNLR mu0=0.5": 1, "FedNLR mu0=2.0": 1}
    points = [next(iter(g.values())) for g in methods.values()]
    assert [p["drift_client"] for p in points] == ["fedavg", "fednlr", "fednlr"]
    assert "lr" not in points[1] and EXPS["fednlr-drift"].base["lr"] == rp.L3[1]
    assert EXPS["fednlr-drift"].base["partition"] == "classes" and EXPS["fednlr-drift"].base["model"] == "mlp1"


def test_no_run_summarises_only_complete_seeds(tmp_path):
    quick = ["fednlr-dir", "--quick", "--dataset", "digits", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):  # nothing on disk yet
        rp.main(quick + ["--no-run"])
    rp.main(quick + ["--seeds", "2"])
    with pytest.raises(SystemExit):  # seed 1 has no runs, and --no-run trains none
        rp.main(quick + ["--no-run", "--seeds", "1"])
    rp.main(quick + ["--no-run", "--seeds", "2"])
    payload = json.loads((tmp_path / "fednlr-dir.json").read_text())
    assert payload["seeds"] == [2] and payload["timing"]["runs_done_this_call"] == 0
