"""NeuronLRSGD and neuron_lr_scales: neuron-wise learning rates (docs/algorithms.md; FedNLR)."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from ..batched.mixin import ClientBatched
from ..core import dtensor as _dtensor
from ..core.float32_switches import float32_switches
from ..core.ops import BATCHED
from ..core.optimizer import state_dtype
from .sgd import SGDFamily


class NeuronLRSGD(SGDFamily):
    r"""SGD with one learning-rate scale per output unit (FedNLR).

    From "FedNLR: Federated Learning with Neuron-wise Learning Rates" (Haozhao Wang, Peirong Zheng,
    Xingshuo Han, Wenchao Xu, Ruixuan Li, Tianwei Zhang; KDD 2024), Eq. 14-18. Each parameter ``x`` of
    shape ``[M, ...]`` may carry a scale vector ``r`` of shape ``[M]`` (default: all ones)::

        x[m, ...] -= lr * r[m] * buf[m, ...]

    where ``buf`` is ``d = g + weight_decay * x + correction + prox_mu * (x - x0)`` or its momentum
    buffer, with ``torch.optim.SGD`` semantics. Scales come from ``neuron_lr_scales`` and are set
    with ``set_neuron_scales`` or ``start_round(neuron_scales=...)``; they persist across rounds
    until replaced. ``round_decay``: ``lr`` of round ``t`` is ``lr * round_decay ** t`` (default 1).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        maximize: bool = False,
        prox_mu: float = 0.0,
        neuron_scales: Optional[Mapping[torch.Tensor, torch.Tensor]] = None,
        round_decay: float = 1.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            maximize=maximize,
            prox_mu=prox_mu,
            round_decay=round_decay,
        )
        super().__init__(params, defaults, backend, replay)
        if neuron_scales is not None:
            self.set_neuron_scales(neuron_scales)

    _float32_state: Tuple[str, ...] = ("neuron_scale",)
    _state_keys: Tuple[str, ...] = SGDFamily._state_keys + ("neuron_scale",)

    def _scale_shape(self, p: torch.Tensor) -> Tuple[Optional[Tuple[int, ...]], str]:
        """(the shape of ``p``'s scale, or None when it cannot have one; how errors describe it)."""
        if p.dim() == 0:
            return None, "no scale (0-dim parameter)"
        return (p.shape[0],), f"shape ({p.shape[0]},)"

    def _check_scales(self, scales: Mapping[torch.Tensor, torch.Tensor]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        if not isinstance(scales, Mapping):
            raise TypeError(f"neuron_scales must be a mapping {{parameter: scale vector}}, got {type(scales).__name__}")
        index = {id(p): i for i, p in enumerate(self._params_flat)}
        out = []
        for p, r in scales.items():
            if id(p) not in index:
                raise ValueError("neuron_scales names a tensor that is not a parameter of this optimizer")
            pname = self._name_of(index[id(p)])
            if not isinstance(r, torch.Tensor):
                raise TypeError(f"neuron scale for {pname} must be a tensor, got {type(r).__name__}")
            shape, want = self._scale_shape(p)
            if shape is None or r.shape != shape:
                raise ValueError(f"neuron scale for {pname} has shape {tuple(r.shape)}; expected {want}")
            if r.device != p.device:
                raise ValueError(f"neuron scale for {pname} is on {r.device}, expected {p.device}")
            if r.is_complex() or not r.is_floating_point():
                raise TypeError(f"neuron scale for {pname} must be a real floating tensor, got {r.dtype}")
            _dtensor.check_row_scale(p, r, pname)
            out.append((p, r))
        return out

    @torch.no_grad()
    def set_neuron_scales(self, scales: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Set the per-output-unit scale vector of each given parameter (others keep theirs)."""
        for p, r in self._check_scales(scales):
            self.state[p]["neuron_scale"] = _dtensor.row_scale(
                p, r.detach().to(dtype=state_dtype(p)).contiguous().clone()
            )
        self._drop_plan()  # new scale tensors: a CUDA graph of the old plan would read the old ones

    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        scales = inputs.pop("neuron_scales", None)
        super()._check_round_inputs(inputs)
        return {"neuron_scales": None if scales is None else self._check_scales(scales)}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        if inputs["neuron_scales"] is not None:
            self.set_neuron_scales(dict(inputs["neuron_scales"]))

    def _step_tensors(self, p, group, state, idx):
        tensors, override = super()._step_tensors(p, group, state, idx)
        if "neuron_scale" in state:
            tensors["neuron_scale"] = state["neuron_scale"]
        return tensors, override


def _default_layers(model: nn.Module) -> List[nn.Module]:
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return [m for m in model.modules() if isinstance(m, kinds)]


@torch.no_grad()
def neuron_lr_scales(
    model: nn.Module,
    batches: Iterable,
    layers: Optional[Sequence[nn.Module]] = None,
    mu0: float = 1.0,
    c1: float = 1.0,
    c2: float = 1.0,
    max_batches: Optional[int] = None,
) -> Dict[torch.Tensor, torch.Tensor]:
    r"""FedNLR's per-neuron learning-rate scales from mean activations (Eq. 14-17 of the FedNLR paper).

    For layers ``l = 1..L`` (the model's Linear/Conv modules in forward order, or ``layers``)::

        hbar[l][m] = mean over samples (and positions) of relu(output) (hidden) or output (last layer)
        mu_l = mu0 + c1 * l / L + c2 * log10(M_l)
        T_l  = (max_m hbar - min_m hbar) / ln(mu_l)
        r[l] = M_l * softmax(hbar[l] / T_l)                 (mean 1, max/min == mu_l)

    A degenerate layer (``max - min < 1e-12`` or ``mu_l <= 1``) gets ``r = 1``. ``batches`` is
    anything a DataLoader yields: inputs, or tuples whose first item is the input. The model runs
    in eval mode (no dropout noise, no BatchNorm statistics update) and its mode is restored; its
    float32 matmuls and convolutions run in IEEE float32 whatever the caller's switches (cuDNN's
    TF32 off, as a run at ``fp32`` promises; core/float32_switches.py).
    Returns ``{weight: r, bias: r}`` for every calibrated layer (float32; float64 for float64 models).
    """
    candidates = list(layers) if layers is not None else _default_layers(model)
    if not candidates:
        raise ValueError("neuron_lr_scales: the model has no Linear/Conv layers (pass layers=...)")
    sums: Dict[int, torch.Tensor] = {}
    counts: Dict[int, int] = {}
    order: List[nn.Module] = []
    outputs: Dict[int, torch.Tensor] = {}

    def hook(module, _inp, out):
        if id(module) not in sums:
            order.append(module)
            sums[id(module)] = torch.zeros(out.shape[1], dtype=torch.float64, device=out.device)
            counts[id(module)] = 0
        outputs[id(module)] = out

    handles = [m.register_forward_hook(hook) for m in candidates]
    was_training = model.training
    model.eval()
    first = next(iter(candidates[0].parameters()), None)
    try:
        with float32_switches("ieee", first.device if first is not None else "cpu"):
            n_batches = 0
            for batch in batches:
                if max_batches is not None and n_batches >= max_batches:
                    break
                x = batch[0] if isinstance(batch, (tuple, list)) else batch
                outputs.clear()
                model(x)
                n_batches += 1
                for mid, raw in outputs.items():
                    # (N, M, *spatial) -> per-unit sums over samples and positions
                    o = raw.detach().double().transpose(0, 1).reshape(raw.shape[1], -1)
                    outputs[mid] = o
                last = id(order[-1]) if order else None
                for mid, o in outputs.items():
                    act = o if mid == last else torch.relu(o)
                    sums[mid] += act.sum(dim=1)
                    counts[mid] += o.shape[1]
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not order:
        raise ValueError("neuron_lr_scales: no batch reached the given layers (empty batches?)")
    # forward order (hence which layer is "last", kept raw above) is fixed by the first batch
    L = len(order)
    out: Dict[torch.Tensor, torch.Tensor] = {}
    for layer_no, module in enumerate(order, start=1):  # l in the docstring
        hbar = sums[id(module)] / max(counts[id(module)], 1)
        M = hbar.numel()
        mu = mu0 + c1 * layer_no / L + c2 * math.log10(M)
        spread = float(hbar.max() - hbar.min())
        if spread < 1e-12 or mu <= 1 or not math.isfinite(spread):
            r = torch.ones(M, dtype=torch.float64, device=hbar.device)
        else:
            T = spread / math.log(mu)
            r = M * torch.softmax(hbar / T, dim=0)
        # a Linear/Conv layer's (torch's stubs type a Module attribute as Tensor | Module)
        weight, bias = cast(torch.Tensor, module.weight), getattr(module, "bias", None)
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        r = r.to(dtype)
        out[weight] = r
        if bias is not None:
            out[bias] = r.clone()
    return out


class BatchedNeuronLRSGD(ClientBatched, NeuronLRSGD):
    """NeuronLRSGD for ``C`` stacked clients; each client's per-neuron scales are one row of a
    ``[C, M]`` tensor (FedNLR: x[c, m, ...] -= lr * r[c, m] * buf[c, m, ...])."""

    _spec = BATCHED["sgd_batched"]

    def _scale_shape(self, p: torch.Tensor) -> Tuple[Optional[Tuple[int, ...]], str]:
        if p.dim() < 2:
            return None, "no scale (no output dimension)"
        return tuple(p.shape[:2]), f"shape {tuple(p.shape[:2])} ([clients, M])"
