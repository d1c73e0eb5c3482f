"""The ``cpu`` backend: C++ kernels of ``csrc/cpu`` (extension ``fedopt_kernels._C_cpu``).

One ``at::parallel_for`` pass over all tensors per pass, vectorised element-wise loops, float32
math for float16/bfloat16 (float64 for float64), and a global norm from fixed per-chunk float64
partial sums added in a fixed order, so results do not depend on the number of threads.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..impl_table import register_device_check
from ._native import load_extension, register_extension

extension = load_extension("_C_cpu")  # the compiled module (dtensor.py calls run_with_norm_reduce)


def _device_check(device: torch.device) -> Optional[str]:
    if device.type != "cpu":
        return f"the cpu backend runs on CPU tensors only, not {device.type}"
    return None


register_device_check("cpu", _device_check)
register_extension(extension, "cpu")
