"""Each algorithm's functional form (``fedopt_kernels.functional``) equals its optimizer's step.

For every option set of the catalogue, in float64 on the equivalence harness's problems: a loop
that calls only the functional forms, with the round logic docs/algorithms.md gives each algorithm
written out here (FedDecay's ``lr * s(k // decay_every)``, FedNAR's ``lr * round_decay ** t``,
momentum buffers cleared at a round start, FedProx anchors, PAdaMFed's ``D``, FedDyn's ``g_i``,
FedSAM's ascent, second gradient, restore and descent), against the optimizer on the reference
backend (bit for bit: it runs these very functions) and on the fused cpu backend (the harness's
float64 tolerance: the C++ kernels are written apart from them).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from harness import SHAPE_SETS, RunResult, assert_close_runs, backend_skip_reason, make_grads, make_params, run_case

from fedopt_kernels import functional as F
from fedopt_kernels.fl import catalogue
from fedopt_kernels.fl.catalogue import Config, SecondGradient

ROUNDS, STEPS = 2, 3
DTYPE = torch.float64
State = Dict[str, torch.Tensor]


class Problem:
    """The harness's parameters in the catalogue's param groups, with per-parameter state kept by hand."""

    def __init__(self, cfg: Config, shapes: str, seed: int = 0):
        self.cfg, self.shapes, self.seed = cfg, shapes, seed
        self.params = make_params(shapes, DTYPE, seed)
        # each group's hyperparameters as the optimizer fills them in (its defaults): read, not stepped
        built = cfg.build([torch.nn.Parameter(p.detach().clone()) for p in self.params], "reference")
        groups = cfg.param_groups(self.params)
        self.groups = [
            (g["params"], {k: v for k, v in b.items() if k != "params"}) for g, b in zip(groups, built.param_groups)
        ]
        self.ordered = [p for ps, _ in self.groups for p in ps]  # the optimizer's parameter order
        self.state: Dict[int, State] = {id(p): {} for p in self.params}
        self.grads: Dict[int, Optional[torch.Tensor]] = {}  # this step's, by parameter

    def st(self, p: torch.Tensor) -> State:
        return self.state[id(p)]

    def hp(self, p: torch.Tensor) -> Dict[str, Any]:
        return next(hp for ps, hp in self.groups if any(q is p for q in ps))

    def with_grads(self, ps: List[torch.Tensor]) -> List[torch.Tensor]:
        return [p for p in ps if self.grads[id(p)] is not None]

    def grads_of(self, ps: List[torch.Tensor]) -> List[torch.Tensor]:
        """The gradients of ``ps``, parameters that have one (``with_grads``)."""
        out = []
        for p in ps:
            g = self.grads[id(p)]
            assert g is not None
            out.append(g)
        return out

    def run(self, start: Callable[[int], None], step: Callable[[int], None], end: Callable[[], None]) -> RunResult:
        """The harness's loop (``run_case``): rounds of steps, each round ended before the next starts."""
        for rnd in range(ROUNDS):
            if rnd > 0:
                end()
            start(rnd)
            for s in range(STEPS):
                gstep = rnd * STEPS + s
                for p, g in zip(self.params, make_grads(self.params, self.shapes, gstep, self.seed)):
                    self.grads[id(p)] = g
                step(gstep)
        state = [{k: v.clone() for k, v in self.state[id(p)].items()} for p in self.params]
        return RunResult([p.detach().clone() for p in self.params], state, None)  # type: ignore[arg-type]

    def round_inputs(self, rnd: int) -> Dict[str, Any]:
        return self.cfg.round_inputs(self.ordered, rnd, self.seed)

    def start_sgd_round(self, rnd: int, prox: str = "prox_mu", momentum: bool = True) -> None:
        """An SGD-family round start: momentum buffers go, FedProx anchors and the correction are taken."""
        inputs = self.round_inputs(rnd)
        for i, p in enumerate(self.ordered):
            st = self.st(p)
            if momentum:
                st.pop("momentum_buffer", None)
            st.pop("correction", None)
            st.pop("x0", None)
            if self.hp(p).get(prox, 0.0) != 0.0:
                st["x0"] = p.detach().clone()
            if "correction" in inputs:
                st["correction"] = inputs["correction"][i].clone()

    def sgd_step(self, lr_factor: float, *, prox: str = "prox_mu", correction: str = "correction", **fixed) -> None:
        """``functional.sgd`` on each param group's parameters with a gradient."""
        for ps, hp in self.groups:
            ps = self.with_grads(ps)
            uses_buffers = hp["momentum"] != 0
            bufs = [self.st(p).get("momentum_buffer") for p in ps] if uses_buffers else None
            opts = {k: hp.get(k, 0.0) for k in ("dampening", "weight_decay", "nesterov", "maximize")}
            opts.update(fixed)
            F.sgd(
                ps,
                self.grads_of(ps),
                bufs,
                lr=hp["lr"] * lr_factor,
                momentum=hp["momentum"],
                prox_mu=hp.get(prox, 0.0),
                x0s=[self.st(p).get("x0") for p in ps],
                corrections=[self.st(p).get(correction) for p in ps],
                neuron_scales=[self.st(p).get("neuron_scale") for p in ps],
                **opts,
            )
            if bufs is not None:
                for p, b in zip(ps, bufs):
                    self.st(p)["momentum_buffer"] = b  # type: ignore[assignment]  # made by the step


def _s(cfg: Config, k: int) -> float:
    """FedDecay's s(k // decay_every) (docs/algorithms.md), from the option set's constructor keywords."""
    beta, every = cfg.kwargs.get("beta", 1.0), cfg.kwargs.get("decay_every", 1)
    j = k // every
    if cfg.kwargs.get("schedule", "exponential") == "exponential":
        return beta**j
    return max(0.0, 1.0 - j * (1.0 - beta))


def _feddecay(prob: Problem) -> RunResult:
    k = [0]

    def start(rnd: int) -> None:
        prob.start_sgd_round(rnd)
        k[0] = 0

    def step(gstep: int) -> None:
        prob.sgd_step(_s(prob.cfg, k[0]))
        k[0] += 1

    return prob.run(start, step, lambda: None)


def _neuron_lr(prob: Problem) -> RunResult:
    def start(rnd: int) -> None:
        prob.start_sgd_round(rnd)
        for p, r in prob.round_inputs(rnd).get("neuron_scales", {}).items():
            prob.st(p)["neuron_scale"] = r.clone()  # kept across rounds until replaced

    return prob.run(start, lambda gstep: prob.sgd_step(1.0), lambda: None)


def _norm_args(prob: Problem, ps: List[torch.Tensor], *names: str) -> Dict[str, List[float]]:
    """One value per tensor of each hyperparameter ``names``: its param group's."""
    return {n: [float(prob.hp(p)[n]) for p in ps] for n in names}


def _fednar(prob: Problem) -> RunResult:
    t = [0]

    def start(rnd: int) -> None:
        prob.start_sgd_round(rnd, momentum=False)
        t[0] = rnd

    def step(gstep: int) -> None:
        ps = prob.with_grads(prob.ordered)
        hp = _norm_args(prob, ps, "lr", "weight_decay", "max_norm", "eps", "prox_mu", "round_decay")
        F.fednar(
            ps,
            prob.grads_of(ps),
            lr=[lr * rd ** t[0] for lr, rd in zip(hp["lr"], hp["round_decay"])],
            weight_decay=hp["weight_decay"],
            max_norm=hp["max_norm"],
            eps=hp["eps"],
            prox_mu=hp["prox_mu"],
            x0s=[prob.st(p).get("x0") for p in ps],
            corrections=[prob.st(p).get("correction") for p in ps],
        )

    return prob.run(start, step, lambda: None)


def _padamfed(prob: Problem) -> RunResult:
    def start(rnd: int) -> None:
        got = prob.round_inputs(rnd)
        c, ci, m = (got.get(k) for k in ("global_control", "local_control", "momentum"))
        for i, p in enumerate(prob.ordered):
            beta = prob.hp(p)["beta"]
            D = torch.zeros_like(p, dtype=DTYPE)  # the optimizer's own arithmetic, in its order
            if c is not None:
                D.add_(c[i].to(DTYPE), alpha=beta)
            if ci is not None:
                D.sub_(ci[i].to(DTYPE), alpha=beta)
            if m is not None:
                D.add_(m[i].to(DTYPE), alpha=1 - beta)
            prob.st(p).update(D=D, acc=torch.zeros_like(p, dtype=DTYPE))

    def step(gstep: int) -> None:
        ps = prob.with_grads(prob.ordered)
        anchors = prob.cfg.step_inputs(prob.ordered, gstep, prob.seed).get("anchor_grads")
        index = {id(p): i for i, p in enumerate(prob.ordered)}
        hp = _norm_args(prob, ps, "lr", "beta", "eps")
        F.padamfed(
            ps,
            prob.grads_of(ps),
            [prob.st(p)["D"] for p in ps],
            [prob.st(p)["acc"] for p in ps],
            lr=hp["lr"],
            beta=hp["beta"],
            eps=hp["eps"],
            anchor_grads=None
            if anchors is None
            else [anchors[index[id(p)]] if prob.hp(p)["variance_reduction"] else None for p in ps],
        )

    return prob.run(start, step, lambda: None)


def _feddyn(prob: Problem) -> RunResult:
    k = [0]

    def start(rnd: int) -> None:
        prob.start_sgd_round(rnd, prox="alpha")
        for p in prob.ordered:
            st = prob.st(p)
            st["x0"] = p.detach().clone()
            st.setdefault("dyn_correction", torch.zeros_like(p))  # -g_i, kept across rounds
        k[0] = 0

    def step(gstep: int) -> None:
        prob.sgd_step(_s(prob.cfg, k[0]), prox="alpha", correction="dyn_correction")
        k[0] += 1

    def end() -> None:  # g_i <- g_i - alpha * (x - x0), kept as -g_i
        for p in prob.ordered:
            st = prob.st(p)
            st["dyn_correction"].copy_(st["dyn_correction"] + prob.hp(p)["alpha"] * (p.detach() - st["x0"]))

    return prob.run(start, step, end)


def _fedsam(prob: Problem) -> RunResult:
    def step(gstep: int) -> None:
        moved = prob.with_grads(prob.ordered)
        saved = [prob.st(p).setdefault("saved_x", torch.zeros_like(p)) for p in moved]
        hp = _norm_args(prob, moved, "rho", "eta", "eps")
        adaptive = [bool(prob.hp(p)["adaptive"]) for p in moved]
        F.sam_ascent(moved, prob.grads_of(moved), saved, rho=hp["rho"], eta=hp["eta"], eps=hp["eps"], adaptive=adaptive)
        closure = prob.cfg.step_inputs(prob.ordered, gstep, prob.seed)["closure"]
        assert isinstance(closure, SecondGradient)
        for p, b in zip(closure.params, closure.bases):  # the second gradient, at x + e
            g = prob.grads[id(p)]
            if g is not None:
                g.copy_(b).add_(p.detach())
        with torch.no_grad():
            for p, s in zip(moved, saved):
                p.copy_(s)  # the restore, bit for bit
        prob.sgd_step(1.0, maximize=False)

    return prob.run(prob.start_sgd_round, step, lambda: None)


LOOPS: Dict[str, Callable[[Problem], RunResult]] = {
    "feddecay": _feddecay,
    "neuron_lr": _neuron_lr,
    "fednar": _fednar,
    "padamfed": _padamfed,
    "feddyn": _feddyn,
    "fedsam": _fedsam,
}


def _cases() -> List[Any]:
    out = []
    for algo in catalogue.ALGOS.values():
        out += [pytest.param(algo.name, option, "odd", id=f"{algo.name}-{option}-odd") for option in algo.options]
        out += [
            pytest.param(algo.name, algo.full, s, id=f"{algo.name}-{algo.full}-{s}") for s in ("frozen", "noncontig")
        ]
    return out


def test_every_algorithm_has_a_functional_loop():
    assert sorted(LOOPS) == sorted(catalogue.ALGOS)
    assert {"frozen", "noncontig"} <= set(SHAPE_SETS)


@pytest.mark.parametrize("algo,option,shapes", _cases())
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_functional_form_is_the_optimizers_step(backend, algo, option, shapes):
    why = backend_skip_reason(backend)
    if why is not None:
        pytest.skip(why)
    got = LOOPS[algo](Problem(catalogue.config(algo, option), shapes))
    ref = run_case(algo, option, shapes, DTYPE, backend, rounds=ROUNDS, steps=STEPS)
    assert_close_runs(ref, got, DTYPE, what=f"functional vs {backend}/{algo}/{option}/{shapes}")
    if backend == "reference":  # the reference backend runs these very functions: the same bits
        assert all(torch.equal(a, b) for a, b in zip(ref.params, got.params))
        assert all(torch.equal(sa[k], sb[k]) for sa, sb in zip(ref.state, got.state) for k in sa)


def test_the_comparison_can_fail():
    """A loop that forgets one piece of an algorithm's round logic (FedNAR's annealing) is caught."""
    ref = run_case("fednar", "clipped", "odd", DTYPE, "reference", rounds=ROUNDS, steps=STEPS)  # round_decay 0.9
    prob = Problem(catalogue.config("fednar", "clipped"), "odd")
    for _, hp in prob.groups:
        hp["round_decay"] = 1.0  # l_t = lr in every round
    with pytest.raises(AssertionError):
        assert_close_runs(ref, _fednar(prob), DTYPE)


def test_hyperparameters_per_tensor_must_match_the_tensors():
    x = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(ValueError, match="lr has 1 values for 2 tensors"):
        F.fednar(x, [torch.ones(2), torch.ones(3)], lr=[0.1], weight_decay=0.0, max_norm=1.0)
