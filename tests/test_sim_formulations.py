"""Every candidate formulation of every client layer, alone: its output and the gradients of its
parameters *and its input* equal per-client autograd on the plain module, in float64, in both sample
orders and input layouts; a formulation a layer cannot run is left out of its candidates and refused
by name.

The models' cases (tests/test_sim_layers_engine.py) see a layer's input gradient only through the layers
before it, and never the first layer's; here every layer's input requires a gradient, and an LSTM's
final state is part of the loss (its last cell gradient is not zero). ``ROUNDING_RTOL`` is float64's
eps times 1e6, as there: the formulations sum the same products in other orders (observed <= 1e-15
relative); ``test_a_wrong_written_out_backward_is_caught`` shows a 1e-8 relative error in any one
gradient of a hand-written backward fails the check.
"""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fedopt_kernels.sim.batched.conv_im2col import _Im2colConv
from fedopt_kernels.sim.batched.layer_types import client_layer
from fedopt_kernels.sim.batched.layers import FORMULATIONS, Clients
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.lstm_cell import _LSTMCell
from fedopt_kernels.sim.batched.lstm_sequence import _LSTMSequence

ROUNDING_RTOL = 1e6 * torch.finfo(torch.float64).eps
C, B = 3, 2
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # torch's note that an even kernel's 'same' padding copies the input (the case is here on purpose)
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths"),
]

# name -> (module, one sample's input shape); odd sizes, so that strides and paddings leave remainders
LAYERS = {
    "conv": (lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 7, 6)),
    "conv-1x1-one-channel": (lambda: nn.Conv2d(1, 2, 1), (1, 5, 5)),
    "conv-stride2-groups2": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False), (4, 7, 6)),
    "conv-same-dilated": (lambda: nn.Conv2d(2, 4, 3, padding="same", dilation=2), (2, 7, 6)),
    "conv-same-even-kernel": (lambda: nn.Conv2d(2, 3, (4, 2), padding="same", dilation=(1, 3)), (2, 7, 8)),
    "conv-valid-rect": (lambda: nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding="valid", dilation=(1, 2)), (2, 7, 6)),
    "linear": (lambda: nn.Linear(4, 5), (2, 4)),
    "lstm-2-layers": (lambda: nn.LSTM(3, 5, num_layers=2, batch_first=True), (4, 3)),
    "lstm-no-bias": (lambda: nn.LSTM(3, 4, bias=False, batch_first=True), (3, 3)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (4, 3, 3)),
    "layernorm": (lambda: nn.LayerNorm(4), (2, 4)),
}


def _layer(make):
    layer = client_layer(make())
    assert layer is not None
    return layer


CASES = [(name, form) for name, (make, _) in LAYERS.items() for form in FORMULATIONS[_layer(make).kind]]


def _module(name):
    torch.manual_seed(0)
    make, shape = LAYERS[name]
    return make().double(), shape


def _outputs(out):
    """The tensors a layer returns, batch axis first: an LSTM's (out, (h, c)) as out, h and c [N, layers, H]."""
    if isinstance(out, tuple):
        seq, (h, cell) = out
        return [seq, h.transpose(0, 1), cell.transpose(0, 1)]
    return [out]


def _per_client(module, params, x, weights):
    """The reference: client c's module on its samples, ``sum(out * weight)`` differentiated by autograd."""
    outs, grads = [], []
    for c in range(C):
        ps = {n: p[c].detach().requires_grad_() for n, p in params.items()}
        xc = x[c].detach().requires_grad_()
        got = _outputs(functional_call(module, ps, (xc,)))
        loss = sum((o * r[c]).sum() for o, r in zip(got, weights))
        grads.append(torch.autograd.grad(loss, [xc, *ps.values()]))
        outs.append([o.detach() for o in got])
    return outs, grads


def _client_layer(module, params, x, weights, form, order, channels_last):
    """The client layer under ``form``: its outputs per client and the gradients of its input and parameters."""
    layer = client_layer(module)
    layer.ctx = ctx = Clients(C, B, order)
    layer.formulation = form
    ps = {n: p.detach().requires_grad_() for n, p in params.items()}
    layer.params = ps
    xs = x.detach().requires_grad_()
    xin = ctx.inputs(xs)
    if channels_last:
        xin = xin.contiguous(memory_format=torch.channels_last)
    got = [ctx.split(o) for o in _outputs(layer(xin))]
    assert layer.last_formulation == form
    loss = sum((o * r).sum() for o, r in zip(got, weights))
    grads = torch.autograd.grad(loss, [xs, *ps.values()])
    return [o.detach() for o in got], grads


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _check(name, form, order="client", channels_last=False, device="cpu"):
    """The client layer (on ``device``) against per-client autograd on the CPU."""
    module, shape = _module(name)
    g = torch.Generator().manual_seed(1)
    params = {
        n: p.detach().unsqueeze(0) + 0.1 * torch.randn(C, *p.shape, generator=g, dtype=torch.float64)
        for n, p in module.named_parameters()
    }
    x = torch.randn(C, B, *shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        ref = [_outputs(module(x[0]))]
    weights = [torch.randn(C, *o.shape, generator=g, dtype=torch.float64) for o in ref[0]]
    want_out, want = _per_client(module, params, x, weights)
    on = {n: p.to(device) for n, p in params.items()}
    there = [r.to(device) for r in weights]
    got_out, got = _client_layer(copy.deepcopy(module).to(device), on, x.to(device), there, form, order, channels_last)
    got_out, got = [o.cpu() for o in got_out], [t.cpu() for t in got]
    for c in range(C):
        for o, r in zip(got_out, want_out[c]):
            assert _rel(o[c], r) <= ROUNDING_RTOL, ("output", c)
        for i, (gr, r) in enumerate(zip(got, want[c])):
            assert _rel(gr[c], r) <= ROUNDING_RTOL, (c, ["input", *params][i])


@pytest.mark.parametrize("order", ["client", "batch"])
@pytest.mark.parametrize("name,form", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_every_candidate_equals_per_client_autograd(name, form, order):
    module, shape = _module(name)
    layer = client_layer(module)
    x = torch.empty(C * B, *shape, device="meta", dtype=torch.float64)
    if form not in layer.candidates(x):
        with pytest.raises(ValueError, match=f"{layer.kind}\\) cannot run '{form}'"):
            _check(name, form, order)
        return
    _check(name, form, order)
    if len(shape) == 3:  # a channels-last input (what a grouped run or an im2col layer before hands on)
        _check(name, form, order, channels_last=True)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["client", "batch"])
@pytest.mark.parametrize("name,form", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_every_candidate_on_a_gpu_equals_per_client_autograd(name, form, order):
    """The same in float64 on CUDA (cuDNN, cuBLAS), against the CPU's per-client autograd."""
    _, shape = _module(name)
    if form not in _layer(LAYERS[name][0]).candidates(torch.empty(C * B, *shape, device="meta")):
        pytest.skip(f"{form} is not a candidate for {name}")
    _check(name, form, order, device="cuda")
    if len(shape) == 3:
        _check(name, form, order, channels_last=True, device="cuda")


def test_every_formulation_is_a_candidate_for_these_layers():
    """Asked on a meta tensor, as a chooser does: every configuration above runs every formulation."""
    for name, (make, shape) in LAYERS.items():
        layer = _layer(make)
        assert layer.candidates(torch.empty(C * B, *shape, device="meta")) == FORMULATIONS[layer.kind], name


def test_a_non_candidate_is_refused_by_layer_name_and_nothing_changes(monkeypatch):
    """A layer that cannot run a formulation (here: a convolution with a kernel wider than 2 refuses
    ``im2col``, a stand-in for a configuration a formulation lacks) leaves it out of its candidates,
    and forcing it raises, naming the layer: in ``set_formulations``, which then changes nothing, and
    at call time when it was set around it, inside a grouped run too."""
    from fedopt_kernels.sim.batched.layers import ClientConv2d

    def why_not(self, form, x=None):
        if form == "im2col" and self.kernel[0] > 2:
            return "a stand-in refusal"
        return super(ClientConv2d, self).why_not(form, x)

    monkeypatch.setattr(ClientConv2d, "why_not", why_not)
    model = nn.Sequential(nn.Conv2d(1, 2, 2), nn.ReLU(), nn.Conv2d(2, 2, 3, padding="same"), nn.Flatten())
    engine = LayersLoss(model, formulations={"Conv2d": "loop"})
    x = torch.empty(6, 2, 5, 5, device="meta")
    assert "im2col" in engine.layers_net.layers["0"].candidates(x)
    assert engine.layers_net.layers["2"].candidates(x) == ("grouped", "grouped-nhwc", "loop", "loop-nhwc")
    with pytest.raises(ValueError, match=r"formulations: 2 \(Conv2d\) cannot run 'im2col': a stand-in refusal"):
        engine.layers_net.set_formulations({"0": "grouped", "Conv2d": "im2col"})
    assert [m.formulation for m in engine.layers_net.layers.values()] == ["loop", "loop"]
    with pytest.raises(ValueError, match=r"formulations: 0 \(Conv2d\) cannot run 'bmm-fused': Conv2d has"):
        LayersLoss(model, formulations={"0": "bmm-fused"})
    params = [p.detach().unsqueeze(0).repeat(2, *([1] * p.dim())) for p in model.parameters()]
    x, y, w = torch.randn(2, 3, 1, 6, 6), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)
    for first, second in (("loop", "im2col"), ("grouped-nhwc", "im2col"), ("grouped-nhwc", "nhwc")):
        engine.layers_net.set_formulations({"0": first})
        engine.layers_net.layers["2"].formulation = second  # as a benchmark sets it, around set_formulations
        with pytest.raises(ValueError, match=f"formulations: 2 \\(Conv2d\\) cannot run '{second}'"):
            engine.grads(params, x, y, w)


def _perturbed(backward, index):
    """``backward`` with its ``index``-th gradient off by 1e-8 relative (a wrong written-out formula)."""

    def wrong(ctx, *grads):
        out = list(backward(ctx, *grads))
        out[index] = out[index] * (1 + 1e-8)
        return tuple(out)

    return staticmethod(wrong)


@pytest.mark.parametrize(
    "fn,index,name,form",
    [
        (_Im2colConv, 0, "conv-stride2-groups2", "im2col"),  # the input's gradient
        (_Im2colConv, 1, "conv-same-even-kernel", "im2col"),  # the weight's
        (_Im2colConv, 2, "conv", "im2col"),  # the bias's
        (_LSTMCell, 0, "lstm-2-layers", "bmm-fused"),  # the gates'
        (_LSTMCell, 1, "lstm-no-bias", "bmm-fused"),  # the previous cell state's
        (_LSTMSequence, 0, "lstm-2-layers", "bmm-sequence"),  # every step's gates'
        (_LSTMSequence, 1, "lstm-no-bias", "bmm-sequence"),  # the recurrent weight's
    ],
)
def test_a_wrong_written_out_backward_is_caught(monkeypatch, fn, index, name, form):
    _check(name, form)
    monkeypatch.setattr(fn, "backward", _perturbed(fn.backward, index))
    with pytest.raises(AssertionError):
        _check(name, form)
