"""The image models (FedAvg CNN, GroupNorm ResNet-18), their input stage and the crop + flip augmentation."""

import copy

import numpy as np
import pytest
import torch
from sim_data_files import write_cifar10
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.augment import random_crop_flip
from fedopt_kernels.sim.data.image_input import ImageClassifier, InputSpec
from fedopt_kernels.sim.models.build import MODELS, TEXT_MODELS, build_model
from fedopt_kernels.sim.simulation import Simulation

# the simulator's tiny models: one torch thread (conftest.py), as fedopt-sim's --threads default
pytestmark = pytest.mark.usefixtures("one_thread")


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_parameter_counts():
    # the FedAvg paper's MNIST CNN has 1,663,370 parameters
    assert n_params(build_model("fedavg-cnn", (1, 28, 28), 10)) == 1_663_370
    assert n_params(build_model("fedavg-cnn", (1, 28, 28), 62)) == 1_690_046
    assert n_params(build_model("fedavg-cnn", (3, 32, 32), 10)) == 2_156_490
    # CIFAR ResNet-18: GroupNorm has the same affine parameters as BatchNorm (11,173,962 for 10 classes)
    assert n_params(build_model("resnet18-gn", (3, 32, 32), 10)) == 11_173_962


@pytest.mark.parametrize("name", [m for m in MODELS if m not in TEXT_MODELS])
def test_models_are_batchnorm_and_buffer_free(name):
    m = build_model(name, (3, 32, 32), 10, InputSpec(mean=(0.5,) * 3, std=(0.2,) * 3, augment=True))
    assert isinstance(m, ImageClassifier) and list(m.buffers()) == []
    assert not any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in m.modules())
    assert [id(p) for p in m.parameters()] == [id(p) for p in m.net.parameters()]


def test_resnet_uses_two_group_groupnorm_and_trains():
    m = build_model("resnet18-gn", (3, 32, 32), 10)
    norms = [x for x in m.modules() if isinstance(x, nn.GroupNorm)]
    assert len(norms) == 1 + 16 + 3 and all(g.num_groups == 2 for g in norms)  # stem, 2 per block, 3 shortcuts
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    loss = nn.functional.cross_entropy(m(x), y)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("name, shape", [("fedavg-cnn", (1, 28, 28)), ("resnet18-gn", (3, 8, 8)), ("cnn", (3, 32, 32))])
def test_vmap_over_clients_matches_a_loop(name, shape):
    """What the client-batched path relies on: stacked client models under vmap = one model at a time."""
    torch.manual_seed(0)
    models = [build_model(name, shape, 10, InputSpec(mean=(0.5,) * shape[0], std=(0.3,) * shape[0])) for _ in range(2)]
    params, buffers = stack_module_state([m.net for m in models])
    raw = torch.randint(0, 256, (2, 2) + shape, dtype=torch.uint8)
    x = torch.stack([models[0].preprocess(raw[i], train=False) for i in range(2)])
    got = vmap(lambda p, b, xx: functional_call(models[0].net, (p, b), (xx,)))(params, buffers, x)
    want = torch.stack([models[i](raw[i]) for i in range(2)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_build_model_errors():
    with pytest.raises(ValueError, match=r"model='fedavg-cnn' needs image inputs \[C, H, W\]"):
        build_model("fedavg-cnn", (60,), 10)
    with pytest.raises(ValueError, match=r"model='resnet18-gn' needs image inputs .* H, W >= 8"):
        build_model("resnet18-gn", (1, 4, 4), 10)
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("vgg", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="model='resnet18-gn' needs images; dataset='synthetic'"):
        SimConfig(dataset="synthetic", model="resnet18-gn").validate()


# ------------------------------------------------------------------ augmentation and the input stage
def crops(img, p):
    """Every crop of ``img`` ([C, H, W]) zero-padded by p, and its mirror image."""
    c, h, w = img.shape
    padded = torch.nn.functional.pad(img, (p, p, p, p))
    out = []
    for dy in range(2 * p + 1):
        for dx in range(2 * p + 1):
            crop = padded[:, dy : dy + h, dx : dx + w]
            out += [crop, crop.flip(-1)]
    return out


def test_random_crop_flip_is_a_padded_crop_or_its_mirror():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 3, 6, 5) + 0.1  # > 0 everywhere: padding zeros are recognisable
    y = random_crop_flip(x, 2, g)
    assert y.shape == x.shape and y.dtype == x.dtype
    flipped = shifted = 0
    for a, b in zip(x, y):
        assert any(torch.equal(b, c) for c in crops(a, 2))
        flipped += any(torch.equal(b, c) for c in crops(a, 2)[1::2]) and not torch.equal(b, a)
        shifted += bool((b == 0).any())
    assert 15 < flipped < 50 and shifted > 32  # both transforms happen, flips about half the time


def test_random_crop_flip_seeded_and_padding_zero_only_flips():
    x = torch.rand(8, 1, 4, 4)
    a = random_crop_flip(x, 4, torch.Generator().manual_seed(3))
    b = random_crop_flip(x, 4, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    z = random_crop_flip(x, 0, torch.Generator().manual_seed(1))
    assert all(torch.equal(zi, xi) or torch.equal(zi, xi.flip(-1)) for zi, xi in zip(z, x))
    with pytest.raises(ValueError, match="padding must be an integer >= 0"):
        random_crop_flip(x, -1)
    with pytest.raises(ValueError, match=r"expects images \[B, C, H, W\]"):
        random_crop_flip(x[0], 1)


def test_input_stage_normalises_and_augments_only_in_training():
    spec = InputSpec(mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0), augment=True)
    m = ImageClassifier(nn.Identity(), spec)
    raw = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    m.eval()
    want = (raw.float() / 255 - torch.tensor([0.5, 0.25, 0.0]).view(1, 3, 1, 1)) / torch.tensor([0.5, 0.25, 1.0]).view(
        1, 3, 1, 1
    )
    torch.testing.assert_close(m(raw), want)
    m.train()
    assert not torch.equal(m(raw), want)
    assert torch.equal(ImageClassifier(nn.Identity(), InputSpec()).train()(raw), raw.float() / 255)
    c = copy.deepcopy(m)  # a copy restarts the augmentation stream from the same seed
    assert torch.equal(copy.deepcopy(c)(raw), c(raw))
    with pytest.raises(ValueError, match="give both mean and std"):
        InputSpec(mean=(0.5,))
    with pytest.raises(ValueError, match="std must be positive"):
        InputSpec(mean=(0.5,), std=(0.0,))


def test_resnet18_gn_short_training_run(tmp_path):
    write_cifar10(tmp_path, per_batch=6, test=6)
    cfg = SimConfig(
        dataset="cifar10",
        data_dir=str(tmp_path),
        model="resnet18-gn",
        augment=True,
        clients=4,
        holdout_fraction=0.25,
        rounds=1,
        local_steps=1,
        batch_size=2,
        clients_per_round=2,
        finetune_steps=0,
        backend="reference",
        device="cpu",
    )
    sim = Simulation(cfg)
    before = [p.detach().clone() for p in sim.global_params]
    res = sim.run()
    assert np.isfinite(res["history"][0]["train_loss"]) and 0 <= res["final"]["pooled_test_acc"] <= 1
    assert any(not torch.equal(a, b) for a, b in zip(before, sim.global_params))


# ------------------------------------------------------------------ 28x28 models and the character models
def test_28x28_models_and_mlp_widths():
    # FedNLR's 2-layer MLP: 784 -> 25 -> 10
    assert n_params(build_model("mlp1", (1, 28, 28), 10)) == 784 * 25 + 25 + 25 * 10 + 10
    assert n_params(build_model("mlp1", (1, 28, 28), 10, hidden=7)) == 784 * 7 + 7 + 7 * 10 + 10
    assert n_params(build_model("mlp", (1, 28, 28), 10, hidden=5)) == 784 * 5 + 5 + 5 * 5 + 5 + 5 * 10 + 10
    x = torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8)
    for name in ("mlp", "mlp1", "cnn", "fedavg-cnn"):
        m = build_model(name, (1, 28, 28), 10, InputSpec(mean=(0.13,), std=(0.31,)))
        assert m(x).shape == (3, 10) and list(m.buffers()) == []


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_character_models_shapes_and_training_step(name):
    torch.manual_seed(0)
    m = build_model(name, (80,), 80, hidden=16)
    assert list(m.buffers()) == [] and not any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in m.modules())
    x, y = torch.randint(0, 80, (4, 80)), torch.randint(0, 80, (4,))
    loss = nn.functional.cross_entropy(m(x), y)
    loss.backward()
    assert m(x).shape == (4, 80) and all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    with pytest.raises(ValueError, match=rf"model='{name}' needs windows of character indices"):
        build_model(name, (1, 28, 28), 10)


def test_leaf_lstm_size():
    # LEAF's Shakespeare model: Embedding(80, 8), 2-layer LSTM(256), Linear(256, 80)
    lstm = 4 * (256 * 8 + 256 * 256 + 2 * 256) + 4 * (256 * 256 + 256 * 256 + 2 * 256)
    assert n_params(build_model("char-lstm", (80,), 80)) == 80 * 8 + lstm + 256 * 80 + 80


def test_char_gru_is_torchs_gru():
    """The plain-ops GRU computes torch's GRU equations (same weights, same outputs)."""
    torch.manual_seed(0)
    m = build_model("char-gru", (80,), 80, hidden=12)
    ref = nn.GRU(8, 12, num_layers=2, batch_first=True)
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            getattr(ref, f"weight_ih_l{i}").copy_(layer.w_ih.weight)
            getattr(ref, f"bias_ih_l{i}").copy_(layer.w_ih.bias)
            getattr(ref, f"weight_hh_l{i}").copy_(layer.w_hh.weight)
            getattr(ref, f"bias_hh_l{i}").copy_(layer.w_hh.bias)
    x = torch.randint(0, 80, (3, 80))
    out, _ = ref(m.embed(x))
    torch.testing.assert_close(m(x), m.head(out[:, -1]), rtol=1e-5, atol=1e-6)


def test_char_transformer_is_causal():
    """Position t sees positions <= t only: the last output on a prefix = position t's output on the whole."""
    torch.manual_seed(0)
    m = build_model("char-transformer", (80,), 80, hidden=16)
    x = torch.randint(0, 80, (2, 80))
    h = m.embed(x) + m.pos
    for block in m.blocks:
        h = block(h)
    torch.testing.assert_close(m(x[:, :50]), m.head(m.ln(h[:, 49])), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["char-gru", "char-transformer"])
def test_character_models_vmap_over_clients_matches_a_loop(name):
    torch.manual_seed(0)
    models = [build_model(name, (80,), 80, hidden=16) for _ in range(3)]
    params, buffers = stack_module_state(models)
    x = torch.randint(0, 80, (3, 4, 80))
    got = vmap(lambda p, b, xx: functional_call(models[0], (p, b), (xx,)))(params, buffers, x)
    torch.testing.assert_close(got, torch.stack([models[i](x[i]) for i in range(3)]), rtol=1e-4, atol=1e-5)


def test_vmap_refuses_an_lstm_the_layers_engine_takes_it():
    from fedopt_kernels.sim.batched.layers_engine import LayersLoss
    from fedopt_kernels.sim.batched.loss import VmapLoss, client_loss

    with pytest.raises(ValueError, match=r"vmap cannot batch the fused recurrent layer lstm \(LSTM\)"):
        VmapLoss(build_model("char-lstm", (80,), 80, hidden=8))
    assert isinstance(client_loss(build_model("char-lstm", (80,), 80, hidden=8)), LayersLoss)
    SimConfig(dataset="shakespeare", data_dir="x", model="char-lstm", client_batched=4).validate()


def test_char_transformer_context_reads_the_last_characters():
    torch.manual_seed(0)
    m = build_model("char-transformer", (80,), 80, hidden=16, context=40)
    assert m.pos.shape == (40, 16)
    x = torch.randint(0, 80, (2, 80))
    y = x.clone()
    y[:, :40] = torch.randint(0, 80, (2, 40))  # what lies before the context does not matter
    torch.testing.assert_close(m(x), m(y), rtol=0, atol=0)
    torch.testing.assert_close(m(x), m(x[:, 40:]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="context only applies to model='char-transformer'"):
        SimConfig(dataset="shakespeare", data_dir="x", model="char-gru", context=10).validate()
