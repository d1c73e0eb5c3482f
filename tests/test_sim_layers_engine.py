"""The layers engine: every client's gradient equals per-client autograd, for every model,
layer formulation and sample order; what it cannot compute goes to vmap or is refused with the reason.

All comparisons run in float64: the formulations compute the same sums in other orders (grouped vs
per-client convolutions, batched vs single matmuls, the written-out LSTM vs torch's fused kernel),
so rounding-only differences are ~1e-16 relative (observed <= 6e-15 here); ``ROUNDING_RTOL`` (float64's
eps times 1e6, as tests/test_sim_batched.py) sits far below what a wrong client mapping, a missing
bias or a swapped gate produces (order 1).
"""

import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedopt_kernels.sim.batched.layers import FORMULATIONS, ClientConv2d, Clients
from fedopt_kernels.sim.batched.layers_engine import LayersLoss, LayersNet, UnsupportedModel
from fedopt_kernels.sim.batched.loss import VmapLoss, client_loss
from fedopt_kernels.sim.batched.lstm import ClientLSTM
from fedopt_kernels.sim.models.build import build_model

ROUNDING_RTOL = 1e6 * torch.finfo(torch.float64).eps
pytestmark = pytest.mark.usefixtures("one_thread")

# name -> (input shape, classes, build kwargs, clients, batch)
MODELS = {
    "cnn": ((1, 8, 8), 10, {}, 3, 4),
    "fedavg-cnn": ((1, 12, 12), 10, {}, 3, 3),
    "mlp": ((1, 6, 6), 5, {}, 3, 4),
    "resnet18-gn": ((3, 8, 8), 10, {}, 2, 2),
    "char-lstm": ((12,), 20, {"hidden": 8}, 3, 4),
    "char-gru": ((12,), 20, {"hidden": 8}, 3, 4),
}
# the formulations each model's layers can take (every combination is checked)
CHOICES = {
    "cnn": [{"Conv2d": c, "Linear": lin} for c in FORMULATIONS["Conv2d"] for lin in FORMULATIONS["Linear"]],
    "fedavg-cnn": [{"Conv2d": c} for c in FORMULATIONS["Conv2d"]],
    "mlp": [{"Linear": lin} for lin in FORMULATIONS["Linear"]],
    "resnet18-gn": [{"Conv2d": c} for c in FORMULATIONS["Conv2d"]],
    "char-lstm": [{"LSTM": f} for f in FORMULATIONS["LSTM"]],
    "char-gru": [{"Linear": lin} for lin in FORMULATIONS["Linear"]],
}


def _case(name, seed=0):
    shape, classes, kw, C, B = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model(name, shape, classes, **kw).double()
    # distinct clients: each its own perturbation of the model
    params = [
        p.detach().unsqueeze(0) + 0.1 * torch.randn(C, *p.shape, generator=g, dtype=torch.float64)
        for p in model.parameters()
    ]
    if len(shape) == 1:
        x = torch.randint(0, classes, (C, B, *shape), generator=g)
    else:
        x = torch.randn(C, B, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (C, B), generator=g)
    w = torch.rand(C, B, generator=g, dtype=torch.float64)
    return model, params, x, y, w


def _per_client(model, params, x, y, w):
    """The reference: client c alone, plain autograd on the plain model."""
    grads, losses = [], []
    for c in range(x.shape[0]):
        with torch.no_grad():
            for p, s in zip(model.parameters(), params):
                p.copy_(s[c])
        model.zero_grad(set_to_none=True)
        loss = (F.cross_entropy(model(x[c]), y[c], reduction="none") * w[c]).sum()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(loss.detach())
    return grads, torch.stack(losses)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _perturbed_clients(model, x, classes):
    """C distinct float64 perturbations of ``model``'s parameters, labels and sample weights for ``x`` [C, B, ...]."""
    C, B = x.shape[:2]
    params = [p.detach().unsqueeze(0) + 0.1 * torch.randn(C, *p.shape, dtype=torch.float64) for p in model.parameters()]
    return params, torch.randint(0, classes, (C, B)), torch.rand(C, B, dtype=torch.float64)


def _assert_layers_engine_equals(want, model, params, x, y, w, formulations, order):
    """The layers engine's gradients in ``order`` equal ``want`` (``_per_client``'s)."""
    grads, _ = LayersLoss(model, formulations=formulations, order=order).grads(params, x, y, w)
    for c in range(x.shape[0]):
        for got, ref in zip(grads, want[c]):
            assert _rel(got[c], ref) <= ROUNDING_RTOL


@pytest.mark.parametrize("order", ["client", "batch"])
@pytest.mark.parametrize(
    "name,choice",
    # ResNet-18-GN's cases (about a second each) run in the full suite; the fast tier keeps the others
    [pytest.param(n, c, marks=pytest.mark.slow if n == "resnet18-gn" else ()) for n in MODELS for c in CHOICES[n]],
    ids=lambda v: v if isinstance(v, str) else "-".join(v.values()),
)
def test_layers_engine_gradients_equal_per_client_autograd(name, choice, order):
    model, params, x, y, w = _case(name)
    want, want_loss = _per_client(model, params, x, y, w)
    engine = LayersLoss(model, formulations=choice, order=order)
    grads, loss = engine.grads(params, x, y, w)
    ran = set(engine.layers_net.formulations().values())
    assert set(choice.values()) <= ran, (choice, ran)  # the forced formulations did run
    assert _rel(loss, want_loss) <= ROUNDING_RTOL
    for c in range(x.shape[0]):
        for i, (got, ref) in enumerate(zip(grads, want[c])):
            assert got.shape == (x.shape[0], *ref.shape)
            assert _rel(got[c], ref) <= ROUNDING_RTOL, (c, engine.names[i])


@pytest.mark.parametrize("name", ["cnn", "char-lstm"])
def test_default_formulations_equal_per_client_autograd(name):
    model, params, x, y, w = _case(name, seed=1)
    want, _ = _per_client(model, params, x, y, w)
    grads, _ = LayersLoss(model).grads(params, x, y, w)
    for c in range(x.shape[0]):
        for got, ref in zip(grads, want[c]):
            assert _rel(got[c], ref) <= ROUNDING_RTOL


def test_a_swapped_client_is_caught():
    """Not vacuous: the reference is per client, so computing client 0 with client 1's rows fails."""
    model, params, x, y, w = _case("cnn")
    want, _ = _per_client(model, params, x, y, w)
    swapped = [torch.cat([p[1:2], p[0:1], p[2:]]) for p in params]
    grads, _ = LayersLoss(model).grads(swapped, x, y, w)
    assert max(_rel(g[0], r) for g, r in zip(grads, want[0])) > 1e-3


@pytest.mark.parametrize("name", ["cnn", "char-lstm", pytest.param("resnet18-gn", marks=pytest.mark.slow)])
def test_gradients_at_shared_parameters(name):
    """grads_at (PAdaMFed-VR's anchor): every client's batch at the same parameters."""
    model, params, x, y, w = _case(name, seed=2)
    shared = [p[0] for p in params]
    want, _ = _per_client(model, [s.unsqueeze(0).expand(x.shape[0], *s.shape) for s in shared], x, y, w)
    grads, _ = LayersLoss(model).grads_at(shared, x, y, w)
    for c in range(x.shape[0]):
        for got, ref in zip(grads, want[c]):
            assert got.shape[0] == x.shape[0] and _rel(got[c], ref) <= ROUNDING_RTOL


def test_logits_are_each_clients_model():
    model, params, x, _, _ = _case("fedavg-cnn")
    out = LayersLoss(model, order="batch").logits(params, x)
    for c in range(x.shape[0]):
        with torch.no_grad():
            for p, s in zip(model.parameters(), params):
                p.copy_(s[c])
            assert _rel(out[c], model(x[c])) <= ROUNDING_RTOL


def test_gpu_defaults_are_the_grouped_and_batched_forms():
    """Off the CPU the convolutions are grouped (cuDNN), LSTMs written out: checked on meta tensors."""
    conv = ClientConv2d(nn.Conv2d(8, 16, 3, padding=1))
    conv.ctx = Clients(50, 10)
    x = torch.empty(500, 8, 28, 28, device="meta")
    assert conv.default_formulation(x) == "grouped"
    assert conv.default_formulation(torch.empty(500, 8, 8, 8)) == "grouped-nhwc"  # small per-client work
    assert conv.default_formulation(torch.empty(500, 8, 280, 280)) == "loop"  # large
    lstm = ClientLSTM(nn.LSTM(4, 8, batch_first=True))
    assert lstm.default_formulation(torch.empty(2, 3, 4, device="meta")) == "bmm"
    assert lstm.default_formulation(torch.empty(2, 3, 4)) == "loop"


# ------------------------------------------------------------------ what the layers engine does not compute
class _Tied(nn.Module):
    sample_wise = True

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Unknown(nn.Module):  # no sample_wise declaration: it might mix samples
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


class _WithGRU(nn.Module):
    sample_wise = True

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize(
    "model,why",
    [
        (_Tied(), "ties"),
        (_Unknown(), r"_Unknown\) is not known to be sample-wise"),
        (build_model("char-transformer", (12,), 20, hidden=8), r"CharTransformer\) holds parameters itself"),
        (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), r"Dropout\) is not known to be sample-wise"),
        (nn.Sequential(nn.Embedding(5, 4, padding_idx=0)), "Embedding with padding_idx"),
        (nn.LSTM(4, 8), "LSTM other than batch_first=True"),
    ],
)
def test_models_the_layers_engine_leaves_to_vmap(model, why):
    with pytest.raises(UnsupportedModel, match=why):
        LayersNet(model)
    with pytest.raises(ValueError, match=f"the layers engine cannot train .*{why}"):
        client_loss(model, engine="layers")


def test_auto_falls_back_to_vmap_or_refuses_with_both_reasons():
    assert isinstance(client_loss(build_model("char-transformer", (12,), 20, hidden=8)), VmapLoss)
    assert isinstance(client_loss(build_model("char-lstm", (12,), 20, hidden=8)), LayersLoss)
    with pytest.raises(
        ValueError,
        match=r"vmap cannot batch the fused recurrent layer rnn \(GRU\).*"
        r"the layers engine cannot either: rnn \(GRU\) is not a layer it computes",
    ):
        client_loss(_WithGRU())
    with pytest.raises(ValueError, match="needs a BatchNorm- and buffer-free model"):
        client_loss(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    with pytest.raises(ValueError, match="engine must be one of"):
        client_loss(_Unknown(), engine="fast")


def test_the_earlier_engine_name_still_works_and_warns():
    model = build_model("cnn", (1, 8, 8), 10)
    with pytest.warns(DeprecationWarning, match="engine='stacked' is engine='layers'"):
        assert isinstance(client_loss(model, engine="stacked"), LayersLoss)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="the layers engine cannot train"):
        client_loss(_WithGRU(), engine="stacked")  # the layers engine's refusal, not vmap's fallback


def test_bad_formulations_are_refused_by_name():
    model = build_model("cnn", (1, 8, 8), 10)
    with pytest.raises(ValueError, match=r"features.0 \(Conv2d\) cannot run 'bmm': Conv2d has \('grouped', 'grouped-"):
        LayersLoss(model, formulations={"Conv2d": "bmm"})
    with pytest.raises(ValueError, match="no client layer is named or of type 'LSTM'"):
        LayersLoss(model, formulations={"LSTM": "loop"})
    with pytest.raises(ValueError, match="order must be 'client' or 'batch'"):
        LayersLoss(model, order="sample")


def test_an_initial_lstm_state_is_refused():
    class Stateful(nn.Module):
        sample_wise = True

        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 4, batch_first=True)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            h = torch.zeros(1, x.shape[0], 4)
            return self.fc(self.lstm(x, (h, h))[0][:, -1])

    engine = LayersLoss(Stateful())
    stacked = [p.detach().unsqueeze(0).repeat(2, *([1] * p.dim())) for p in engine.model.parameters()]
    with pytest.raises(ValueError, match=r"initial state \(hx\) is not supported"):
        engine.grads(stacked, torch.randn(2, 3, 5, 3), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))


def test_every_client_layer_type_has_a_formulation_list():
    from fedopt_kernels.sim.batched.layer_types import _MAKERS

    assert {m.kind for m in _MAKERS.values()} == set(FORMULATIONS)
    assert all(FORMULATIONS[k] for k in FORMULATIONS)
    assert len(list(itertools.chain(*CHOICES.values()))) > 10


# ------------------------------------------------------------------ the simulator on it
def test_char_lstm_trains_client_batched_as_sequentially():
    """fedopt-sim --client-batched on the LSTM (vmap cannot batch it; the layers engine does):
    the client-batched run stays within rounding of the sequential one (float64), fine-tuning included."""
    from fedopt_kernels.sim.config import SimConfig
    from fedopt_kernels.sim.data.clients import ClientData
    from fedopt_kernels.sim.federated_data import FederatedData
    from fedopt_kernels.sim.validate import validate_client_batched

    g = torch.Generator().manual_seed(0)
    T, V = 6, 12
    users = []
    for i, n in enumerate((3, 9, 5, 12)):  # one client smaller than the batch
        x = torch.randint(0, V, (n + 2, T), generator=g)
        y = (x[:, -1] + 1) % V  # learnable: the next symbol
        users.append(ClientData(i, x[:n], y[:n], x[n : n + 1], y[n : n + 1], x[n + 1 :], y[n + 1 :]))
    data = FederatedData(users, [], (T,), V)
    cfg = SimConfig(
        algorithm="fednar",
        clients=4,
        holdout_fraction=0.0,
        clients_per_round=3,
        local_steps=3,
        batch_size=4,
        rounds=2,
        lr=0.5,
        backend="reference",
        device="cpu",
        finetune_steps=2,
        client_batched=2,
    )

    def model_fn():
        return build_model("char-lstm", (T,), V, hidden=8)

    v = validate_client_batched(cfg, data=data, model_fn=model_fn)
    assert v.passed and v.dtype == "float64" and v.max_rel <= ROUNDING_RTOL, v.report()


@pytest.mark.parametrize("form", FORMULATIONS["Conv2d"])
def test_conv_options_same_padding_dilation_stride_groups(form):
    """Convolutions other than the simulator's: padding='same' with dilation, stride 2 with groups."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding="same", dilation=2),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 3),
    ).double()
    x = torch.randn(3, 2, 2, 8, 8, dtype=torch.float64)
    params, y, w = _perturbed_clients(model, x, 3)
    want, _ = _per_client(model, params, x, y, w)
    for order in ("client", "batch"):
        _assert_layers_engine_equals(want, model, params, x, y, w, {"Conv2d": form}, order)


def test_grouped_runs_convert_once_per_run_and_stop_at_mixing_modules(monkeypatch):
    """A Sequential keeps the grouped layout through per-channel modules and grouped convolutions, and
    converts back before a module that mixes channels (GroupNorm) or samples' planes (Flatten): its
    gradients are per-client autograd's, with one conversion into the grouped layout per run."""
    from fedopt_kernels.sim.batched import layers

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(2, stride=1),  # 8x8 -> 7x7
        nn.Conv2d(4, 6, 3, padding=1, groups=2),
        nn.GroupNorm(2, 6),  # statistics over a sample's channels: not per channel, ends the run
        nn.Tanh(),
        nn.Conv2d(6, 4, 3, stride=2),  # 7x7 -> 3x3
        nn.MaxPool2d(2, stride=1),  # 3x3 -> 2x2
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 3),
    ).double()
    C, B = 3, 2
    x = torch.randn(C, B, 2, 8, 8, dtype=torch.float64)
    params, y, w = _perturbed_clients(model, x, 3)
    want, _ = _per_client(model, params, x, y, w)
    into = []
    to_grouped = layers._to_grouped_nhwc
    monkeypatch.setattr(layers, "_to_grouped_nhwc", lambda t, ctx: into.append(tuple(t.shape)) or to_grouped(t, ctx))
    for order in ("client", "batch"):
        into.clear()
        _assert_layers_engine_equals(want, model, params, x, y, w, {"Conv2d": "grouped-nhwc"}, order)
        # forward: the input of each run (conv-relu-pool-conv, then conv-pool-pool); backward: the gradient
        # at each run's end
        assert into == [(C * B, 2, 8, 8), (C * B, 6, 7, 7), (C * B, 4, 2, 2), (C * B, 6, 7, 7)], into


@pytest.mark.parametrize("order", ["client", "batch"])
def test_grouped_runs_end_at_convolutions_of_other_formulations(monkeypatch, order):
    """A run goes on only through grouped-nhwc convolutions: an im2col or loop-nhwc convolution ends it
    (it reads the model's batch), and the next grouped-nhwc one starts a new run."""
    from fedopt_kernels.sim.batched import layers

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),  # grouped-nhwc: a run starts
        nn.ReLU(),
        nn.Conv2d(3, 4, 3, padding=1),  # im2col: the run ends before it
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2),  # grouped-nhwc: a second run
        nn.MaxPool2d(2),
        nn.Conv2d(4, 3, 2),  # loop-nhwc: the second run ends
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 3),
    ).double()
    C, B = 3, 2
    x = torch.randn(C, B, 2, 8, 8, dtype=torch.float64)
    params, y, w = _perturbed_clients(model, x, 3)
    want, _ = _per_client(model, params, x, y, w)
    into = []
    to_grouped = layers._to_grouped_nhwc
    monkeypatch.setattr(layers, "_to_grouped_nhwc", lambda t, ctx: into.append(tuple(t.shape)) or to_grouped(t, ctx))
    forms = {"0": "grouped-nhwc", "2": "im2col", "4": "grouped-nhwc", "6": "loop-nhwc"}
    _assert_layers_engine_equals(want, model, params, x, y, w, forms, order)
    # forward: each run's input; backward: the gradient at each run's end, last run first
    assert into == [(C * B, 2, 8, 8), (C * B, 4, 8, 8), (C * B, 4, 4, 4), (C * B, 3, 8, 8)], into


def test_relu_then_max_pool_runs_pooled_first_with_the_same_gradients(monkeypatch):
    """Inside a grouped run ReLU -> MaxPool2d is computed as MaxPool2d -> ReLU (the ReLU on the smaller
    tensor): equal values and gradients, also where a window's maximum is tied (piecewise-constant
    images give tied positive maxima, as well as the all-zero windows after the ReLU)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=1, padding=1),  # overlapping windows, padded
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
    ).double()
    C, B = 3, 2
    x = torch.randint(0, 2, (C, B, 1, 4, 4)).double().repeat_interleave(2, -1).repeat_interleave(2, -2)  # 2x2 blocks
    params, y, w = _perturbed_clients(model, x, 3)
    with torch.no_grad():
        params[1].abs_()  # positive first-layer biases: constant regions give positive, tied outputs
    with torch.no_grad():  # the case is not vacuous: client 0's first pooling sees tied positive maxima
        for p, s in zip(model.parameters(), params):
            p.copy_(s[0])
        a = model[1](model[0](x[0])).unfold(2, 2, 2).unfold(3, 2, 2).flatten(-2)
        top = a.max(-1, keepdim=True).values
        assert ((a == top).sum(-1) > 1)[top.squeeze(-1) > 0].any()
    want, _ = _per_client(model, params, x, y, w)
    relu_inputs = []
    relu = F.relu
    monkeypatch.setattr(F, "relu", lambda t, inplace=False: relu_inputs.append(tuple(t.shape)) or relu(t, inplace))
    for order in ("client", "batch"):
        relu_inputs.clear()
        _assert_layers_engine_equals(want, model, params, x, y, w, {"Conv2d": "grouped-nhwc"}, order)
        assert relu_inputs == [(B, C * 3, 4, 4), (B, C * 4, 5, 5)]  # pooled, grouped


def test_keep_freed_memory_is_idempotent():
    import sys

    from fedopt_kernels.sim.batched.host_memory import keep_freed_memory

    first = keep_freed_memory()
    assert keep_freed_memory() == first
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            _ = ctypes.CDLL(None).gnu_get_libc_version  # glibc only
        except AttributeError:
            return  # musl: nothing to set
        assert first is True
