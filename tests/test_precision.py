"""The run's precision (``fedopt_kernels/sim/batched/precision.py``): fp32, tf32, bf16.

What is checked, and against what:

* the scopes: TF32 switches on inside ``precision_scope("tf32", cuda)`` and exactly as before after it
  (an exception included); autocast only inside ``autocast_scope("bf16", ...)``;
* every matmul and convolution of the client-batched engines, forward and backward, takes bfloat16
  operands under bf16 (float32 under fp32), and the gradients handed to the optimizer are float32;
* the engines under bf16 equal per-client autograd under the same autocast. Both round the same
  tensors to bfloat16 at the same points (the inputs and outputs of every matmul and convolution)
  and accumulate in float32 in other orders, so they differ by roundings only. The tolerance comes
  from the computation: ``R - X``, the per-client path's own bf16 error against the exact (float64)
  gradient, measured on the same case. If the engine is as accurate as the per-client path
  (``|E - X| <= |R - X|``, the claim), the triangle inequality gives ``|E - R| <= 2 |R - X|`` (L2
  over every client and parameter). The nets are smooth (Tanh, average pooling): at bfloat16's
  8-bit resolution a ReLU at exactly zero or a max-pooling tie is common, and when the two
  roundings decide it differently a whole row of a gradient moves by order one, which no rounding
  tolerance covers. The simulator's models are checked end to end instead (accuracy, slow tier);
* a bf16 run's final accuracy on the built-in digits against fp32's, within three standard errors
  of a difference of two accuracies on the n pooled test samples, ``3 sqrt(2 p (1 - p) / n)``: a bf16
  run that trains as well as fp32 lands there, one that does not train lands near chance;
* tf32 on a CPU computes fp32, bit for bit; validation runs at fp32 and says so.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any, Dict

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fedopt_kernels.fl.checkpoint import CheckpointError
from fedopt_kernels.sim.batched import layers
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.loss import VmapLoss, client_loss
from fedopt_kernels.sim.batched.precision import (
    PRECISIONS,
    UnsupportedPrecision,
    autocast_inputs,
    autocast_scope,
    backend_flags,
    check_precision,
    check_supported,
    flags_now,
    precision_scope,
    tf32_enabled,
)
from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.clients import ClientData
from fedopt_kernels.sim.federated_data import FederatedData
from fedopt_kernels.sim.models.build import build_model
from fedopt_kernels.sim.models.small import SmallCNN
from fedopt_kernels.sim.simulation import Simulation
from fedopt_kernels.sim.validate import validate_client_batched

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CUDNN: Any = torch.backends.cudnn  # Any: torch's type stubs lack the fp32_precision settings
SWITCHES = (torch.backends.cuda.matmul, CUDNN.conv, CUDNN.rnn)


@pytest.fixture
def switches():
    """The TF32 switches as they were, put back after the test whatever it did."""
    saved = [s.fp32_precision for s in SWITCHES]
    yield saved
    for s, v in zip(SWITCHES, saved):
        s.fp32_precision = v


# ------------------------------------------------------------------ the scopes
def test_a_precision_other_than_the_three_is_refused_by_name():
    assert PRECISIONS == ("fp32", "tf32", "bf16")
    for bad in ("fp16", "BF16", None, 16):
        with pytest.raises(ValueError, match="precision must be one of"):
            check_precision(bad)
        with pytest.raises(ValueError, match="precision"):
            SimConfig(precision=bad).validate()
        with pytest.raises(ValueError, match="precision"):
            client_loss(SmallCNN((1, 8, 8), 4), precision=bad)


def test_tf32_switches_are_on_inside_the_scope_and_restored_after(switches):
    with precision_scope("tf32", "cuda"):
        assert [s.fp32_precision for s in SWITCHES] == ["tf32"] * 3
        assert tf32_enabled() == {"matmul": True, "conv": True}
    assert [s.fp32_precision for s in SWITCHES] == switches
    assert torch.backends.cuda.matmul.allow_tf32 in (True, False)  # torch's own flag reads again
    with pytest.raises(KeyError):
        with precision_scope("tf32", torch.device("cuda")):
            raise KeyError("inside")
    assert [s.fp32_precision for s in SWITCHES] == switches


def test_a_scope_restores_what_the_user_had_set(switches):
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the user's own choice before the run
    CUDNN.conv.fp32_precision = "ieee"
    before = [s.fp32_precision for s in SWITCHES]
    with precision_scope("tf32", "cuda"), precision_scope("tf32", "cuda"):  # nested: the inner restores to "on"
        pass
    assert [s.fp32_precision for s in SWITCHES] == before


@pytest.mark.parametrize(
    "precision,device", [("tf32", "cpu"), ("fp32", "cpu"), ("bf16", "cpu"), ("fp32", "cuda"), ("bf16", "cuda")]
)
def test_every_other_precision_computes_ieee_float32(switches, precision, device):
    """fp32 is IEEE float32 in every kernel (cuDNN's TF32 off, which torch's default leaves on); bf16's
    float32 ops too; a CPU has no TF32, so tf32 there is fp32. Restored afterwards."""
    with precision_scope(precision, device):
        assert flags_now(device) == backend_flags(precision, device) and set(flags_now(device).values()) == {"ieee"}
        if device == "cuda":  # torch's own default has cuDNN's in TF32: the scope turned it off
            assert CUDNN.conv.fp32_precision == CUDNN.rnn.fp32_precision == "ieee"
            assert tf32_enabled() == {"matmul": False, "conv": False}  # torch's legacy getters read them too
    assert [s.fp32_precision for s in SWITCHES] == switches


def test_a_switch_left_to_inherit_counts_as_its_parents_value(switches):
    """A switch at "none" computes as its parent (oneDNN's own switch, then the global one): a scope
    sets what does not already compute as asked, overriding a parent set to TF32, and puts back what
    it computed in (torch reads a "none" switch as its parent's value, so that is what comes back)."""
    mkldnn: Any = torch.backends.mkldnn
    saved = (mkldnn.fp32_precision, mkldnn.conv.fp32_precision)
    try:
        mkldnn.conv.fp32_precision = "none"
        mkldnn.fp32_precision = "tf32"  # a user's choice for every oneDNN kernel
        assert flags_now("cpu")["mkldnn.conv"] == "tf32"
        with precision_scope("fp32", "cpu"):
            assert flags_now("cpu")["mkldnn.conv"] == "ieee" and mkldnn.conv.fp32_precision == "ieee"
        assert flags_now("cpu")["mkldnn.conv"] == "tf32"
    finally:
        mkldnn.fp32_precision, mkldnn.conv.fp32_precision = saved


@pytest.mark.parametrize("precision", PRECISIONS)
def test_autocast_only_for_bf16_and_only_inside(precision):
    with autocast_scope(precision, "cpu"):
        on = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu")
    assert on == (precision == "bf16") and (not on or dtype == torch.bfloat16)
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_inputs_cast_float32_only_under_autocast():
    f32, f64 = torch.ones(2), torch.ones(2, dtype=torch.float64)
    assert [t.dtype for t in autocast_inputs(f32, f64)] == [torch.float32, torch.float64]
    with autocast_scope("bf16", "cpu"):
        a, b, c = autocast_inputs(f32, f64, None)
    assert (a.dtype, b.dtype, c) == (torch.bfloat16, torch.float64, None)  # float64 is never autocast


def test_check_supported_names_the_precision_when_a_layer_has_no_kernel(monkeypatch):
    lstm = build_model("char-lstm", (12,), 20, hidden=8)
    for precision in ("fp32", "tf32"):
        check_supported(lstm, precision, "cpu")  # nothing is tried
    check_supported(SmallCNN((1, 8, 8), 4), "bf16", "cpu")  # no recurrent layer: nothing to try

    def refuse(self, *args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")

    monkeypatch.setattr(nn.LSTM, "forward", refuse)
    with pytest.raises(UnsupportedPrecision, match=r"precision='bf16' cannot run lstm \(LSTM\) on this CPU.*fp32"):
        check_supported(lstm, "bf16", "cpu")
    check_supported(lstm, "bf16", "cuda")  # only a CPU kernel is tried (on CUDA, models/lstm_call.py runs it in bf16)


# ------------------------------------------------------------------ dtypes in the engines
MATMULS = ("mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward")


class _Dtypes(TorchDispatchMode):
    """The operand dtypes of every matmul and convolution that runs (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.append((str(func), {a.dtype for a in args if isinstance(a, torch.Tensor)}))
        return func(*args, **(kwargs or {}))


def _clients(model, C, B, shape, classes, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    params = [
        (p.detach().double().unsqueeze(0) + 0.1 * torch.randn(C, *p.shape, generator=g, dtype=torch.float64)).to(
            device, dtype
        )
        for p in model.parameters()
    ]
    if len(shape) == 1:
        x = torch.randint(0, classes, (C, B, *shape), generator=g).to(device)
    else:
        x = torch.randn(C, B, *shape, generator=g, dtype=torch.float64).to(device, dtype)
    y = torch.randint(0, classes, (C, B), generator=g).to(device)
    w = torch.rand(C, B, generator=g, dtype=torch.float64).to(device, dtype)
    return params, x, y, w


# (model, input shape, classes, engine: ("layers", formulations) or ("vmap", None))
DTYPE_CASES = (
    [
        ("cnn", (1, 8, 8), 10, "layers", {"Conv2d": c, "Linear": lin})
        for c in layers.FORMULATIONS["Conv2d"]
        for lin in layers.FORMULATIONS["Linear"]
    ]
    + [
        ("cnn", (1, 8, 8), 10, "vmap", None),
        ("mlp", (1, 6, 6), 5, "layers", None),
        ("char-gru", (12,), 20, "layers", None),
    ]
    + [  # "loop" is torch's own LSTM kernel (check_supported)
        ("char-lstm", (12,), 20, "layers", {"LSTM": f}) for f in layers.FORMULATIONS["LSTM"] if f != "loop"
    ]
)


def _engine(model, kind, forms, precision):
    if kind == "vmap":
        return VmapLoss(model, precision=precision)
    return LayersLoss(model, formulations=forms, precision=precision)


def _seen_dtypes(name, shape, classes, kind, forms, precision, device="cpu"):
    model = build_model(name, shape, classes, **({"hidden": 8} if name.startswith("char") else {})).to(device)
    params, x, y, w = _clients(model, 2, 3, shape, classes, device=device)
    engine = _engine(model, kind, forms, precision)
    with _Dtypes() as rec:
        grads, loss = engine.grads(params, x, y, w)
    return rec.seen, grads, loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name,shape,classes,kind,forms", DTYPE_CASES, ids=lambda v: "-".join(v.values()) if isinstance(v, dict) else None
)
def test_bf16_matmuls_and_convolutions_take_bfloat16_and_gradients_stay_float32(
    device, name, shape, classes, kind, forms
):
    seen, grads, loss = _seen_dtypes(name, shape, classes, kind, forms, "bf16", device)
    assert seen and all(dtypes == {torch.bfloat16} for _, dtypes in seen), seen
    assert any("backward" in op or op.startswith("aten.bmm") for op, _ in seen)  # the backward ran in bf16 too
    assert {g.dtype for g in grads} == {torch.float32} and loss.dtype == torch.float32


def test_the_dtype_check_can_fail():
    """Not vacuous: the same engine at fp32 runs its matmuls in float32, which the check refuses."""
    seen, _, _ = _seen_dtypes("cnn", (1, 8, 8), 10, "layers", None, "fp32")
    assert seen and all(dtypes == {torch.float32} for _, dtypes in seen)
    assert not any(dtypes == {torch.bfloat16} for _, dtypes in seen)


def test_the_client_layers_need_their_casts_under_autocast(monkeypatch):
    """Why layers.py casts: without it a hand-written backward meets a saved float32 tensor and the
    bfloat16 gradient of the output autocast gave its forward."""
    monkeypatch.setattr(layers, "autocast_inputs", lambda *ts: ts)
    with pytest.raises(RuntimeError, match="(?i)float|bfloat16|dtype"):
        _seen_dtypes("cnn", (1, 8, 8), 10, "layers", {"Conv2d": "grouped-nhwc", "Linear": "bmm"}, "bf16")


# ------------------------------------------------------------------ engines against per-client autograd
def smooth_conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Tanh(),
        nn.GroupNorm(2, 4),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 10),
    )


def smooth_text() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(20, 6), nn.Flatten(), nn.LayerNorm(72), nn.Linear(72, 16), nn.Tanh(), nn.Linear(16, 20)
    )


SMOOTH = {"conv": (smooth_conv, (1, 8, 8), 10), "text": (smooth_text, (12,), 20)}
C, B = 3, 4


def _per_client(model, params, x, y, w, precision, device):
    """Client c alone through the plain model, autograd, under ``precision``: the gradients of every
    client, concatenated, in float64."""
    out = []
    for c in range(x.shape[0]):
        with torch.no_grad():
            for p, s in zip(model.parameters(), params):
                p.copy_(s[c])
        model.zero_grad(set_to_none=True)
        with precision_scope(precision, device):
            with autocast_scope(precision, device):
                loss = (F.cross_entropy(model(x[c]), y[c], reduction="none") * w[c]).sum()
            loss.backward()
        out += [p.grad.double().flatten() for p in model.parameters()]
    return torch.cat(out)


@cache
def _smooth_case(kind, device, seed=0):
    """(model, clients' params, x, y, w, R: per-client bf16, X: exact)."""
    make, shape, classes = SMOOTH[kind]
    torch.manual_seed(seed)
    model = make().to(device)
    params, x, y, w = _clients(model, C, B, shape, classes, seed, device=device)
    R = _per_client(model, params, x, y, w, "bf16", device)
    exact = make().to(device, torch.float64)
    x64 = x if x.dtype == torch.long else x.double()
    X = _per_client(exact, [p.double() for p in params], x64, y, w.double(), "fp32", device)
    return model, params, x, y, w, R, X


def _flat(grads):
    return torch.cat([torch.cat([g[c].double().flatten() for g in grads]) for c in range(C)])


def _bf16_gap(kind, device, engine, params=None):
    """|E - R| / |R - X| (module docstring): at most 2 when the engine is as accurate as per-client autograd."""
    model, ps, x, y, w, R, X = _smooth_case(kind, device)
    grads, _ = engine(model).grads(ps if params is None else params, x, y, w)
    return float((_flat(grads) - R).norm() / (R - X).norm())


ENGINES = [("conv", "vmap", None, None)] + [
    ("conv", "layers", {"Conv2d": c, "Linear": lin}, order)
    for c in layers.FORMULATIONS["Conv2d"]
    for lin in layers.FORMULATIONS["Linear"]
    for order in layers.ORDERS
]
ENGINES += [("text", "vmap", None, None)] + [
    ("text", "layers", {"Linear": lin}, order) for lin in layers.FORMULATIONS["Linear"] for order in layers.ORDERS
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kind,engine,forms,order", ENGINES, ids=lambda v: "-".join(v.values()) if isinstance(v, dict) else v
)
def test_bf16_engines_equal_per_client_autograd_under_the_same_autocast(device, kind, engine, forms, order):
    model, *_, R, X = _smooth_case(kind, device)
    assert float((R - X).norm() / X.norm()) > 2**-12  # bf16 really rounded the reference (u = 2**-8)

    def make(m):
        if engine == "vmap":
            return VmapLoss(m, precision="bf16")
        return LayersLoss(m, formulations=forms, order=order, precision="bf16")

    assert _bf16_gap(kind, device, make) <= 2.0


def test_the_bf16_engine_check_can_fail():
    """Not vacuous: client 0 computed with client 1's parameters is far outside."""
    _, params, *_ = _smooth_case("conv", "cpu")
    swapped = [torch.cat([p[1:2], p[0:1], p[2:]]) for p in params]
    assert _bf16_gap("conv", "cpu", lambda m: LayersLoss(m, precision="bf16"), swapped) > 10


# ------------------------------------------------------------------ the simulator
def tiny_data() -> FederatedData:
    g = torch.Generator().manual_seed(0)
    users = []
    for i, n in enumerate((6, 9, 7, 8)):
        y = torch.randint(0, 4, (n + 2,), generator=g)
        x = torch.randn(n + 2, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1) * 0.5
        users.append(ClientData(i, x[:n], y[:n], x[n : n + 1], y[n : n + 1], x[n + 1 :], y[n + 1 :]))
    return FederatedData(users, [], (1, 8, 8), 4)


def tiny(**kw) -> SimConfig:
    base: Dict[str, Any] = dict(
        clients=4,
        holdout_fraction=0.0,
        clients_per_round=3,
        local_steps=2,
        batch_size=4,
        rounds=2,
        lr=0.1,
        backend="reference",
        device="cpu",
        finetune_steps=1,
    )
    base.update(kw)
    return SimConfig(**base)


def _model():
    return SmallCNN((1, 8, 8), 4, channels=(3, 4))


def _run(cfg) -> Simulation:
    sim = Simulation(cfg, data=tiny_data(), model_fn=_model)
    sim.run()
    return sim


@pytest.mark.parametrize("at_once", [1, 2])
def test_tf32_on_a_cpu_is_fp32_bit_for_bit_and_bf16_is_not(at_once):
    fp32, tf32, bf16 = (_run(tiny(client_batched=at_once, precision=p)) for p in PRECISIONS)
    assert all(torch.equal(a, b) for a, b in zip(fp32.global_params, tf32.global_params))
    assert [h["train_loss"] for h in fp32.history] == [h["train_loss"] for h in tf32.history]
    assert not all(torch.equal(a, b) for a, b in zip(fp32.global_params, bf16.global_params))
    assert {p.dtype for p in bf16.global_params} == {torch.float32}  # parameters stay float32
    if at_once > 1:
        assert bf16.batched.trainer.precision == bf16.batched.loss.precision == "bf16"
        opt = bf16.batched.trainer.opt
        assert {t.dtype for st in opt.state.values() for t in st.values() if t.is_floating_point()} <= {torch.float32}


def test_replay_bookkeeping_replays_bf16_steps_exactly():
    """The replay path (emulated on the CPU: a recorded step replayed) under bf16 equals the eager
    client-batched run bit for bit: the precision travels with the engine into the recorded step."""
    cfg = tiny(client_batched=2, precision="bf16", rounds=3, local_steps=4, finetune_steps=0)
    eager = _run(cfg)
    replayed = Simulation(cfg, data=tiny_data(), model_fn=_model)
    replayed.batched.replay_mode = "emulate"
    for t in range(cfg.rounds):
        replayed.run_round(t)
    assert replayed.batched.trainer.replay.recorded is not None
    assert all(torch.equal(a, b) for a, b in zip(eager.global_params, replayed.global_params))


def test_validation_runs_at_fp32_and_says_so():
    cfg = tiny(client_batched=2, finetune_steps=0)
    plain, asked = (
        validate_client_batched(c, data=tiny_data(), model_fn=_model) for c in (cfg, cfg.replace(precision="bf16"))
    )
    assert plain.passed and asked.passed, asked.report()
    assert asked.rounds == plain.rounds and asked.dtype == "float64"
    assert "precision bf16 is not applied here" in asked.report()
    assert "precision" not in plain.report()


def test_a_checkpoint_resumes_only_at_its_precision(tmp_path):
    cfg = tiny(rounds=1)
    Simulation(cfg, data=tiny_data(), checkpoint_dir=tmp_path, model_fn=_model).run()
    other = Simulation(cfg.replace(precision="bf16"), data=tiny_data(), checkpoint_dir=tmp_path, model_fn=_model)
    with pytest.raises(CheckpointError, match="precision: 'fp32' in the checkpoint, 'bf16' now"):
        other.load_checkpoint()


def test_the_command_line_takes_precision_and_shows_it(capsys):
    pytest.importorskip("sklearn")  # the digits
    code = fedopt_sim.main(
        "--precision bf16 --rounds 1 --clients 10 --local-steps 2 --finetune-steps 0 --no-files --quiet".split()
    )
    out = capsys.readouterr().out
    assert code == 0 and "precision bf16;" in out, out
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(["--precision", "fp16"])
    assert exc.value.code == 2 and "--precision" in capsys.readouterr().err


def test_the_command_line_refuses_a_model_without_a_kernel_at_the_precision(monkeypatch, capsys):
    """A layer without a kernel at the precision (torch's LSTM in bf16 on a CPU without AVX-512) is
    found when the run builds its model: exit 2 naming the option, no traceback."""
    pytest.importorskip("sklearn")  # the digits

    def refuse(model, precision, device):
        raise UnsupportedPrecision(f"precision={precision!r} cannot run lstm (LSTM) on this CPU")

    monkeypatch.setattr("fedopt_kernels.sim.simulation.check_supported", refuse)
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main("--precision bf16 --rounds 1 --clients 10 --no-files --quiet".split())
    assert exc.value.code == 2
    assert "fedopt-sim: error: --precision 'bf16' cannot run lstm" in capsys.readouterr().err


# ------------------------------------------------------------------ accuracy, end to end (slow)
def _accuracy_tolerance(p: float, n: int) -> float:
    """Three standard errors of the difference of two accuracies near ``p`` on ``n`` test samples."""
    return 3 * math.sqrt(2 * p * (1 - p) / n)


@pytest.mark.slow
def test_bf16_trains_the_digits_as_well_as_fp32():
    """A few rounds of fedopt-sim's default CNN on the built-in digits (20 users, all sampled, iid):
    bf16 sequential and bf16 client-batched reach fp32's final pooled test accuracy within three
    standard errors; the untrained model does not (the check can fail)."""
    pytest.importorskip("sklearn")
    cfg = SimConfig(clients=20, sample_rate=1.0, partition="iid", rounds=8, lr=0.1, finetune_steps=0, device="cpu")
    runs = {}
    for name, c in (
        ("fp32", cfg),
        ("bf16", cfg.replace(precision="bf16")),
        ("bf16 client-batched", cfg.replace(precision="bf16", client_batched=8)),
    ):
        sim = Simulation(c)
        runs[name] = sim.run()["final"]["pooled_test_acc"]
    users = sim.data.train_clients + sim.data.new_clients
    n = sum(int(u.test_y.shape[0]) for u in users)
    p = runs["fp32"]
    tol = _accuracy_tolerance(p, n)
    assert p > 0.6, runs  # the run trained: a comparison near chance would say little
    for name in ("bf16", "bf16 client-batched"):
        assert abs(runs[name] - p) <= tol, (runs, n, tol)
    untrained = Simulation(cfg.replace(rounds=1)).final_evaluation()["pooled_test_acc"]
    assert abs(untrained - p) > tol, (untrained, p, tol)


# ------------------------------------------------------------------ the benchmark (slow)
@pytest.mark.slow
def test_device_peak_measures_at_the_precision():
    from bench.peak import device_peak

    for precision, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        r = device_peak(torch.device("cpu"), min_time_s=0.0, precision=precision)
        assert r["precision"] == precision and r["dtype"] == dtype
        assert r["peak_flops_per_s"] > 0 and not r["tf32_matmul"] and not r["tf32_conv"]


@pytest.mark.slow
def test_bench_clients_runs_and_reports_bf16(capsys):
    from bench import clients

    assert clients.main("--smoke --model small-cnn --device cpu --no-write --no-layers --precision bf16".split()) == 0
    out = capsys.readouterr().out
    assert "- precision: bf16 (autocast" in out and "(bfloat16)" in out, out
    assert "error" not in out.split("## small-cnn")[1], out


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_tf32_changes_cuda_matmuls_only_inside_the_scope(switches):
    """TF32 rounds each float32 input to 10 mantissa bits (relative error up to 2**-11), float32 to
    23 (2**-24): a 1024-term product's relative error is ~1e-4 under TF32 and ~1e-7 without. The
    boundary 2**-15 sits between them by two orders of magnitude each way."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1024, 1024, generator=g, dtype=torch.float64) for _ in range(2))
    exact = a @ b

    def error():
        got = (a.float().cuda() @ b.float().cuda()).double().cpu()
        return float((got - exact).norm() / exact.norm())

    with precision_scope("fp32", "cuda"):
        plain = error()
    with precision_scope("tf32", "cuda"):
        tf32 = error()
    assert plain < 2**-15 < tf32, (plain, tf32)
    assert error() < 2**-15  # restored
