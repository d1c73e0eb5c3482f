"""``--client-batched auto``: how many clients to train at once, from a memory estimate.

Per client, the batched round keeps (bytes):

    persistent = P * (4 + S)      P: parameter bytes of the model; 4: the client's parameter copy,
                                  its gradient, the gradient the engine returns before it is handed over
                                  (or clipped), and its update (ClientUpdate.delta); S: optimizer
                                  state copies (momentum, FedProx x0, SCAFFOLD correction, PAdaMFed
                                  D and acc, VR anchor gradients)
    activations = 2 * A           A: bytes autograd saves for backward in one forward pass of one
                                  batch (``batch_size`` samples), measured once in eval mode on a
                                  training client's data; x2 for the activation gradients the backward pass creates

and ``N = floor(budget / (persistent + activations))``, at least 1, at most the clients sampled per
round and at most ``MAX_AUTO`` = 256: past a few hundred clients one computation gets slower *per
client* (activation tensors leave the caches, convolution libraries are not tuned for thousands of
groups; ``python -m bench clients`` measures it), and chunks of that size lose nothing. ``budget`` is
half of the free device memory on CUDA (``torch.cuda.mem_get_info``; the
other half is left to the allocator's fragmentation, cuDNN/cuBLAS workspaces and the evaluation),
and a quarter of ``MemAvailable`` on a CPU (other processes share it), 4 GiB where that is unknown.
The estimate is deliberately rough; give N explicitly to override it.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ...fl.server_rules import RULES

_CPU_FALLBACK = 4 << 30
MAX_AUTO = 256


def state_copies(cfg) -> int:
    """Optimizer state tensors per parameter, per client, for the run's client optimizer; under
    user-level DP also the chunk's stacked replies (``sim/dp_chunk.py``: the update and the rule's
    reply tensors, one copy each)."""
    dp = 1 + len(RULES[cfg.server_rule].reply) if cfg.dp_clip is not None else 0
    return cfg.algo.state_copies(cfg, cfg.variant) + dp


def activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward pass of ``model`` on ``(x, y)``."""
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    was_training = model.training
    model.eval()  # an augmenting input stage would draw from the run's random stream in training mode
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            F.cross_entropy(model(x), y)
    finally:
        model.train(was_training)
    return sum(n for ptr, n in seen.items() if ptr not in params)


def free_bytes(device: torch.device) -> int:
    """The memory budget for client-batched training on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except (OSError, ValueError, IndexError):
        pass
    return _CPU_FALLBACK


def auto_clients_at_once(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    state: int,
    limit: int,
    budget: int,
    cap: Optional[int] = MAX_AUTO,
) -> int:
    """Clients that fit in ``budget`` bytes (module docstring), between 1 and ``min(limit, cap)``
    (``cap`` None: memory alone, for a caller that measures which size runs fastest).

    ``x``, ``y``: one batch of one client (as the model takes it, e.g. raw pixels for image
    models); ``state``: optimizer state copies per parameter (``state_copies``).
    """
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_client = param_bytes * (4 + state) + 2 * activation_bytes(model, x, y)
    return max(1, min(limit, cap or limit, budget // max(per_client, 1)))
