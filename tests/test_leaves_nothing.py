"""A test run leaves nothing outside the clone: what its tests and the processes they start write to
the temporary folder (tmp_path, tempfile, Ray's session folders) and to the home folder (Flower's
home, compiled-kernel caches) goes to a folder of the run that is removed when the run passes, or
to pytest's cache folder in the clone. tests/conftest.py does it; a small suite with that conftest
runs here in a child pytest whose temporary and home folders are empty to begin with."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

ROOT = Path(__file__).resolve().parent.parent

# what the suite's engines do: Ray writes $RAY_TMPDIR/ray (else $TMPDIR/ray), Flower $FLWR_HOME, the
# kernel compilers their cache folders; a subprocess makes a temporary folder and never removes it
SUITE = f"""
import os, subprocess, sys, tempfile
from pathlib import Path

CACHES = {tuple(conftest.CACHES)!r}


def _write(folder, name):
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / name).write_text("x")


def test_engines_write(tmp_path):
    (tmp_path / "out.txt").write_text("x")
    ray = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    _write(Path(ray) / "ray" / "session_1", "log")
    _write(os.environ.get("FLWR_HOME", os.path.expanduser("~/.flwr")), "source")
    for var in CACHES:
        _write(os.environ[var], "cached")
    subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkdtemp()"], check=True)


def test_may_fail():
    assert os.environ.get("FAIL_ON_PURPOSE") != "1"
"""

# variables the outer run set for itself, which the child must choose afresh
OURS = (conftest.SCRATCH_VAR, "RAY_TMPDIR", "FLWR_HOME", *conftest.CACHES)


def _run(tmp_path: Path, *args: str, fail: bool = False) -> subprocess.CompletedProcess:
    clone = tmp_path / "clone"
    (clone / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "conftest.py", clone / "tests" / "conftest.py")
    (clone / "tests" / "test_suite.py").write_text(SUITE)
    (clone / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntmp_path_retention_policy = "failed"\n')
    for folder in ("tmp", "home"):
        (tmp_path / folder).mkdir()
    env = {k: v for k, v in os.environ.items() if k not in OURS and not k.startswith("PYTEST_")}
    env.update(TMPDIR=str(tmp_path / "tmp"), HOME=str(tmp_path / "home"), FAIL_ON_PURPOSE="1" if fail else "0")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests", *args],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _left(folder: Path) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("args", [(), ("-n", "2")], ids=["one-process", "xdist"])
def test_a_passing_run_leaves_nothing_outside_the_clone(tmp_path, args):
    proc = _run(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _left(tmp_path / "tmp") == [], proc.stdout
    assert _left(tmp_path / "home") == [], proc.stdout
    kept = _left(tmp_path / "clone" / ".pytest_cache")
    assert any(p.endswith("fedopt-torchinductor/cached") for p in kept), kept


def test_a_failing_run_keeps_its_files_and_says_where(tmp_path):
    proc = _run(tmp_path, fail=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (kept,) = [ln.rsplit(" ", 1)[1] for ln in proc.stdout.splitlines() if "temporary files of this run kept in" in ln]
    assert Path(kept).parent == tmp_path / "tmp" and (Path(kept) / "ray" / "session_1" / "log").is_file()
    assert _left(tmp_path / "home") == []
