"""The op-level harness of the GPU tests (tests/test_native_cuda.py), shared with a CPU test
(tests/test_gpu_harness.py) that builds and runs every op through it on the reference and cpu
backends: an op or hyperparameter this harness does not know fails on any machine, not first on a GPU.

``op_args`` builds an op's arguments for a layout of parameters (per-client shape, dtype, row group),
per-client or client-batched; ``HP`` holds one value for every hyperparameter column of every op
(``core/ops.py``); ``same_roles`` compares two runs' role tensors and counters.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from fedopt_kernels.core.ops import FRESH, OpSpec

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
Layout = Sequence[Tuple[Tuple[int, ...], torch.dtype, int]]

# a value for every hp column of every op; a column missing here fails hp_rows (and the CPU test)
HP: Dict[str, float] = {
    "lr": 0.1,
    "momentum": 0.9,
    "dampening": 0.1,
    "weight_decay": 0.01,
    "prox_mu": 0.2,
    "nesterov": 1.0,
    "maximize": 0.0,
    "max_norm": 1.0,
    "eps": 1e-6,
    "beta": 0.5,
    "rho": 0.3,
    "eta": 0.01,
    "adaptive": 1.0,  # ASAM's w = |x| + eta: the form that reads x in both passes
    "beta1": 0.5,  # the batched rows scale every column by up to 1.6: betas stay below 1
    "beta2": 0.6,
    "tau": 1e-3,
    "rule": 1.0,  # FedYogi: the sign(v - g^2) rule
    "bias_correction": 1.0,
    "mean_sq_norm": 50.0,
}

# optional roles every row group carries (PAdaMFed's D and acc; the server optimizers' moments);
# second moments are sums of squares: never negative
ALWAYS = {"D", "acc", "exp_avg", "exp_avg_sq"}
NON_NEGATIVE = {"exp_avg_sq"}

# per-client shapes: two chunks per client (16384 + 4619 elements; 21003 is odd, so every other
# client's slice is misaligned), 5 (misaligned), aligned ones, a one-element tensor, a zero-size one
MIXED: Layout = [
    ((3, 7001), F32, 0),
    ((5,), F32, 1),
    ((64, 3, 3, 3), BF16, 0),
    ((1,), F64, 2),
    ((0,), F32, 0),
    ((33, 2), F16, 1),
    ((17, 1025), F64, 0),
    ((2, 2), F32, 2),
]
# more stacked tensors (65 float32 ones) and row groups (20) than one kernel-argument table holds
MANY: Layout = [
    (((i * 37) % 300 + 1,) if i % 3 else (i % 5 + 1, 9), (F32, F32, BF16, F64)[i % 4], i % 20) for i in range(130)
]


def hp_rows(spec: OpSpec, groups: int) -> torch.Tensor:
    """``spec``'s hp rows on the host, float64 ``[row groups, len(spec.hps)]``: ``HP``'s values, column 0
    (every op's learning rate, or FedSAM's rho) 5% larger in each later row group."""
    missing = [h for h in spec.hps if h not in HP]
    if missing:
        raise KeyError(f"tests/op_harness.py HP has no value for op {spec.name!r}'s hyperparameters {missing}")
    hp = torch.tensor([[HP[h] for h in spec.hps] for _ in range(groups)], dtype=torch.float64)
    for b in range(groups):
        hp[b, 0] *= 1 + 0.05 * b
    return hp


def op_args(
    spec: OpSpec, layout: Layout, backend: str, device: str = "cuda", clients: int = 0, seed: int = 0
) -> List[Any]:
    """Arguments of op ``spec``: ``layout`` lists (per-client shape, dtype, row group) per parameter.
    Even row groups carry every optional role, odd ones only those of ``ALWAYS``. Batched
    (``clients`` > 0): every tensor gets a leading client dimension, hp rows differ per client, k
    is 0 for every third client (sgd's FRESH rule applies to it in row group 0) and every fourth client
    is inactive."""
    g = torch.Generator().manual_seed(seed)
    lead = (clients,) if clients else ()
    nb = 1 + max(b for _, _, b in layout)
    present = [
        (1 << len(spec.optional)) - 1
        if b % 2 == 0
        else sum(1 << i for i, r in enumerate(spec.optional) if r.name in ALWAYS)
        for b in range(nb)
    ]

    def rnd(shape, dt):
        return torch.randn(lead + tuple(shape), generator=g).to(dtype=dt, device=device)

    lists = [[rnd(s, dt) for s, dt, _ in layout], [rnd(s, dt) for s, dt, _ in layout]]
    for i, role in enumerate(spec.optional):
        ts = []
        for s, dt, b in layout:
            if present[b] >> i & 1:
                st = torch.float64 if dt == torch.float64 else torch.float32
                if role.per_row:
                    ts.append((0.5 + torch.rand(lead + tuple(s[:1]), generator=g)).to(dtype=st, device=device))
                else:
                    t = rnd(s, st if role.state_typed else dt)
                    ts.append(t.abs() if role.name in NON_NEGATIVE else t)
        lists.append(ts)
    hp = hp_rows(spec, nb)
    row_of = [b for _, _, b in layout]
    table = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64, device=device)
    gs = torch.full((1,), 4.0, device=device)
    fi = torch.zeros(1, device=device)
    if not clients:
        k = torch.zeros(1, dtype=torch.int32, device=device)
        return [*lists, row_of, present, hp.to(device), k, table, 1, gs, fi, backend]
    hp = torch.stack([hp * (1 + 0.1 * (c % 7)) for c in range(clients)], 1).contiguous().to(device)
    k = torch.tensor([0 if c % 3 == 0 else 1 + c % 2 for c in range(clients)], dtype=torch.int32, device=device)
    active = torch.tensor([c % 4 != 3 for c in range(clients)], device=device)
    if spec.base == "sgd":
        present = [m | FRESH if b == 0 else m for b, m in enumerate(present)]
    return [*lists, row_of, present, hp, k, table, 1, gs, fi, active, backend]


def tol(dtype: torch.dtype) -> float:
    """A fused kernel against the reference after a few steps: an ulp or two of the storage type
    (FMA contraction, summation order), as tests/harness.py's TOLERANCE."""
    return {torch.float64: 1e-10, torch.float32: 2e-5}.get(dtype, 3e-2)


def same_roles(spec: OpSpec, ref: Sequence[Any], got: Sequence[Any], exact: bool) -> None:
    """Every role tensor and k of two argument lists (on any devices) agree."""
    n = len(spec.roles)
    for r, (la, lb) in enumerate(zip(ref[:n], got[:n], strict=True)):
        assert len(la) == len(lb)
        for i, (a, b) in enumerate(zip(la, lb, strict=True)):
            a, b = a.cpu(), b.cpu()
            if exact:
                assert torch.equal(a, b), f"{spec.roles[r].name}[{i}] differs"
            else:
                t = tol(a.dtype)
                name = f"{spec.roles[r].name}[{i}]"

                def msg(m: str, name: str = name) -> str:
                    return f"{name}: {m}"

                torch.testing.assert_close(b.double(), a.double(), rtol=t, atol=t, msg=msg)
    assert torch.equal(ref[n + 3].cpu(), got[n + 3].cpu()), "k differs"
