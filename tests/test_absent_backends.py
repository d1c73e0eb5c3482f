"""A backend this machine lacks for an expected reason (no GPU for the CUDA extension, the triton extra
not installed) is reported in one line that says so; a real failure keeps its whole story."""

import sys

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.core.backends import _native

CUDA = "fedopt_kernels.core.backends.cuda"
TRITON = "fedopt_kernels.core.backends.triton"

# what the loader says on a CPU machine after the README's install (the install skipped the build)
NO_GPU_STORY = (
    "fedopt_kernels._C_cuda is missing: it was not built at install time (no GPU is visible at build time "
    "(FEDOPT_BUILD_CUDA=1, or TORCH_CUDA_ARCH_LIST, builds it anyway)), and it cannot be built on first use: "
    "no GPU is visible; the on-first-use CUDA build targets the visible GPUs (set TORCH_CUDA_ARCH_LIST to build "
    "for others)"
)
FAILED_STORY = (
    "fedopt_kernels._C_cuda is missing: it was not built at install time (build failed: CalledProcessError: "
    "nvcc exited 1), and it cannot be built on first use: no GPU is visible"
)


def _reload(monkeypatch, module: str, backend: str) -> str:
    """Import ``module`` afresh (whatever an earlier test loaded) and return the reason the registry gives."""
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delitem(_registry._LOAD_ERRORS, backend, raising=False)
    return fk.available_backends("cpu").missing[backend]


def _cuda_reason(monkeypatch, story: str, gpu: bool, torch_cuda="13.0") -> str:
    """The registry's reason for cuda when its extension is missing with ``story``, on a machine with
    or without a GPU, with a CUDA build of torch (or, ``torch_cuda=None``, a CPU-only one)."""

    def missing(ext):
        raise ImportError(story)

    monkeypatch.setattr(_native, "load_extension", missing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    return _reload(monkeypatch, CUDA, "cuda")


def test_no_gpu_reads_as_expected_in_one_line(monkeypatch):
    why = _cuda_reason(monkeypatch, NO_GPU_STORY, gpu=False)
    assert why.startswith("backend 'cuda' not built here: no GPU is visible, as expected"), why
    assert "\n" not in why and "failed" not in why and why.count("(") == 1, why
    assert "FEDOPT_BUILD_CUDA=1" in why


def test_cpu_only_torch_reads_as_expected(monkeypatch):
    story = "fedopt_kernels._C_cuda is missing: torch 2.13.0+cpu is a CPU-only build"
    why = _cuda_reason(monkeypatch, story, gpu=False, torch_cuda=None)
    assert why.startswith("backend 'cuda' not built here: torch ") and "CPU-only build" in why, why
    assert "failed" not in why


def test_a_failed_build_keeps_its_whole_story(monkeypatch):
    why = _cuda_reason(monkeypatch, FAILED_STORY, gpu=False)
    assert why == f"backend 'cuda' failed to load (ImportError: {FAILED_STORY})", why


def test_with_a_gpu_a_missing_extension_is_a_failure(monkeypatch):
    why = _cuda_reason(monkeypatch, NO_GPU_STORY, gpu=True)
    assert why.startswith("backend 'cuda' failed to load (ImportError: fedopt_kernels._C_cuda is missing"), why


def test_triton_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ModuleNotFoundError
    why = _reload(monkeypatch, TRITON, "triton")
    extra = "pip install 'fedopt_kernels[triton]'"
    assert why == f"backend 'triton' not installed: the triton package is an extra ({extra})", why


@pytest.mark.parametrize("absent", [False, True], ids=["failure", "expected"])
def test_an_unusable_backend_is_refused_by_name_either_way(monkeypatch, absent):
    _cuda_reason(monkeypatch, NO_GPU_STORY, gpu=not absent)
    with pytest.raises(RuntimeError, match=r"backend='cuda' is not available: backend 'cuda' "):
        _registry.resolve("fednar", "cuda", torch.device("cuda"))
