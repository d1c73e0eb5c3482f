"""The fixes fedopt-sim prints run as printed: the Python between backticks parses, and every option
a hint tells the user to pass parses with fedopt-sim's own parser."""

import ast
import re
import shlex

import pytest

from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import FOLDER_DATASETS

# "pass --data-dir leaf/data/femnist/data", "pass --download (needs ...)": an option and its value
PASS = re.compile(r"\bpass (--[\w-]+(?: (?!\()[^\s,;)]+)?)")


def check_hint(message: str, dataset: str) -> None:
    """Fail when a hint in ``message`` would not run as printed."""
    for code in re.findall(r"`([^`]*)`", message):
        words = shlex.split(code)
        if words[:2] == ["python", "-c"]:
            ast.parse(words[2])  # a SyntaxError fails the test with the hint's text
        if words[0] == "fedopt-sim":
            fedopt_sim.build_parser().parse_args(words[1:])
    outside = re.sub(r"`[^`]*`", "", message)
    for option in PASS.findall(outside):
        argv = ["--dataset", dataset, *shlex.split(option.replace("DIR", "data"))]
        try:
            fedopt_sim.build_parser().parse_args(argv)
        except SystemExit as exc:  # argparse's way of refusing
            raise AssertionError(f"{option!r} does not parse: {message}") from exc


def _hint(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(argv + ["--quiet", "--no-files"])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("dataset", FOLDER_DATASETS)
@pytest.mark.parametrize("data_dir", [None, "/nonexistent/fedopt-sim-data"], ids=["no-dir", "missing-dir"])
def test_the_printed_fix_runs_as_printed(dataset, data_dir, capsys):
    err = _hint(capsys, ["--dataset", dataset] + ([] if data_dir is None else ["--data-dir", data_dir]))
    assert "--data-dir" in err, err
    check_hint(err, dataset)


def test_a_download_hint_keeps_its_python_keyword(capsys):
    err = _hint(capsys, ["--dataset", "cifar10", "--data-dir", "/nonexistent/fedopt-sim-data"])
    assert "torchvision.datasets.CIFAR10('DIR', download=True)" in err, err
    assert "pass --download" in err, err  # outside the code, the option's name is the command line's


def test_the_hint_check_can_fail():
    broken = "run `python -c \"import torchvision; torchvision.datasets.CIFAR10('DIR', --download True)\"`"
    with pytest.raises(SyntaxError):
        check_hint(broken, "cifar10")
    with pytest.raises(AssertionError, match="does not parse"):
        check_hint("or pass --data_dir DIR", "cifar10")
    check_hint("or pass --data-dir DIR (see docs/data.md)", "cifar10")  # the right spelling passes


def _extras() -> dict:
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("dataset", FOLDER_DATASETS)
def test_a_torchvision_hint_names_the_extra_that_installs_it(dataset, capsys):
    err = _hint(capsys, ["--dataset", dataset, "--data-dir", "/nonexistent/fedopt-sim-data"])
    if "torchvision" not in err:
        pytest.skip(f"{dataset}'s hint does not suggest torchvision")
    named = re.findall(r'pip install "fedopt_kernels\[(\w+)\]"', err)
    assert named, err
    assert all(any(dep.startswith("torchvision") for dep in _extras()[extra]) for extra in named), (named, err)
