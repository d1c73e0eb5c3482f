"""The README's usage block is examples/usage.py, and that script runs as it is."""

import re
import runpy
from pathlib import Path

import pytest

import fedopt_kernels as fk

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "usage.py"


def usage_block(readme: str) -> str:
    """The first python block under the README's "## Usage" heading."""
    m = re.search(r"^## Usage\n.*?```python\n(.*?)```\n", readme, re.S | re.M)
    assert m, "README.md has no python block under ## Usage"
    return m.group(1)


def test_the_readme_shows_the_example_file():
    assert usage_block((ROOT / "README.md").read_text()) == EXAMPLE.read_text()


def test_the_comparison_can_fail():
    readme = (ROOT / "README.md").read_text()
    drifted = readme.replace("lr=0.05, rho=0.05", "lr=0.05, rho=0.1", 1)
    assert drifted != readme
    with pytest.raises(AssertionError):
        assert usage_block(drifted) == EXAMPLE.read_text()


def test_the_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    backend, available = capsys.readouterr().out.split("\n", 1)
    assert backend in fk.available_backends() and available.startswith("available: ")
