"""The GPU tests' harnesses, checked on any machine, so that an op or algorithm they do not know
fails here and not first on a GPU (on an H200, every test of the sixth algorithm's op failed at
its first line: the op-level harness had no value for its hyperparameter ``rho``).

* every op of the declaration (per-client and client-batched) builds its arguments through the
  GPU tests' own harness (tests/op_harness.py, which tests/test_native_cuda.py uses) and runs on
  the reference and cpu backends, which agree;
* the GPU test modules' lists of optimizers have one for every algorithm of the catalogue (the
  per-client cuda tests and the triton tests, per-client and client-batched); the others are
  parametrised from the catalogue or the op declaration themselves.
"""

from __future__ import annotations

import op_harness
import pytest
import test_native_cuda
import test_triton_gpu
import torch
from backends import usable
from op_harness import MIXED, op_args, same_roles

from fedopt_kernels.core import ops as _ops
from fedopt_kernels.core.ops import OPS, PER_CLIENT
from fedopt_kernels.fl import algorithm, catalogue

# the GPU tests' MIXED layout (its dtypes, row groups and a zero-size tensor), each dimension cut to 7
SMALL = [(tuple(min(d, 7) for d in shape), dtype, group) for shape, dtype, group in MIXED]


def _run_every_backend(name: str) -> None:
    spec = OPS[name]
    backends = [b for b in ("reference", "cpu") if b in usable("cpu")]
    out = {}
    for backend in backends:
        args = op_args(spec, SMALL, backend, "cpu", clients=5 if spec.batched else 0, seed=1)
        for _ in range(2):  # k advances; sgd_batched's FRESH rule only at a client's k == 0
            _ops.torch_op(name)(*args)
        out[backend] = args
    for backend in backends[1:]:
        same_roles(spec, out["reference"], out[backend], exact=False)


@pytest.mark.parametrize("name", list(OPS))
def test_every_op_runs_through_the_gpu_tests_harness(name):
    _run_every_backend(name)


def test_the_harness_check_can_fail(monkeypatch):
    """Not vacuous: the hyperparameter table without FedSAM's rho fails on the CPU, naming it."""
    monkeypatch.delitem(op_harness.HP, "rho")
    with pytest.raises(KeyError, match="rho"):
        _run_every_backend("sam_ascent_batched")


def _native_cuda_algorithms() -> set:
    """The algorithms of test_native_cuda's per-client optimizers (built on the CPU)."""
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    return {
        algorithm.of_optimizer(type(test_native_cuda._make(a, params, "reference"))).name
        for a in test_native_cuda.ALGOS
    }


def _gpu_lists() -> dict:
    """Each GPU test module's list of optimizers, as the algorithms they stand for."""
    return {
        "test_native_cuda.ALGOS": _native_cuda_algorithms(),
        "test_triton_gpu._builders": set(test_triton_gpu._builders()),
        "test_triton_gpu._batched_builders": set(test_triton_gpu._batched_builders()),
    }


def test_the_gpu_tests_have_an_optimizer_for_every_algorithm():
    want = set(catalogue.ALGOS)
    missing = {where: sorted(want - have) for where, have in _gpu_lists().items() if want - have}
    assert not missing, f"algorithms the GPU tests do not know: {missing}"
    # and what they take from the declarations covers every op
    assert [n for n, _ in test_native_cuda.BATCHED_CFGS] == list(catalogue.ALGOS)
    assert set(test_native_cuda.NORM_OPS) == {n for n, s in PER_CLIENT.items() if s.norm}


def test_the_coverage_check_can_fail(monkeypatch):
    """Not vacuous: a triton test list without FedSAM fails on the CPU, naming it."""
    real = test_triton_gpu._builders
    monkeypatch.setattr(test_triton_gpu, "_builders", lambda: {k: v for k, v in real().items() if k != "fedsam"})
    with pytest.raises(AssertionError, match="fedsam"):
        test_the_gpu_tests_have_an_optimizer_for_every_algorithm()
