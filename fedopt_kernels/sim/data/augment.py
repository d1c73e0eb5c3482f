"""Train-time image augmentation in plain torch: random crop with zero padding, then horizontal flip.

The same transform as torchvision's ``RandomCrop(size, padding=p)`` followed by
``RandomHorizontalFlip(0.5)``, applied to a whole batch at once on the batch's device, so the core
simulator needs no torchvision and no per-image Python loop.
"""

from __future__ import annotations

from typing import Optional

import torch


def random_crop_flip(x: torch.Tensor, padding: int = 4, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Each image of ``x`` ([B, C, H, W]) padded by ``padding`` zeros on every side, cropped back to
    H x W at a uniformly random offset, and mirrored left-right with probability 1/2.

    Random numbers come from ``generator`` (on ``x``'s device), so a seeded generator gives the same
    crops on every run. Returns a new tensor of ``x``'s dtype; ``x`` is not modified.
    """
    if x.dim() != 4:
        raise ValueError(f"random_crop_flip expects images [B, C, H, W], got shape {tuple(x.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an integer >= 0, got {padding!r}")
    b, _, h, w = x.shape
    dev = x.device
    off_y = torch.randint(0, 2 * padding + 1, (b,), device=dev, generator=generator)
    off_x = torch.randint(0, 2 * padding + 1, (b,), device=dev, generator=generator)
    flip = torch.rand(b, device=dev, generator=generator) < 0.5
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    rows = off_y[:, None] + torch.arange(h, device=dev)  # [B, H]
    cols_fwd = torch.arange(w, device=dev)
    cols = off_x[:, None] + torch.where(flip[:, None], cols_fwd.flip(0), cols_fwd)  # [B, W]; flip = reversed columns
    batch = torch.arange(b, device=dev)[:, None, None]
    # advanced indices on dims 0, 2, 3 around a slice: result is [B, H, W, C]
    out = padded[batch, :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()
