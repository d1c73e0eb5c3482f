"""PAdaMFed: normalized momentum with control variates and parameter-free step sizes (docs/algorithms.md)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..batched.mixin import ClientBatched
from ..core import dtensor as _dtensor
from ..core.ops import BATCHED, PADAMFED
from ..core.optimizer import FedOptimizer, check_number, check_tensor_list, state_dtype
from ..fl import algorithm
from ..fl.algorithm import Algorithm, BenchCase, FlowerName, Variant
from ..fl.server_rules import RULES, ServerRule, Tensors, check_like, check_updates, register_rule


class PAdaMFed(FedOptimizer):
    r"""Normalized momentum with control variates, parameter-free step sizes (PAdaMFed).

    The client optimizer of "Problem-Parameter-Free Federated Learning" (Wenjing Yan, Kai Zhang,
    Xiaolu Wang, Xuanyu Cao), Alg. 1 and Thm. 1-2.

    Per round the client receives the global control ``c``, the global momentum ``m`` and keeps its
    own control ``c_i``: ``start_round(global_control=c, local_control=c_i, momentum=m)`` (missing
    lists count as zeros). With ``D = beta * (c - c_i) + (1 - beta) * m``, step k with raw gradient
    ``G``::

        v    = beta * G + D                    (variance_reduction: v = G + D - (1 - beta) * H)
        x   -= eta * v / max(||v||_2, eps)     (norm over all parameters, squares summed in float64:
                                               each step moves x by exactly eta)
        acc += G

    ``H`` is the gradient of the same mini-batch at the round's starting model, passed as
    ``step(anchor_grads=[...])``. After the round, ``local_control()`` returns ``acc / K``, the
    client's new ``c_i``. ``lr`` is ``eta`` (round ``t``'s: ``lr * round_decay ** t``, default
    ``round_decay`` 1); ``theory_hparams`` gives eta, gamma and beta.
    D and acc are kept in float32 (float64 for float64 parameters).
    """

    _spec = PADAMFED
    _accepts_correction = False
    _float32_state: Tuple[str, ...] = ("D", "acc")
    _state_keys: Tuple[str, ...] = ("D", "acc")
    _step_input = "anchor_grads"

    def __init__(
        self,
        params: Iterable,
        lr: float,
        beta: float,
        variance_reduction: bool = False,
        eps: float = 1e-12,
        round_decay: float = 1.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
    ):
        defaults = dict(lr=lr, beta=beta, variance_reduction=bool(variance_reduction), eps=eps, round_decay=round_decay)
        super().__init__(params, defaults, backend, replay)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("beta", group["beta"], low=0.0, high=1.0)
        check_number("eps", group["eps"], low=0.0, low_open=True)

    def _structure(self, group: Dict[str, Any]) -> tuple:
        return super()._structure(group) + (bool(group["variance_reduction"]),)

    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        names_in = ("global_control", "local_control", "momentum")
        got = {k: inputs.pop(k, None) for k in names_in}
        super()._check_round_inputs(inputs)
        params = self._params_flat
        return {k: (None if v is None else check_tensor_list(k, v, params, self._name_of)) for k, v in got.items()}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        c, ci, m = inputs["global_control"], inputs["local_control"], inputs["momentum"]
        i = 0
        for group in self.param_groups:
            beta = group["beta"]
            for p in group["params"]:
                dt = state_dtype(p)
                D = torch.zeros_like(p, dtype=dt, memory_format=torch.contiguous_format)
                if c is not None:
                    D.add_(c[i].to(dt), alpha=beta)
                if ci is not None:
                    D.sub_(ci[i].to(dt), alpha=beta)
                if m is not None:
                    D.add_(m[i].to(dt), alpha=1 - beta)
                st = self.state[p]
                st["D"] = D
                st["acc"] = torch.zeros_like(p, dtype=dt, memory_format=torch.contiguous_format)
                i += 1

    def _step_roles(self) -> Tuple[str, ...]:
        return ("anchor_grad",)

    def _check_step_inputs(self, anchor: Any) -> Dict[str, List[Optional[torch.Tensor]]]:
        params = self._params_flat
        vr = [g["variance_reduction"] for g in self.param_groups]
        if anchor is None:
            if any(vr):
                raise ValueError(
                    "variance_reduction=True needs step(anchor_grads=[...]): the gradients of "
                    "the same mini-batch at the round's starting model, one per parameter"
                )
            return {}
        if not any(vr):
            raise ValueError("anchor_grads was given but variance_reduction=False")
        if not isinstance(anchor, (list, tuple)) or len(anchor) != len(params):
            raise TypeError(
                f"anchor_grads must be a list with one tensor (or None) per parameter "
                f"({len(params)}), got {type(anchor).__name__}"
                + (f" of length {len(anchor)}" if isinstance(anchor, (list, tuple)) else "")
            )

        def entry_name(i: int) -> Callable[[int], str]:  # check_tensor_list's names for entry i alone
            return lambda _j: self._name_of(i)

        for i, (t, p) in enumerate(zip(anchor, params, strict=True)):
            if p.grad is None:
                continue
            if t is None:
                raise ValueError(f"anchor_grads entry for {self._name_of(i)} is None but the parameter has a gradient")
            if (
                not isinstance(t, torch.Tensor)
                or t.shape != p.shape
                or t.device != p.device
                or t.is_sparse
                or t.is_complex()
                or _dtensor.misplaced(t, p)
            ):
                check_tensor_list("anchor_grads", [t], [p], entry_name(i))
        return {"anchor_grad": list(anchor)}

    def _step_tensors(self, p, group, state, idx):
        tensors, override = super()._step_tensors(p, group, state, idx)
        if "D" not in state or "acc" not in state:
            raise RuntimeError(
                f"{self._name_of(idx)} has no PAdaMFed round state (D, acc): it was added to the "
                f"optimizer after start_round(); call start_round() before the next step()"
            )
        tensors["D"], tensors["acc"] = state["D"], state["acc"]
        if group["variance_reduction"]:
            tensors["anchor_grad"] = p  # marks the role present; each step's anchor_grads fill it (_step_roles)
        return tensors, override

    @torch.no_grad()
    def local_control(self) -> List[torch.Tensor]:
        """The client's new control ``c_i' = acc / K`` after the round's K steps, one per parameter."""
        if self._k_bound() == 0:
            raise RuntimeError("local_control() needs at least one step() since start_round()")
        k = self._k()
        if not isinstance(k, torch.Tensor):
            return [self.state[p]["acc"] / k for p in self._params_flat]
        # K from the device counter (steps skipped by GradScaler do not count): no host sync
        return [_dtensor.divided(self.state[p]["acc"], k) for p in self._params_flat]


class BatchedPAdaMFed(ClientBatched, PAdaMFed):
    """PAdaMFed's client step for ``C`` stacked clients: every client's step moves its own
    parameters by exactly ``eta`` (per-client normalisation); ``local_control()`` is each
    client's ``acc / K_c``, or for a client that took no step the local control it was given."""

    _spec = BATCHED["padamfed_batched"]
    # the local control given to start_round: what a client without a step this round keeps
    _float32_state = PAdaMFed._float32_state + ("local_control",)
    _state_keys = PAdaMFed._state_keys + ("local_control",)

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        super()._apply_round_inputs(inputs)
        ci = inputs["local_control"]
        for i, p in enumerate(self._params_flat):
            if ci is None:
                self.state[p].pop("local_control", None)
            else:
                self.state[p]["local_control"] = (
                    ci[i].detach().to(state_dtype(p)).clone(memory_format=torch.contiguous_format)
                )

    @torch.no_grad()
    def local_control(self) -> List[torch.Tensor]:
        """Each client's new control ``acc / K_c`` (``K_c``: the steps client c took), stacked ``[C, ...]``;
        a client with ``K_c = 0`` keeps the local control it was given at start_round (zeros if none)."""
        out = []
        counted = self._k()
        for p in self._params_flat:
            st = self.state[p]
            acc = st["acc"]
            k = (
                counted.to(acc.dtype)
                if isinstance(counted, torch.Tensor)
                else torch.tensor(self.round_step, dtype=acc.dtype)
            )
            k = k.to(acc.device).view(-1, *([1] * (acc.dim() - 1)))
            given = st.get("local_control")
            kept = given if given is not None else torch.zeros_like(acc)
            # no host sync: the choice is made on the device, per client
            out.append(torch.where(k > 0, acc / k.clamp(min=1), kept))
        return out


def theory_hparams(S: int, K: int, T: int, variance_reduction: bool = False) -> Tuple[float, float, float]:
    """PAdaMFed's step sizes from theory ("Problem-Parameter-Free Federated Learning", Thm. 1-2):
    returns ``(eta, gamma, beta)``.

    non-VR: ``eta = 1/(K sqrt(T))``, ``gamma = (S K)^(1/4) / T^(3/4)``, ``beta = min(1, sqrt(S K / T))``;
    VR: ``eta = 1/(K T)``, ``gamma = beta = min(1, (S K)^(1/3) / T^(2/3))``.
    ``S``: clients sampled per round, ``K``: local steps, ``T``: rounds.
    """
    for name, v in (("S", S), ("K", K), ("T", T)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if variance_reduction:
        eta = 1.0 / (K * T)
        gamma = beta = min(1.0, (S * K) ** (1.0 / 3.0) / T ** (2.0 / 3.0))
    else:
        eta = 1.0 / (K * math.sqrt(T))
        gamma = (S * K) ** 0.25 / T**0.75
        beta = min(1.0, math.sqrt(S * K / T))
    return eta, gamma, beta


# ---------------------------------------------------------------------------- the server
@torch.no_grad()
def padamfed_init(local_controls: Sequence[Sequence[torch.Tensor]], num_clients: int) -> Tuple[Tensors, Tensors]:
    """PAdaMFed's initial server state from the clients' first controls: ``c = sum_i ci / N``, ``m = c``.

    Each ``ci`` is the mean of K stochastic gradients at the initial model ("Problem-Parameter-Free
    Federated Learning", Yan, Zhang, Wang, Cao: Alg. 1, line 1). A client missing from
    ``local_controls`` counts as ``ci = 0``.
    """
    if len(local_controls) == 0:
        raise ValueError("local_controls is empty: PAdaMFed's initialisation needs at least one client")
    check_updates("local_controls", local_controls, local_controls[0])
    state = RULES["padamfed"].initial_state([list(ci) for ci in local_controls], num_clients)
    return state["c"], state["m"]


@torch.no_grad()
def padamfed_step(
    x: Sequence[torch.Tensor],
    c: Sequence[torch.Tensor],
    m: Sequence[torch.Tensor],
    deltas: Sequence[Sequence[torch.Tensor]],
    dcs: Sequence[Sequence[torch.Tensor]],
    num_clients: int,
    lr: float,
    local_steps: int,
    server_lr: float,
    beta: float,
) -> Tuple[Tensors, Tensors, Tensors]:
    """PAdaMFed's server step ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao: Alg. 1).

    With S = len(deltas) clients, eta = ``lr``, K = ``local_steps``, gamma = ``server_lr``::

        x'  = x + gamma * mean_i(delta_i) / (eta * K)     (delta_i = y_i - x; the paper's
                                                       x - gamma * mean(x - y_i) / (eta K))
        dc  = sum_i (ci' - ci)
        m'  = beta * (dc / S + c) + (1 - beta) * m
        c'  = c + dc / N

    Returns ``(x', c', m')``. ``eta = 0`` leaves x unchanged (no client moved).
    """
    check_updates("deltas", deltas, x)
    check_updates("dcs", dcs, x)
    if len(dcs) != len(deltas):
        raise ValueError(f"dcs has {len(dcs)} entries for {len(deltas)} deltas")
    check_like("c", c, x)
    check_like("m", m, x)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    hp = {"lr": lr, "server_lr": server_lr, "beta": beta}
    replies = [{"dc": list(dc)} for dc in dcs]
    state = {"c": list(c), "m": list(m)}
    out = RULES["padamfed"].step(
        list(x), state, [list(d) for d in deltas], [1.0] * len(deltas), replies, hp, num_clients, local_steps
    )
    return out["x"], out["c"], out["m"]


class PAdaMFedRule(ServerRule):
    """PAdaMFed's server ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao; Alg. 1):
    global momentum ``m`` and control ``c`` (``padamfed_step``); every client keeps its
    ``c_i`` and computes the first one before round 1 (``padamfed_init``)."""

    name = "padamfed"
    state = ("c", "m")
    sent = {"control": "c", "momentum": "m"}
    keeps = True
    reply = ("dc",)
    init_controls = True

    def initial_finish(self, fold):
        """``c = sum_i ci / N`` from the clients' first controls (the mean of K gradients at the
        initial model), ``m = c``."""
        return {"c": fold.total, "m": [cj.clone() for cj in fold.total]}

    def client_inputs(self, got, kept, x):
        return {"global_control": got["c"], "local_control": kept, "momentum": got["m"]}

    def client_finish(self, opt, algo, hp, t, steps, got, kept, delta):
        new_ci = [v.to(d.dtype) for v, d in zip(opt.local_control(), delta, strict=True)]
        ci = kept if kept is not None else [torch.zeros_like(d) for d in delta]
        return new_ci, {"dc": [n - o for n, o in zip(new_ci, ci, strict=True)]}

    sums = ("delta", "dc")

    def add(self, fold, delta, weight, reply):
        fold.accumulate("delta", delta)  # unweighted: the paper's mean over the S clients
        fold.accumulate("dc", reply["dc"])

    def finish(self, fold):
        """``padamfed_step``'s formulas on the fold's sums."""
        hp, S = fold.hp, fold.count
        c, m = fold.state["c"], fold.state["m"]
        scale = hp["server_lr"] / (hp["lr"] * fold.local_steps) if hp["lr"] > 0 else 0.0
        beta, total, dc = hp["beta"], fold.sums["delta"], fold.sums["dc"]
        return {
            "x": [xj.clone().add_(d, alpha=scale / S) for xj, d in zip(fold.x, total, strict=True)],
            # m uses the old c
            "m": [mj.clone().mul_(1 - beta).add_(d / S + cj, alpha=beta) for mj, d, cj in zip(m, dc, c, strict=True)],
            "c": [cj.clone().add_(d, alpha=1.0 / fold.num_clients) for cj, d in zip(c, dc, strict=True)],
        }


register_rule(PAdaMFedRule())


# ---------------------------------------------------------------------------- the descriptor
class _PAdaMFed(Algorithm):
    def hparams(self, cfg, variant):
        eta, gamma, beta = theory_hparams(
            cfg.sampled_per_round,
            cfg.local_steps,
            cfg.rounds,
            variance_reduction=variant.options.get("variance_reduction", False),
        )
        return {
            "lr": (eta if cfg.lr is None else cfg.lr) * cfg.lr_scale,
            "server_lr": gamma if cfg.server_lr is None else cfg.server_lr,
            "beta": beta if cfg.beta is None else cfg.beta,
            "prox_mu": 0.0,
            "clip_norm": None,
            "round_decay": 1.0,
        }

    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(
            params, lr=hp["lr"], beta=hp["beta"], round_decay=hp["round_decay"], backend=backend, **variant.options
        )

    def state_copies(self, cfg, variant):
        # D, acc, the given local control (+ anchor gradients)
        return 3 + int(bool(variant.options.get("variance_reduction")))

    def needs_anchor(self, variant):
        return bool(variant.options.get("variance_reduction"))

    def step_inputs(self, kwargs, params, seed):
        if not kwargs.get("variance_reduction"):
            return {}
        g = torch.Generator().manual_seed(seed)
        return {"anchor_grads": [torch.randn(p.shape, generator=g).to(dtype=p.dtype, device=p.device) for p in params]}

    def present(self, kwargs, correction, scales):
        return ("D", "acc") + (("anchor_grad",) if kwargs.get("variance_reduction") else ())


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def strategy_keywords(
    *,
    num_rounds: int,
    clients_per_round: int,
    local_steps: int = 10,
    variance_reduction: bool = False,
    lr: Optional[float] = None,
    server_lr: Optional[float] = None,
    beta: Optional[float] = None,
    **strategy: Any,
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``PAdaMFedStrategy``'s keywords as (FLConfig keywords, strategy keywords): the theory step sizes
    ``theory_hparams(clients_per_round, local_steps, num_rounds)`` unless lr, server_lr, beta are given;
    ``clients_per_round`` is also the number sampled (so ``fraction_train`` does not apply)."""
    _count("num_rounds", num_rounds)
    _count("clients_per_round", clients_per_round)
    if "fraction_train" in strategy:
        raise ValueError("PAdaMFed samples clients_per_round clients; fraction_train does not apply")
    cfg = dict(
        algorithm="padamfed-vr" if variance_reduction else "padamfed",
        rounds=num_rounds,
        clients=clients_per_round,
        holdout_fraction=0.0,
        clients_per_round=clients_per_round,
        local_steps=local_steps,
        lr=lr,
        server_lr=server_lr,
        beta=beta,
    )
    return cfg, {"clients_per_round": clients_per_round, **strategy}


DESCRIPTOR = algorithm.register(
    _PAdaMFed(
        "padamfed",
        PAdaMFed,
        BatchedPAdaMFed,
        title="Problem-Parameter-Free Federated Learning",
        settings=("beta",),
        refusals={
            "momentum": "its optimizer has none",
            "weight_decay": "its client step has no weight decay term",
            "clip_norm": "its steps are normalized",
            "round_decay": "its step sizes come from theory_hparams",
        },
        variants=(
            Variant("padamfed", "padamfed"),
            Variant("padamfed-vr", "padamfed", options={"variance_reduction": True}),
        ),
        round_outputs=("local_control",),
        flower=(
            FlowerName(
                "PAdaMFedStrategy",
                {False: "padamfed", True: "padamfed-vr"},
                choose="variance_reduction",
                keywords=strategy_keywords,
                doc="Keywords: num_rounds, clients_per_round (required), local_steps, variance_reduction, "
                "lr, server_lr, beta (default: the theory step sizes), and the strategy's.",
            ),
        ),
        full="controls",
        bench=(
            BenchCase("padamfed", "PAdaMFed beta=0.3, controls", "controls", core=True),
            BenchCase("padamfed_vr", "PAdaMFed variance reduction", "vr"),
        ),
        options={
            "plain": dict(lr=0.05, beta=0.5),
            "controls": dict(lr=0.05, beta=0.3, controls=True),
            "vr": dict(lr=0.02, beta=0.4, variance_reduction=True, controls=True),
            "groups": dict(lr=0.05, beta=0.5, controls=True, groups=dict(lr=0.01, beta=0.9)),
        },
    )
)
