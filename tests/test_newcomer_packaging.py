"""What the sdist and the wheel carry: the test helpers (conftest.py, harness.py), the documentation
the README links, and the C++/CUDA sources with csrc/build.py inside the package (for the first-use
build); the project metadata uses the SPDX license string."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build(kind: str, out: Path, src: Path = ROOT) -> Path:
    """Build an sdist or wheel the way `python -m build --no-isolation` does (setuptools' PEP 517 hooks)."""
    env = dict(os.environ, FEDOPT_BUILD_CPU="0", FEDOPT_BUILD_CUDA="0")  # no compiling here: contents only
    code = f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / proc.stdout.strip().splitlines()[-1]


def _fresh_clone(dest: Path) -> Path:
    """The files a fresh clone has (tracked, plus new files git does not ignore), copied to ``dest``.

    A build in the checkout itself reuses what earlier builds left there (``*.egg-info/SOURCES.txt``
    lists every file an earlier setup.py shipped), which hid a package that setup.py no longer
    listed. Without git (the tests of an unpacked sdist) the folder itself is what a user has."""
    proc = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
        )
        if (ROOT / ".git").exists()
        else None
    )
    if proc is None or proc.returncode != 0:
        return ROOT
    for name in proc.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():  # a deleted file is still listed until it is committed
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def sdist_names(tmp_path_factory):
    clone = _fresh_clone(tmp_path_factory.mktemp("clone"))
    path = _build("sdist", tmp_path_factory.mktemp("sdist"), src=clone)
    with tarfile.open(path) as tar:
        return {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    # from the sdist, as pip builds it: libraries built in place in a working tree are not part of it
    clone = _fresh_clone(tmp_path_factory.mktemp("clone"))
    sdist = _build("sdist", tmp_path_factory.mktemp("sdist_for_wheel"), src=clone)
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked)
    path = _build("wheel", tmp_path_factory.mktemp("wheel"), src=next(unpacked.iterdir()))
    with zipfile.ZipFile(path) as whl:
        return set(whl.namelist())


def test_sdist_runs_its_own_tests(sdist_names):
    for name in (
        "tests/conftest.py",
        "tests/harness.py",
        "tests/test_equivalence.py",
        "pyproject.toml",
        "setup.py",
        "csrc/build.py",
        "README.md",
        "tests/cuda_host/chunk_order.cpp",
        "tests/cuda_host/include/cuda_runtime.h",
    ):
        assert name in sdist_names, name


def _relative_links(md: Path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
        if not re.match(r"[a-z]+:", target):
            yield target, (md.parent / target).resolve()


def test_sdist_has_what_the_readme_links(sdist_names):
    docs = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    links = [(md.name, t, path) for md in docs for t, path in _relative_links(md)]
    assert links, "README.md links no file"
    outside = [(md, t) for md, t, path in links if not path.is_relative_to(ROOT)]
    assert not outside, f"links to files outside the repository: {outside}"
    missing = {path.relative_to(ROOT).as_posix() for _, _, path in links} - sdist_names
    assert not missing, f"linked but not in the sdist: {sorted(missing)}"


def test_wheel_carries_the_sources_of_the_first_use_build(wheel_names):
    spec = importlib.util.spec_from_file_location("_csrc_build_for_test", ROOT / "csrc" / "build.py")
    csrc_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(csrc_build)
    assert "fedopt_kernels/csrc/build.py" in wheel_names
    for src in csrc_build.CPU_SOURCES + csrc_build.CUDA_SOURCES:
        assert f"fedopt_kernels/{src}" in wheel_names, src
    headers = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cuh")}
    assert {f"fedopt_kernels/{h}" for h in headers} <= wheel_names
    assert not [n for n in wheel_names if n.endswith(".so")]  # FEDOPT_BUILD_*=0: a pure-Python wheel


def _python_files(folder: str, installed_as: str):
    """(source path, path in the wheel) of every Python file under ``folder`` of the checkout."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), f"{installed_as}/{path.relative_to(ROOT / folder).as_posix()}"


SETUP_ARGS = """
import json, runpy, setuptools
setuptools.setup = lambda **kw: print(json.dumps({k: kw[k] for k in ("packages", "package_dir")}))
runpy.run_path("setup.py", run_name="__main__")
"""


def test_setup_lists_every_package_folder():
    env = dict(os.environ, FEDOPT_BUILD_CPU="0", FEDOPT_BUILD_CUDA="0")
    proc = subprocess.run(
        [sys.executable, "-c", SETUP_ARGS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = json.loads(proc.stdout.strip().splitlines()[-1])
    folders = {name: name.replace(".", "/") for name in args["packages"]}
    folders.update(args["package_dir"])  # triton_kernels/ and csrc/ install inside fedopt_kernels
    listed = {(ROOT / path).resolve() for name, path in folders.items() if name in args["packages"]}
    # a folder that holds Python files is a package the install needs (csrc/'s subfolders hold C++)
    wanted = {p.parent.resolve() for top in ("fedopt_kernels", "triton_kernels") for p in (ROOT / top).rglob("*.py")}
    assert (ROOT / "fedopt_kernels" / "batched").resolve() in wanted
    missing = sorted(str(p.relative_to(ROOT)) for p in wanted - listed)
    assert not missing, f"package folders setup.py does not install: {missing}"


def test_wheel_carries_every_python_file_of_the_package(wheel_names):
    # setup.py finds the packages from the folders: a subpackage without __init__.py, or one that a
    # hand-kept list forgets, installs a package whose imports fail outside the source tree
    expected = list(_python_files("fedopt_kernels", "fedopt_kernels")) + list(
        _python_files("triton_kernels", "fedopt_kernels/triton_kernels")
    )
    assert any(src.startswith("fedopt_kernels/batched/") for src, _ in expected)  # the folder the list once lacked
    missing = [src for src, installed in expected if installed not in wheel_names]
    assert not missing, f"in the checkout but not in the wheel: {missing}"


def test_spdx_license_and_build_requirements():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', text, re.M), "SPDX string form (PEP 639)"
    requires = re.search(r"^requires = \[(.*)\]$", text, re.M).group(1)
    assert '"setuptools>=77"' in requires  # what the SPDX string needs; bdist_wheel is in setuptools since 70.1
    # the README's install names the same floor, since --no-build-isolation does not install `requires`
    assert "setuptools>=77" in (ROOT / "README.md").read_text()
