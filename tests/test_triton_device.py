"""The triton backend launches on the tensors' device, not on whichever CUDA device is current.

Triton launches on the current device (and its current stream). The backend enters
``launcher.device_guard(tensors' device)`` around a step's plan building and launches, for every
per-client and client-batched op. Checked here:

* on any machine (CPU tensors under TRITON_INTERPRET=1): every kernel launch of every op happens
  inside the guard, entered with the tensors' device;
* the guard's choice, with ``torch.cuda`` stubbed: a switch only when the index differs;
* with two GPUs: parameters on ``cuda:1`` while ``cuda:0`` is current match ``reference`` on
  ``cuda:1``, and ``cuda:0`` is current again afterwards.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fedopt_kernels.core import registry as _registry
from fedopt_kernels.fl import catalogue

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_WHY = _registry.unavailable_reason("triton", DEVICE)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

if _WHY is None:
    from fedopt_kernels.core.backends import triton as backend
    from fedopt_kernels.triton_kernels import launcher
    from fedopt_kernels.triton_kernels import sgd as triton_sgd

SHAPES = [(5, 3), (7,), (2, 2, 3)]
# every algorithm's option set that uses every role of its op
OPTIONS = {name: a.full for name, a in catalogue.ALGOS.items()}
C = 3


def _params(device, stacked: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lead = (C,) if stacked else ()
    return [torch.nn.Parameter(torch.randn(lead + s, generator=g).to(device)) for s in SHAPES]


def _step_once(algo: str, device, stacked: bool, backend: str = "triton"):
    """One round of one seeded step of ``algo`` on fresh parameters; returns them."""
    cfg = catalogue.config(algo, OPTIONS[algo])
    params = _params(device, stacked)
    if not stacked:
        catalogue.run(cfg, params, backend, rounds=1, steps=1)
        return params
    opt = cfg.build_batched(params, backend)
    ordered = [p for grp in opt.param_groups for p in grp["params"]]
    views = [[p[c] for p in ordered] for c in range(C)]
    opt.start_round(**cfg.batched_round_inputs(views, ordered, 0))
    for p, g in zip(params, catalogue.rand_like_list(params, seed=7, scale=1.0)):
        p.grad = g
    opt.step(**cfg.batched_step_inputs(views, 0))
    return params


@pytest.mark.skipif(DEVICE.type != "cpu", reason="records the guard on CPU tensors under the interpreter")
@pytest.mark.parametrize("stacked", [False, True], ids=["per_client", "batched"])
@pytest.mark.parametrize("algo", list(OPTIONS))
def test_every_launch_happens_inside_the_tensors_device_guard(algo, stacked, monkeypatch):
    entered, inside, at_launch = [], [], []

    @contextlib.contextmanager
    def guard(device):
        entered.append(device)
        inside.append(device)
        try:
            yield
        finally:
            inside.pop()

    def recording(fn):
        def call(*args, **kwargs):
            at_launch.append(inside[-1] if inside else None)
            return fn(*args, **kwargs)

        return call

    # raising=False: without a guard in the launcher the fake is never called and the asserts say so
    monkeypatch.setattr(launcher, "device_guard", guard, raising=False)
    for mod, name in ((triton_sgd, "launch"), (backend._two_pass, "launch"), (backend._two_pass, "advance")):
        monkeypatch.setattr(mod, name, recording(getattr(mod, name)))
    _step_once(algo, DEVICE, stacked)
    assert entered and all(d == DEVICE for d in entered), f"guard entered with {entered}, tensors on {DEVICE}"
    assert at_launch and all(d == DEVICE for d in at_launch), f"launches outside the guard: {at_launch}"


def test_the_guard_switches_only_to_another_index(monkeypatch):
    switched = []

    class FakeDevice:
        def __init__(self, index):
            switched.append(index)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    with launcher.device_guard(torch.device("cuda", 1)):
        pass
    assert switched == [1]
    for same in (torch.device("cuda", 0), torch.device("cpu")):
        assert isinstance(launcher.device_guard(same), contextlib.nullcontext)
    assert switched == [1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("stacked", [False, True], ids=["per_client", "batched"])
@pytest.mark.parametrize("algo", list(OPTIONS))
def test_parameters_on_the_second_gpu_while_the_first_is_current(algo, stacked):
    with torch.cuda.device(0):
        got = _step_once(algo, "cuda:1", stacked)
        assert torch.cuda.current_device() == 0
    want = _step_once(algo, "cuda:1", stacked, backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=2e-5, atol=2e-6)
