"""The input stage of the image models: raw pixels in, normalised (and, in training, augmented) floats out.

Image data sets (CIFAR, FEMNIST) stay ``uint8`` on the simulation's device: 4x less memory than
float32 (CIFAR's 60k images are 184 MB), converted a batch at a time inside the model. The stage has
no parameters and no buffers (mean and std are Python floats), so a model built on it has exactly
the parameters of its network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .augment import random_crop_flip


@dataclass(frozen=True)
class InputSpec:
    """How a data set's pixels become model inputs: ``x / scale``, then ``(x - mean[c]) / std[c]``
    per channel; in training mode, first ``random_crop_flip`` with ``padding`` if ``augment``.

    ``mean``/``std`` are ``None`` for no normalisation. ``scale`` is 255 for uint8 pixels.
    """

    scale: float = 255.0
    mean: Optional[Tuple[float, ...]] = None
    std: Optional[Tuple[float, ...]] = None
    augment: bool = False
    padding: int = 4

    def __post_init__(self) -> None:
        if (self.mean is None) != (self.std is None):
            raise ValueError("InputSpec: give both mean and std, or neither")
        if self.std is not None and self.mean is not None:  # both or neither, checked above
            if len(self.std) != len(self.mean) or not all(math.isfinite(s) and s > 0 for s in self.std):
                raise ValueError(
                    f"InputSpec: std must be positive and as long as mean, got mean={self.mean}, std={self.std}"
                )


class ImageClassifier(nn.Module):
    """``net(preprocess(x))``: the input stage of ``spec`` in front of a classifier network.

    ``preprocess`` casts to float32 (the network's dtype if it was cast), divides by ``spec.scale``,
    augments (training mode and ``spec.augment`` only; random crop + flip from a generator seeded at
    construction from torch's RNG, so a seeded run is reproducible) and normalises. Evaluation
    (``eval()`` mode) never augments.

    For client-batched training under ``torch.func.vmap``: ``net`` is BatchNorm-free, buffer-free and
    deterministic; the random augmentation is the only op that does not belong inside a vmapped
    function, so call ``preprocess(x, train=True)`` on the stacked batch first and vmap
    ``torch.func.functional_call(model.net, ...)`` on its output (``model.parameters()`` are exactly
    ``model.net.parameters()``, same order, names prefixed ``net.``).
    """

    def __init__(self, net: nn.Module, spec: InputSpec):
        super().__init__()
        self.net = net
        self.spec = spec
        # a seed, not a generator: generators are per device and do not deepcopy/pickle everywhere
        self.augment_seed = int(torch.randint(0, 2**62, (1,)).item())
        self._generators: Dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The augmentation generator of ``device``, seeded from ``augment_seed`` on first use."""
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = torch.Generator(device=device)
            gen.manual_seed(self.augment_seed)
        return gen

    def generator_states(self) -> Dict[str, torch.Tensor]:
        """The state of each device's augmentation generator used so far (a checkpoint saves these)."""
        return {dev: g.get_state() for dev, g in self._generators.items()}

    def __getstate__(self):  # copies restart the augmentation stream from the seed
        state = self.__dict__.copy()
        state["_generators"] = {}
        return state

    def preprocess(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        s = self.spec
        w = next(self.net.parameters(), None)  # float32, or the dtype the model was cast to
        x = x.to(w.dtype if w is not None and w.is_floating_point() else torch.float32) / s.scale
        if train and s.augment:
            x = random_crop_flip(x, s.padding, self.generator(x.device))
        if s.mean is not None:
            shape = (1, len(s.mean)) + (1,) * (x.dim() - 2)
            mean = torch.tensor(s.mean, dtype=x.dtype, device=x.device).view(shape)
            std = torch.tensor(s.std, dtype=x.dtype, device=x.device).view(shape)
            x = (x - mean) / std
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.preprocess(x, self.training))
