"""For the tests that compile kernel code on the host: the C++ compiler, and the generated op_table.h."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fedopt_kernels.core import op_header as _op_header


def compiler() -> str:
    """The host C++ compiler ($CXX, g++, clang++ or c++); skips the test without one."""
    for cxx in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if cxx and shutil.which(cxx):
            return cxx
    pytest.skip("no C++ compiler")


def generated_include(folder: Path) -> str:
    """op_table.h written into ``folder / "generated"``, as the build generates it; the include folder."""
    return _op_header.write(str(folder / "generated"))
