"""torch's switches for how float32 matmuls and convolutions compute (``fp32_precision``), per device
type, and a scope that sets them and restores them exactly.

The run's precision (``sim/batched/precision.py``) sets them for its passes; a computation that must
be IEEE float32 whatever the caller set (FedNLR's calibration pass) sets ``"ieee"`` itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Union

import torch

# torch >= 2.9's per-backend settings: the switches behind torch.backends.cuda.matmul.allow_tf32 and
# torch.backends.cudnn.allow_tf32, but restorable exactly: resetting a legacy flag leaves "ieee"
# where "none" (inherit) was, and reading a legacy flag after a new-style setting raises (cuDNN's
# conv and rnn are always set alike, so that it reads)
CUBLAS: Any = torch.backends.cuda.matmul  # Any: torch's type stubs lack the fp32_precision settings
CUDNN: Any = torch.backends.cudnn
MKLDNN: Any = torch.backends.mkldnn
# device type -> the switches its kernels read. torch reads a switch left at "none" as its nearest
# parent's value (oneDNN's or cuDNN's own, then the global one), and all at "none" is its default,
# "ieee" (torch's default for cuDNN's conv and rnn is an explicit "tf32")
DEVICE_SWITCHES: Dict[str, Dict[str, Any]] = {
    "cuda": {"cuda.matmul": CUBLAS, "cudnn.conv": CUDNN.conv, "cudnn.rnn": CUDNN.rnn},
    "cpu": {f"mkldnn.{name}": getattr(MKLDNN, name) for name in ("matmul", "conv", "rnn") if hasattr(MKLDNN, name)},
}


def device_type(device: Union[torch.device, str]) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


@contextlib.contextmanager
def float32_switches(value: str, device: Union[torch.device, str]) -> Iterator[None]:
    """Every switch ``device``'s kernels read at ``value`` (``"ieee"`` or ``"tf32"``) while the scope
    lasts, those not there already set, and restored afterwards. Process-wide while it lasts (torch
    has no per-thread switches)."""
    saved = []
    try:
        for switch in DEVICE_SWITCHES.get(device_type(device), {}).values():
            now = switch.fp32_precision
            if (now if now != "none" else "ieee") != value:
                saved.append((switch, now))
                switch.fp32_precision = value
        yield
    finally:
        for switch, old in reversed(saved):
            switch.fp32_precision = old
