"""Build a missing native extension on first use, against the torch that is running.

A wheel built where torch was absent (``pip install .`` with build isolation), or an extension
built for another torch, leaves ``fedopt_kernels._C_cpu`` / ``_C_cuda`` unusable. When a C++
compiler (and nvcc for CUDA) is present, this module compiles the installed sources
(``fedopt_kernels/csrc``, listed by its ``build.py``, the same list setup.py builds) with
``torch.utils.cpp_extension.load`` the first time a backend is asked for — as DeepSpeed's op
builder does — and caches the result per extension, torch, CUDA version, GPU architectures and
source digest, so later processes only import it. The header of every op's argument layout
(``op_table.h``) is generated from the running package's ``ops.py`` into the cache folder and is
part of the digest.

Switches: ``FEDOPT_JIT_BUILD=0`` turns the build off (a build already in the cache is still
loaded); ``FEDOPT_CACHE_DIR`` moves the cache (default
``$XDG_CACHE_HOME/fedopt_kernels`` or ``~/.cache/fedopt_kernels``). An extension disabled on purpose
(``FEDOPT_BUILD_CPU=0`` / ``FEDOPT_BUILD_CUDA=0``, now, or at install time unless
``FEDOPT_JIT_BUILD=1``) is neither built nor loaded here. A failed build is remembered (its log
kept) so that every later import does not retry it; delete its cache folder to try again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Optional

from .. import op_header as _op_header

_PKG_DIR = Path(__file__).resolve().parents[2]  # fedopt_kernels/
_SWITCH = {"_C_cpu": "FEDOPT_BUILD_CPU", "_C_cuda": "FEDOPT_BUILD_CUDA"}
_BACKEND = {"_C_cpu": "cpu", "_C_cuda": "cuda"}
_SOURCE_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")
_LOCK_WAIT_S = 1800.0


class JitUnavailable(ImportError):
    """The extension cannot be built on first use; the message says why, for the user."""


def _off(value: Optional[str]) -> bool:
    return value is not None and value.strip().lower() in ("0", "false", "no", "off")


def _on(value: Optional[str]) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def _switched_off(ext: str, install_status: Optional[str]) -> Optional[str]:
    """Why ``ext`` is not wanted at all (its build switch, now or at install time), or None."""
    switch = _SWITCH[ext]
    if _off(os.environ.get(switch)):
        return f"disabled by {switch}=0"
    if (
        install_status
        and install_status.startswith(f"disabled by {switch}=0")
        and not _on(os.environ.get("FEDOPT_JIT_BUILD"))
    ):
        return f"disabled at install time ({switch}=0); reinstall without it, or set FEDOPT_JIT_BUILD=1 to build it now"
    return None


def disabled_reason(ext: str, install_status: Optional[str] = None) -> Optional[str]:
    """Why the on-first-use build of ``ext`` is switched off, or None when it may run."""
    if _off(os.environ.get("FEDOPT_JIT_BUILD")):
        return "the on-first-use build is off (FEDOPT_JIT_BUILD=0)"
    return _switched_off(ext, install_status)


def cache_root() -> Path:
    """Where built extensions are kept: $FEDOPT_CACHE_DIR, else the user's cache folder."""
    if os.environ.get("FEDOPT_CACHE_DIR"):
        return Path(os.environ["FEDOPT_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fedopt_kernels"


def build_script() -> Optional[Path]:
    """csrc/build.py: installed inside the package (wheels), or beside it (a checkout, editable installs)."""
    for cand in (_PKG_DIR / "csrc" / "build.py", _PKG_DIR.parent / "csrc" / "build.py"):
        if cand.is_file():
            return cand
    return None


def _load_build_module(path: Path) -> ModuleType:
    name = "_fedopt_kernels_csrc_build"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file path always has both
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _digest(csrc: Path, spec) -> str:
    """Hash of every source and header under csrc/, of the generated op_table.h and of the build's
    flags and target."""
    h = hashlib.sha256()
    h.update(_op_header.render().encode() + b"\0")
    for f in sorted(p for p in csrc.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        h.update(str(f.relative_to(csrc)).encode() + b"\0" + f.read_bytes() + b"\0")
    for part in (spec.tag, sys.version, *spec.cflags, "|", *spec.ldflags, "|", *(spec.cuda_cflags or [])):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def cache_folder(ext: str, script: Path, spec) -> Path:
    """The cache folder of ``ext`` built from ``script``'s sources with ``spec`` (jit_spec)."""
    return (
        cache_root() / f"{ext}-{spec.tag}-py{sys.version_info[0]}{sys.version_info[1]}-{_digest(script.parent, spec)}"
    )


def _say(msg: str, end: str = "\n") -> None:
    sys.stdout.flush()  # what was printed before the message stays before it where both streams meet
    print(f"fedopt_kernels: {msg}", file=sys.stderr, end=end, flush=True)


def _end_line(msg: str) -> None:
    """Finish the line ``_say(..., end="")`` began (the build's one line)."""
    print(msg, file=sys.stderr, flush=True)


def _import(ext: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(ext, library)
    if spec is None or spec.loader is None:
        raise JitUnavailable(f"cannot import the built extension {library}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _publish(ext: str, mod: ModuleType) -> ModuleType:
    # make `from fedopt_kernels import _C_cpu` and `import fedopt_kernels._C_cpu` find it too
    sys.modules[f"fedopt_kernels.{ext}"] = mod
    pkg = sys.modules.get("fedopt_kernels")
    if pkg is not None:
        setattr(pkg, ext, mod)
    return mod


def _cpp_extension() -> ModuleType:
    # importing it guesses CUDA_HOME and warns "No CUDA runtime is found" on machines without a
    # GPU, which means nothing for a CPU build (and a CUDA build is given the toolkit explicitly)
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def _failure_summary(text: str) -> str:
    """The line of a compiler log a user most needs: the first error, else the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln[:300]
    return (lines[0] if lines else "unknown error")[:300]


def build(ext: str, install_status: Optional[str] = None) -> ModuleType:
    """Import ``fedopt_kernels.<ext>`` from the cache, building it first if needed; raise
    JitUnavailable saying why when it cannot be had. ``FEDOPT_JIT_BUILD=0`` stops the build, not
    the import of a build already in the cache."""
    why = _switched_off(ext, install_status)
    if why:
        raise JitUnavailable(why)
    no_build = disabled_reason(ext, install_status)  # FEDOPT_JIT_BUILD=0: only a cached build is used
    script = build_script()
    if script is None:
        raise JitUnavailable(no_build or "the C++/CUDA sources are not installed with the package (no csrc/build.py)")
    try:
        import torch  # noqa: F401  (the extension links against it: loaded first)

        mod = _load_build_module(script)
        spec = mod.jit_spec(ext)
    except Exception as exc:  # CannotBuild, or the build script failing: the reason, not a traceback
        raise JitUnavailable(
            no_build
            or (
                str(exc)
                if type(exc).__name__ == "CannotBuild"
                else f"the build configuration failed ({type(exc).__name__}: {exc})"
            )
        ) from None
    out = cache_folder(ext, script, spec)
    library, ok, failed = out / f"{ext}.so", out / "OK", out / "FAILED"
    if ok.is_file() and library.is_file():
        return _publish(ext, _import(ext, library))
    if no_build:
        raise JitUnavailable(f"{no_build}, and no build of it is cached in {cache_root()}")
    if failed.is_file():
        raise JitUnavailable(
            f"its on-first-use build failed earlier ({failed.read_text().strip()}); "
            f"log: {out / 'build.log'}; delete {out} to try again"
        )
    cpp_extension = _cpp_extension()
    if not cpp_extension.is_ninja_available():
        raise JitUnavailable("the on-first-use build needs ninja (pip install ninja)")
    try:
        from filelock import FileLock, Timeout  # a torch dependency

        out.mkdir(parents=True, exist_ok=True)
    except (ImportError, OSError) as exc:
        raise JitUnavailable(
            f"cannot prepare the build cache {out} ({type(exc).__name__}: {exc}); "
            f"set FEDOPT_CACHE_DIR to a writable folder"
        ) from None
    # one builder at a time; the OS drops the lock if its holder dies, so a crash never blocks anyone
    lock = FileLock(str(out) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"waiting for another process that is building {ext} in {out} ...")
        try:
            lock.acquire(timeout=_LOCK_WAIT_S)
        except Timeout:
            raise JitUnavailable(
                f"another process has been building {ext} in {out} for over {_LOCK_WAIT_S:.0f} s"
            ) from None
    try:
        if ok.is_file() and library.is_file():  # the other process finished it
            return _publish(ext, _import(ext, library))
        if failed.is_file():
            raise JitUnavailable(
                f"its on-first-use build failed ({failed.read_text().strip()}); "
                f"log: {out / 'build.log'}; delete {out} to try again"
            )
        stale = out / "lock"  # older torch marks a build with a plain file that a killed build leaves behind
        if stale.is_file():
            stale.unlink()
        return _publish(ext, _compile(ext, spec, out, cpp_extension))
    finally:
        lock.release()


def _compile(ext: str, spec, out: Path, cpp_extension) -> ModuleType:
    import torch

    backend = _BACKEND[ext]
    # one line: begun here, ended with the outcome (the compiler prints nothing unless it fails)
    _say(
        f"building the {backend} backend (fedopt_kernels.{ext}) for torch {torch.__version__} on first use, "
        f"once (cached in {out}; FEDOPT_JIT_BUILD=0 turns this off) ...",
        end="",
    )
    if spec.cuda_home:
        # torch found CUDA_HOME when it was imported; point it at the toolkit that matches torch
        os.environ["CUDA_HOME"] = spec.cuda_home
        cpp_extension.CUDA_HOME = spec.cuda_home
    if "CXX" not in os.environ and shutil.which("c++") is None:
        for cxx in ("g++", "clang++"):
            if shutil.which(cxx):
                os.environ["CXX"] = cxx  # torch compiles with $CXX, else c++
                break
    generated = _op_header.write(str(out / "generated"))  # the sources include op_table.h from here
    t0 = time.perf_counter()
    try:
        mod = cpp_extension.load(
            name=ext,
            sources=spec.sources,
            extra_cflags=spec.cflags,
            extra_ldflags=spec.ldflags,
            extra_cuda_cflags=spec.cuda_cflags,
            extra_include_paths=spec.include_dirs + [generated],
            build_directory=str(out),
            with_cuda=spec.with_cuda,
            verbose=False,
        )
    except Exception as exc:  # the compiler's output is in the exception's text
        text = f"{type(exc).__name__}: {exc}"
        (out / "build.log").write_text(text + "\n", encoding="utf-8")
        summary = _failure_summary(text)
        (out / "FAILED").write_text(summary + "\n", encoding="utf-8")
        _end_line(f" failed after {time.perf_counter() - t0:.0f} s: {summary} (log: {out / 'build.log'})")
        raise JitUnavailable(
            f"its on-first-use build failed ({summary}); log: {out / 'build.log'}; delete {out} to try again"
        ) from None
    (out / "OK").write_text(f"built in {time.perf_counter() - t0:.1f} s for torch {torch.__version__}\n")
    _end_line(f" built in {time.perf_counter() - t0:.0f} s")
    return mod
