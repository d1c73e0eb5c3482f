"""The ``reference`` backend: each op's arguments handed to its function of ``fedopt_kernels.functional``.

It is the ground truth every fused backend is tested against: docs/algorithms.md in plain PyTorch,
one tensor at a time (the rounding rules are ``functional``'s). Unlike the fused backends it reads
its scalars (hp, k, found_inf) on the host, which synchronises on CUDA.
"""

import importlib

from ..ops import PER_CLIENT

# importing an op's module (reference/<op>.py) registers it; batched.py registers every batched form
for _name in PER_CLIENT:
    importlib.import_module(f"{__name__}.{_name}")
importlib.import_module(f"{__name__}.batched")
