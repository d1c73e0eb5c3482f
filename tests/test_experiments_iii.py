"""experiments/run_iii.py: the third round's grids (experiments/protocol_iii.md), a one-round smoke
run of every experiment on the built-in digits, and FedNova's one-round aggregate with equal steps."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


r3 = _load("run_iii")
rep = _load("report_iii")
EXPS = r3.experiments("digits", None)
PILOT = {"max_norm": 1.5}


def test_the_experiments_and_their_order():
    assert list(EXPS) == ["iii-fednar-a0.3", "iii-fednova", "iii-dp", "iii-fednar-a10", "iii-fednar-a10-wd0.1"]
    table_a = ("iii-fednar-a0.3", "iii-fednar-a10", "iii-fednar-a10-wd0.1")
    assert [EXPS[n].base["dirichlet_alpha"] for n in table_a] == [0.3, 10.0, 10.0]
    assert [len(EXPS[n].comparisons) for n in table_a] == [
        12,
        6,
        6,
    ]


@pytest.mark.parametrize("name", sorted(EXPS))
def test_one_point_per_method_and_paired_configs(name):
    """A fixed lr for every method: each comparison's two runs differ only in the method's settings."""
    exp = EXPS[name]
    methods = exp.methods(PILOT)
    assert all(len(g) == 1 for g in methods.values())
    shared = {"lr", "weight_decay", "rounds", "local_steps", "batch_size", "round_decay", "dirichlet_alpha"}
    for method, baseline, sign, how in exp.comparisons:
        assert sign == +1 and how == "select"
        a = dict(exp.base, **next(iter(methods[method].values())))
        b = dict(exp.base, **next(iter(methods[baseline].values())))
        assert {k: a.get(k) for k in shared} == {k: b.get(k) for k in shared}
        assert a["algorithm"] != b["algorithm"]
        for key in ("server_optimizer", "sampling", "dp_target_epsilon", "local_steps_range", "stragglers"):
            assert a.get(key) == b.get(key), key
    assert exp.base["client_batched"] == 20 and exp.base["formulations"] == "default"


def test_table_a_clips_every_run_at_the_pilots_max_norm():
    methods = EXPS["iii-fednar-a0.3"].methods(PILOT)
    assert len(methods) == 6 * 2 * 2
    points = [cfg for g in methods.values() for cfg in g.values()]
    assert {cfg["clip_norm"] for cfg in points} == {1.5}
    assert {cfg.get("server_optimizer") for cfg in points} == {None, "exp", "adam", "avgm"}
    assert {cfg["weight_decay"] for cfg in points} == set(r3.WDS)
    assert r3.paper_cell("FedAvg", 0.3) == "87.64 vs 85.19" and r3.paper_cell("FedAvgM", 10.0) == "91.15 vs 92.19"


def test_dp_epsilons_and_the_no_dp_point():
    methods = EXPS["iii-dp"].methods(PILOT)
    eps = {k: cfg.get("dp_target_epsilon") for g in methods.values() for k, cfg in g.items()}
    assert sorted(v for v in eps.values() if v is not None) == [1.0, 1.0, 4.0, 4.0, 8.0, 8.0]
    assert all("dp_clip" not in cfg for cfg in methods["FedAvg eps=inf"].values())
    assert EXPS["iii-dp"].base["sampling"] == "poisson" and EXPS["iii-dp"].base["clients_per_round"] is None
    adaptive = {k: "dp_adaptive_quantile" in cfg for g in methods.values() for k, cfg in g.items() if "dp_clip" in cfg}
    assert adaptive == {
        "fedavg_eps1": False,
        "fednar_eps1": False,
        **{f"{a}_eps{e}": True for a in ("fedavg", "fednar") for e in (4, 8)},
    }


def test_every_dp_setting_is_one_the_package_accepts():
    """At the real scale (100 clients, 20 expected a round, 40 rounds): epsilon 1 needs z = 3.18, which
    adaptive clipping refuses (2 sigma_b > z, sigma_b = 1); its fixed clip is accepted, as is every other point."""
    from fedopt_kernels.sim import SimConfig
    from fedopt_kernels.sim.dp_round import build

    base = dict(r3.experiments("fmnist", "/nonexistent")["iii-dp"].base)
    for cfg in (c for g in r3.dp_methods(PILOT).values() for c in g.values() if "dp_clip" in c):
        dp = build(SimConfig(**dict(base, **cfg)))
        assert dp is not None and dp.z > 0
        if "dp_adaptive_quantile" not in cfg:
            assert dp.z > 2 * dp.count_std  # what adaptive clipping would refuse
            with pytest.raises(ValueError, match="adaptive clipping"):
                build(SimConfig(**dict(base, **cfg, dp_adaptive_quantile=0.5)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of every experiment (1 seed, 1 round, 3 local steps) on the built-in digits."""
    out = tmp_path_factory.mktemp("iii")
    r3.main(["all", "--quick", "--dataset", "digits", "--out", str(out)])
    return out


@pytest.mark.slow
def test_smoke_run_of_every_experiment(smoke):
    tmp_path = smoke
    pilot = json.loads((tmp_path / "pilot.json").read_text())
    assert pilot["max_norm"] > 0 and set(pilot["clipping"]) == {
        "FedNAR wd=0.01 a=0.3",
        "FedNAR wd=0.1 a=0.3",
        "FedNAR wd=0.01 a=10",
        "FedAvg wd=0.01 a=0.3",
    }
    assert all(0.0 <= c["clipped_fraction"] <= 1.0 for c in pilot["clipping"].values())
    for name in EXPS:
        payload = json.loads((tmp_path / f"{name}.json").read_text())
        assert len(payload["summary"]["comparisons"]) == len(EXPS[name].comparisons)
        for path in (tmp_path / name / "runs").glob("*.json"):
            run = json.loads(path.read_text())
            assert run["provenance"]["command"].startswith("python experiments/run_iii.py all")
            assert ("privacy" in run) == ("dp_clip" in run["config"])
    for path in (tmp_path / "iii-dp" / "runs").glob("*_eps1__s0.json"):
        assert math.isclose(json.loads(path.read_text())["privacy"]["epsilon"], 1.0, rel_tol=1e-3)
    # FedNova's round with equal steps is FedAvg's: a_i = K for every client, tau_eff = K, and
    # K * sum p_i Delta_i / K rounds to the same float32 values (the fold sums in float64)
    one = json.loads((tmp_path / "iii-fednova" / "one_round.json").read_text())
    assert one["max_abs_update"] > 0 and one["max_diff_in_eps32_x"] <= 1.0


@pytest.mark.slow
def test_the_report_renders_from_run_files(smoke):
    """The page's code on a smoke run's files: every section, one seed, nothing decided."""
    page = rep.render(smoke)
    for heading in ("## Summary", "## Pilot", "## Table A", "## Table B", "## Figure C", "## Deviations", "## Compute"):
        assert heading in page
    assert "reproduced" not in page.split("## Table A")[1].split("## Table B")[0].replace("**reproduced**", "")
    assert page.count("| not resolved |") >= 24 and "FedNova's global model and FedAvg's are bitwise equal" in page
    assert "fewer than 5 complete seeds" in page  # one seed: the cut rule's wording


def test_the_page_matches_the_run_files():
    """Every number on experiments/results_iii.md is what report_iii.py computes from the run files."""
    assert (r3.OUT / "pilot.json").exists() and rep.PAGE.exists()
    assert rep.render(r3.OUT) == rep.PAGE.read_text()


def test_every_run_file_says_where_it_came_from():
    files = sorted(r3.OUT.glob("*/runs/*.json"))
    assert len(files) >= 200
    for path in files:
        assert path.stat().st_size < 8192, path  # small: committed, and read by the test above
        run = json.loads(path.read_text())
        prov = run["provenance"]
        assert len(prov["commit"]) == 40 and prov["dirty"] is False, path
        assert prov["started_utc"] <= prov["ended_utc"] and prov["torch"] and prov["device_name"], path
        # the experiment's own command, or `all` (the first runs, before the amendment split the commands)
        words = prov["command"].split()
        assert words[:2] == ["python", "experiments/run_iii.py"] and words[2] in ("all", path.parent.parent.name)
        assert run["config"]["seed"] == int(path.stem.rsplit("__s", 1)[1]), path
