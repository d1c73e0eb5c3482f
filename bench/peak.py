"""The device's measured FLOP/s: a dense matmul and a dense convolution of the run's dtype, timed in
the same process and with the same thread count and backend settings as the model they are compared
with (on a GPU that includes cuDNN's TF32 default for float32 convolutions), at the run's precision
(``fedopt_kernels.sim.batched.precision``): ``tf32`` times them with the TF32 switches on, ``bf16``
in bfloat16 (what autocast makes of a model's matmuls and convolutions).

``device_peak`` returns both and takes the larger as the device's FLOP/s: a model's achieved FLOP/s
is reported as a fraction of it. On a shared machine the figure moves with the load, which is why
it is measured in the same run as the model, not taken from a data sheet.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch
from torch.nn import functional as F

from fedopt_kernels.sim.batched.precision import check_precision, precision_scope, tf32_enabled

from .timing import Budget, time_calls


def _best_rate(fn: Callable[[], Any], flops: float, device: torch.device, min_time_s: float) -> float:
    """FLOP/s of the fastest of repeated calls (after two warm-up calls), at least 3 of them and
    ``min_time_s`` seconds: the fastest call is the one the least disturbed by other work."""
    return flops / min(time_calls(fn, device, Budget(warmup=2, min_reps=3, max_reps=10**6, min_time_s=min_time_s)))


def device_peak(
    device: torch.device, dtype: torch.dtype = torch.float32, min_time_s: float = 0.5, precision: str = "fp32"
) -> Dict[str, Any]:
    """Measured matmul and convolution FLOP/s of ``device`` in ``dtype`` at ``precision`` (module
    docstring; ``bf16`` times bfloat16 tensors whatever ``dtype`` says)."""
    check_precision(precision)
    gpu = device.type != "cpu"
    dtype = torch.bfloat16 if precision == "bf16" else dtype
    n = 8192 if gpu else 2048
    if not gpu and dtype == torch.bfloat16:
        # a CPU without bfloat16 instructions multiplies bfloat16 matrices on a slow path, orders of
        # magnitude below its float32 rate, where a 2048 product takes tens of seconds; 512 keeps the
        # measurement short there and still fills the caches of a CPU that has them
        n = 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # a 3x3 convolution of the size the models' large layers have, channels-last (the fast layout on
    # both oneDNN and cuDNN)
    N, C, H = (256, 128, 32) if gpu else (64, 64, 28)
    x = torch.randn(N, C, H, H, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C, C, 3, 3, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    with precision_scope(precision, device), torch.no_grad():
        mm = _best_rate(lambda: a @ b, 2.0 * n**3, device, min_time_s)
        conv = _best_rate(lambda: F.conv2d(x, w, padding=1), 2.0 * N * H * H * C * C * 9, device, min_time_s)
        tf32 = tf32_enabled() if gpu and dtype == torch.float32 else {"matmul": False, "conv": False}
    return {
        "matmul_flops_per_s": mm,
        "matmul": f"{n}x{n} @ {n}x{n}",
        "conv_flops_per_s": conv,
        "conv": f"[{N},{C},{H},{H}] * [{C},{C},3,3], channels-last",
        "peak_flops_per_s": max(mm, conv),
        "peak_from": "conv" if conv >= mm else "matmul",
        "dtype": str(dtype).replace("torch.", ""),
        "precision": precision,
        "tf32_conv": tf32["conv"],
        "tf32_matmul": tf32["matmul"],
    }
