"""Native backends on every install path: an install without a usable compiled extension builds it on
first use against the running torch (fedopt_kernels/core/backends/_jit.py), from the sources that ship in
the package; when it cannot, available_backends() says plainly why.

The slow test copies the package in the layout a wheel installs (``fedopt_kernels/csrc`` inside the
package, no ``_C_*.so``) and imports it in a child process with a fresh cache folder: two processes
start at once, one builds, the other waits for it, and both step on the ``cpu`` backend. Building
``_C_cpu`` took 74 s on a shared 2-core machine (AMD EPYC), hence ``slow``.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# a child process that imports the fedopt_kernels of its working directory, not an editable install
PRELUDE = textwrap.dedent("""
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
""")


def _child(code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH="", **env)
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _build_module():
    spec = importlib.util.spec_from_file_location("_test_csrc_build", ROOT / "csrc" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_source_list_for_setup_and_first_use_build():
    build = _build_module()
    spec = build.jit_spec("_C_cpu")
    assert spec.sources == [os.path.join(str(ROOT), s) for s in build.CPU_SOURCES]
    assert all(Path(s).is_file() for s in spec.sources)
    assert spec.cflags == build.cpu_flags()[0]


HIDDEN = """
    sys.modules["fedopt_kernels._C_cpu"] = None   # as if the install had no compiled extension
    import fedopt_kernels
    print("MISSING", fedopt_kernels.available_backends("cpu").missing.get("cpu"))
"""


def test_switched_off_says_so(tmp_path):
    proc = _child(HIDDEN, ROOT, FEDOPT_JIT_BUILD="0", FEDOPT_CACHE_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("MISSING"))
    assert "no compiled extension" in line and "FEDOPT_JIT_BUILD=0" in line, line
    assert not any(tmp_path.iterdir())


CACHED = """
    sys.modules["fedopt_kernels._C_cpu"] = None   # as if the install had no compiled extension
    import fedopt_kernels
    print("AVAILABLE", "cpu" in fedopt_kernels.available_backends("cpu"))
    from fedopt_kernels import _C_cpu
    print("LIB", _C_cpu.__file__)
"""


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler")
def test_switched_off_still_loads_a_cached_build(tmp_path, monkeypatch):
    """FEDOPT_JIT_BUILD=0 stops compiling, not importing: a build already in the cache (here the
    checkout's own extension put where the first-use build keeps it) is loaded, nothing is built."""
    built = importlib.util.find_spec("fedopt_kernels._C_cpu")
    if built is None or not built.origin:
        pytest.skip("no built fedopt_kernels._C_cpu to place in the cache")
    from fedopt_kernels.core.backends import _jit

    monkeypatch.setenv("FEDOPT_CACHE_DIR", str(tmp_path))
    script = _jit.build_script()
    folder = _jit.cache_folder("_C_cpu", script, _jit._load_build_module(script).jit_spec("_C_cpu"))
    folder.mkdir(parents=True)
    shutil.copy(built.origin, folder / "_C_cpu.so")
    (folder / "OK").write_text("placed by the test\n")
    before = sorted(p.name for p in folder.iterdir())
    proc = _child(CACHED, ROOT, FEDOPT_JIT_BUILD="0", FEDOPT_CACHE_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"LIB {folder / '_C_cpu.so'}" in proc.stdout and "AVAILABLE True" in proc.stdout, proc.stdout
    assert "building" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == before


def test_switched_on_overrides_an_install_time_switch(monkeypatch):
    from fedopt_kernels.core.backends import _jit

    monkeypatch.delenv("FEDOPT_BUILD_CPU", raising=False)
    monkeypatch.setenv("FEDOPT_JIT_BUILD", "1")
    assert _jit.disabled_reason("_C_cpu", "disabled by FEDOPT_BUILD_CPU=0 at build time") is None
    monkeypatch.setenv("FEDOPT_JIT_BUILD", "0")
    assert "FEDOPT_JIT_BUILD=0" in _jit.disabled_reason("_C_cpu")


def test_no_compiler_says_so(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(empty), FEDOPT_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH="")
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(HIDDEN)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("MISSING"))
    assert "cannot be built on first use" in line and "no C++ compiler" in line, line


def test_disabled_at_install_time_is_respected(monkeypatch):
    from fedopt_kernels.core.backends import _jit

    monkeypatch.delenv("FEDOPT_JIT_BUILD", raising=False)
    monkeypatch.delenv("FEDOPT_BUILD_CPU", raising=False)
    assert _jit.disabled_reason("_C_cpu", "no C++ compiler found at build time (set CXX)") is None
    assert "FEDOPT_BUILD_CPU=0" in _jit.disabled_reason("_C_cpu", "disabled by FEDOPT_BUILD_CPU=0 at build time")
    monkeypatch.setenv("FEDOPT_BUILD_CPU", "0")
    assert "FEDOPT_BUILD_CPU=0" in _jit.disabled_reason("_C_cpu")
    monkeypatch.setenv("FEDOPT_CACHE_DIR", "/somewhere")
    assert _jit.cache_root() == Path("/somewhere")


def _wheel_layout(dst: Path) -> Path:
    """The package as a wheel installs it: csrc inside, no compiled extension, no build status."""
    pkg = dst / "fedopt_kernels"
    shutil.copytree(
        ROOT / "fedopt_kernels", pkg, ignore=shutil.ignore_patterns("*.so", "*.build-status.txt", "__pycache__")
    )
    shutil.copytree(ROOT / "csrc", pkg / "csrc", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


STEP = """
    import torch, fedopt_kernels as fk
    assert "cpu" in fk.available_backends("cpu"), fk.available_backends("cpu")
    from fedopt_kernels import _C_cpu
    print("LIB", _C_cpu.__file__)
    out = {}
    for backend in ("reference", "cpu"):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(33, 7), (7,), (1000,)]]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt = fk.FedNAR(ps, lr=0.1, weight_decay=0.01, max_norm=1.0, backend=backend)
        opt.step()
        assert opt.resolved_backend() == backend
        out[backend] = [p.detach().clone() for p in ps]
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(out["reference"], out["cpu"]))
    print("STEPPED")
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler")
def test_first_use_build_of_the_cpu_extension(tmp_path):
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:
        pytest.skip("torch.utils.cpp_extension is not importable")
    if not is_ninja_available():
        pytest.skip("ninja is not installed (the first-use build needs it)")
    site = _wheel_layout(tmp_path / "site")
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH="", FEDOPT_CACHE_DIR=str(cache))
    env.pop("FEDOPT_JIT_BUILD", None)
    env.pop("FEDOPT_BUILD_CPU", None)
    cmd = [sys.executable, "-c", PRELUDE + textwrap.dedent(STEP)]
    # two processes at once with an empty cache: one builds, the other waits and loads its result
    procs = [
        subprocess.Popen(cmd, cwd=site, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
        assert "STEPPED" in out
        lib = next(ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith("LIB "))
        assert Path(lib).resolve().is_relative_to(cache.resolve()), lib
    errs = [err for _, err in results]
    # one line, begun and ended by the process that builds
    lines = [ln for e in errs for ln in e.splitlines() if "building the cpu backend" in ln]
    assert len(lines) == 1 and re.search(r"\.\.\. built in \d+ s$", lines[0]), errs
    # a later process only imports the cached build, silently
    proc = subprocess.run(cmd, cwd=site, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "STEPPED" in proc.stdout, proc.stderr[-3000:]
    assert "building" not in proc.stderr


def test_the_installed_extension_records_the_torch_it_was_built_for():
    from fedopt_kernels.core.backends import _native

    try:
        mod = _native.load_extension("_C_cpu")
    except ImportError as exc:
        pytest.skip(f"no cpu extension here: {exc}")
    assert mod.built_for_torch == _native.torch_release()


@pytest.mark.parametrize("built_for", ["1.0.0", None])
def test_an_extension_built_for_another_torch_is_rebuilt_not_loaded(monkeypatch, built_for):
    """It may import (same symbols) and still disagree with this torch's ABI or op layouts: the
    loader builds one for this torch instead, saying why, or refuses naming both versions."""
    import types

    from fedopt_kernels.core.backends import _jit, _native

    stale = types.ModuleType("fedopt_kernels._C_cpu")
    if built_for is not None:
        stale.built_for_torch = built_for
    monkeypatch.setattr(_native.importlib, "import_module", lambda name: stale)
    rebuilt = types.ModuleType("fedopt_kernels._C_cpu")
    seen = []

    def fake_build(ext, install_status=None):
        seen.append(ext)
        return rebuilt

    monkeypatch.setattr(_jit, "build", fake_build)
    with pytest.warns(
        RuntimeWarning, match=f"built for torch {built_for or 'an unknown version'}, not {_native.torch_release()}"
    ):
        assert _native.load_extension("_C_cpu") is rebuilt
    assert seen == ["_C_cpu"]

    def no_build(ext, install_status=None):
        raise _jit.JitUnavailable("switched off for this test")

    monkeypatch.setattr(_jit, "build", no_build)
    with pytest.warns(RuntimeWarning), pytest.raises(ImportError, match="built for torch .* not .*switched off"):
        _native.load_extension("_C_cpu")


@pytest.mark.parametrize(
    "version,release",
    [
        ("2.14.1+cu130", "2.14.1"),
        ("2.12.0a0+git1234abc", "2.12.0"),
        ("2.10.0", "2.10.0"),
        ("2.11.0.dev20260101", "2.11.0"),
    ],
)
def test_torch_release_drops_local_and_pre_release_parts(version, release):
    """A nightly's "2.12.0a0" is the 2.12.0 its headers say: no rebuild warning at every import."""
    from fedopt_kernels.core.backends import _native

    assert _native.torch_release(version) == release
