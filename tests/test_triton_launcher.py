"""The Triton backend's multi-tensor launcher: plan cache, launches per dtype, staging, the
compiled kernels' 1-D path (run under the interpreter), bitwise determinism, speed, bad input.

Numerical agreement with ``reference`` over the full option matrix is test_equivalence.py's job;
here each check compares against ``reference`` only where a launcher code path needs it.
Runs on CUDA tensors with a GPU, else on CPU tensors under TRITON_INTERPRET=1 (conftest.py).
"""
from __future__ import annotations

import time
from typing import Callable, List

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels import _registry

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_WHY = _registry.unavailable_reason("triton", DEVICE)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

if _WHY is None:
    import triton.language as tl

    from fedopt_kernels.triton_kernels import launcher, tiles

INTERPRETED = _WHY is None and launcher.interpreted()
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="monkeypatches the interpreter's tile choice")

TOL = {torch.float32: (2e-5, 2e-6), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture(autouse=True)
def _fresh_cache():
    launcher.clear_cache()
    launcher.stats.update(builds=0, hits=0)
    yield
    launcher.clear_cache()


def _params(shapes, dtype=torch.float32, seed=0) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(DEVICE)) for s in shapes]


def _grads(params, seed) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype).to(DEVICE) for p in params]


def _copy(params) -> List[torch.nn.Parameter]:
    out = []
    for p in params:
        if p.is_contiguous() and p.data_ptr() % 16:  # keep a misaligned view misaligned
            skip = (p.data_ptr() % 16) // p.element_size()
            q = torch.empty(p.numel() + skip, dtype=p.dtype, device=p.device)[skip:].view(p.shape)
        else:
            q = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
        q.copy_(p.detach())
        out.append(torch.nn.Parameter(q))
    return out


# one builder per op, with the options that give every role of its kernels
def _sgd(ps, backend):
    scales = {p: torch.linspace(0.5, 1.5, p.shape[0], device=DEVICE) for p in ps if p.dim() >= 1}
    return fk.NeuronLRSGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, prox_mu=0.1,
                          neuron_scales=scales, backend=backend)


def _fednar(ps, backend):
    return fk.FedNAR(ps, lr=0.1, weight_decay=0.05, max_norm=0.5, prox_mu=0.2, backend=backend)


def _padamfed(ps, backend):
    return fk.PAdaMFed(ps, lr=0.05, beta=0.4, variance_reduction=True, backend=backend)


BUILDERS = {"sgd": _sgd, "fednar": _fednar, "padamfed": _padamfed}


def _run(build: Callable, params, backend: str, steps: int = 3) -> List[torch.Tensor]:
    ps = _copy(params)
    opt = build(ps, backend)
    kw = {}
    if isinstance(opt, (fk.FedDecaySGD, fk.NeuronLRSGD, fk.FedNAR)):
        kw["correction"] = [0.1 * g for g in _grads(ps, 99)]
    opt.start_round(**kw)
    for s in range(steps):
        for p, g in zip(ps, _grads(ps, s)):
            p.grad = g
        step_kw = {"anchor_grads": _grads(ps, 50 + s)} if isinstance(opt, fk.PAdaMFed) else {}
        opt.step(**step_kw)
    state = [t for p in ps for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in ps] + [t.clone() for t in state]


def _assert_close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True)


def _last_plan():
    return next(reversed(launcher._CACHE.values()))


# ---------------------------------------------------------------- plan cache
def test_plan_is_reused_while_the_tensor_set_is_unchanged_and_rebuilt_when_it_changes():
    ps = _params([(5, 3), (7,), (130,)])
    opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, momentum=0.9, backend="triton")
    grads = _grads(ps, 0)
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()  # builds: momentum buffers are new
    opt.step()  # momentum buffers exist now, with new addresses -> one more build
    builds = launcher.stats["builds"]
    plan = opt._plan.cache["plan"]
    for _ in range(3):
        for g, new in zip(grads, _grads(ps, 1)):
            g.copy_(new)  # same tensors, new values: no rebuild
        opt.step()
    # the optimizer's cache hands the same launcher plan back without re-keying every tensor
    assert launcher.stats["builds"] == builds and opt._plan.cache["plan"] is plan

    old = ps[1].grad
    ps[1].grad = old.clone()  # a new gradient tensor (old kept alive: the address differs)
    opt.step()
    assert launcher.stats["builds"] == builds + 1
    opt.step()
    assert launcher.stats["builds"] == builds + 1

    with torch.no_grad():
        ps[2].data = torch.zeros(64, device=DEVICE)  # new shape
    ps[2].grad = torch.ones(64, device=DEVICE)
    opt.start_round()
    opt.step()
    assert launcher.stats["builds"] >= builds + 2


def test_one_launch_per_dtype_signature_and_zero_size_tensors_skipped():
    ps = _params([(4, 3), (9,)]) + _params([(6,)], torch.bfloat16) + _params([(0,), (3, 0)]) + \
        _params([(5,)], torch.float16)
    opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, backend="triton")
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    opt.step()
    plan = _last_plan()
    assert len(plan.launches) == 3  # fp32, bf16, fp16; the zero-size tensors are in none
    assert sorted(lau.meta.shape[0] for lau in plan.launches) == [1, 1, 2]

    only_empty = _params([(0,), (0, 4)])
    opt = fk.FedNAR(only_empty, lr=0.1, weight_decay=0.1, backend="triton")
    for p in only_empty:
        p.grad = torch.zeros_like(p)
    opt.step()  # nothing to do, nothing launched, no error
    assert _last_plan().launches == []


def test_noncontiguous_and_misaligned_tensors_are_staged_and_correct():
    base = torch.randn(12, 10, device=DEVICE)
    flat = torch.randn(101, device=DEVICE)
    params = [torch.nn.Parameter(base.t()),           # transposed
              torch.nn.Parameter(base[:, ::2]),        # strided
              torch.nn.Parameter(flat[1:]),            # contiguous but 4 bytes off 16-byte alignment
              torch.nn.Parameter(torch.randn(33, device=DEVICE))]
    assert params[2].data_ptr() % 16 != 0
    for name, build in BUILDERS.items():
        want = _run(build, params, "reference")
        got = _run(build, params, "triton")
        _assert_close(got, want, torch.float32)
        staged = {(role, i) for _, role, i, _, _ in _last_plan().staged}
        assert {("x", 0), ("x", 1), ("x", 2)} <= staged, (name, staged)
        assert ("x", 3) not in staged


# ---------------------------------------------------------------- the compiled kernels' 1-D path
@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_one_chunk_per_program_path_matches_reference(op, dtype, monkeypatch):
    """ROWS == 1 is what runs on a GPU: full chunks take the unmasked branch, tails the masked
    one, norm programs loop over several chunks (few norm programs)."""
    monkeypatch.setattr(launcher, "FORCE_TILE", (1, 64))
    monkeypatch.setattr(launcher, "MAX_NORM_PROGRAMS", 3)
    params = _params([(64,), (65,), (1,), (0,), (5, 13), (130,), (3, 70)], dtype)
    want = _run(BUILDERS[op], params, "reference")
    got = _run(BUILDERS[op], params, "triton")
    _assert_close(got, want, dtype)
    assert all(lau.rows == 1 and lau.block == 64 for lau in _last_plan().launches)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_only_branches_match_reference(dtype, monkeypatch):
    """The compiled kernels' 32-bit per-neuron row arithmetic, run under the interpreter."""
    monkeypatch.setattr(launcher, "FORCE_TILE", (1, 32))
    monkeypatch.setattr(tiles, "INTERPRETED", tl.constexpr(False))
    params = _params([(7, 9), (40, 3), (33,), (2, 2, 17)], dtype)
    want = _run(_sgd, params, "reference", steps=2)
    got = _run(_sgd, params, "triton", steps=2)
    _assert_close(got, want, dtype)


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_bitwise_deterministic_across_runs_and_plan_rebuilds(op, monkeypatch):
    if INTERPRETED:  # several norm programs and slots, so the fixed-order reduction is exercised
        monkeypatch.setattr(launcher, "FORCE_TILE", (2, 64))
        monkeypatch.setattr(launcher, "MAX_NORM_PROGRAMS", 4)
    params = _params([(300,), (17, 5), (1,), (129,), (64, 8)], torch.float32, seed=3) + \
        _params([(200,)], torch.bfloat16, seed=4)
    first = _run(BUILDERS[op], params, "triton")
    launcher.clear_cache()
    second = _run(BUILDERS[op], params, "triton")
    for a, b in zip(first, second):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- speed of the interpreter path
@interpreter_only
def test_step_over_250_small_tensors_is_fast_under_the_interpreter():
    ps = _params([(1 + (i * 37) % 61, 1 + i % 7) for i in range(250)])
    opts = [fk.FedDecaySGD(ps, lr=0.1, beta=0.5, momentum=0.9, backend="triton"),
            fk.FedNAR(ps, lr=0.1, weight_decay=0.01, backend="triton"),
            fk.PAdaMFed(ps, lr=0.1, beta=0.5, backend="triton")]
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    for opt in opts:
        opt.step()
        opt.step()  # plans built
        t0 = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - t0
        assert elapsed < 1.0, f"{type(opt).__name__}: {elapsed:.3f} s for one step over 250 tensors"


# ---------------------------------------------------------------- bad input and availability
def test_float64_is_refused_with_a_message_naming_dtype_and_backend():
    ps = _params([(3,)], torch.float64)
    ps[0].grad = torch.ones_like(ps[0])
    opt = fk.FedDecaySGD(ps, lr=0.1, beta=0.5, backend="triton")
    with pytest.raises(TypeError) as info:
        opt.step()
    assert "torch.float64" in str(info.value) and "'triton'" in str(info.value)


def test_device_check_explains_interpreter_and_cuda():
    check = _registry._DEVICE_OK["triton"]
    if INTERPRETED:
        assert check(torch.device("cpu")) is None
        assert "TRITON_INTERPRET" in check(torch.device("cuda"))
    else:
        assert check(torch.device("cuda")) is None
        assert "TRITON_INTERPRET" in check(torch.device("cpu"))
    assert "not supported" in check(torch.device("meta"))


def test_kernels_load_from_a_source_checkout_without_the_installed_mapping(tmp_path):
    """backends/triton.py falls back to loading the top-level triton_kernels/ folder."""
    import subprocess
    import sys
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'fedopt_kernels.triton_kernels':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fedopt_kernels.backends.triton as b\n"
        "import fedopt_kernels.triton_kernels as k\n"
        "print(k.__file__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("triton_kernels/__init__.py")
