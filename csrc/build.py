"""What setup.py builds natively: ``fedopt_kernels._C_cpu`` (C++) and ``fedopt_kernels._C_cuda`` (CUDA).

Rules (README "Install"):

* ``_C_cpu`` is built when torch and a C++ compiler are present; ``_C_cuda`` when, in addition, nvcc
  and a CUDA build of torch with the same CUDA major version are present, and a GPU is visible (or
  ``TORCH_CUDA_ARCH_LIST`` names the GPUs to build for).
  ``FEDOPT_BUILD_CPU=0/1`` and ``FEDOPT_BUILD_CUDA=0/1`` force either off / on.
* Object files stay in ``build/native-*`` beside setup.py (``kept_build_temp``), so a reinstall of
  unchanged sources only links (ninja).
* GPU code targets ``TORCH_CUDA_ARCH_LIST`` when set, else sm_86 and sm_90 (plus the visible
  GPUs' architectures, and PTX of the newest for GPUs that came later).
* A skipped or failed extension never fails ``pip install`` nor ``import fedopt_kernels``: the build
  prints a warning and writes ``fedopt_kernels/<ext>.build-status.txt`` with the reason, which the
  backend's import error (and so ``available_backends()``) repeats.
* CUDA headers torch needs besides nvcc's own are also looked up in the ``nvidia-*`` pip packages
  (``site-packages/nvidia/*/include``), so no paths have to be set by hand.
* The sources index every op's arguments with ``op_table.h``, which is generated from
  ``fedopt_kernels/core/ops.py`` (``fedopt_kernels/core/op_header.py``) into the build's own folder and put on
  the include path (``write_op_header``): setup.py's build writes it under ``build_temp``, the
  on-first-use build into its cache folder. It is never part of the sources.
* The same source lists and flags serve the on-first-use build (``jit_spec``): an installed package
  without a compiled extension builds it against the running torch with
  ``torch.utils.cpp_extension.load`` (``fedopt_kernels/core/backends/_jit.py``). This file is installed
  as ``fedopt_kernels/csrc/build.py`` next to the sources for that purpose, so it imports nothing
  outside the standard library at module level.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import types
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_ARCHS = ("8.6", "9.0")
STATUS_SUFFIX = ".build-status.txt"


def _rel(*parts: str) -> str:
    # setuptools wants sources relative to setup.py's directory
    return os.path.join("csrc", *parts)


def _sources_in(folder: str, *suffixes: str) -> List[str]:
    """Every source of csrc/<folder> with one of ``suffixes``, sorted (the build is the same wherever
    it runs: a checkout, an sdist, the installed package's fedopt_kernels/csrc)."""
    path = os.path.join(HERE, folder)
    names = os.listdir(path) if os.path.isdir(path) else []
    return sorted(_rel(folder, f) for f in names if f.endswith(suffixes) and os.path.isfile(os.path.join(path, f)))


# Every source of the folder is built: an op's own files (csrc/cpu/<op>_cpu.cpp, csrc/cuda/<op>.cu)
# join the build by being there, with no list to keep (docs/dispatch.md, "Adding an algorithm").
COMMON_SOURCES = _sources_in("common", ".cpp")
CPU_SOURCES = _sources_in("cpu", ".cpp") + COMMON_SOURCES
CUDA_SOURCES = _sources_in("cuda", ".cpp", ".cu") + COMMON_SOURCES
# The file of each op (op_table.h FO_FOR_EACH_OP) that defines its entry point, per extension
OP_SOURCE = {"_C_cpu": ("cpu", "{op}_cpu.cpp"), "_C_cuda": ("cuda", "{op}.cu")}


# ------------------------------------------------------------------------------ op_table.h
def _op_header_module():
    """fedopt_kernels/core/op_header.py: the running package's when it is imported (its ops are declared
    with torch once per process), else the copy beside these sources, loaded without the package's
    __init__ (setup.py, where only torch is importable)."""
    if "fedopt_kernels.core.ops" in sys.modules:
        return importlib.import_module("fedopt_kernels.core.op_header")
    for pkg_dir in (os.path.join(ROOT, "fedopt_kernels", "core"), os.path.join(ROOT, "core")):  # a checkout; installed
        if os.path.isfile(os.path.join(pkg_dir, "op_header.py")):
            break
    else:
        raise FileNotFoundError(f"fedopt_kernels/core/op_header.py not found beside {HERE}")
    name = "_fedopt_kernels_build_src"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [pkg_dir]
        sys.modules[name] = pkg
    return importlib.import_module(f"{name}.op_header")


def write_op_header(folder: str) -> str:
    """Generate op_table.h (every op's slots, present bits and hp columns) into ``folder``; returns
    the folder, for the include path."""
    return _op_header_module().write(os.path.abspath(folder))


def missing_op_sources(ext: str) -> List[str]:
    """The entry-point files ``ext`` ("_C_cpu" or "_C_cuda") lacks: one per op of the declaration
    without its file (OP_SOURCE). The bindings dispatch to every declared op, so without this check
    a missing file would surface only as an undefined symbol when the extension is imported."""
    folder, pattern = OP_SOURCE[ext]
    sources = set(CPU_SOURCES if ext == "_C_cpu" else CUDA_SOURCES)
    ops = [name for name, spec in _op_header_module().OPS.items() if not spec.batched]
    return [f for f in (_rel(folder, pattern.format(op=op)) for op in ops) if f not in sources]


def _missing_message(missing: List[str]) -> str:
    return (
        f"an op declared in fedopt_kernels/core/ops.py has no kernel file: {', '.join(missing)} "
        f'(docs/dispatch.md, "Adding an algorithm")'
    )


def _warn(msg: str) -> None:
    print(f"fedopt_kernels build: WARNING: {msg}", file=sys.stderr, flush=True)


def _note(msg: str) -> None:
    print(f"fedopt_kernels build: {msg}", file=sys.stderr, flush=True)


def compile_plan(name: str, sources: List[str], ninja: bool) -> str:
    """What the build of extension ``name`` is about to compile, and how, in one line."""
    folders = sorted({os.path.dirname(s) for s in sources})
    how = (
        "in parallel (ninja; MAX_JOBS caps the jobs), recompiling only what changed since the last build"
        if ninja
        else "one file at a time, as ninja is not installed (pip install ninja compiles them in parallel)"
    )
    return f"compiling {name} from {len(sources)} source files in {', '.join(folders)}, {how}"


def _switch(name: str) -> Optional[bool]:
    """True / False when the env var forces a build on / off, None when unset (auto)."""
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "auto"):
        return None
    return v not in ("0", "false", "no", "off")


# ---------------------------------------------------------------------------------------- CUDA
def _has_cuda_headers(home: str) -> bool:
    return os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")) or bool(
        glob.glob(os.path.join(home, "targets", "*", "include", "cuda_runtime_api.h"))
    )


def find_cuda_home() -> Optional[str]:
    """The CUDA toolkit root: $CUDA_HOME / $CUDA_PATH, nvcc's own install (also through a wrapper
    script such as /usr/local/bin/nvcc), or /usr/local/cuda."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        try:  # a wrapper script: ask nvcc where it lives ("#$ TOP=<home>/bin/.." in a dry run)
            out = subprocess.run(
                [nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=60
            )
            m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
            if m:
                cands.append(os.path.normpath(m.group(1).strip()))
        except (OSError, subprocess.SubprocessError):
            pass
    cands.append("/usr/local/cuda")
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "bin", "nvcc")) and _has_cuda_headers(c):
            return os.path.normpath(c)
    return None


def nvcc_version(home: str) -> Optional[Tuple[int, int]]:
    try:
        out = subprocess.run(
            [os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def nvcc_archs(home: str) -> List[str]:
    """compute capabilities this nvcc can target, e.g. ['7.5', '8.0', ...] (empty if unknown)."""
    try:
        out = subprocess.run(
            [os.path.join(home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\d+)", out)]


def arch_flags(home: str, defaults: Tuple[str, ...] = DEFAULT_ARCHS) -> List[str]:
    """-gencode flags: TORCH_CUDA_ARCH_LIST if set, else ``defaults`` (sm_86 + sm_90) plus the
    visible GPUs, and PTX of the newest."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    ptx_for = set()
    if env:
        archs = []
        for item in re.split(r"[;\s,]+", env):
            if not item:
                continue
            base = item.replace("+PTX", "")
            if not re.fullmatch(r"\d+\.\d+[af]?", base):
                _warn(f"TORCH_CUDA_ARCH_LIST entry {item!r} is not of the form 8.6 / 9.0+PTX; ignored")
                continue
            archs.append(base)
            if item.endswith("+PTX"):
                ptx_for.add(base)
    else:
        archs = list(defaults)
        try:
            import torch

            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    archs.append("{}.{}".format(*torch.cuda.get_device_capability(i)))
        except Exception:  # no driver: the defaults
            pass
        if not archs:
            return []
        ptx_for.add(max(archs, key=lambda a: float(re.sub(r"[af]$", "", a))))
    known = nvcc_archs(home)
    flags = []
    for a in sorted(set(archs), key=lambda a: float(re.sub(r"[af]$", "", a))):
        num = a.replace(".", "")
        if known and re.sub(r"[af]$", "", a) not in known:
            _warn(f"nvcc cannot target compute capability {a}; skipped")
            continue
        code = f"sm_{num}" + (f",compute_{num}" if a in ptx_for else "")
        flags.append(
            f"-gencode=arch=compute_{num},code=[{code}]" if a in ptx_for else f"-gencode=arch=compute_{num},code={code}"
        )
    return flags


def pip_nvidia_include_dirs() -> List[str]:
    """include/ folders of the nvidia-* wheels (cu13 layout and the older per-library layout)."""
    dirs = []
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        nv = os.path.join(base, "nvidia")
        dirs += sorted(glob.glob(os.path.join(nv, "cu*", "include"))) + sorted(
            glob.glob(os.path.join(nv, "*", "include"))
        )
    seen, out = set(), []
    for d in dirs:
        if os.path.isdir(d) and d not in seen:
            seen.add(d)
            out.append(d)
    return out


# ---------------------------------------------------------------------------------------- setup
class _Skipped:
    """Marks an extension that is not built, with the reason (recorded in its status file)."""

    def __init__(self, reason: str):
        self.reason = reason


def _cxx_available() -> Optional[str]:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c.split()[0]):
            return c
    return None


def _placeholder(name: str, reason: str):
    from setuptools import Extension

    ext = Extension(name, sources=[_rel("cpu", "bindings_cpu.cpp")])
    ext._fedopt_skip = reason  # type: ignore[attr-defined, unused-ignore]  # typed where setuptools is
    return ext


def cpu_flags() -> Tuple[List[str], List[str]]:
    """(compile flags, link flags) of the C++ extension, for setup.py and the on-first-use build."""
    import torch

    # no FMA contraction: same bits as the reference on any CPU; -g0: no debug info (build time, size)
    # -fvisibility=hidden: our symbols (fo::*) stay private to each extension module;
    # -fno-math-errno: no kernel reads errno, and without it a loop calling sqrt vectorises (the IEEE
    # root either way: the same bits)
    cflags = ["-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"]
    lflags: List[str] = []
    if "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux"):
        cflags.append("-fopenmp")  # at::parallel_for is inline: OpenMP must be on in our objects too
        lflags.append("-fopenmp")
    return cflags, lflags


def cuda_flags(gencode: List[str]) -> Dict[str, List[str]]:
    """{"cxx": host compiler flags, "nvcc": nvcc flags} of the CUDA extension."""
    return {
        "cxx": ["-O3", "-g0", "-fvisibility=hidden"],
        # --fmad=false: no FMA contraction, so the math rounds as the reference's
        "nvcc": ["-O3", "--fmad=false", "-lineinfo", "-Xcompiler=-fvisibility=hidden"] + gencode,
    }


def cpu_extension():
    force = _switch("FEDOPT_BUILD_CPU")
    if force is False:
        return _placeholder("fedopt_kernels._C_cpu", "disabled by FEDOPT_BUILD_CPU=0 at build time")
    if force is None and _cxx_available() is None:
        return _placeholder("fedopt_kernels._C_cpu", "no C++ compiler found at build time (set CXX)")
    from torch.utils.cpp_extension import CppExtension

    cflags, lflags = cpu_flags()
    return CppExtension(
        "fedopt_kernels._C_cpu", CPU_SOURCES, extra_compile_args={"cxx": cflags}, extra_link_args=lflags
    )


def cuda_extension():
    name = "fedopt_kernels._C_cuda"
    force = _switch("FEDOPT_BUILD_CUDA")
    if force is False:
        return _placeholder(name, "disabled by FEDOPT_BUILD_CUDA=0 at build time")
    import torch

    if torch.version.cuda is None and not force:
        return _placeholder(name, f"torch {torch.__version__} is a CPU-only build")
    if force is None and not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() and not torch.cuda.is_available():
        # minutes of nvcc for a backend nothing here can run; a GPU machine builds it on first use
        return _placeholder(
            name, "no GPU is visible at build time (FEDOPT_BUILD_CUDA=1, or TORCH_CUDA_ARCH_LIST, builds it anyway)"
        )
    home = find_cuda_home()
    if home is None:
        return _placeholder(name, "nvcc / the CUDA toolkit was not found at build time (set CUDA_HOME)")
    ver = nvcc_version(home)
    if not force and ver and torch.version.cuda and ver[0] != int(torch.version.cuda.split(".")[0]):
        return _placeholder(name, f"nvcc {ver[0]}.{ver[1]} ({home}) does not match torch's CUDA {torch.version.cuda}")
    # torch guesses CUDA_HOME from `which nvcc`, which is wrong for wrapper scripts: tell it
    os.environ["CUDA_HOME"] = home
    import torch.utils.cpp_extension as cpp_ext

    cpp_ext.CUDA_HOME = home
    gencode = arch_flags(home)
    if not gencode:
        return _placeholder(name, "no usable GPU architecture in TORCH_CUDA_ARCH_LIST for this nvcc")
    include_dirs = pip_nvidia_include_dirs()  # after CUDA_HOME/include, which CUDAExtension puts first
    return cpp_ext.CUDAExtension(name, CUDA_SOURCES, include_dirs=include_dirs, extra_compile_args=cuda_flags(gencode))


def native_extensions():
    """(ext_modules, cmdclass) for setup(); ([], {}) when torch itself is missing."""
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension
    except Exception as exc:  # pure-Python install; the backends say the extensions are missing
        _warn(
            f"torch is not importable here ({exc}), e.g. in pip's isolated build environment: the package "
            f"installs without compiled backends, which are then built on first use against the installed "
            f"torch when a C++ compiler is present (or: pip install torch, then pip install --no-build-isolation)"
        )
        return [], {}
    exts = []
    for make in (cpu_extension, cuda_extension):
        try:
            exts.append(make())
        except Exception as exc:  # configuring one extension must not stop the other
            name = "fedopt_kernels._C_cpu" if make is cpu_extension else "fedopt_kernels._C_cuda"
            exts.append(_placeholder(name, f"configuration failed: {type(exc).__name__}: {exc}"))
    return exts, {"build_ext": _make_build_ext(BuildExtension)}


def _status_name(ext) -> str:
    return ext.name.split(".")[-1] + STATUS_SUFFIX


def kept_build_temp(current: str, root: str = ROOT) -> str:
    """Where the object files of setup.py's build stay between installs: ``build/native-<python>-torch<version>/``
    beside setup.py (git-ignored), instead of the new temporary folder pip's editable install hands
    each build. ninja then recompiles only the sources whose text, headers or command line changed,
    so reinstalling an unchanged checkout only links. ``current`` is kept where that folder cannot
    be written. ``root``: the folder of setup.py."""
    import hashlib

    import torch

    tv = re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)
    # one folder per environment: two venvs' command lines differ (include paths), and sharing one
    # folder would make each install recompile what the other one built
    env = hashlib.sha256(f"{sys.prefix}\0{torch.__file__}".encode()).hexdigest()[:8]
    path = os.path.join(root, "build", f"native-{sys.implementation.cache_tag}-torch{tv}-{env}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return current
    return path if os.access(path, os.W_OK) else current


def _make_build_ext(base):
    class NativeBuild(base):
        """torch's BuildExtension (ninja, nvcc) that records failures instead of raising them."""

        # declared for mypy (base is only known at run time); annotations alone add no attributes
        build_temp: str
        extensions: List[Any]

        def build_extensions(self) -> None:
            self.build_temp = kept_build_temp(self.build_temp)
            self._fedopt_failed: Dict[str, str] = {}
            skipped = [e for e in self.extensions if getattr(e, "_fedopt_skip", None)]
            for e in skipped:
                self._record(e, e._fedopt_skip)
            self.extensions = [e for e in self.extensions if not getattr(e, "_fedopt_skip", None)]
            if self.extensions:
                try:
                    generated = write_op_header(os.path.join(self.build_temp, "fedopt_generated"))
                except Exception as exc:  # no header, no build: say why instead of a compiler error
                    for e in self.extensions:
                        self._record(
                            e,
                            f"build failed: cannot generate op_table.h from fedopt_kernels/core/ops.py "
                            f"({type(exc).__name__}: {exc})",
                        )
                    self.extensions = self.extensions + skipped
                    return
                for e in self.extensions:
                    e.include_dirs.append(generated)
                    missing = missing_op_sources(e.name.split(".")[-1])
                    if missing:  # build_extension skips what is recorded
                        self._record(e, f"build failed: {_missing_message(missing)}")
            try:
                super().build_extensions()
            except Exception as exc:  # a failure before any extension (e.g. the CUDA version check)
                cuda = [e for e in self.extensions if any(s.endswith(".cu") for s in e.sources)]
                for e in cuda:
                    self._record(e, f"build failed: {type(exc).__name__}: {exc}")
                self.extensions = [e for e in self.extensions if e not in cuda]
                if cuda and self.extensions:
                    try:
                        super().build_extensions()
                    except Exception as exc2:
                        for e in self.extensions:
                            self._record(e, f"build failed: {type(exc2).__name__}: {exc2}")
                else:
                    for e in self.extensions:
                        self._record(e, f"build failed: {type(exc).__name__}: {exc}")
            self.extensions = self.extensions + skipped

        def build_extension(self, ext) -> None:
            if getattr(ext, "_fedopt_skip", None) or ext.name in getattr(self, "_fedopt_failed", {}):
                return
            # pip shows these lines, and the compiler's, with pip install -v
            _note(compile_plan(ext.name, ext.sources, bool(getattr(self, "use_ninja", False))))
            started = time.perf_counter()
            try:
                super().build_extension(ext)
            except Exception as exc:
                self._record(
                    ext,
                    f"build failed: {type(exc).__name__}: {exc} (the compiler output is in the "
                    f"build log: pip install -v ...)",
                )
            else:
                _note(f"{ext.name} built in {time.perf_counter() - started:.0f} s")
                path = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), _status_name(ext))
                if os.path.exists(path):
                    os.remove(path)

        def _record(self, ext, reason: str) -> None:
            reason = " ".join(str(reason).split())[:2000]
            _warn(f"{ext.name} not built: {reason}")
            getattr(self, "_fedopt_failed", {})[ext.name] = reason
            out = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), _status_name(ext))
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w", encoding="utf-8") as fh:
                fh.write(reason + "\n")

        def copy_extensions_to_source(self) -> None:
            # editable / --inplace installs: copy what was built, record what was not (and drop a
            # stale library of an earlier build, which would otherwise be imported)
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
                status_src = os.path.join(os.path.dirname(regular_file), _status_name(ext))
                status_dst = os.path.join(os.path.dirname(inplace_file), _status_name(ext))
                if os.path.exists(regular_file) and ext.name not in getattr(self, "_fedopt_failed", {}):
                    self.copy_file(regular_file, inplace_file, level=self.verbose)
                    if os.path.exists(status_dst):
                        os.remove(status_dst)
                else:
                    stem = ext.name.split(".")[-1]
                    for stale in glob.glob(os.path.join(os.path.dirname(inplace_file), stem + ".*.so")) + glob.glob(
                        os.path.join(os.path.dirname(inplace_file), stem + ".so")
                    ):
                        os.remove(stale)
                    if os.path.exists(status_src) and os.path.abspath(status_src) != os.path.abspath(status_dst):
                        shutil.copyfile(status_src, status_dst)

        def get_outputs(self) -> List[str]:
            # only what exists: a skipped extension has no library to install
            return [p for p in super().get_outputs() if os.path.exists(p)]

        def get_output_mapping(self) -> Dict[str, str]:
            return {k: v for k, v in super().get_output_mapping().items() if os.path.exists(k)}

    return NativeBuild


# ------------------------------------------------------------------------- on-first-use build
class CannotBuild(Exception):
    """The on-first-use build cannot run here; the message says why, for the user."""


class JitSpec:
    """What ``torch.utils.cpp_extension.load`` needs to build one extension, plus ``tag``: what the
    binary depends on besides the sources (torch, CUDA, GPU architectures), for the cache key."""

    def __init__(
        self,
        name: str,
        sources: List[str],
        cflags: List[str],
        ldflags: List[str],
        cuda_cflags: Optional[List[str]] = None,
        include_dirs: Optional[List[str]] = None,
        cuda_home: Optional[str] = None,
        tag: str = "",
    ):
        self.name, self.sources, self.cflags, self.ldflags = name, sources, cflags, ldflags
        self.cuda_cflags, self.include_dirs = cuda_cflags, include_dirs or []
        self.cuda_home, self.tag = cuda_home, tag

    @property
    def with_cuda(self) -> bool:
        return self.cuda_cflags is not None


def _abs(sources: List[str]) -> List[str]:
    return [os.path.join(ROOT, s) for s in sources]


def jit_spec(ext: str) -> JitSpec:
    """The on-first-use build of ``fedopt_kernels.<ext>`` ("_C_cpu" or "_C_cuda") for the running
    torch; raises CannotBuild saying what is missing. Unlike setup.py, CUDA code is built only for
    the GPUs that are visible (or TORCH_CUDA_ARCH_LIST), so the build is as short as it can be."""
    import torch

    tv = re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)  # the local tag too: +cpu and +cu130 builds differ
    folder = "cpu" if ext == "_C_cpu" else "cuda"
    if not _sources_in(folder, ".cpp", ".cu"):
        raise CannotBuild(f"the sources are incomplete (no C++ sources under {os.path.join(HERE, folder)})")
    missing = missing_op_sources(ext) if ext in OP_SOURCE else []
    if missing:
        raise CannotBuild(_missing_message(missing))
    if _cxx_available() is None:
        raise CannotBuild("no C++ compiler found (install g++ or clang++, or set CXX)")
    if ext == "_C_cpu":
        cflags, lflags = cpu_flags()
        return JitSpec(ext, _abs(CPU_SOURCES), cflags, lflags, tag=f"torch{tv}-cpu")
    if ext != "_C_cuda":
        raise CannotBuild(f"unknown extension {ext!r}")
    if torch.version.cuda is None:
        raise CannotBuild(f"torch {torch.__version__} is a CPU-only build")
    env_archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not env_archs and not torch.cuda.is_available():
        raise CannotBuild(
            "no GPU is visible; the on-first-use CUDA build targets the visible GPUs "
            "(set TORCH_CUDA_ARCH_LIST to build for others)"
        )
    home = find_cuda_home()
    if home is None:
        raise CannotBuild("nvcc / the CUDA toolkit was not found (install it or set CUDA_HOME)")
    ver = nvcc_version(home)
    if ver and ver[0] != int(torch.version.cuda.split(".")[0]):
        raise CannotBuild(f"nvcc {ver[0]}.{ver[1]} ({home}) does not match torch's CUDA {torch.version.cuda}")
    gencode = arch_flags(home, defaults=())
    if not gencode:
        raise CannotBuild("no GPU architecture to build for (TORCH_CUDA_ARCH_LIST / visible GPUs)")
    archs = "_".join(sorted(set(re.findall(r"sm_(\d+[af]?)", " ".join(gencode)))))
    flags = cuda_flags(gencode)
    return JitSpec(
        ext,
        _abs(CUDA_SOURCES),
        flags["cxx"],
        [],
        cuda_cflags=flags["nvcc"],
        include_dirs=pip_nvidia_include_dirs(),
        cuda_home=home,
        tag=f"torch{tv}-cu{torch.version.cuda}-sm{archs}",
    )
