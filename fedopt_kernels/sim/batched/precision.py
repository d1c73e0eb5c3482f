"""The precision a run computes its forward and backward passes in: ``fp32``, ``tf32`` or ``bf16``.

=========  ==================================================================================
``fp32``   IEEE float32 in every kernel: cuBLAS's matmuls and cuDNN's convolutions and recurrent
           layers with TF32 off (torch's default lets cuDNN use TF32 for float32 convolutions;
           a run at ``fp32`` does not), and oneDNN's on a CPU in IEEE float32 too. So which
           formulation of a layer runs (``choose.py``) changes speed, never the arithmetic.
``tf32``   CUDA: matmuls (cuBLAS) and cuDNN's convolutions and recurrent layers in TF32 (10-bit
           mantissa inputs, float32 accumulation), whichever formulation. A CPU has no TF32:
           there it is ``fp32``.
``bf16``   the forward pass under ``torch.autocast(device_type, dtype=torch.bfloat16)``: the
           matmuls and convolutions take bfloat16 inputs and give bfloat16 outputs (float32
           accumulation), and their backward runs in the same dtypes; what autocast leaves in
           float32 is IEEE float32, as under ``fp32``. Never float16: torch's autocast casts
           cuDNN's LSTM to float16 whatever its dtype, so an ``nn.LSTM`` runs through
           ``models/lstm_call.py`` (bfloat16, autocast off around it). Parameters, the gradients handed to
           the optimizer, optimizer state and the fused step stay float32.
=========  ==================================================================================

``backend_flags(precision, device)`` says what the switches are during a pass; a run records it
(its results' ``client_batched`` entry), and the same precision gives the same flags whichever
formulations run. Both settings act on float32 tensors only: autocast leaves float64 alone, and
TF32 is a float32 mode, so a run cast to float64 (the validations) computes the same at every
precision.

A pass runs as::

    with precision_scope(precision, device):        # the backend switches, forward and backward
        with autocast_scope(precision, device):     # bf16 autocast, the forward pass only
            loss = loss_fn(model(x), y)
        loss.backward()

autocast wraps the forward pass and the loss only, as torch recommends: backward ops run in the
dtypes autocast chose for their forward ops. Both scopes restore what they change when they end,
so nothing leaks into the caller's other code.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch
from torch import nn

from ...core.float32_switches import CUBLAS, CUDNN, DEVICE_SWITCHES, float32_switches

PRECISIONS = ("fp32", "tf32", "bf16")
Device = Union[torch.device, str]


class UnsupportedPrecision(ValueError):
    """A layer of the model has no kernel at the asked precision on the device; the message says which."""


def check_precision(value: object, name: str = "precision") -> str:
    """``value`` if it is one of ``PRECISIONS``, else ValueError naming ``name``."""
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {value!r}")
    return value


def _device_type(device: Device) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _switches(device: Device) -> Dict[str, Any]:
    return DEVICE_SWITCHES.get(_device_type(device), {})


def _effective(switch: Any) -> str:
    """What ``switch`` computes in (torch resolves an inherited value; "none" throughout is "ieee")."""
    value = switch.fp32_precision
    return "ieee" if value == "none" else value


def backend_flags(precision: str, device: Device) -> Dict[str, str]:
    """The backend switches (``fp32_precision``) the kernels of ``device`` read during a pass of
    ``precision``: on CUDA cuBLAS's and cuDNN's conv and rnn, ``"tf32"`` under ``tf32`` and ``"ieee"``
    otherwise; on a CPU oneDNN's, ``"ieee"`` at every precision (a CPU has no TF32; under ``bf16``
    what autocast leaves in float32)."""
    check_precision(precision)
    value = "tf32" if precision == "tf32" and _device_type(device) == "cuda" else "ieee"
    return {name: value for name in _switches(device)}


def flags_now(device: Device) -> Dict[str, str]:
    """The switches ``backend_flags`` names for ``device``, as its kernels would read them now."""
    return {name: _effective(switch) for name, switch in _switches(device).items()}


@contextlib.contextmanager
def precision_scope(precision: str, device: Device) -> Iterator[None]:
    """What a forward and backward pass run under: the backend switches of ``device`` at
    ``backend_flags`` (``fp32``: IEEE float32, cuDNN's TF32 off; ``tf32`` on CUDA: TF32 matmuls, cuDNN
    convolutions and recurrent layers), those not there already set, and restored afterwards.

    The switches are process-wide while the scope lasts (torch has no per-thread ones). Inside it,
    read them as ``fp32_precision`` (``flags_now``) or with ``tf32_enabled``: torch's legacy getters
    (``torch.backends.cuda.matmul.allow_tf32``, ``torch.get_float32_matmul_precision``) refuse to
    read some mixes of switches set the new way."""
    check_precision(precision)
    value = "tf32" if precision == "tf32" and _device_type(device) == "cuda" else "ieee"  # backend_flags
    with float32_switches(value, device):
        yield


def autocast_scope(precision: str, device: Device) -> contextlib.AbstractContextManager:
    """What a forward pass (and its loss) runs under, inside ``precision_scope``: for ``bf16``,
    ``torch.autocast(device_type, dtype=torch.bfloat16)``; for the others, nothing."""
    check_precision(precision)
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(_device_type(device), dtype=torch.bfloat16)


def tf32_enabled() -> Dict[str, bool]:
    """Whether CUDA matmuls and cuDNN convolutions take float32 inputs in TF32 now."""
    out = {}
    for name, legacy, switch in (("matmul", CUBLAS, CUBLAS), ("conv", CUDNN, CUDNN.conv)):
        try:
            out[name] = bool(legacy.allow_tf32)  # resolves "none" (inherit) to the effective value
        except RuntimeError:  # set through the new settings (precision_scope): read those
            out[name] = switch.fp32_precision == "tf32"
    return out


def autocast_inputs(*tensors: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """``tensors`` as autocast hands them to a matmul or a convolution: where autocast is on for a
    tensor's device, a float32 tensor in autocast's dtype; anything else (float64, None, autocast
    off) unchanged.

    For hand-written autograd Functions: casting their inputs first keeps forward and backward in
    one dtype (autocast would cast inside each op, and the Function's backward would meet the
    saved float32 tensors and the 16-bit gradient). The gradient such a Function returns is in that
    dtype; autograd casts it to the dtype of its input (float32), as for autocast's own casts."""
    out = []
    for t in tensors:
        if t is not None and t.dtype == torch.float32 and torch.is_autocast_enabled(t.device.type):
            t = t.to(torch.get_autocast_dtype(t.device.type))
        out.append(t)
    return tuple(out)


def check_supported(model: nn.Module, precision: str, device: Device) -> None:
    """``UnsupportedPrecision`` (a ValueError) naming ``precision`` when a layer of ``model`` has no
    kernel for it on ``device``.

    The one case known: ``bf16`` on a CPU runs ``nn.LSTM`` through oneDNN's bfloat16 LSTM, which
    needs AVX-512 (x86 CPUs without it refuse it). A one-step LSTM of each configuration is tried."""
    check_precision(precision)
    dev = torch.device(device)
    if precision != "bf16" or dev.type != "cpu":
        return
    for name, m in model.named_modules():
        if isinstance(m, nn.RNNBase):
            x = torch.zeros(1, 1, m.input_size, device=dev, dtype=next(m.parameters()).dtype)
            try:
                with torch.no_grad(), autocast_scope(precision, dev):
                    m(x)  # one step of one sample: [1, 1, input] whether batch_first or not
            except RuntimeError as exc:
                first = str(exc).splitlines()[0][:160]
                raise UnsupportedPrecision(
                    f"precision='bf16' cannot run {name or type(model).__name__} ({type(m).__name__}) on this "
                    f"CPU: torch's bfloat16 kernel for it refused ({first}); use precision='fp32' here"
                ) from None


def summary(precision: str) -> str:
    """One line for a run's report: what ``precision`` computes in."""
    return {
        "fp32": "fp32 (IEEE float32 in every kernel: cuDNN's TF32 off, as cuBLAS's)",
        "tf32": "tf32 (CUDA matmuls and convolutions in TF32; a CPU computes fp32)",
        "bf16": "bf16 (autocast: bfloat16 matmuls and convolutions, forward and backward; parameters, "
        "gradients and optimizer in float32)",
    }[check_precision(precision)]
