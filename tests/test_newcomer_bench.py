"""A newcomer's benchmark run: it never waits for a quiet machine unless asked, leaves the clone as it
was (results go to a git-ignored folder), and bench/gpu_check.sh's install phase really runs."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.__main__ as bench_main  # noqa: E402
import bench.runner as runner  # noqa: E402
import bench.timing as timing  # noqa: E402

TINY = ["--algos", "feddecay", "--backends", "reference", "--no-baselines", "--device", "cpu"]


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--is-inside-work-tree").returncode == 0


class _Busy:
    """OtherLoad stand-in: another process kept a whole core busy during every timed block."""

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
    monkeypatch.setattr(timing, "OtherLoad", _Busy)
    assert bench_main.main(["--quick", "--sizes", "small_cnn", "--out-dir", str(tmp_path)] + TINY) == 0
    md = next(tmp_path.glob("*-quick.md")).read_text()
    assert "⚠" in md  # the disturbed row is flagged, not redone
    import json

    rows = json.loads(next(tmp_path.glob("*-quick.json")).read_text())["rows"]
    assert rows and all(r["attempts"] == 1 for r in rows)


def test_retries_and_waiting_stay_available(monkeypatch, tmp_path):
    waits = []
    monkeypatch.setattr(runner, "wait_quiet", lambda s: waits.append(s))
    monkeypatch.setattr(timing, "OtherLoad", _Busy)
    assert (
        bench_main.main(["--smoke", "--sizes", "small_cnn", "--retries", "2", "--out-dir", str(tmp_path)] + TINY) == 0
    )
    assert len(waits) == 2  # one wait before each redo of the one (always disturbed) group of cases
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
def test_gpu_check_dry_run_with_its_install_phase(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    res = tmp_path / "dry-run"  # a folder of its own: another test runs the script at the same time
    # the benchmark phase is left out: tests/test_bench_smoke.py runs the same --smoke benchmark
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--no-gpu", "--skip-tests", "--skip-bench", "--results-dir", str(res)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = proc.stdout
    assert "| install | 0 |" in summary, summary[-3000:] + proc.stderr[-2000:]
    assert "| bench | skipped" in summary, summary[-3000:]
    assert proc.returncode == 0, summary[-3000:] + proc.stderr[-2000:]
    log = (res / "install.log").read_text()
    assert "Would install" in log, log[-2000:]  # pip resolved the install, changed nothing


def test_gpu_check_installs_the_package_alone_when_an_extra_is_not_to_be_had(tmp_path):
    """A lent GPU machine has no network and no flwr: the offline install of the test extra fails
    there, and the check installs the package alone and goes on (simulated here with a constraint no
    flwr meets); the GPU-relevant tests are what it selects."""
    pins = tmp_path / "no-flwr.txt"
    pins.write_text("flwr==0.0.0\n")
    env = dict(os.environ, PYTHON=sys.executable, PIP_CONSTRAINT=str(pins))
    env.pop("OUT", None)
    res = tmp_path / "dry-run"
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--no-gpu", "--skip-tests", "--skip-bench", "--results-dir", str(res)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = proc.stdout
    assert "| install | 0 |" in summary, summary[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, summary[-3000:] + proc.stderr[-2000:]
    log = (res / "install.log").read_text()
    assert "== offline, the package alone" in log, log[-2000:]
    assert "Would install" in log.split("== offline, the package alone")[1], log[-2000:]
    selection = next(line for line in summary.splitlines() if "test selection:" in line)
    assert "pytest tests --ignore=tests/test_equivalence.py" in selection, selection
    assert selection.count('-k "cuda or gpu or triton or replay"') == 2, selection


def test_result_files_name_no_enclosing_repository_commit(tmp_path, monkeypatch):
    """A copy of the tree inside another repository is not a checkout: its results say "unknown", or
    FEDOPT_COMMIT when that is set, never the enclosing repository's HEAD."""
    from bench.machine import commit_of

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    for args in (
        ["init", "-q"],
        ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "outer"],
    ):
        subprocess.run(["git", *args], cwd=outer, check=True, capture_output=True)
    monkeypatch.delenv("FEDOPT_COMMIT", raising=False)
    assert commit_of(outer / "copy") == "unknown"
    assert commit_of(outer) != "unknown"  # the repository's own top level is a checkout
    monkeypatch.setenv("FEDOPT_COMMIT", "abc123")
    assert commit_of(outer / "copy") == "abc123"


class _FakeTime:
    """Stands in for bench.timing's ``time``: the clock moves only when the timed step runs; a
    step takes ``fast`` seconds, except the calls numbered in ``stalled``, which take ``stall``."""

    def __init__(self, fast: float, stall: float, stalled: range):
        self.now, self.calls = 0.0, 0
        self.fast, self.stall, self.stalled = fast, stall, stalled

    def perf_counter(self) -> float:
        return self.now

    def step(self) -> None:
        self.calls += 1
        self.now += self.stall if self.calls in self.stalled else self.fast


class _FakeLoad:
    """Stands in for bench.timing's OtherLoad: another process kept a core busy during any block in
    which a stalled call ran (the cause of a stall on a shared machine)."""

    clock: _FakeTime

    def __enter__(self):
        self.first, self.cores = self.clock.calls + 1, None
        return self

    def __exit__(self, *exc):
        ran = range(self.first, self.clock.calls + 1)
        self.cores = 1.0 if any(c in self.clock.stalled for c in ran) else 0.0


class _FakeOpt:
    def step(self) -> None:
        pass


def _quick_row(monkeypatch, clock: _FakeTime) -> dict:
    """One case measured as the quick benchmark does, on the fake clock (no memory probes)."""
    from bench.algorithms import Stepper

    class Timed(Stepper):
        def step(self) -> None:
            clock.step()

    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(timing, "OtherLoad", type("Load", (_FakeLoad,), {"clock": clock}), raising=False)
    monkeypatch.setattr(runner, "step_peak_bytes", lambda step, device: 0)
    monkeypatch.setattr(runner, "state_bytes", lambda opt: 0)
    budget = bench_main.MODES["quick"][3]
    plan = runner.Plan(device=runner.torch.device("cpu"), sizes=[], algos=[], budget=budget)
    return runner._measure(lambda: Timed(cast(Any, _FakeOpt())), plan, graph=False)  # a stand-in optimizer


@pytest.mark.parametrize("stalled", [range(5, 6), range(1, 2)], ids=["mid_run", "first_timed"])
def test_one_huge_outlier_does_not_move_a_row(monkeypatch, stalled):
    row = _quick_row(monkeypatch, _FakeTime(fast=1e-5, stall=2.0, stalled=stalled))
    assert row["median_s"] == pytest.approx(1e-5, rel=1e-6)


def test_a_stall_over_a_whole_timing_block_does_not_move_a_row(monkeypatch):
    """A descheduled thread makes every call of a multi-threaded step wait (here 48 ms each) while
    it lasts; a stall longer than the quick budget's 0.25 s used to be all a row measured."""
    clock = _FakeTime(fast=1e-5, stall=0.048, stalled=range(1, 12))
    row = _quick_row(monkeypatch, clock)
    assert row["median_s"] == pytest.approx(1e-5, rel=1e-6)
    assert row["reps"] >= bench_main.MODES["quick"][3].min_reps


def test_flower_tests_skip_with_the_reason_where_flwr_is_missing(tmp_path):
    """Where flwr cannot be installed (the lent GPU machines), the Flower test files skip, saying why,
    instead of failing at import."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoFlower:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'flwr' or name.startswith('flwr.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (simulated)', name=name)\n"
        "sys.meta_path.insert(0, _NoFlower())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/test_flower_strategies.py",
            "tests/test_flower_engine.py",
            "tests/test_flower_resume.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 5, out[-3000:]  # pytest's "no tests ran": every test skipped
    assert out.count("Flower is not installed") == 3 and "3 skipped" in out, out[-3000:]
    assert "failed" not in out and "error" not in out.lower().replace("importerror", ""), out[-3000:]


def test_gpu_check_keeps_the_tests_their_share_of_the_budget():
    """Each phase's deadline keeps back the shares of the phases after it. With the install an H100
    took (43 s), the tests phase must still get its whole share: a phase added later must not
    starve it (a run where the tests get under 10 s skips them)."""
    text = (ROOT / "bench" / "gpu_check.sh").read_text()
    budget = int(re.search(r"BUDGET=(\d+)", text).group(1))
    shares = {k: int(v) for k, v in re.findall(r"\b([A-Z_]+_S)=(\d+)", text)}
    tests_line = re.search(r"T=\$\(\( \$\(left\) - 15 - ([A-Z_ -]+) \)\)", text).group(1)
    reserved = sum(shares[name.strip()] for name in tests_line.split("-"))
    assert budget - 43 - 15 - reserved >= shares["TESTS_S"], (budget, reserved, shares)
