"""The formulation search changes speed only: every formulation computes under the same backend flags.

Under ``fp32`` every matmul, convolution and recurrent kernel of every formulation runs with the
backend switches ``backend_flags`` names (IEEE float32; on CUDA cuDNN's TF32 off, which torch's
default leaves on); under ``tf32`` all of them alike; under ``bf16`` none in float16. On this CPU
the switches are oneDNN's (on CUDA cuBLAS's and cuDNN's, which the same scope sets: see
test_precision.py). What each kernel ran under is read at the kernel (a dispatch mode), for every
formulation of every client layer, and a run records the flags it set whichever formulations it
chose. ``nn.LSTM`` under a bfloat16 autocast runs through ``models/lstm_call.py``: on a device
whose autocast would cast it to float16, with autocast off and bfloat16 inputs (exercised here by
naming the CPU such a device).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import pytest
import torch
from test_sim_resume import make, tiny_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fedopt_kernels.sim.batched import choose, layers, timing
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.precision import (
    PRECISIONS,
    UnsupportedPrecision,
    backend_flags,
    check_supported,
    flags_now,
)
from fedopt_kernels.sim.models import lstm_call
from fedopt_kernels.sim.models.build import build_model

KERNELS = ("mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward")
RNN = ("lstm", "rnn")  # any aten op of a recurrent layer (mkldnn_rnn_layer, _cudnn_rnn, ...)

pytestmark = pytest.mark.usefixtures("one_thread")


class _Flags(TorchDispatchMode):
    """Per kernel that runs (forward and backward): the backend switches then, and its operands' dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.states: Set[Tuple[Tuple[str, str], ...]] = set()
        self.dtypes: Set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in KERNELS or any(r in name for r in RNN):
            self.states.add(tuple(sorted(flags_now("cpu").items())))
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _case(name: str):
    shape, classes = ((1, 8, 8), 10) if name == "cnn" else ((12,), 20)
    torch.manual_seed(0)
    model = (
        build_model(name, shape, classes, hidden=8) if name.startswith("char") else build_model(name, shape, classes)
    )
    C, B = 2, 3
    g = torch.Generator().manual_seed(1)
    params = [p.detach().unsqueeze(0).repeat(C, *([1] * p.dim())) for p in model.parameters()]
    if len(shape) == 1:
        x = torch.randint(0, classes, (C, B, *shape), generator=g)
    else:
        x = torch.randn(C, B, *shape, generator=g)
    return model, params, x, torch.randint(0, classes, (C, B), generator=g), torch.full((C, B), 1.0 / B)


# every formulation of every layer kind once (a layer's kernels do not depend on its neighbours')
ASSIGNMENTS = [("cnn", {"Conv2d": c, "Linear": "bmm"}) for c in layers.FORMULATIONS["Conv2d"]]
ASSIGNMENTS += [("cnn", {"Linear": "loop"})] + [("char-lstm", {"LSTM": f}) for f in layers.FORMULATIONS["LSTM"]]


def flags_by_formulation(precision: str) -> Dict[str, Tuple[Set[tuple], Set[torch.dtype]]]:
    """For every assignment of formulations: the flag states and the dtypes its kernels ran with."""
    out: Dict[str, Tuple[Set[tuple], Set[torch.dtype]]] = {}
    for name, forms in ASSIGNMENTS:
        model, params, x, y, w = _case(name)
        if name == "char-lstm" and forms["LSTM"] == "loop":
            try:  # bf16 on a CPU without oneDNN's bfloat16 LSTM: torch has no kernel, nothing to check
                check_supported(model, precision, "cpu")
            except UnsupportedPrecision:
                continue
        engine = LayersLoss(model, formulations=forms, precision=precision)
        with _Flags() as seen:
            engine.grads(params, x, y, w)
        out[f"{name} {forms}"] = (seen.states, seen.dtypes)
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_formulation_runs_under_the_precisions_flags(precision):
    got = flags_by_formulation(precision)
    want = {tuple(sorted(backend_flags(precision, "cpu").items()))}
    assert all(states == want for states, _ in got.values()), {k: s for k, (s, _) in got.items() if s != want}
    assert all(torch.float16 not in dtypes for _, dtypes in got.values())  # bf16 is never fp16
    if precision == "bf16":
        assert all(torch.bfloat16 in dtypes for _, dtypes in got.values())


def test_the_flags_check_can_fail(monkeypatch):
    """A formulation that turned oneDNN's convolutions to TF32 inside itself would be seen at its kernels."""
    real = layers.im2col_conv2d
    conv: Any = torch.backends.mkldnn.conv

    def tf32_inside(*args, **kwargs):
        saved = conv.fp32_precision
        conv.fp32_precision = "tf32"
        try:
            return real(*args, **kwargs)
        finally:
            conv.fp32_precision = saved

    monkeypatch.setattr(layers, "im2col_conv2d", tf32_inside)
    got = flags_by_formulation("fp32")
    im2col = [states for key, (states, _) in got.items() if "im2col" in key]
    assert im2col and all(len(states) == 2 for states in im2col)


def test_a_run_records_the_same_flags_whichever_formulations_it_chose(monkeypatch):
    """fp32 client-batched runs, the defaults and a measured choice that differs from them: the same
    switches recorded, those fp32 sets (IEEE everywhere)."""
    monkeypatch.setattr(choose, "_PROCESS", {})

    def measure(self, trial):  # loop wins every layer it can run
        if trial[0] == "alone":
            return 0.1 if trial[2] == "loop" else 1.0
        return sum(0.1 if f == "loop" else 1.0 for f in self.assignments[trial[1]].values())

    monkeypatch.setattr(timing.Timer, "measure", measure)
    runs = {}
    for mode in ("default", "measure"):
        runs[mode] = make(tiny_config("fedavg", client_batched=3, formulations=mode, rounds=1)).run()["client_batched"]
    assert runs["default"]["formulations"] != runs["measure"]["formulations"]
    assert runs["default"]["precision_flags"] == runs["measure"]["precision_flags"] == backend_flags("fp32", "cpu")


# ------------------------------------------------------------------ nn.LSTM under a bf16 autocast
def _lstm_entry(monkeypatch, half_devices: Tuple[str, ...]) -> List[Tuple[bool, torch.dtype]]:
    """(autocast on?, input dtype) at each ``nn.LSTM`` call of the char-LSTM's bf16 forward and backward,
    the CPU taken to be a device of ``half_devices``."""
    monkeypatch.setattr(lstm_call, "HALF_RNN_AUTOCAST", half_devices)
    seen: List[Tuple[bool, torch.dtype]] = []
    real = nn.LSTM.forward

    def spy(self, x, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(nn.LSTM, "forward", spy)
    model, params, x, y, w = _case("char-lstm")
    engine = LayersLoss(model, formulations={"LSTM": "loop"}, precision="bf16")
    try:
        grads, _ = engine.grads(params, x, y, w)
    except RuntimeError as exc:  # no bfloat16 LSTM kernel on this CPU
        pytest.skip(f"torch's CPU bfloat16 LSTM is not available here: {str(exc).splitlines()[0][:120]}")
    assert {g.dtype for g in grads} == {torch.float32}
    return seen


def test_an_lstm_under_a_bf16_autocast_that_would_take_fp16_runs_in_bf16(monkeypatch):
    entries = _lstm_entry(monkeypatch, ("cpu",))
    assert entries and all(state == (False, torch.bfloat16) for state in entries)


def test_the_lstm_check_can_fail(monkeypatch):
    """Elsewhere the LSTM is called plainly: autocast on, a float32 input (autocast casts it)."""
    entries = _lstm_entry(monkeypatch, ())
    assert entries and all(state == (True, torch.float32) for state in entries)


def test_the_sequential_char_lstm_takes_the_same_path(monkeypatch):
    monkeypatch.setattr(lstm_call, "HALF_RNN_AUTOCAST", ("cpu",))
    model = build_model("char-lstm", (12,), 20, hidden=8)
    seen: List[Optional[torch.dtype]] = []
    real = nn.LSTM.forward
    monkeypatch.setattr(nn.LSTM, "forward", lambda self, x, *a, **k: seen.append(x.dtype) or real(self, x, *a, **k))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            out = model(torch.randint(0, 20, (3, 12)))
        except RuntimeError as exc:
            pytest.skip(f"torch's CPU bfloat16 LSTM is not available here: {str(exc).splitlines()[0][:120]}")
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16


def test_fednlr_calibration_runs_in_ieee_float32_whatever_the_callers_switches():
    """FedNLR's scales come from a forward pass outside the round's precision scope: it sets IEEE
    float32 itself (a caller at TF32 or oneDNN's bf16 included), and gives the switches back."""
    import fedopt_kernels as fk

    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    seen: List[Dict[str, str]] = []
    net[0].register_forward_pre_hook(lambda *_: seen.append(flags_now("cpu")))
    switch: Any = torch.backends.mkldnn.matmul
    before = switch.fp32_precision
    switch.fp32_precision = "bf16"  # what a caller might have left
    try:
        fk.neuron_lr_scales(net, [torch.randn(4, 6), torch.randn(3, 6)], max_batches=1)
        assert switch.fp32_precision == "bf16"  # given back
    finally:
        switch.fp32_precision = before
    assert seen and all(set(flags.values()) == {"ieee"} for flags in seen), seen
