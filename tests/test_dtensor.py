"""The optimizers on DTensor parameters (docs/sharded.md), on CPU process groups under gloo.

Every check of a world runs inside one spawned world (starting processes costs seconds): the
workers return what they measured and the tests below assert on it.

* Each catalogue configuration x backend (reference, cpu) x placement (Shard(0) with uneven and
  empty shards, Shard(last dim), Replicate, a mix in one optimizer) on 2 ranks against the same
  configuration on the whole tensors in one process: parameters and state on each rank against
  the matching slice of the unsharded run. Element-wise algorithms must agree bit for bit. The
  norm algorithms' only difference is the order in which the float64 sums of squares are added
  (this rank's tensors, then the ranks); that changes the norm by a few float64 ulps, which can
  flip the rounding of the norm to the compute dtype and of every factor formed from it (a few
  ulps of the compute dtype, eps_c), so a step's update may differ by ``4 eps_c |update|`` and the
  rounded parameter by one ulp of its storage dtype. The bound per element is the sum of both
  over the steps, from the unsharded run; state that does not depend on the norm is bitwise.
* The norm algorithms on the triton backend (interpreted on the CPU), a few configurations.
* A 2 x 2 mesh (4 ranks, placements over both mesh dims, one all-reduce over the whole world).
* An FSDP2 ``fully_shard`` model trained on 2 ranks equals the one-process run on both ranks' data.
* state_dict through ``torch.distributed.checkpoint.state_dict``, sharded and full, and across
  sharded / unsharded optimizers.
* Misplaced inputs are refused with errors naming them, and change nothing.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, cast

import pytest
import torch

from fedopt_kernels import FedSAM, PAdaMFed
from fedopt_kernels.fl import catalogue
from fedopt_kernels.fl.local_world import gloo_unavailable, run_local_world

pytestmark = pytest.mark.skipif(gloo_unavailable() is not None, reason=f"no gloo: {gloo_unavailable()}")

SHAPES = [(7, 5), (4,), (1, 3), (3, 6), (6, 4, 2), (130, 257)]
PLACEMENTS = ("shard0", "shard_last", "replicate", "mixed")
BACKENDS = ("reference", "cpu")
ROUNDS, STEPS = 2, 3
# (algo, option, dtype, placements): every option in float32 on every placement, the full option
# sets in float64 and bfloat16 on the mixed placement
# the triton backend (interpreted on the CPU, slow): the norm algorithms, fewer and smaller tensors
TRITON_CASES = [
    ("fednar", "prox_correction", "float32", "shard0"),
    ("fednar", "clipped", "float32", "shard_last"),
    ("padamfed", "vr", "float32", "shard0"),
]
TRITON_SHAPES = SHAPES[:5]  # (also the 4-rank world's: its start-up is what costs)
CASES = [(a, o, "float32", pl) for a, algo in catalogue.ALGOS.items() for o in algo.options for pl in PLACEMENTS] + [
    (a, catalogue.ALGOS[a].full, dt, "mixed") for a in catalogue.ALGOS for dt in ("float64", "bfloat16")
]


# ------------------------------------------------------------------------------ helpers (in the workers)
def _placements(kind: str, i: int, shape, mesh_ndim: int = 1):
    from torch.distributed.tensor import Replicate, Shard

    last = Shard(len(shape) - 1)
    one = {"shard0": Shard(0), "shard_last": last, "replicate": Replicate()}.get(kind)
    if one is None:  # mixed
        one = (Shard(0), Replicate(), last)[i % 3]
    if mesh_ndim == 1:
        return [one]
    return [Replicate() if i % 2 else Shard(0), one]  # 2-D mesh: the first dim replicates or shards rows


def _like(t: torch.Tensor, p) -> Any:
    """``t`` (a whole tensor, the same on every rank) placed like DTensor ``p``, without communication."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)


def _sharded_step_input(value: Any, params: List[Any]) -> Any:
    """A step input of the unsharded run for the sharded one: tensors placed like their parameters; a
    closure's seeded gradients too (FedSAM's second gradient)."""
    if isinstance(value, catalogue.SecondGradient):
        return catalogue.SecondGradient(params, [_like(b, q) for b, q in zip(value.bases, params)])
    return [_like(t, q) for t, q in zip(value, params)]


def _sharded_inputs(inputs: Dict[str, Any], plain: List[Any], params: List[Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, v in inputs.items():
        if isinstance(v, dict):  # neuron scales: whole vectors, sliced by the optimizer
            index = {id(p): i for i, p in enumerate(plain)}
            out[key] = {params[index[id(p)]]: r for p, r in v.items()}
        else:
            out[key] = [_like(t, p) for t, p in zip(v, params)]
    return out


def _state_tensors(opt, params) -> Dict[str, Any]:  # torch.Tensor, or DTensor
    out = {}
    for i, p in enumerate(params):
        for key, v in sorted(opt.state[p].items()):
            if isinstance(v, torch.Tensor):
                out[f"{key}[{i}]"] = v
    return out


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of ``x``'s storage dtype at each element (as float64)."""
    big = x.abs().double()
    return torch.finfo(x.dtype).eps * torch.maximum(big, torch.full_like(big, torch.finfo(x.dtype).tiny))


def _compare_config(
    algo: str,
    option: str,
    dtype_name: str,
    kind: str,
    backend: str,
    mesh,
    shapes=SHAPES,
    rounds: int = ROUNDS,
    steps: int = STEPS,
) -> Dict[str, Any]:
    """Run one configuration sharded and unsharded; this rank's worst differences and bounds."""
    cfg = catalogue.config(algo, option)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(1)
    whole = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    plain = [torch.nn.Parameter(t.clone()) for t in whole]
    # DTensor parameters (torch's stubs type a Parameter of a DTensor as a plain Parameter)
    sharded: List[Any] = [
        torch.nn.Parameter(_like(t.clone(), _Ghost(mesh, _placements(kind, i, t.shape, mesh.ndim))))
        for i, t in enumerate(whole)
    ]
    opt_p, opt_s = cfg.build(plain, backend), cfg.build(sharded, backend)
    order_p = [p for grp in opt_p.param_groups for p in grp["params"]]
    order_s = [p for grp in opt_s.param_groups for p in grp["params"]]
    bound = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    eps_c = _eps(dtype)
    for rnd in range(rounds):
        inputs = cfg.round_inputs(order_p, rnd)
        opt_p.start_round(**inputs)
        opt_s.start_round(**_sharded_inputs(inputs, order_p, order_s))
        for step in range(steps):
            gstep = rnd * steps + step
            grads = catalogue.rand_like_list(plain, gstep, 1.0)
            before = [p.detach().double() for p in plain]
            for p, q, gr in zip(plain, sharded, grads):
                p.grad = gr
                q.grad = _like(gr.clone(), q)  # its own memory: a closure writes the gradients in place
            step_in = cfg.step_inputs(order_p, gstep)
            opt_p.step(**step_in)
            opt_s.step(**{k: _sharded_step_input(v, order_s) for k, v in step_in.items()})
            for b, x0, p in zip(bound, before, plain):
                b += 4 * eps_c * (p.detach().double() - x0).abs() + _ulp(p.detach())
    worst = {
        "max_abs": 0.0,
        "max_rel": 0.0,
        "over_bound": 0.0,
        "state_abs": 0.0,
        "state_rel": 0.0,
        "eps_c": eps_c,
        "steps": rounds * steps,
    }
    for p, q, b in zip(plain, sharded, bound):
        want = _like(p.detach(), q).to_local().double()
        got = q.detach().to_local().double()
        diff = (got - want).abs()
        if diff.numel():
            worst["max_abs"] = max(worst["max_abs"], float(diff.max()))
            rel = diff / want.abs().clamp_min(torch.finfo(dtype).tiny)
            worst["max_rel"] = max(worst["max_rel"], float(rel.max()))
            worst["over_bound"] = max(worst["over_bound"], float((diff - _like(b, q).to_local()).max()))
    sp, ss = _state_tensors(opt_p, order_p), _state_tensors(opt_s, order_s)
    if sorted(sp) != sorted(ss):
        raise AssertionError(f"state keys differ: {sorted(sp)} vs {sorted(ss)}")
    for key in sp:
        want, got = _like(sp[key], ss[key]).to_local(), ss[key].to_local()
        if want.numel():
            diff = (got.double() - want.double()).abs()
            worst["state_abs"] = max(worst["state_abs"], float(diff.max()))
            scale = want.double().abs().max().clamp_min(torch.finfo(dtype).tiny)
            worst["state_rel"] = max(worst["state_rel"], float(diff.max() / scale))
    if cfg.cls.__name__ == "PAdaMFed":
        for a, b in zip(cast(PAdaMFed, opt_p).local_control(), cast(PAdaMFed, opt_s).local_control()):
            want, got = _like(a, b).to_local(), b.to_local()  # type: ignore[attr-defined]  # DTensors
            if want.numel():
                worst["state_abs"] = max(worst["state_abs"], float((got.double() - want.double()).abs().max()))
    worst["same_round"] = (opt_p.round_index, opt_p.round_step) == (opt_s.round_index, opt_s.round_step)
    return worst


class _Ghost:
    """Stands for a DTensor's mesh and placements in ``_like``."""

    def __init__(self, mesh, placements):
        self.device_mesh, self.placements = mesh, placements


def _agreement_world(
    rank: int, n: int, cases: List[tuple], mesh_shape: tuple, shapes=SHAPES
) -> Dict[tuple, Dict[str, Any]]:
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    for algo, option, dtype, kind in cases:
        for backend in BACKENDS:
            out[(algo, option, dtype, kind, backend)] = _compare_config(
                algo, option, dtype, kind, backend, mesh, shapes=shapes
            )
    return out


def _merge(per_rank: List[Dict[tuple, Dict[str, Any]]]) -> Dict[tuple, Dict[str, Any]]:
    out = {}
    for key in per_rank[0]:
        rows = [r[key] for r in per_rank]
        out[key] = {f: (all(r[f] for r in rows) if f == "same_round" else max(r[f] for r in rows)) for f in rows[0]}
    return out


# ------------------------------------------------------------------------------ FSDP2, state_dict, errors
def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3)).double()


def _batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64))
        for _ in range(steps)
    ]


def _train(model, opt, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _fsdp_world(rank: int, n: int) -> Dict[Any, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    import fedopt_kernels as fk

    mesh = init_device_mesh("cpu", (n,))
    out: Dict[Any, Any] = {}
    steps = 3
    mine = _batches(rank, steps)
    together = [
        (
            torch.cat([_batches(r, steps)[s][0] for r in range(n)]),
            torch.cat([_batches(r, steps)[s][1] for r in range(n)]),
        )
        for s in range(steps)
    ]
    for backend in BACKENDS:
        for name, make in (
            (
                "FedNAR",
                lambda ps, backend=backend: fk.FedNAR(ps, lr=0.2, weight_decay=0.01, max_norm=0.3, backend=backend),
            ),
            ("PAdaMFed", lambda ps, backend=backend: fk.PAdaMFed(ps, lr=0.05, beta=0.5, backend=backend)),
            (
                "FedDecaySGD",
                lambda ps, backend=backend: fk.FedDecaySGD(ps, lr=0.1, beta=0.8, momentum=0.9, backend=backend),
            ),
        ):
            model = _mlp(0)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = make(model.parameters())
            opt.start_round()
            _train(model, opt, mine)
            ref = _mlp(0)
            ref_opt = make(ref.parameters())
            ref_opt.start_round()
            _train(ref, ref_opt, together)
            # FSDP2's parameters are DTensors; torch's stubs type them as plain Parameters
            diff = max(
                float((p.full_tensor() - q).abs().max())  # type: ignore[attr-defined]
                for p, q in zip(model.parameters(), ref.parameters())
            )
            scale = max(float(q.abs().max()) for q in ref.parameters())
            out[("fsdp", name, backend)] = diff / scale

            # sharded checkpoint -> a fresh sharded optimizer: continues exactly as the original
            # cloned: a state_dict holds the optimizer's live tensors, as torch's optimizers' do
            saved: Dict[str, Any] = get_optimizer_state_dict(model, opt)
            saved["state"] = {
                k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in st.items()}
                for k, st in saved["state"].items()
            }
            model2 = _mlp(1)
            for layer in model2:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model2, mesh=mesh)
            model2.load_state_dict(model.state_dict())
            opt2 = make(model2.parameters())
            set_optimizer_state_dict(model2, opt2, saved)
            more = _batches(rank + 7, 2)
            _train(model, opt, more)
            _train(model2, opt2, more)
            out[("dcp_sharded", name, backend)] = (
                max(
                    float((p.to_local() - q.to_local()).abs().max())  # type: ignore[attr-defined]  # FSDP2: DTensors
                    for p, q in zip(model.parameters(), model2.parameters())
                ),
                (opt.round_index, opt.round_step) == (opt2.round_index, opt2.round_step),
            )

            # full (unsharded) checkpoint -> a plain optimizer in this process, and back into a sharded one
            full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
            plain_model = _mlp(2)
            plain_model.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
            plain_opt = make(plain_model.parameters())
            plain_opt.load_state_dict(full)
            opt3 = make(model2.parameters())
            opt3.load_state_dict(full)  # whole tensors into a sharded optimizer: each rank keeps its slice
            out[("full_into_sharded_is_dtensor", name, backend)] = all(
                isinstance(v, DTensor) for st in opt3.state.values() for v in st.values() if isinstance(v, torch.Tensor)
            )
            p_state = get_optimizer_state_dict(model2, opt3, options=StateDictOptions(full_state_dict=True))
            out[("full_roundtrip", name, backend)] = _state_diff(full, p_state)
            out[("full_into_plain", name, backend)] = _state_diff(full, plain_opt.state_dict())
    return out


def _state_diff(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    """Largest difference between two optimizer state_dicts' tensors, parameter by parameter in
    param-group order (inf when their layouts differ)."""
    ka = [k for g in a["param_groups"] for k in g["params"]]
    kb = [k for g in b["param_groups"] for k in g["params"]]
    if len(ka) != len(kb):
        return math.inf
    worst = 0.0
    for x, y in zip((a["state"].get(k, {}) for k in ka), (b["state"].get(k, {}) for k in kb)):
        if sorted(x) != sorted(y):
            return math.inf
        for k in x:
            if isinstance(x[k], torch.Tensor):
                worst = max(worst, float((x[k].double() - y[k].double()).abs().max()) if x[k].numel() else 0.0)
    return worst


def _errors_world(rank: int, n: int) -> Dict[str, str]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import fedopt_kernels as fk

    mesh = init_device_mesh("cpu", (n,))
    mesh2 = init_device_mesh("cpu", (1, n))
    out: Dict[str, str] = {}

    def catch(key, fn, *watched):
        before = [t.detach().clone() for t in watched]
        try:
            fn()
            out[key] = "no error"
        except (TypeError, ValueError, RuntimeError) as exc:
            changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, watched))
            out[key] = f"{type(exc).__name__}: {exc}" + (" [CHANGED STATE]" if changed else "")

    # Parameters of DTensors (torch's stubs type them as plain Parameters)
    w: Any = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)], src_data_rank=None))
    b = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()], src_data_rank=None))
    catch("mixed_plain", lambda: fk.FedNAR([w, torch.nn.Parameter(torch.ones(2))], lr=0.1, weight_decay=0.0))
    other = torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh2, [Replicate(), Shard(0)], src_data_rank=None))
    catch("mesh_mismatch", lambda: fk.FedNAR([w, other], lr=0.1, weight_decay=0.0))
    opt = fk.FedNAR([w, b], lr=0.1, weight_decay=0.0, prox_mu=0.1, backend="cpu")
    opt.start_round()
    x0_before = opt.state[w]["x0"].to_local().clone()
    bad = [
        distribute_tensor(torch.ones(4, 3), mesh, [Replicate()], src_data_rank=None),
        distribute_tensor(torch.ones(4), mesh, [Replicate()], src_data_rank=None),
    ]
    catch("correction_placement", lambda: opt.start_round(correction=bad), w.to_local())
    catch("correction_plain", lambda: opt.start_round(correction=[torch.ones(4, 3), torch.ones(4)]))
    out["x0_kept"] = str(torch.equal(opt.state[w]["x0"].to_local(), x0_before))
    w.grad = distribute_tensor(torch.ones(4, 3), mesh, [Replicate()], src_data_rank=None)
    b.grad = distribute_tensor(torch.ones(4), mesh, [Replicate()], src_data_rank=None)
    catch("grad_placement", opt.step, w.to_local())
    pa = fk.PAdaMFed([w, b], lr=0.1, beta=0.5, variance_reduction=True)
    catch("control_placement", lambda: pa.start_round(global_control=bad))
    w.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)], src_data_rank=None)
    pa.start_round()
    catch("anchor_placement", lambda: pa.step(anchor_grads=bad), w.to_local())
    nl = fk.NeuronLRSGD([w, b], lr=0.1)
    catch(
        "scale_placement",
        lambda: nl.set_neuron_scales({w: distribute_tensor(torch.ones(4), mesh, [Replicate()], src_data_rank=None)}),
    )
    catch("scale_shape", lambda: nl.set_neuron_scales({w: torch.ones(2)}))
    from fedopt_kernels.batched import BatchedFedNAR

    stacked: Any = torch.nn.Parameter(distribute_tensor(torch.ones(2, 4), mesh, [Shard(1)], src_data_rank=None))
    stacked.grad = distribute_tensor(torch.ones(2, 4), mesh, [Shard(1)], src_data_rank=None)
    catch("batched", BatchedFedNAR([stacked], lr=0.1, weight_decay=0.0).step, stacked.to_local())
    plain = fk.FedNAR([torch.nn.Parameter(torch.ones(4, 3))], lr=0.1, weight_decay=0.0, prox_mu=0.1)
    plain.start_round()
    sd = opt.state_dict()
    sd["state"] = {0: sd["state"][0]}
    sd["param_groups"][0]["params"] = [0]
    catch("dtensor_state_into_plain", lambda: plain.load_state_dict(sd))
    return out


# ------------------------------------------------------------------------------ the worlds (one each per module)
@pytest.fixture(scope="module")
def two_ranks() -> Dict[str, Any]:
    res = run_local_world(_world2, 2)
    triton = res[0]["triton"]
    if "unavailable" not in triton:
        triton = {
            **_merge([{k: v for k, v in r["triton"].items() if k != "mixed"} for r in res]),
            "mixed": triton["mixed"],
        }
    return {
        "agree": _merge([r["agree"] for r in res]),
        "fsdp": res[0]["fsdp"],
        "errors": res[0]["errors"],
        "errors_all": [r["errors"] for r in res],
        "triton": triton,
    }


def _triton_world(rank: int, n: int) -> Dict[Any, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import fedopt_kernels as fk

    why = fk.available_backends("cpu").missing.get("triton")
    if why is not None:
        return {"unavailable": why}
    mesh = init_device_mesh("cpu", (n,))
    out: Dict[Any, Any] = {
        case: _compare_config(*case, "triton", mesh, shapes=TRITON_SHAPES, rounds=1, steps=2) for case in TRITON_CASES
    }
    ps = [
        torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [pl], src_data_rank=None))
        for pl in (Shard(0), Replicate())
    ]
    for p in ps:
        p.grad = torch.ones_like(p)
    try:
        fk.FedNAR(ps, lr=0.1, weight_decay=0.0, backend="triton").step()
        out["mixed"] = "no error"
    except RuntimeError as exc:
        out["mixed"] = str(exc)
    return out


def _world2(rank: int, n: int) -> Dict[str, Any]:
    return {
        "agree": _agreement_world(rank, n, CASES, (n,)),
        "fsdp": _fsdp_world(rank, n),
        "errors": _errors_world(rank, n),
        "triton": _triton_world(rank, n),
    }


def _world4(rank: int, n: int) -> Dict[tuple, Dict[str, Any]]:
    cases = [(a, catalogue.ALGOS[a].full, "float32", kind) for a in catalogue.ALGOS for kind in ("shard0", "mixed")]
    return _agreement_world(rank, n, cases, (2, 2), shapes=TRITON_SHAPES)


@pytest.fixture(scope="module")
def four_ranks() -> Dict[tuple, Dict[str, Any]]:
    return _merge(run_local_world(_world4, 4))


def _check_agreement(key: tuple, row: Dict[str, Any]) -> None:
    algo = key[0]
    assert row["same_round"], key
    if catalogue.ALGOS[algo].cls is FedSAM:
        # the ascent's factor rho / (norm + eps) may differ by 4 eps_c (the norm's summation order), so
        # may e and the gradient taken at x + e (one more eps_c rounding it): the parameters stay within
        # the norm algorithms' bound, and the state the descent builds from that gradient (momentum
        # buffers) within 5 eps_c of its size per step
        assert row["over_bound"] <= 0.0, (key, row)
        assert row["state_rel"] <= 5 * row["eps_c"] * row["steps"], (key, row)
        return
    assert row["state_abs"] == 0.0, (key, row)  # controls, accumulators, buffers: element-wise
    if catalogue.ALGOS[algo].cls._spec.norm:
        assert row["over_bound"] <= 0.0, (key, row)
    else:
        assert row["max_abs"] == 0.0, (key, row)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo,option,dtype,kind", CASES)
def test_sharded_step_equals_unsharded(two_ranks, algo, option, dtype, kind, backend):
    _check_agreement((algo, option, dtype, kind, backend), two_ranks["agree"][(algo, option, dtype, kind, backend)])


@pytest.mark.parametrize("case", TRITON_CASES)
def test_sharded_triton_interpreted_equals_unsharded(two_ranks, case):
    res = two_ranks["triton"]
    if "unavailable" in res:
        pytest.skip(f"triton backend: {res['unavailable']}")
    _check_agreement(case + ("triton",), res[case])


def test_triton_refuses_replicated_mixed_with_sharded(two_ranks):
    res = two_ranks["triton"]
    if "unavailable" in res:
        pytest.skip(f"triton backend: {res['unavailable']}")
    assert "placed alike" in res["mixed"], res["mixed"]


def test_two_by_two_mesh_equals_unsharded(four_ranks):
    for key, row in four_ranks.items():
        _check_agreement(key, row)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["FedNAR", "PAdaMFed", "FedDecaySGD"])
def test_fsdp2_training_and_checkpoints(two_ranks, name, backend):
    res = two_ranks["fsdp"]
    # float64 model: FSDP2 averages the ranks' gradients in another order than one process does
    assert res[("fsdp", name, backend)] < 1e-12
    diff, same_round = res[("dcp_sharded", name, backend)]
    assert diff == 0.0 and same_round
    assert res[("full_into_sharded_is_dtensor", name, backend)]
    assert res[("full_roundtrip", name, backend)] == 0.0
    assert res[("full_into_plain", name, backend)] == 0.0


@pytest.mark.parametrize(
    "key,pattern",
    [
        ("mixed_plain", "TypeError: .*plain tensor.*DTensor"),
        ("mesh_mismatch", "ValueError: .*device mesh"),
        ("correction_placement", "ValueError: correction entry for parameter 0 .*placed like its parameter"),
        ("correction_plain", "TypeError: correction entry for parameter 0 .*plain Tensor.*distribute_tensor"),
        ("grad_placement", "ValueError: gradient entry for parameter 0 "),
        ("control_placement", "ValueError: global_control entry for parameter 0"),
        ("anchor_placement", "ValueError: anchor_grads entry for parameter 0"),
        ("scale_placement", "ValueError: neuron scale for parameter 0 .*Shard\\(dim=0\\)"),
        ("scale_shape", "ValueError: neuron scale for parameter 0 .*shape"),
        ("batched", "TypeError: BatchedFedNAR takes no DTensor parameters"),
        ("dtensor_state_into_plain", "ValueError: state 'x0' of parameter 0 .*full_state_dict"),
    ],
)
def test_misplaced_inputs_are_refused(two_ranks, key, pattern):
    import re

    for errors in two_ranks["errors_all"]:
        assert re.match(pattern, errors[key], re.S), errors[key]
        assert "CHANGED STATE" not in errors[key]
    assert two_ranks["errors"]["x0_kept"] == "True"


def test_plain_tensors_keep_the_ordinary_plan():
    """An optimizer over ordinary tensors plans and steps exactly as before (no sharded plan)."""
    import fedopt_kernels as fk
    from fedopt_kernels.core.plan import StepPlan

    p = torch.nn.Parameter(torch.ones(5))
    p.grad = torch.ones(5)
    for opt in (fk.FedNAR([p], lr=0.1, weight_decay=0.0), fk.FedDecaySGD([p], lr=0.1, beta=0.5)):
        opt.step()
        opt.step()
        assert type(opt.step_plan) is StepPlan
