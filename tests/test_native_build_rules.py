"""setup.py's native build (csrc/build.py): the CUDA extension is built only where it can run (a
visible GPU) unless asked for, and a second install of unchanged sources compiles nothing."""

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def build():
    spec = importlib.util.spec_from_file_location("_test_csrc_build_rules", ROOT / "csrc" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NO_TOOLKIT = "nvcc / the CUDA toolkit was not found"


@pytest.fixture
def cuda_torch_without_gpu(build, monkeypatch):
    """A CUDA build of torch on a machine without a GPU; no toolkit is found, so that a rule which
    lets the CUDA build go on stops at the next step, with that step's reason."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    for name in ("FEDOPT_BUILD_CUDA", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    return build


def _skip_reason(ext):
    return getattr(ext, "_fedopt_skip", None)


def test_no_gpu_skips_the_cuda_build_and_says_how_to_ask(cuda_torch_without_gpu):
    reason = _skip_reason(cuda_torch_without_gpu.cuda_extension())
    assert reason is not None and "no GPU is visible" in reason and "FEDOPT_BUILD_CUDA=1" in reason, reason


@pytest.mark.parametrize("env", [{"FEDOPT_BUILD_CUDA": "1"}, {"TORCH_CUDA_ARCH_LIST": "9.0"}])
def test_asking_for_it_builds_cuda_without_a_gpu(cuda_torch_without_gpu, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert NO_TOOLKIT in _skip_reason(cuda_torch_without_gpu.cuda_extension())  # past the GPU rule


def test_a_visible_gpu_builds_cuda(cuda_torch_without_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert NO_TOOLKIT in _skip_reason(cuda_torch_without_gpu.cuda_extension())


def test_switched_off_stays_off_with_a_gpu(cuda_torch_without_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("FEDOPT_BUILD_CUDA", "0")
    assert "disabled by FEDOPT_BUILD_CUDA=0" in _skip_reason(cuda_torch_without_gpu.cuda_extension())


# setup.py's build_ext (csrc/build.py's NativeBuild over torch's BuildExtension) of a one-line
# source, each run with a new temporary build folder as pip's editable install gives it
BUILD_EXT = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("csrc_build", sys.argv[1])
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    kept = build.kept_build_temp
    build.kept_build_temp = lambda current: kept(current, root=sys.argv[2])  # the project folder: here
    from setuptools import Extension, setup
    from torch.utils.cpp_extension import BuildExtension
    setup(name="probe", ext_modules=[Extension("fedopt_kernels._C_cpu", ["probe.cpp"], language="c++")],
          cmdclass={"build_ext": build._make_build_ext(BuildExtension)},
          script_args=["build_ext", "--build-temp", sys.argv[3], "--build-lib", sys.argv[4]])
""")


def _build_ext(project: Path, run: int) -> Path:
    lib = project / f"lib{run}"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            BUILD_EXT,
            str(ROOT / "csrc" / "build.py"),
            str(project),
            str(project / f"pip-temp{run}"),
            str(lib),
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, FEDOPT_BUILD_CPU="1"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert list(lib.glob("fedopt_kernels/_C_cpu*.so")), proc.stdout[-2000:] + proc.stderr[-3000:]
    return lib


def test_a_second_install_of_unchanged_sources_compiles_nothing(tmp_path):
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        pytest.skip("ninja is not installed: without it every build compiles every source")
    if shutil.which(os.environ.get("CXX", "c++").split()[0]) is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "probe.cpp").write_text('extern "C" int fedopt_probe() { return 1; }\n')
    _build_ext(tmp_path, 1)
    objects = list((tmp_path / "build").glob("native-*/probe.o"))
    assert len(objects) == 1, sorted(map(str, (tmp_path / "build").rglob("*")))  # kept beside setup.py
    first = objects[0].stat().st_mtime_ns
    _build_ext(tmp_path, 2)
    assert objects[0].stat().st_mtime_ns == first, "unchanged source recompiled"
    (tmp_path / "probe.cpp").write_text('extern "C" int fedopt_probe() { return 2; }\n')
    _build_ext(tmp_path, 3)
    assert objects[0].stat().st_mtime_ns != first, "changed source not recompiled"


def test_the_build_says_what_it_compiles_and_how(build):
    """The line the build prints before compiling an extension (pip shows it with -v): its files, and
    whether they compile in parallel; without ninja, how to get it."""
    line = build.compile_plan("fedopt_kernels._C_cpu", build.CPU_SOURCES, ninja=True)
    assert f"fedopt_kernels._C_cpu from {len(build.CPU_SOURCES)} source files" in line
    assert "csrc/cpu" in line and "csrc/common" in line and "in parallel" in line
    slow = build.compile_plan("fedopt_kernels._C_cpu", build.CPU_SOURCES, ninja=False)
    assert "one file at a time" in slow and "pip install ninja" in slow
