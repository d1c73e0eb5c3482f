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
    assert args.seeds is None and args.jobs == 1 and args.dataset == "fmnist"
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
        ["feddyn", "--client-batched", "0"],
        ["feddyn", "--device", "tpu"],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        rp.parse_args(argv)


def test_all_is_every_experiment():
    assert "all" in rp.parse_args(["all"]).experiment
    assert set(EXPS) == {
        "feddecay",
        "fednlr-shards",
        "fednlr-dir",
        "fednar",
        "padamfed",
        "feddyn",
        "fednlr-drift",
        "feddyn10",
        "fednlr-lr",
        "padamfed-band",
        "fednar-wd",
    }


PILOTS = {
    "fednar": {"max_norm": 1.0},
    "padamfed": {"eta": 0.01, "gamma": 0.1, "beta": 0.5},
    "feddyn": {"target": 0.5},
    "feddyn10": {"target": 0.5},
    "padamfed-band": {"eta": 0.01, "gamma": 0.1, "beta": 0.5},
    "fednar-wd": {"max_norm": 1.0},
}


def pilot_of(name):
    """The pilot an experiment's grids read; for those with a tuning stage, its first points as picks."""
    exp, pilot = EXPS[name], dict(PILOTS.get(name, {}))
    if exp.tuning is not None:
        pilot["tuned"] = {m: next(iter(g.values())) for m, g in exp.tuning.methods(pilot, {}).items()}
    return pilot


def grids(name, ext=None):
    exp = EXPS[name]
    return exp.methods(pilot_of(name), ext or {}) if exp.axes else exp.methods(pilot_of(name))


@pytest.mark.parametrize("name", sorted(EXPS))
def test_method_and_baseline_grids_are_equal_in_size(name):
    exp = EXPS[name]
    methods = grids(name)
    on_top = {name for name, *_ in exp.on_top}
    for method, baseline, _, _how in exp.comparisons:
        if baseline is None or method in on_top:  # against zero / a per-seed subset of a grid
            continue
        if method == "PAdaMFed (theory)":  # the paper's claim itself: untuned against tuned
            assert len(methods[method]) == 1
            continue
        if name == "fednlr-lr":  # the same lr points; FedNLR's mu0 on top (protocol.md §8)
            lrs = [{cfg["lr"] for cfg in methods[m].values()} for m in (method, baseline)]
            assert lrs[0] == lrs[1] and len(methods[method]) == 3 * len(methods[baseline])
            continue
        assert len(methods[method]) == len(methods[baseline]), (method, baseline)


def test_baseline_lr_grid_contains_the_methods_lrs():
    """The method's knob buys the baseline extra lr points over the same range, not another range."""
    for name in ("feddecay", "fednlr-dir"):
        methods = EXPS[name].methods({})
        method_lrs = {cfg["lr"] for cfg in methods[next(iter(methods))].values()}
        base_lrs = {cfg["lr"] for cfg in methods["FedAvg"].values()}
        assert method_lrs <= base_lrs and min(base_lrs) == min(method_lrs) and max(base_lrs) == max(method_lrs)


def test_device_and_client_batched_reach_every_run_but_fednar():
    exps = rp.experiments("digits", None, "cuda", 8)
    for name, exp in exps.items():
        assert exp.base["device"] == "cuda"
        assert exp.base["client_batched"] == (1 if name in ("fednar", "fednar-wd", "fednlr-drift") else 8)


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
    for path in runs:  # every run says where it came from
        prov = json.loads(path.read_text())["provenance"]
        assert prov["commit"] and isinstance(prov["dirty"], bool) and prov["device"] == "cpu"
        assert prov["started_utc"] <= prov["ended_utc"] and prov["torch"] and prov["device_name"]
        assert prov["command"].startswith("python experiments/run_protocol.py " + name)
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


def test_a_cell_refuses_runs_from_another_commit(tmp_path):
    quick = ["fednlr-dir", "--quick", "--dataset", "digits", "--out", str(tmp_path)]
    rp.main(quick + ["--seeds", "0"])
    run_dir = tmp_path / "fednlr-dir" / "runs"
    old = next(run_dir.glob("fedavg_*__s0.json"))
    record = json.loads(old.read_text())
    record["provenance"]["commit"] = "0" * 40  # as if an earlier commit had written it
    old.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="FedAvg"):  # seed 1 would join FedAvg's cell from another commit
        rp.main(quick + ["--seeds", "1"])
    assert not list(run_dir.glob("*__s1.json"))  # refused before anything ran
    record.pop("provenance")  # a run from before run files recorded their commit
    old.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="unrecorded"):
        rp.main(quick + ["--seeds", "1"])
    rp.main(quick + ["--seeds", "1", "--mix-commits"])
    rp.main(quick + ["--seeds", "0", "--no-run"])  # summarising adds no run: no refusal
    grid = {p.name.split("__s")[0]: {} for p in run_dir.glob("fedavg_*__s*.json")}
    runs = {k: {s: json.loads((run_dir / f"{k}__s{s}.json").read_text()) for s in (0, 1)} for k in grid}
    sources = rp.cell_sources(grid, runs)["sources"]  # what the page's provenance table shows
    assert rp.UNRECORDED in sources and len(sources) == 2


def test_band_width_interpolates_and_reports_censoring():
    xs = [0.0, 0.5, 1.0, 1.5, 2.0]
    width, low, high = rp.band(xs, [0.50, 0.80, 0.86, 0.84, 0.10])
    # floor 0.81: left end 0.5 + 0.5 * (0.01 / 0.06), right end 1.5 + 0.5 * (0.03 / 0.74)
    assert math.isclose(width, (1.5 + 0.5 * 0.03 / 0.74) - (0.5 + 0.5 * 0.01 / 0.06))
    assert not low and not high
    assert rp.band(xs, [0.85, 0.86, 0.2, 0.2, 0.2])[1:] == (True, False)  # reaches the low end
    assert rp.band(xs, [0.1, 0.2, 0.3, 0.8, 0.9])[1:] == (False, True)  # best at the high end
    assert rp.band(xs, [0.1, float("nan"), 0.9, 0.1, 0.1])[1:] == (False, False)  # NaN counts as worst


def test_lattice_and_ladder_points():
    assert rp.lattice(31.6227, 0.5, 3, 3) == [1.0, 3.162, 10.0, 31.62, 100.0, 316.2, 1000.0]
    assert rp.ladder(0.1, rp.HALF, 0, 1, 1, 1) == [0.03162, 0.1, 0.3162, 1.0]
    assert rp.ladder(0.1, rp.QUARTER, -1, 1, 0, 2) == [0.05623, 0.1, 0.1778, 0.3162, 0.5623]
    assert math.isclose(rp.FEDNLR_LR_LADDER[1], rp.L3[1], rel_tol=1e-4) and rp.FEDNLR_LR_LADDER[3] == rp.L3[2]


def _fake_measure(best_lr):
    def measure(kind, cfg, pilot):
        score = -abs(math.log10(cfg["lr"]) - math.log10(best_lr)) + 0.01 * cfg["seed"] / 100
        return {"val_score": score, "test_acc": 0.9 + score / 10, "rounds_test": 10, "seconds": 0.0}

    return measure


def test_the_edge_rule_grows_a_ladder_until_every_pick_is_inside(tmp_path, monkeypatch):
    """feddyn10's FedAvg ladder starts at 0.075 ... 0.316; a best lr of 0.6 needs three more steps."""
    monkeypatch.setattr(rp, "measure", _fake_measure(0.6))
    exp = rp.dataclasses.replace(EXPS["feddyn10"], pilot=lambda e, a: {"target": 0.5}, kind="final")
    args = rp.parse_args(["feddyn10", "--dataset", "digits", "--out", str(tmp_path), "--seeds", "0", "1"])
    payload = rp.run_experiment(exp, args)
    grown = payload["summary"]["grown"]
    assert tuple(grown["FedAvg lr"]) == (0, 3) and tuple(grown["FedDyn lr"]) == (0, 3)  # to 0.75 and 1.0
    ext = {tuple(k.rsplit(" ", 1)): tuple(v) for k, v in grown.items()}
    final = rp.feddyn10_methods({}, ext)
    assert set(payload["methods"]["FedAvg"]) == set(final["FedAvg"])
    for m in ("FedAvg", "FedDyn"):
        values = sorted({c["lr"] for c in final[m].values()})
        for key in payload["summary"]["methods"][m]["chosen"].values():
            assert values[0] < final[m][key]["lr"] < values[-1], (m, key)  # every pick inside
    assert values[-1] > 0.6 > values[-2]


def test_a_ladder_grows_at_most_max_extra_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(rp, "measure", _fake_measure(1e6))  # the best lr is out of reach
    exp = rp.dataclasses.replace(EXPS["feddyn10"], pilot=lambda e, a: {"target": 0.5}, kind="final")
    args = rp.parse_args(["feddyn10", "--dataset", "digits", "--out", str(tmp_path), "--seeds", "0"])
    payload = rp.run_experiment(exp, args)
    assert tuple(payload["summary"]["grown"]["FedAvg lr"]) == (0, rp.MAX_EXTRA)  # and no further


def test_design_b_takes_fednlr_at_fedavgs_selected_lr():
    exp = EXPS["fednlr-lr"]
    methods = exp.methods({}, {})
    runs = {}
    for k, cfg in {k: c for g in methods.values() for k, c in g.items()}.items():
        val = cfg["lr"] if cfg["algorithm"] == "fedavg" else -cfg["lr"] + cfg["nlr_mu0"]  # FedNLR likes small lrs
        runs[k] = {0: {"val_score": val, "test_acc": val, "config": cfg}}
    summary = rp.summarise(exp, methods, runs, [0])
    fedavg_lr = methods["FedAvg"][summary["methods"]["FedAvg"]["chosen"][0]]["lr"]
    on_top = methods["FedNLR"][summary["methods"]["FedNLR on FedAvg's lr"]["chosen"][0]]
    assert fedavg_lr == max(rp.FEDNLR_LR_LADDER) and on_top["lr"] == fedavg_lr and on_top["nlr_mu0"] == 2.0
    design_a = methods["FedNLR"][summary["methods"]["FedNLR"]["chosen"][0]]
    assert design_a["lr"] == min(rp.FEDNLR_LR_LADDER)


def test_verdict_states_the_two_sided_p():
    v = rp.verdict([1.0, 2.0, 3.0], +1)  # t = 2 / (1 / sqrt 3) = 3.464 at 2 degrees of freedom
    assert math.isclose(v["t"], 2 * math.sqrt(3)) and math.isclose(v["p_two_sided"], 0.07417, rel_tol=1e-3)


def test_a_floor_axis_does_not_grow_below_its_first_value(tmp_path, monkeypatch):
    """FedProx's μ ladder stops at 0.01 (μ → 0 is FedAvg); its lr ladder still grows."""

    def measure(kind, cfg, pilot):
        score = -abs(math.log10(cfg["lr"]) - math.log10(0.5)) - cfg.get("prox_mu", 0.0) - cfg["weight_decay"]
        return {"val_score": score, "test_acc": 0.5, "seconds": 0.0, "norm_median": 1.0, "norm_steps": 1}

    monkeypatch.setattr(rp, "measure", measure)
    exp = rp.dataclasses.replace(EXPS["fednar-wd"], pilot=lambda e, a: {"max_norm": 1.0}, kind="final")
    args = rp.parse_args(["fednar-wd", "--dataset", "digits", "--out", str(tmp_path), "--seeds", "0"])
    payload = rp.run_experiment(exp, args)
    grown = payload["tuning"]["grown"]
    assert tuple(grown["FedProx lr"]) == (0, 1) and "FedProx prox_mu" not in grown
    assert payload["pilot"]["tuned"]["FedProx"]["prox_mu"] == 0.01 and tuple(grown["FedAvg lr"]) == (0, 1)
