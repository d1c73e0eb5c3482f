"""docs/algorithms.md: bad input raises a clear error naming the parameter, and leaves parameters untouched."""

import pytest
import torch

import fedopt_kernels as fk
from fedopt_kernels.fl import catalogue


def _p(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


def _builder(name):
    cfg = catalogue.config(name, next(iter(catalogue.ALGOS[name].options)))  # its first, plainest option set
    return lambda ps, **kw: cfg.cls(ps, **{**cfg.kwargs, **kw})


# every registered algorithm, built from its catalogue options (keywords override them)
BUILDERS = {name: _builder(name) for name in catalogue.ALGOS}


def _step(algo, opt, params):
    """``opt.step`` with what a step of ``algo`` takes besides the gradients (FedSAM's closure)."""
    opt.step(**catalogue.config(algo, next(iter(catalogue.ALGOS[algo].options))).step_inputs(params, 0))


@pytest.mark.parametrize("algo", list(BUILDERS))
def test_negative_lr(algo):
    with pytest.raises(ValueError, match="lr"):
        BUILDERS[algo]([_p(3)], lr=-0.1)


@pytest.mark.parametrize("algo", list(BUILDERS))
def test_lr_set_negative_later_raises_at_step_and_leaves_params(algo):
    p = _p(3)
    opt = BUILDERS[algo]([p])
    opt.param_groups[0]["lr"] = -1.0
    before = p.detach().clone()
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="lr"):
        _step(algo, opt, [p])
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan")])
def test_beta_outside_unit_interval(beta):
    with pytest.raises(ValueError, match="beta"):
        fk.FedDecaySGD([_p(2)], lr=0.1, beta=beta)
    with pytest.raises(ValueError, match="beta"):
        fk.PAdaMFed([_p(2)], lr=0.1, beta=beta)
    with pytest.raises(ValueError, match="beta"):
        fk.WithinRoundDecay(torch.optim.SGD([_p(2)], lr=0.1), beta=beta)


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_max_norm_not_positive(max_norm):
    with pytest.raises(ValueError, match="max_norm"):
        fk.FedNAR([_p(2)], lr=0.1, weight_decay=0.0, max_norm=max_norm)


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(momentum=-0.1), "momentum"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(nesterov=True), "nesterov"),
        (dict(decay_every=0), "decay_every"),
        (dict(schedule="cosine"), "schedule"),
        (dict(prox_mu=-1.0), "prox_mu"),
    ],
)
def test_feddecay_options(kw, name):
    with pytest.raises(ValueError, match=name):
        fk.FedDecaySGD([_p(2)], lr=0.1, beta=0.5, **kw)


def test_schedule_must_not_increase():
    p = _p(2)
    opt = fk.FedDecaySGD([p], lr=0.1, beta=0.5, schedule=lambda j: [1.0, 2.0][min(j, 1)])
    p.grad = torch.ones(2)
    opt.step()
    before = p.detach().clone()
    with pytest.raises(ValueError, match="non-increasing"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_schedule_tensor_too_short():
    p = _p(2)
    opt = fk.FedDecaySGD([p], lr=0.1, beta=0.5, schedule=torch.tensor([1.0, 0.5]))
    p.grad = torch.ones(2)
    opt.step()
    opt.step()
    with pytest.raises(ValueError, match="length 2"):
        opt.step()


@pytest.mark.parametrize("algo", list(BUILDERS))
def test_sparse_gradient(algo):
    p = _p(4, 2)
    opt = BUILDERS[algo]([p])
    p.grad = torch.eye(4, 2).to_sparse()
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        _step(algo, opt, [p])
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("algo", list(BUILDERS))
def test_complex_parameters(algo):
    with pytest.raises(TypeError, match="complex"):
        BUILDERS[algo]([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))])


def test_neuron_scale_wrong_shape_device_dtype():
    w = _p(3, 4)
    opt = fk.NeuronLRSGD([w], lr=0.1)
    with pytest.raises(ValueError, match=r"neuron scale .*shape \(4,\).*expected shape \(3,\)"):
        opt.set_neuron_scales({w: torch.ones(4)})
    with pytest.raises(TypeError, match="neuron scale"):
        opt.set_neuron_scales({w: torch.ones(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="not a parameter"):
        opt.set_neuron_scales({torch.zeros(3): torch.ones(3)})
    with pytest.raises(ValueError, match="on meta"):
        opt.set_neuron_scales({w: torch.ones(3, device="meta")})
    with pytest.raises(ValueError, match="0-dim"):
        s = torch.nn.Parameter(torch.tensor(1.0))
        fk.NeuronLRSGD([s], lr=0.1, neuron_scales={s: torch.ones(1)})


@pytest.mark.parametrize("algo", ["feddecay", "neuron_lr", "fednar"])
def test_correction_shape_mismatch_leaves_state(algo):
    a, b = _p(3, 2), _p(5)
    opt = BUILDERS[algo]([a, b])
    with pytest.raises(ValueError, match=r"correction entry for parameter 1 .*shape \(4,\)"):
        opt.start_round(correction=[torch.zeros(3, 2), torch.zeros(4)])
    with pytest.raises(ValueError, match="correction has 1 tensors"):
        opt.start_round(correction=[torch.zeros(3, 2)])
    assert opt.round_index == -1, "a rejected start_round must not start a round"


@pytest.mark.parametrize("name", ["global_control", "local_control", "momentum"])
def test_padamfed_control_shape_mismatch(name):
    a, b = _p(3, 2), _p(5)
    opt = BUILDERS["padamfed"]([a, b])
    with pytest.raises(ValueError, match=name):
        opt.start_round(**{name: [torch.zeros(3, 2), torch.zeros(6)]})


def test_padamfed_vr_needs_anchor_grads():
    p = _p(3)
    opt = fk.PAdaMFed([p], lr=0.1, beta=0.5, variance_reduction=True)
    p.grad = torch.ones(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="anchor_grads"):
        opt.step()
    with pytest.raises(ValueError, match="anchor_grads"):
        opt.step(anchor_grads=[torch.ones(4)])
    assert torch.equal(p.detach(), before)
    with pytest.raises(RuntimeError, match="local_control"):
        opt.local_control()


def test_unexpected_round_input():
    with pytest.raises(TypeError, match="global_control"):
        BUILDERS["fednar"]([_p(2)]).start_round(global_control=[torch.zeros(2)])
    with pytest.raises(TypeError, match="correction"):
        BUILDERS["padamfed"]([_p(2)]).start_round(correction=[torch.zeros(2)])


@pytest.mark.parametrize("backend", ["gpu", "Reference", ""])
def test_unknown_backend(backend):
    with pytest.raises(ValueError, match="backend"):
        fk.FedNAR([_p(2)], lr=0.1, weight_decay=0.0, backend=backend)


def test_unavailable_backend_names_what_is_missing(monkeypatch):
    from fedopt_kernels.core import registry as _registry

    monkeypatch.setitem(_registry._LOAD_ERRORS, "cpu", "extension fedopt_kernels._C_cpu was not built")
    with pytest.raises(ValueError, match=r"backend='cpu' cannot run parameter 0 .*_C_cpu was not built"):
        fk.FedDecaySGD([_p(2)], lr=0.1, beta=0.5, backend="cpu")
    assert "cpu" in fk.available_backends().missing


def test_backend_made_unavailable_after_construction_is_refused_at_step(monkeypatch):
    from fedopt_kernels.core import registry as _registry

    p = _p(2)
    opt = fk.FedDecaySGD([p], lr=0.1, beta=0.5, backend="reference")
    monkeypatch.setitem(_registry._LOAD_ERRORS, "reference", "made unavailable by this test")
    p.grad = torch.ones(2)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"backend='reference' is not available.*made unavailable by this test"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("batched", [False, True], ids=["per-client", "client-batched"])
@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_backend_that_cannot_run_the_parameters_is_refused_at_construction(algo, batched):
    # SPEC: a backend that cannot run the parameters is refused where it is named. The cuda backend
    # runs CUDA tensors only, built or not, so CPU parameters are refused on every machine.
    cfg = catalogue.config(algo, next(iter(catalogue.ALGOS[algo].options)))
    params = [_p(2, 3) if batched else _p(3), _p(2, 4) if batched else _p(4)]
    build = cfg.build_batched if batched else cfg.build
    with pytest.raises(ValueError, match=r"backend='cuda' cannot run parameter 0 of param group 0 .*, on cpu"):
        build(params, backend="cuda")
    assert build(params, backend="reference").resolved_backend() == "reference"  # the same call, a backend that runs


def test_prox_mu_set_mid_round():
    p = _p(2)
    opt = fk.FedDecaySGD([p], lr=0.1, beta=0.5)
    opt.start_round()
    opt.param_groups[0]["prox_mu"] = 0.1
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="prox_mu"):
        opt.step()


def test_mixed_devices():
    a = _p(2)
    b = torch.nn.Parameter(torch.zeros(2, device="meta"))
    opt = fk.FedDecaySGD([a, b], lr=0.1, beta=0.5)
    a.grad = torch.ones(2)
    b.grad = torch.ones(2, device="meta")
    with pytest.raises(RuntimeError, match="one device"):
        opt.step()


@pytest.mark.parametrize("S,K,T", [(0, 1, 1), (1, 0, 1), (1, 1, -3), (1.5, 1, 1)])
def test_theory_hparams_bad(S, K, T):
    with pytest.raises(ValueError):
        fk.theory_hparams(S, K, T)
