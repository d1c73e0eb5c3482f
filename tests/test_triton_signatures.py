"""Every hyperparameter of every Triton kernel is a runtime argument, never a ``tl.constexpr``.

A constexpr is baked into the compiled binary: a learning-rate schedule, a changed ``beta`` or
``max_norm`` would compile a new kernel per value. Only structural switches (dtypes, which
tensors exist, nesterov, variance reduction, tile shape) may be constexprs, and integer sizes
that change with the tensor set must not be specialised on either (``do_not_specialize``).
Works on the kernel objects of either mode (compiled ``JITFunction`` or interpreted).
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from fedopt_kernels import _registry

_WHY = _registry.unavailable_reason("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

STRUCTURAL = re.compile(r"^(?:[A-Z0-9]+_DTYPE|HAS_[A-Z0-9_]+|NESTEROV|VR|ROWS|BLOCK|SLOT_BLOCK)$")
# kernel name -> the hyperparameters it must take as float32 runtime arguments
HYPERPARAMETERS = {
    "sgd_kernel": {"lr", "momentum", "damp1", "weight_decay", "gsign", "prox_mu"},
    "fednar_norm_kernel": {"weight_decay", "prox_mu"},
    "fednar_update_kernel": {"step_lr", "weight_decay", "max_norm", "eps", "prox_mu"},
    "padamfed_norm_kernel": {"beta", "one_minus_beta"},
    "padamfed_update_kernel": {"lr", "beta", "one_minus_beta", "eps"},
}


def _kernels():
    from fedopt_kernels.triton_kernels import fednar, padamfed, sgd
    return [sgd.sgd_kernel, fednar.fednar_norm_kernel, fednar.fednar_update_kernel,
            padamfed.padamfed_norm_kernel, padamfed.padamfed_update_kernel]


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


@pytest.mark.parametrize("kernel", _kernels() if _WHY is None else [], ids=lambda k: k.__name__)
def test_only_structural_switches_are_constexpr(kernel):
    params = inspect.signature(kernel.fn).parameters
    constexprs = {name for name, p in params.items() if "constexpr" in _annotation(p)}
    bad = {name for name in constexprs if not STRUCTURAL.match(name)}
    assert not bad, f"{kernel.__name__}: hyperparameters must not be tl.constexpr: {sorted(bad)}"


@pytest.mark.parametrize("kernel", _kernels() if _WHY is None else [], ids=lambda k: k.__name__)
def test_hyperparameters_are_float32_runtime_arguments(kernel):
    params = inspect.signature(kernel.fn).parameters
    floats = {name for name, p in params.items() if _annotation(p) in ("tl.float32", "float32", "fp32")}
    assert floats == HYPERPARAMETERS[kernel.__name__]


@pytest.mark.parametrize("kernel", _kernels() if _WHY is None else [], ids=lambda k: k.__name__)
def test_integer_sizes_are_not_specialised(kernel):
    """Unannotated non-pointer arguments are counts/offsets: specialising on them (== 1, % 16)
    would compile new variants when the tensor set or the schedule table changes."""
    params = inspect.signature(kernel.fn).parameters
    ints = {name for name, p in params.items() if not _annotation(p) and not name.endswith("_ptr")}
    assert ints and ints <= _do_not_specialize(kernel), (kernel.__name__, ints)
