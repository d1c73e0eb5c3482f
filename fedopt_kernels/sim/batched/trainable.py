"""What every client-batched engine needs of a model: no BatchNorm, no buffers."""

from __future__ import annotations

from torch import nn


def check_trainable(model: nn.Module) -> None:
    """ValueError naming what stops ``model`` from being trained client-batched by any engine (BatchNorm, buffers)."""
    norms = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    buffers = [name for name, _ in model.named_buffers()]
    if not norms and not buffers:
        return
    found = []
    if norms:
        found.append(f"BatchNorm layer(s) {', '.join(norms[:4])}{' ...' if len(norms) > 4 else ''}")
    if buffers:
        found.append(f"buffer(s) {', '.join(buffers[:4])}{' ...' if len(buffers) > 4 else ''}")
    raise ValueError(
        f"--client-batched needs a BatchNorm- and buffer-free model (client copies cannot carry running "
        f"statistics or other buffers), but {type(model).__name__} has {' and '.join(found)}. "
        f"Use a GroupNorm/LayerNorm model (the simulator's mlp, cnn, fedavg-cnn, resnet18-gn) or "
        f"client_batched=1 (--client-batched 1, the sequential path)"
    )
