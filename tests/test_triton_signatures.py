"""No hyperparameter of any Triton kernel is a kernel argument, let alone a ``tl.constexpr``.

A constexpr is baked into the compiled binary, and a float argument is baked into a captured CUDA
graph: a learning-rate schedule, a changed ``beta`` or ``max_norm`` would compile a new kernel per
value, or replay a stale one. Hyperparameters are read on the device from the op's float64 ``hp``
rows (``hp_ptr``); only structural switches (dtypes, which tensors exist, GradScaler in use, the
op, tile shape) are constexprs, and integer sizes that change with the tensor set must not be
specialised on either (``do_not_specialize``). Works on the kernel objects of either mode.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from fedopt_kernels.core import registry as _registry

_WHY = _registry.unavailable_reason("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

STRUCTURAL = re.compile(
    r"^(?:[A-Z0-9]+_DTYPE|HAS_[A-Z0-9_]+|DT\d|P\d|OP|NR|HPN|UNSCALE|SKIPPABLE|ADVANCE|ROWS|"
    r"BLOCK|SLOT_BLOCK|BATCHED|ALIGNED|CLIENTS)$"
)


def _kernels():
    from fedopt_kernels.triton_kernels import sgd, two_pass_kernels

    return [
        sgd.sgd_kernel,
        two_pass_kernels.norm_kernel,
        two_pass_kernels.update_kernel,
        two_pass_kernels.finalize_kernel,
        two_pass_kernels.advance_kernel,
    ]


def _annotation(param: inspect.Parameter) -> str:
    ann = param.annotation
    if ann is inspect.Parameter.empty:
        return ""
    return ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))


def _do_not_specialize(kernel) -> set:
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # interpreted kernels keep the decorator arguments
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize") or []
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[n] if isinstance(n, int) else n for n in names}


KERNELS = _kernels() if _WHY is None else []


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_only_structural_switches_are_constexpr(kernel):
    params = inspect.signature(kernel.fn).parameters
    constexprs = {name for name, p in params.items() if "constexpr" in _annotation(p)}
    bad = {name for name in constexprs if not STRUCTURAL.match(name)}
    assert not bad, f"{kernel.__name__}: hyperparameters must not be tl.constexpr: {sorted(bad)}"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_no_float_arguments_hyperparameters_come_from_hp_rows(kernel):
    params = inspect.signature(kernel.fn).parameters
    floats = {name for name, p in params.items() if _annotation(p) in ("tl.float32", "float32", "fp32", "tl.float64")}
    assert not floats, f"{kernel.__name__}: float arguments {sorted(floats)} would be baked into a CUDA graph"
    if kernel.__name__ != "advance_kernel":
        assert "hp_ptr" in params
    if kernel.__name__ not in ("advance_kernel", "finalize_kernel"):  # those two work per client, not per row
        assert "row" in params


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_integer_sizes_are_not_specialised(kernel):
    """Unannotated non-pointer arguments are counts/offsets/rows: specialising on them (== 1, % 16)
    would compile new variants when the tensor set, the schedule table or the row groups change."""
    params = inspect.signature(kernel.fn).parameters
    ints = {name for name, p in params.items() if not _annotation(p) and not name.endswith("_ptr")}
    assert ints <= _do_not_specialize(kernel), (kernel.__name__, ints)
