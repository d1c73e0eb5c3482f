"""The device's measured FLOP/s: a dense matmul and a dense convolution of the run's dtype, timed in
the same process and with the same thread count and backend settings as the model they are compared
with (on a GPU that includes cuDNN's TF32 default for float32 convolutions).

``device_peak`` returns both and takes the larger as the device's FLOP/s: a model's achieved FLOP/s
is reported as a fraction of it. On a shared machine the figure moves with the load, which is why
it is measured in the same run as the model, not taken from a data sheet.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict

import torch
from torch.nn import functional as F


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(fn: Callable[[], Any], flops: float, device: torch.device, min_time_s: float) -> float:
    """FLOP/s of the fastest of repeated calls (after two warm-up calls), at least ``min_time_s`` of them."""
    fn()
    fn()
    _sync(device)
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or spent < min_time_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return flops / best


def device_peak(device: torch.device, dtype: torch.dtype = torch.float32, min_time_s: float = 0.5) -> Dict[str, Any]:
    """Measured matmul and convolution FLOP/s of ``device`` in ``dtype`` (module docstring)."""
    gpu = device.type != "cpu"
    n = 8192 if gpu else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm = _best_rate(lambda: a @ b, 2.0 * n**3, device, min_time_s)
    # a 3x3 convolution of the size the models' large layers have, channels-last (the fast layout on
    # both oneDNN and cuDNN)
    N, C, H = (256, 128, 32) if gpu else (64, 64, 28)
    x = torch.randn(N, C, H, H, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C, C, 3, 3, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        conv = _best_rate(lambda: F.conv2d(x, w, padding=1), 2.0 * N * H * H * C * C * 9, device, min_time_s)
    return {
        "matmul_flops_per_s": mm,
        "matmul": f"{n}x{n} @ {n}x{n}",
        "conv_flops_per_s": conv,
        "conv": f"[{N},{C},{H},{H}] * [{C},{C},3,3], channels-last",
        "peak_flops_per_s": max(mm, conv),
        "peak_from": "conv" if conv >= mm else "matmul",
        "dtype": str(dtype).replace("torch.", ""),
        "tf32_conv": bool(gpu and torch.backends.cudnn.allow_tf32),
        "tf32_matmul": bool(gpu and torch.backends.cuda.matmul.allow_tf32),
    }
