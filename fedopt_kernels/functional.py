"""The algorithms' math as functions, in plain PyTorch (docs/algorithms.md, "Functional forms").

The counterpart of ``torch.optim``'s functional ``sgd()``: each function takes the tensors of one
step and updates them in place, one tensor at a time. Each optimizer class of the package runs
exactly this on its ``reference`` backend (``core/reference.py`` hands the op's arguments
over), and every fused backend is tested against it; a user can call it from a loop of their own.

Math runs in float32 for float16/bfloat16/float32 tensors (float64 for float64) and each tensor is
rounded to its storage dtype once, when it is written back; the fused kernels follow the same
rule. A global norm is the L2 norm over all the tensors given, its squares summed in float64.
``grad_scale`` / ``found_inf`` are ``torch.amp.GradScaler``'s: the gradients are divided by the
scale (as a multiplication by its float32 reciprocal, as ``GradScaler.unscale_`` does) and a step
with ``found_inf`` set changes nothing; both are read on the host.

A norm function's hyperparameters are a number, or one number per tensor: the parameters of
several param groups share one norm, each with its group's values.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

Tensors = Sequence[torch.Tensor]
Optionals = Optional[Sequence[Optional[torch.Tensor]]]  # one tensor (or None) per parameter, or none at all
Number = Union[float, Sequence[float]]  # one value, or one per tensor
# the float64 sums of squares, one per tensor -> their total over every rank (sharded parameters)
Reduce = Callable[[torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------- shared pieces
def _up(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype: float64 for float64, float32 otherwise (a copy only when it changes)."""
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _skipped(found_inf: Optional[torch.Tensor]) -> bool:
    """GradScaler found an inf or NaN: the step does not happen."""
    return found_inf is not None and float(found_inf.reshape(-1)[0]) != 0.0


def _unscaler(grad_scale: Optional[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``g -> g / grad_scale`` in ``g``'s compute dtype, as a product with the float32 reciprocal."""
    if grad_scale is None:
        return _up
    inv = grad_scale.reshape(-1)[0].double().reciprocal().float()

    def unscaled(g: torch.Tensor) -> torch.Tensor:
        gf = _up(g)
        return gf * inv.to(gf.dtype)

    return unscaled


def _each(name: str, value: Number, n: int) -> List[float]:
    """A hyperparameter per tensor: ``value`` for all ``n``, or its ``n`` values."""
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for {n} tensors: give one number, or one per tensor")
    return values


def _at(tensors: Optionals, i: int) -> Optional[torch.Tensor]:
    return None if tensors is None else tensors[i]


def effective_grad(
    d: torch.Tensor,
    x: torch.Tensor,
    weight_decay: float,
    correction: Optional[torch.Tensor] = None,
    prox_mu: float = 0.0,
    x0: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``d + weight_decay * x + correction + prox_mu * (x - x0)``, each term where it is given, in this
    order (the fused kernels' too): ``d`` (the unscaled gradient) and ``x`` in their compute dtype.
    The SCAFFOLD ``correction`` is ``c - c_i``; ``x0`` is the FedProx anchor (FedDyn's, with
    ``prox_mu = alpha`` and ``correction = -g_i``)."""
    if weight_decay != 0:
        d = d + weight_decay * x
    if correction is not None:
        d = d + _up(correction)
    if x0 is not None:
        d = d + prox_mu * (x - _up(x0))
    return d


def global_norm(tensors: Tensors, reduce: Optional[Reduce] = None) -> torch.Tensor:
    """The L2 norm over all ``tensors`` as a float64 0-dim tensor, its squares summed in float64 (a
    float32 sum of squares overflows for elements near 1e20 and underflows near 1e-23), so it is
    right to ~1e-15 for every finite input in [1e-30, 1e30]; NaN and inf propagate as in
    ``clip_grad_norm_``. ``reduce``: the float64 sums of squares, one per tensor, to their total
    over every rank (sharded parameters; docs/sharded.md)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if reduce is not None:
        sums = [torch.sum(t.to(torch.float64) * t.to(torch.float64)) for t in tensors]
        per_tensor = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
        return reduce(per_tensor).reshape(()).sqrt()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        t64 = t.to(torch.float64)
        total = total + torch.sum(t64 * t64)
    return total.sqrt()


def _norm_dtype(params: Tensors) -> torch.dtype:
    """The dtype a norm is used in, as the kernels round it: float64 when any tensor is float64."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


# ------------------------------------------------------------------------------- sgd
@torch.no_grad()
def sgd(
    params: Tensors,
    grads: Tensors,
    momentum_buffers: Optional[List[Optional[torch.Tensor]]] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    prox_mu: float = 0.0,
    x0s: Optionals = None,
    corrections: Optionals = None,
    neuron_scales: Optionals = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    r"""One SGD step: ``torch.optim.SGD``'s with the FedProx and SCAFFOLD terms and per-row scales.

    FedDecaySGD (``lr = lr * s(k // decay_every)``, FedDecay Eq. 4), NeuronLRSGD (``neuron_scales``,
    FedNLR Eq. 18), FedDyn (``prox_mu = alpha``, ``corrections = -g_i``; Acar et al., ICLR 2021) and
    FedSAM's descent run it. For each parameter ``x`` with gradient ``g``::

        d    = (-g if maximize else g) + weight_decay * x + correction + prox_mu * (x - x0)
        buf  = momentum * buf + (1 - dampening) * d              (where a momentum buffer is given)
        d    = d + momentum * buf  if nesterov  else  buf
        x   -= (lr * r[m]) * d[m, ...]                           (r: its neuron scale, else 1)

    ``momentum_buffers``: one per parameter, updated in place; an entry None is made (zeros, with
    dampening 0 for its first step, so ``buf = d`` as torch's first step), and put in the list.
    Without the list there is no momentum term.
    """
    if _skipped(found_inf):
        return
    unscaled = _unscaler(grad_scale)
    for i, (x, g) in enumerate(zip(params, grads, strict=True)):
        xf = _up(x)
        d = unscaled(g)
        if maximize:
            d = -d
        d = effective_grad(d, xf, weight_decay, _at(corrections, i), prox_mu, _at(x0s, i))
        if momentum_buffers is not None:
            buf, damp = momentum_buffers[i], dampening
            if buf is None:
                buf = momentum_buffers[i] = torch.zeros_like(x, memory_format=torch.preserve_format)
                damp = 0.0
            bf = _up(buf) * momentum + (1 - damp) * d
            buf.copy_(bf)
            d = d + momentum * bf if nesterov else bf
        r = _at(neuron_scales, i)
        if r is not None:
            x.copy_(xf - (lr * _up(r)).view(-1, *([1] * (x.dim() - 1))) * d)
        else:
            x.copy_(xf - lr * d)


# ------------------------------------------------------------------------------- fednar
@torch.no_grad()
def fednar(
    params: Tensors,
    grads: Tensors,
    *,
    lr: Number,
    weight_decay: Number,
    max_norm: Number,
    eps: Number = 1e-6,
    prox_mu: Number = 0.0,
    x0s: Optionals = None,
    corrections: Optionals = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    reduce: Optional[Reduce] = None,
) -> None:
    r"""One FedNAR step: gradient and weight decay clipped together by their global norm.

    From "FedNAR: Federated Optimization with Normalized Annealing Regularization" (Li et al.,
    NeurIPS 2023), Eq. 3-4 and Alg. 2. ``lr`` is the round's step size ``l_t = lr * round_decay ** t``::

        d    = g + weight_decay * x + correction + prox_mu * (x - x0)
        s    = || all d ||_2                                  (global_norm)
        coef = min(1, max_norm / (s + eps))                   (clip_grad_norm_'s; NaN propagates)
        x   -= (lr * coef) * d
    """
    if _skipped(found_inf) or not params:
        return
    n = len(params)
    lrs, wds, epss, mus = (
        _each("lr", lr, n),
        _each("weight_decay", weight_decay, n),
        _each("eps", eps, n),
        _each("prox_mu", prox_mu, n),
    )
    norms = _each("max_norm", max_norm, n)
    unscaled = _unscaler(grad_scale)
    ds = [
        effective_grad(unscaled(g), _up(x), wds[i], _at(corrections, i), mus[i], _at(x0s, i))
        for i, (x, g) in enumerate(zip(params, grads, strict=True))
    ]
    s = global_norm(ds, reduce).to(_norm_dtype(params))
    for i, (x, d) in enumerate(zip(params, ds, strict=True)):
        coef = torch.clamp(norms[i] / (s + epss[i]), max=1.0)
        x.copy_(_up(x) - (lrs[i] * coef).to(d.dtype) * d)


# ------------------------------------------------------------------------------- padamfed
@torch.no_grad()
def padamfed(
    params: Tensors,
    grads: Tensors,
    D: Tensors,
    acc: Tensors,
    *,
    lr: Number,
    beta: Number,
    eps: Number = 1e-12,
    anchor_grads: Optionals = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    reduce: Optional[Reduce] = None,
) -> None:
    r"""One PAdaMFed client step: normalized momentum with control variates.

    From "Problem-Parameter-Free Federated Learning" (Yan, Zhang, Wang, Cao; ICLR 2025), Alg. 1.
    ``D = beta * (c - c_i) + (1 - beta) * m`` is fixed for the round, ``acc`` sums the raw gradients
    (``c_i' = acc / K`` after the round), ``anchor_grads`` (``H``) the variance-reduced variant's::

        v    = beta * G + D                    (with H: v = G + D - (1 - beta) * H)
        acc += G
        x   -= v * (lr / max(|| all v ||_2, eps))        (every step moves x by exactly lr)
    """
    if _skipped(found_inf) or not params:
        return
    n = len(params)
    lrs, betas, epss = (_each(k, v, n) for k, v in (("lr", lr), ("beta", beta), ("eps", eps)))
    unscaled = _unscaler(grad_scale)
    vs = []
    for i, g in enumerate(grads):
        G = unscaled(g)
        H = _at(anchor_grads, i)
        vs.append(G + _up(D[i]) - (1 - betas[i]) * _up(H) if H is not None else betas[i] * G + _up(D[i]))
        acc[i].add_(G)
    norm = global_norm(vs, reduce).to(_norm_dtype(params))
    for i, (x, v) in enumerate(zip(params, vs, strict=True)):
        x.copy_(_up(x) - v * (lrs[i] / torch.clamp(norm, min=epss[i])).to(v.dtype))


# ------------------------------------------------------------------------------- sam_ascent
@torch.no_grad()
def sam_ascent(
    params: Tensors,
    grads: Tensors,
    saved: Optionals = None,
    *,
    rho: Number,
    eta: Number = 0.01,
    eps: Number = 1e-12,
    adaptive: Union[bool, Sequence[bool]] = False,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    reduce: Optional[Reduce] = None,
) -> None:
    r"""FedSAM's first step: the ascent to ``x + e`` (its second step is ``sgd`` from the saved ``x``).

    From "Improving Generalization in Federated Learning by Seeking Flat Minima" (Caldarola et al.,
    ECCV 2022); SAM (Foret et al., ICLR 2021), ASAM's ``adaptive`` form (Kwon et al., ICML 2021)::

        w     = |x| + eta   (adaptive)   or 1                 (elementwise)
        s     = || all w * g ||_2
        saved = x ;  x += rho / (s + eps) * (w * w * g)       (= rho * w^2 * g / (s + eps))

    ``saved``: where ``x`` is copied first (None entries: not copied).
    """
    if _skipped(found_inf) or not params:
        return
    n = len(params)
    rhos, etas, epss = (_each(k, v, n) for k, v in (("rho", rho), ("eta", eta), ("eps", eps)))
    adaptives = [bool(v) for v in _each("adaptive", adaptive, n)] if not isinstance(adaptive, bool) else [adaptive] * n
    unscaled = _unscaler(grad_scale)
    ds = []
    for i, (x, g) in enumerate(zip(params, grads, strict=True)):
        gf = unscaled(g)
        ds.append((_up(x).abs() + etas[i]) * gf if adaptives[i] else gf)
    norm = global_norm(ds, reduce).to(_norm_dtype(params))
    for i, (x, d) in enumerate(zip(params, ds, strict=True)):
        factor = rhos[i] / (norm + epss[i])
        s = _at(saved, i)
        if s is not None:
            s.copy_(x)
        w_d = (_up(x).abs() + etas[i]) * d if adaptives[i] else d
        x.copy_(_up(x) + factor.to(d.dtype) * w_d)


# ------------------------------------------------------------------------------- the server optimizers
# FedAdam / FedYogi / FedAdagrad's second-moment rules, as the fedadam op's "rule" column numbers them
ADAPTIVE_RULES = ("adam", "yogi", "adagrad")


def _sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root (IEEE, as the kernels' sqrt): torch's float32 sqrt on a CPU may
    be an ulp off; through float64 it is exact (a float64 root rounded to float32 is the float32 root)."""
    return v.double().sqrt().float() if v.dtype == torch.float32 else v.sqrt()


def bias_corrections(beta1: float, beta2: float, step: int, rule: str, bias_correction: bool) -> Tuple[float, float]:
    """``(1 / (1 - beta1^t), 1 / sqrt(1 - beta2^t))`` in float64 for step ``t`` (both 1.0 without bias
    correction; Adagrad's v takes none: its second factor is always 1.0)."""
    if not bias_correction:
        return 1.0, 1.0
    # IEEE results where Python raises (the kernels' too; the optimizers refuse betas outside [0, 1))
    d1, d2 = 1.0 - beta1**step, 1.0 - beta2**step
    c1 = 1.0 / d1 if d1 != 0 else math.copysign(math.inf, d1)
    c2 = 1.0 / math.sqrt(d2) if d2 > 0 else (math.inf if d2 == 0 else math.nan)
    return c1, 1.0 if rule == "adagrad" else c2


@torch.no_grad()
def fedadam(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    *,
    lr: Number,
    beta1: Number = 0.9,
    beta2: Number = 0.99,
    tau: Number = 1e-3,
    rule: Union[str, Sequence[str]] = "adam",
    step: int = 1,
    bias_correction: Union[bool, Sequence[bool]] = False,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    r"""One server step of FedAdam, FedYogi or FedAdagrad on the pseudo-gradient ``g = -Delta``.

    From "Adaptive Federated Optimization" (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar,
    McMahan; ICLR 2021), Algorithm 2::

        m  = beta1 m + (1 - beta1) g
        v  = v + g^2                                  (rule "adagrad")
        v  = v - (1 - beta2) g^2 sign(v - g^2)        (rule "yogi")
        v  = beta2 v + (1 - beta2) g^2                (rule "adam")
        x -= (lr c1) m / (sqrt(v) c2 + tau)

    with ``c1, c2 = bias_corrections(beta1, beta2, step, rule, bias_correction)`` (1 without bias
    correction; with it, torch.optim.Adam's ``1 / (1 - beta1^t)`` and ``1 / sqrt(1 - beta2^t)``,
    ``t = step``; Adagrad corrects m only). ``exp_avgs`` / ``exp_avg_sqs`` (m, v) are updated in place.
    """
    if _skipped(found_inf) or not params:
        return
    n = len(params)
    lrs, b1s, b2s, taus = (_each(k, v, n) for k, v in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("tau", tau)))
    rules = [rule] * n if isinstance(rule, str) else list(rule)
    bcs = [bias_correction] * n if isinstance(bias_correction, bool) else [bool(b) for b in bias_correction]
    unscaled = _unscaler(grad_scale)
    for i, (x, g, m_t, v_t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        if rules[i] not in ADAPTIVE_RULES:
            raise ValueError(f"rule must be one of {ADAPTIVE_RULES}, got {rules[i]!r}")
        gf = unscaled(g)
        g2 = gf * gf
        m = _up(m_t) * b1s[i] + (1.0 - b1s[i]) * gf
        v = _up(v_t)
        if rules[i] == "adam":
            v = v * b2s[i] + (1.0 - b2s[i]) * g2
        elif rules[i] == "yogi":
            v = v - (1.0 - b2s[i]) * g2 * torch.sign(v - g2)
        else:
            v = v + g2
        c1, c2 = bias_corrections(b1s[i], b2s[i], step, rules[i], bcs[i])
        m_t.copy_(m)
        v_t.copy_(v)
        x.copy_(_up(x) - (lrs[i] * c1) * (m / (_sqrt_rn(v) * c2 + taus[i])))


def fedexp_step_size(norm: torch.Tensor, mean_sq_norm: float, eps: float, lr: float = 1.0) -> torch.Tensor:
    """FedExP's ``lr * eta_g``, ``eta_g = max(1, mean_sq_norm / (2 (norm^2 + eps)))``, in float64 from
    the float64 global norm (NaN propagates, as torch.clamp keeps it)."""
    q = mean_sq_norm / (2.0 * (norm.double() * norm.double() + eps))
    return lr * torch.clamp(q, min=1.0)


@torch.no_grad()
def fedexp(
    params: Tensors,
    grads: Tensors,
    *,
    mean_sq_norm: Number,
    eps: Number = 1e-3,
    lr: Number = 1.0,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    reduce: Optional[Reduce] = None,
) -> None:
    r"""One FedExP server step on the pseudo-gradient ``g = -Delta``.

    From "FedExP: Speeding Up Federated Averaging via Extrapolation" (Jhunjhunwala, Wang, Joshi;
    ICLR 2023). ``mean_sq_norm`` is the weighted mean over the round's clients of ``||Delta_i||^2``::

        s     = || all g ||_2                                       (global_norm, float64)
        eta_g = max(1, mean_sq_norm / (2 (s^2 + eps)))               (float64, then the norm dtype)
        x    -= (lr * eta_g) * g                                     (x + eta_g Delta for lr = 1)
    """
    if _skipped(found_inf) or not params:
        return
    n = len(params)
    lrs, epss, msns = (_each(k, v, n) for k, v in (("lr", lr), ("eps", eps), ("mean_sq_norm", mean_sq_norm)))
    unscaled = _unscaler(grad_scale)
    ds = [unscaled(g) for g in grads]
    norm = global_norm(ds, reduce)
    dtype = _norm_dtype(params)
    for i, (x, d) in enumerate(zip(params, ds, strict=True)):
        factor = fedexp_step_size(norm, msns[i], epss[i], lrs[i]).to(dtype)
        x.copy_(_up(x) - factor.to(d.dtype) * d)
