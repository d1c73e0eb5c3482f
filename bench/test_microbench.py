"""pytest-benchmark microbenchmarks: one optimizer step per (algorithm, backend, size).

``pytest bench/`` runs them (``--benchmark-json=FILE`` saves them). Each case records its
bytes per step (counted as docs/benchmarks.md says) and the GB/s at the median in ``extra_info``.
Sizes default to the small CNN and the ResNet-18 list (plus the 100M list on CUDA); set
``FEDOPT_BENCH_SIZES="small_cnn large"`` to choose. The figures with copy-bandwidth and goal
columns come from ``python -m bench``.
"""

from __future__ import annotations

import functools
import os
from typing import List

import pytest
import torch

from bench.algorithms import ALGOS, BASELINES, CORE, build_baseline
from bench.runner import Plan, _make_params, select_backends
from bench.shapes import SIZES
from bench.timing import sync
from bench.traffic import bytes_per_step

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_default_sizes = "small_cnn resnet18" + (" large" if DEVICE.type == "cuda" else "")
SIZE_NAMES = os.environ.get("FEDOPT_BENCH_SIZES", _default_sizes).split()
BACKENDS, _ = select_backends(Plan(device=DEVICE, sizes=[], algos=[]))


@functools.lru_cache(maxsize=1)
def _params(size: str) -> List[torch.Tensor]:
    return _make_params(SIZES[size], torch.float32, DEVICE)


@pytest.mark.parametrize("size", SIZE_NAMES)
@pytest.mark.parametrize("backend", BACKENDS + list(BASELINES))
@pytest.mark.parametrize("algo", CORE)
def test_step(benchmark, algo: str, backend: str, size: str) -> None:
    spec = ALGOS[algo]
    params = _params(size)
    if backend in BASELINES:
        if backend not in spec.baselines():
            pytest.skip(f"{backend} does no comparable work to {algo}")
        stepper = build_baseline(spec, params, backend)
    else:
        stepper = spec.build(params, backend)
    nbytes = bytes_per_step(spec.traffic, SIZES[size], torch.float32)
    benchmark.group = f"{size}/{algo}"
    benchmark.extra_info["bytes_per_step"] = nbytes

    def step() -> None:
        stepper.step()
        sync(DEVICE)

    benchmark(step)
    benchmark.extra_info["gbps_at_median"] = nbytes / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("size", SIZE_NAMES)
def test_copy(benchmark, size: str) -> None:
    """The roofline: dst.copy_(src) moving a 20 B/element step's bytes (read + write)."""
    nbytes = 20 * sum(p.numel() for p in _params(size))
    src = torch.randn(nbytes // 8, device=DEVICE)
    dst = torch.empty_like(src)
    benchmark.group = f"{size}/copy"

    def copy() -> None:
        dst.copy_(src)
        sync(DEVICE)

    benchmark(copy)
    benchmark.extra_info["gbps_at_median"] = nbytes / benchmark.stats.stats.median / 1e9
