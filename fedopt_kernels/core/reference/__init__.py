"""The ``reference`` backend: docs/algorithms.md in plain PyTorch, one tensor at a time.

It is the ground truth every fused backend is tested against. Math runs in float32 for
float16/bfloat16/float32 parameters (float64 for float64), and each tensor is rounded to its
storage dtype once, when it is written back: the fused kernels follow the same rule. Unlike the
fused backends it reads its scalars (hp, k, found_inf) on the host, which synchronises on CUDA.
"""

import importlib

from ..ops import PER_CLIENT

# importing an op's module (reference/<op>.py) registers it; batched.py registers every batched form
for _name in PER_CLIENT:
    importlib.import_module(f"{__name__}.{_name}")
importlib.import_module(f"{__name__}.batched")
