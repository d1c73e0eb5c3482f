"""Test-wide setup.

Without a GPU, Triton kernels run on CPU tensors under the Triton interpreter. The variable is read
when a kernel is decorated, so it must be set before ``fedopt_kernels.triton_kernels`` is imported:
this file runs before any test module.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (the simulator's models are tiny: threads only add overhead)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
