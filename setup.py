"""Build script: the pure-Python package always; native extensions when a toolchain is present.

``triton_kernels/`` (Triton sources) is installed as ``fedopt_kernels.triton_kernels`` so that no
top-level ``triton_kernels`` module clashes with other projects.
"""
import importlib.util
import os

from setuptools import setup

PACKAGES = [
    "fedopt_kernels",
    "fedopt_kernels.backends",
    "fedopt_kernels.flower",
    "fedopt_kernels.reference",
    "fedopt_kernels.sim",
    "fedopt_kernels.triton_kernels",
]
PACKAGE_DIR = {"fedopt_kernels.triton_kernels": "triton_kernels"}


def native_extensions():
    """C++ CPU and CUDA extensions (see csrc/build.py); an empty list when they cannot be built.

    A skipped or failed extension never fails the install: csrc/build.py records why, and
    ``fedopt_kernels.available_backends()`` reports it.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "build.py")
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
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
