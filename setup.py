"""Build script: the pure-Python package always; native extensions when a toolchain is present.

``triton_kernels/`` (Triton sources) is installed as ``fedopt_kernels.triton_kernels`` so that no
top-level ``triton_kernels`` module clashes with other projects. ``csrc/`` (C++/CUDA sources and
``build.py``, which lists them) is installed as ``fedopt_kernels/csrc``: an install without the
compiled extensions (e.g. a wheel built in an isolated environment without torch) builds them on
first use from there (``fedopt_kernels/core/backends/_jit.py``).
"""

import importlib.util
import os
import re

import setuptools
from setuptools import find_packages, setup

# pyproject.toml's SPDX `license = "..."` string needs setuptools >= 77 (PEP 639). With
# --no-build-isolation the installed setuptools is used as is: say so instead of a schema error.
_MIN_SETUPTOOLS = (77, 0)
_found = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
if _found < _MIN_SETUPTOOLS:
    raise SystemExit(
        f"fedopt_kernels needs setuptools>={_MIN_SETUPTOOLS[0]} to build, found {setuptools.__version__}: "
        f"pip install -U 'setuptools>={_MIN_SETUPTOOLS[0]}' (with --no-build-isolation pip uses the "
        f"installed setuptools)"
    )

# Found from the folders, so that a new subpackage ships without a list to keep: every folder of
# fedopt_kernels/ and triton_kernels/ with an __init__.py (tests/test_newcomer_packaging.py checks
# that no folder holding Python files is left out), plus csrc/ (sources and build.py, no __init__.py).
HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = (
    find_packages(HERE, include=["fedopt_kernels", "fedopt_kernels.*"])
    + ["fedopt_kernels.triton_kernels"]
    + [f"fedopt_kernels.triton_kernels.{p}" for p in find_packages(os.path.join(HERE, "triton_kernels"))]
    + ["fedopt_kernels.csrc"]
)
PACKAGE_DIR = {"fedopt_kernels.triton_kernels": "triton_kernels", "fedopt_kernels.csrc": "csrc"}
# the sources of the on-first-use build; build.py (the source list) is picked up as a module
PACKAGE_DATA = {"fedopt_kernels.csrc": ["*/*.h", "*/*.cuh", "*/*.cpp", "*/*.cu"]}


def native_extensions():
    """C++ CPU and CUDA extensions (see csrc/build.py); an empty list when they cannot be built.

    A skipped or failed extension never fails the install: csrc/build.py records why, and
    ``fedopt_kernels.available_backends()`` reports it.
    """
    path = os.path.join(HERE, "csrc", "build.py")
    try:
        spec = importlib.util.spec_from_file_location("fedopt_native_build", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.native_extensions()
    except Exception as exc:  # never let the native part break a pure-Python install
        print(f"fedopt_kernels build: WARNING: native extensions skipped ({type(exc).__name__}: {exc})")
        return [], {}


ext_modules, cmdclass = native_extensions()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data=PACKAGE_DATA,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
