"""A newcomer's benchmark run: it never waits for a quiet machine unless asked, leaves the clone as it
was (results go to a git-ignored folder), and bench/gpu_check.sh's install phase really runs."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.__main__ as bench_main  # noqa: E402
import bench.runner as runner  # noqa: E402

TINY = ["--algos", "feddecay", "--backends", "reference", "--no-baselines", "--device", "cpu"]


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--is-inside-work-tree").returncode == 0


class _Busy:
    """OtherLoad stand-in: another process kept a whole core busy during every case."""

    def __init__(self):
        self.cores = 1.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_quick_mode_neither_waits_nor_retries(monkeypatch, tmp_path, capsys):
    args = bench_main.parse_args(["--quick"])
    assert args.wait_quiet == 0 and args.retries == 0

    def no_waiting(*a, **k):
        raise AssertionError("a default run must not wait for a quiet machine")

    monkeypatch.setattr(runner, "wait_quiet", no_waiting)
    monkeypatch.setattr(bench_main, "wait_quiet", no_waiting)
    monkeypatch.setattr(runner, "OtherLoad", _Busy)
    assert bench_main.main(["--quick", "--sizes", "small_cnn", "--out-dir", str(tmp_path)] + TINY) == 0
    md = next(tmp_path.glob("*-quick.md")).read_text()
    assert "⚠" in md  # the disturbed row is flagged, not redone
    import json
    rows = json.loads(next(tmp_path.glob("*-quick.json")).read_text())["rows"]
    assert rows and all(r["attempts"] == 1 for r in rows)


def test_retries_and_waiting_stay_available(monkeypatch, tmp_path):
    waits = []
    monkeypatch.setattr(runner, "wait_quiet", lambda s: waits.append(s))
    monkeypatch.setattr(runner, "OtherLoad", _Busy)
    assert bench_main.main(["--smoke", "--sizes", "small_cnn", "--retries", "2", "--out-dir", str(tmp_path)] + TINY) == 0
    assert len(waits) == 2  # one wait before each redo of the one (always disturbed) case
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--retries", "-1"])


@pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout")
def test_default_run_leaves_the_clone_clean():
    assert bench_main.parse_args([]).out_dir == ROOT / "bench_runs"
    before = _git("status", "--porcelain", "--untracked-files=all").stdout
    existing = set((ROOT / "bench_runs").glob("*")) if (ROOT / "bench_runs").is_dir() else set()
    try:
        assert bench_main.main(["--smoke"] + TINY) == 0
        written = set((ROOT / "bench_runs").glob("*")) - existing
        assert any(p.suffix == ".json" for p in written)
        assert _git("status", "--porcelain", "--untracked-files=all").stdout == before
    finally:
        for p in set((ROOT / "bench_runs").glob("*")) - existing:
            if p.name != "LATEST.md" or "LATEST.md" not in {q.name for q in existing}:
                p.unlink()
        if not existing and (ROOT / "bench_runs").is_dir():
            shutil.rmtree(ROOT / "bench_runs")


@pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout")
def test_sim_default_output_is_git_ignored():
    # fedopt-sim writes to sim_runs/<algorithm>-<dataset> under the current directory by default
    for path in ("sim_runs/feddecay-digits/curves.png", "bench_runs/x.json"):
        assert _git("check-ignore", "-q", path).returncode == 0, path


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_check_dry_run_with_its_install_phase():
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    # the benchmark phase is left out: tests/test_bench_smoke.py runs the same --smoke benchmark
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--no-gpu", "--skip-tests", "--skip-bench"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    summary = proc.stdout
    assert "| install | 0 |" in summary, summary[-3000:] + proc.stderr[-2000:]
    assert "| bench | skipped" in summary, summary[-3000:]
    assert proc.returncode == 0, summary[-3000:] + proc.stderr[-2000:]
    res = next(p for p in (ROOT / "bench" / "results" / "tmp").glob("cpu-dryrun-*") if p.is_dir())
    log = (res / "install.log").read_text()
    assert "Would install" in log, log[-2000:]  # pip resolved the install, changed nothing
