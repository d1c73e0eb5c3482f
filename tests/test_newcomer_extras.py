"""A newcomer without the optional extras: fedopt-sim and python -m bench say which extra is missing
(or do without it) instead of dying with a raw ModuleNotFoundError; --quiet verdict lines say
which algorithm they belong to."""

import json
import re
import sys
from pathlib import Path

import pytest

from fedopt_kernels.sim.cli import fedopt_sim

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["--clients", "10", "--rounds", "1", "--local-steps", "2", "--clients-per-round", "2", "--finetune-steps", "1"]


def _hide(monkeypatch, *modules):
    """Make ``import <module>`` fail as if the package were not installed."""
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_quiet_validate_verdicts_name_their_algorithm(capsys):
    for algorithm in ("fedavg", "fednar-scaffold"):
        assert (
            fedopt_sim.main(SHORT + ["--algorithm", algorithm, "--validate", "reference", "--quiet", "--no-files"]) == 0
        )
    verdicts = [ln for ln in capsys.readouterr().out.splitlines() if "PASS" in ln or "FAIL" in ln]
    assert len(verdicts) == 2, verdicts
    assert "PASS fedavg (reference vs reference, seed 0)" in verdicts[0]
    assert "PASS fednar-scaffold (reference vs reference, seed 0)" in verdicts[1]


def test_sim_runs_without_tqdm(monkeypatch, capsys):
    _hide(monkeypatch, "tqdm")
    assert fedopt_sim.main(SHORT + ["--quiet", "--no-files"]) == 0
    # without --quiet on a terminal: a note instead of the bar, and the run goes on
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert fedopt_sim.main(SHORT + ["--no-files"]) == 0
    err = capsys.readouterr().err
    assert "no progress bar" in err and "fedopt_kernels[sim]" in err


def test_sim_without_sklearn_names_the_extra(monkeypatch, capsys):
    _hide(monkeypatch, "sklearn")
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(SHORT + ["--quiet", "--no-files", "--dataset", "digits"])
    assert exc.value.code == 3
    err = capsys.readouterr().err
    assert "scikit-learn" in err and "fedopt_kernels[sim]" in err and "Traceback" not in err
    # what a plain `pip install .` runs: the default data set is then the synthetic one (its model the
    # mlp), which needs no scikit-learn, and the run says so
    assert fedopt_sim.main(SHORT + ["--quiet", "--no-files", "--algorithm", "fednar"]) == 0
    err = capsys.readouterr().err
    assert "dataset synthetic (the default, digits, needs scikit-learn" in err
    assert fedopt_sim.main(SHORT + ["--quiet", "--no-files", "--dataset", "synthetic"]) == 0


def test_sim_without_matplotlib_writes_everything_but_the_png(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "matplotlib")
    assert fedopt_sim.main(SHORT + ["--quiet", "--out", str(tmp_path)]) == 0
    # checkpoints/: the run's resumable state (docs/checkpoints.md)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics_seed0.csv", "metrics_seed0.json"]
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_bench_without_matplotlib_skips_the_chart(monkeypatch, tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from bench.__main__ import main
    finally:
        sys.path.remove(str(ROOT))
    _hide(monkeypatch, "matplotlib")
    args = [
        "--smoke",
        "--device",
        "cpu",
        "--algos",
        "feddecay",
        "--backends",
        "reference",
        "--no-baselines",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    js = next(tmp_path.glob("*-smoke.json"))
    assert json.loads(js.read_text())["rows"]
    assert "matplotlib is not installed" in capsys.readouterr().err
    js.with_suffix(".png").write_bytes(b"an earlier run's chart")
    assert main(args) == 0  # the same file names again: the stale chart must go
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([js.name, js.with_suffix(".md").name, "LATEST.md"])
    assert f"[{js.with_suffix('.png').name}]" not in (tmp_path / "LATEST.md").read_text()


def test_bench_clients_without_matplotlib_skips_the_chart(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT))
    try:
        from bench import clients
    finally:
        sys.path.remove(str(ROOT))
    # the newest table under the name the benchmark gives it (committed reruns carry a suffix,
    # clients-sim's tables are another benchmark's); sorted, so that every file system picks the same one
    canonical = re.compile(r"clients-(?!sim-)[a-z0-9-]+-\d{4}-\d{2}-\d{2}\.json")
    saved = sorted(p for p in (ROOT / "bench" / "results").glob("clients-*.json") if canonical.fullmatch(p.name))[-1]
    result = json.loads(saved.read_text())
    _hide(monkeypatch, "matplotlib")
    paths = clients.write(result, tmp_path)
    assert "png" not in paths
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([saved.name, saved.with_suffix(".md").name, "LATEST.md"])
    first = result["rows"][0]
    assert f"| {first['clients']} |" in (tmp_path / saved.with_suffix(".md").name).read_text()
