"""``--validate BACKEND``: the same run on ``reference`` and on BACKEND, side by side, compared.

(``--validate sequential`` with ``--client-batched N`` does the same with the sequential run in
the reference's place and the client-batched run as the one checked: ``validate_client_batched``.)

All runs share the data and every seed, so they see the same clients and mini-batches; they differ
only in the optimizer kernels. Three runs step together:

* ``reference``;
* BACKEND left alone (end to end): its parameter divergence from the reference after each round is
  printed as the *trajectory* divergence, and its final accuracies are compared with the reference's;
* BACKEND re-synchronised to the reference (global model and server state) at the start of every
  round: its divergence after the round is the *one-round* divergence, the error that round's kernels
  added, free of the amplification by training that makes trajectories of any two float programs
  drift apart over many rounds (PAdaMFed-VR, whose normalized direction nearly cancels, grows a
  1e-7 difference to ~5e-3 in 100 rounds with a correct backend).

Tolerances (documented defaults, overridable on the command line):
    PARAM_RTOL = 1e-4   one-round divergence, max_j |x_ref_j - x_j| / max_j |x_ref_j|, every round
    ACC_TOL    = 0.01   |difference| of each final accuracy of the end-to-end run (one percentage point)
A wrong kernel (a missed term, a wrong coefficient) moves a round by far more than 1e-4.

Precision: every run of a validation is cast to float64 (model, data, optimizer state) whenever
the backends compared have float64 kernels (``reference``, ``cpu``). The two sides compute the
same mathematics in different orders (fused kernels, vmapped convolutions), and in float32 their
rounding differences are not small in any bound one could state: a ReLU or max-pool decision that
the two roundings take differently routes a gradient elsewhere (a 1e-3 relative change of one
client's conv gradient was seen from a last-bit difference of oneDNN's AVX-512 convolutions), and
normalised or cancelling updates (PAdaMFed, SCAFFOLD) amplify what is left. In float64 rounding
is 1e-16 relative, such ties essentially never flip, and rounding-only divergences sit ~10 orders
of magnitude below the tolerance on every CPU and thread count (and on a GPU with cuDNN). The
``dtype`` argument overrides the choice (float32 checks the float32 kernels end to end, with that
caveat). ``cuda`` has float64 kernels for every op; ``triton`` has none, so

* ``--validate triton`` compares it with ``reference`` in float32: both run the same model code and
  differ only in the optimizer kernels;
* ``--validate sequential`` on triton splits the claim in two (``validate_client_batched``): the
  two gradient paths (client by client vs vmapped, where cuDNN's float32 orders differ) are checked
  in float64 with a backend that has float64 kernels (``cuda``, else ``reference``), and triton's
  batched kernels are checked against the reference batched op on the client-batched path in
  float32, where only the optimizer kernels differ.

The run's ``precision`` (``tf32``, ``bf16``: ``batched/precision.py``) is not what a validation
compares: both sides run at ``fp32``. What it checks, the optimizer kernels and the client-batched
gradients, computes the same mathematics at every precision, and autocast and TF32 act on float32
tensors only, so in float64 they would change nothing anyway; in float32, a bf16 cast that the two
sides round differently (2**-8 relative) would swamp the 1e-4 tolerance. The report says so. A
bf16 run's accuracy against fp32 is a test of its own (tests/test_precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

from ..core import registry as _registry
from .config import SimConfig
from .federated_data import FederatedData
from .report import final_rows
from .simulation import Simulation, resolve_backend, resolve_device

PARAM_RTOL = 1e-4
ACC_TOL = 0.01
FLOAT64_BACKENDS = ("reference", "cpu", "cuda")  # backends with float64 kernels for every op


def validation_dtype(*backends: str) -> torch.dtype:
    """float64 when every backend compared has float64 kernels, else float32 (module docstring)."""
    return torch.float64 if all(b in FLOAT64_BACKENDS for b in backends) else torch.float32


def _nan_max(values: Iterable[float]) -> float:
    """max that returns NaN if any value is NaN (Python's max may skip it), 0 for no values."""
    out = 0.0
    for v in values:
        if v != v:
            return float("nan")
        out = max(out, v)
    return out


@dataclass
class Validation:
    backend: str  # what was checked (label)
    rounds: List[Dict[str, float]] = field(default_factory=list)  # per round: step_* and traj_* divergences
    acc_diff: Dict[str, float] = field(default_factory=dict)  # final metric -> |ref - backend|
    param_rtol: float = PARAM_RTOL
    acc_tol: float = ACC_TOL
    reference: str = "reference"  # what it was checked against (label)
    dtype: str = "float32"  # precision both sides ran in
    parts: List[Validation] = field(default_factory=list)  # further checks of the same claim
    precision: str = "fp32"  # the run's precision; the comparison itself runs at fp32 (module docstring)

    @property
    def max_rel(self) -> float:
        return _nan_max(r["step_rel"] for r in self.rounds)

    @property
    def max_acc_diff(self) -> float:
        return _nan_max(self.acc_diff.values())

    @property
    def passed(self) -> bool:
        # "<=" is False for NaN: a run that blew up on one side fails
        return (
            all(r["step_rel"] <= self.param_rtol for r in self.rounds)
            and all(v <= self.acc_tol for v in self.acc_diff.values())
            and all(p.passed for p in self.parts)
        )

    def report(self, name: str = "") -> str:
        """The per-round table and a verdict line that names the run (``name``, e.g. the algorithm),
        so that the PASS/FAIL lines of several runs in a row say which run each belongs to."""
        lines = [part.report(name) for part in self.parts]
        lines += [
            f"validate: {self.reference} vs {self.backend} (same seeds and batches, {self.dtype})",
        ]
        if self.precision != "fp32":
            lines.append(
                f"  precision {self.precision} is not applied here: both sides run at fp32, as the optimizer "
                f"kernels and the client-batched gradients compute the same mathematics at every precision"
            )
        lines += [
            f"  {'round':>5}  {'one-round max |dx|':>18}  {'relative':>10}  "
            f"{'trajectory max |dx|':>19}  {'relative':>10}",
        ]
        for r in self.rounds:
            lines.append(
                f"  {r['round']:>5}  {r['step_max_abs']:>18.3e}  {r['step_rel']:>10.3e}  "
                f"{r['traj_max_abs']:>19.3e}  {r['traj_rel']:>10.3e}"
            )
        lines.append(
            f"  final accuracy differences, end-to-end run (|{self.reference} - {self.backend}|, percentage points):"
        )
        for k, v in self.acc_diff.items():
            lines.append(f"    {k:<32} {100 * v:.3f}")
        verdict = "PASS" if self.passed else "FAIL"
        named = f"{verdict} {name}" if name else verdict
        lines.append(
            f"  {named}: max one-round relative divergence {self.max_rel:.3e} (tolerance {self.param_rtol:.1e}), "
            f"max accuracy difference {100 * self.max_acc_diff:.3f} pp (tolerance {100 * self.acc_tol:.2f} pp)"
        )
        return "\n".join(lines)


def param_divergence(a: List[torch.Tensor], b: List[torch.Tensor]) -> Dict[str, float]:
    """Largest absolute parameter difference, and that divided by the largest |reference parameter|."""
    max_abs = _nan_max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True) if x.numel())
    scale = max((float(x.double().abs().max()) for x in a if x.numel()), default=0.0)
    return {"max_abs": max_abs, "rel": max_abs / scale if scale > 0 else max_abs}


def validate_backend(
    cfg: SimConfig,
    backend: str,
    param_rtol: float = PARAM_RTOL,
    acc_tol: float = ACC_TOL,
    on_round: Optional[Callable[[Dict[str, Any]], None]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Validation:
    """Run ``cfg`` on reference and on ``backend`` round by round; compare (see module docstring).

    ``dtype``: the precision of every run (None: ``validation_dtype`` of the backends compared).
    Every run is at ``fp32`` whatever ``cfg.precision`` says (module docstring).
    """
    asked, cfg = cfg.precision, cfg.replace(precision="fp32")
    checked = cfg.replace(backend=backend)
    dtype = dtype or validation_dtype("reference", resolve_backend(checked, resolve_device(cfg.device)))
    ref = Simulation(cfg.replace(backend="reference"), dtype=dtype)
    free = Simulation(checked, data=ref.data, dtype=dtype)
    synced = Simulation(checked, data=ref.data, dtype=dtype)
    out = Validation(backend=free.backend, param_rtol=param_rtol, acc_tol=acc_tol, dtype=_name(dtype), precision=asked)
    return _compare(cfg, ref, free, synced, out, on_round)


def validate_client_batched(
    cfg: SimConfig,
    param_rtol: float = PARAM_RTOL,
    acc_tol: float = ACC_TOL,
    on_round: Optional[Callable[[Dict[str, Any]], None]] = None,
    data: Optional[FederatedData] = None,
    model_fn: Optional[Callable[[], nn.Module]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Validation:
    """The client-batched run ``cfg`` against the same config trained one client after another.

    Both use ``cfg.backend`` (``auto`` resolves per path: the per-client op sequentially, the
    batched op in parallel); same tolerances, same one-round / end-to-end protocol as above.
    ``data`` / ``model_fn`` replace the config's data set / model, as for ``Simulation``;
    ``dtype``: the precision of every run (None: ``validation_dtype`` of both paths' backends).
    Every run is at ``fp32`` whatever ``cfg.precision`` says (module docstring).
    """
    if not cfg.batched:
        raise ValueError("validate_client_batched needs a client-batched config (client_batched != 1)")
    asked, cfg = cfg.precision, cfg.replace(precision="fp32")
    seq_cfg = cfg.replace(client_batched=1, replay=False)
    device = resolve_device(cfg.device)
    backends = (resolve_backend(seq_cfg, device), resolve_backend(cfg, device))
    if dtype is None and not all(b in FLOAT64_BACKENDS for b in backends):
        out = _paths_and_kernels(cfg, device, param_rtol, acc_tol, on_round, data, model_fn)
        out.precision = asked
        return out
    dtype = dtype or validation_dtype(*backends)
    ref = Simulation(seq_cfg, data=data, model_fn=model_fn, dtype=dtype)
    free = Simulation(cfg, data=ref.data, model_fn=model_fn, dtype=dtype)
    synced = Simulation(cfg, data=ref.data, model_fn=model_fn, dtype=dtype)
    b = free.batched
    assert b is not None  # cfg.batched, checked above
    chunks = f" (chunks of {b.size})" if b.size != b.at_once else ""
    out = Validation(
        backend=f"client-batched {b.at_once}{chunks} [{free.backend}]",
        reference=f"sequential [{ref.backend}]",
        param_rtol=param_rtol,
        acc_tol=acc_tol,
        dtype=_name(dtype),
        precision=asked,
    )
    return _compare(cfg, ref, free, synced, out, on_round)


def _paths_and_kernels(
    cfg: SimConfig,
    device: torch.device,
    param_rtol: float,
    acc_tol: float,
    on_round: Optional[Callable[[Dict[str, Any]], None]],
    data: Optional[FederatedData],
    model_fn: Optional[Callable[[], nn.Module]],
) -> Validation:
    """``validate_client_batched`` for a backend without float64 kernels (module docstring): the
    paths in float64 with a stand-in backend, then the kernels on the client-batched path in float32."""
    ops = [cfg.algo.op.name, cfg.algo.op.name + "_batched"]
    if all(_registry.unavailable_reason("cuda", device, op) is None for op in ops):
        paths_cfg = cfg.replace(backend="cuda")
    else:  # the reference's batched ops read step counters on the host: no CUDA graph there
        paths_cfg = cfg.replace(backend="reference", replay=False)
    paths = validate_client_batched(paths_cfg, param_rtol, acc_tol, on_round, data, model_fn, dtype=torch.float64)
    ref = Simulation(cfg.replace(backend="reference", replay=False), data=data, model_fn=model_fn, dtype=torch.float32)
    free = Simulation(cfg, data=ref.data, model_fn=model_fn, dtype=torch.float32)
    synced = Simulation(cfg, data=ref.data, model_fn=model_fn, dtype=torch.float32)
    b = free.batched
    assert b is not None  # cfg.batched: validate_client_batched's caller checked it
    out = Validation(
        backend=f"client-batched {b.at_once} [{free.backend}]",
        reference=f"client-batched {b.at_once} [{ref.backend}]",
        param_rtol=param_rtol,
        acc_tol=acc_tol,
        dtype="float32",
        parts=[paths],
    )
    return _compare(cfg, ref, free, synced, out, on_round)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _compare(
    cfg: SimConfig,
    ref: Simulation,
    free: Simulation,
    synced: Simulation,
    out: Validation,
    on_round: Optional[Callable[[Dict[str, Any]], None]],
) -> Validation:
    for t in range(cfg.rounds):
        if t > 0:
            synced.sync_from(ref)  # start the round from the reference's state
        for sim in (ref, free, synced):
            sim.run_round(t)
        step = param_divergence(ref.global_params, synced.global_params)
        traj = param_divergence(ref.global_params, free.global_params)
        rec = {
            "round": t + 1,
            "step_max_abs": step["max_abs"],
            "step_rel": step["rel"],
            "traj_max_abs": traj["max_abs"],
            "traj_rel": traj["rel"],
        }
        out.rounds.append(rec)
        if on_round is not None:
            on_round(rec)
    a, b = final_rows(ref.final_evaluation()), final_rows(free.final_evaluation())
    # a metric that is NaN on both sides (e.g. no new users) is not a difference
    out.acc_diff = {k: abs(a[k] - b[k]) for k in a if not k.endswith(" std") and not (a[k] != a[k] and b[k] != b[k])}
    return out
