"""bench/gpu_check.sh's "Failed tests" section (bench/junit_failures.py): the node ids of the tests
that failed or errored, read from the junit file of a real pytest run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import junit_failures

_TESTS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

class TestGroup:
    def test_in_a_class(self):
        assert False

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_setup_error(broken):
    pass

@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x == 1
"""


def _junit(tmp_path: Path, source: str) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(source)
    out = tmp_path / "junit-tests.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sample.py", f"--junitxml={out}"],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    return out


def test_the_failed_tests_are_listed_by_node_id(tmp_path):
    text = junit_failures.section([_junit(tmp_path, _TESTS), tmp_path / "junit-tests_wide.xml"], root=tmp_path)
    lines = text.splitlines()
    assert lines[0] == "## Failed tests (junit-tests.xml, junit-tests_wide.xml)"
    listed = [line.split("`")[1] for line in lines if line.startswith("- `")]
    assert listed == [
        "tests/test_sample.py::test_fails",
        "tests/test_sample.py::TestGroup::test_in_a_class",
        "tests/test_sample.py::test_setup_error",
        "tests/test_sample.py::test_param[2]",
    ]
    assert "(failed: AssertionError: one is not two)" in text and "(error: " in text and "setup broke" in text
    assert "junit-tests_wide.xml unreadable" in text  # a phase that never wrote its file says so


def test_a_run_without_failures_says_none(tmp_path):
    text = junit_failures.section([_junit(tmp_path, "def test_passes():\n    pass\n")], root=tmp_path)
    assert text.splitlines()[-1] == "none"
