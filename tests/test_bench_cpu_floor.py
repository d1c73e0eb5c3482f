"""``python -m bench cpu-floor``: every formulation it times computes the small CNN's numbers, and its check
of that can fail."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cpu_floor  # noqa: E402


def test_every_formulation_is_within_its_bound():
    for case in cpu_floor.cases(C=3, B=2, seed=1):
        assert len(case.forms) >= 2 and next(iter(case.forms)).endswith("(used)")
        for name, f in case.forms.items():
            share = case.error(f())
            assert share <= 1.0, (case.name, name, share)


def test_the_bound_check_fails_on_a_wrong_result():
    for case in cpu_floor.cases(C=2, B=2, seed=2):
        outs = next(iter(case.forms.values()))()
        wrong = list(outs)
        t = wrong[0].clone()
        t[(0,) * t.dim()] += 1e-3 * (1 + t.abs().max())  # one element off by far more than rounding
        wrong[0] = t
        assert case.error(tuple(wrong)) > 1.0, case.name


def test_dgrad_weights_give_the_input_gradient():
    """The flipped, channel-swapped weights turn the input gradient into a forward convolution (float64)."""
    g = torch.Generator().manual_seed(3)
    C, B = 2, 3
    x = torch.randn(B, C * 8, 8, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(C * 16, 8, 3, 3, dtype=torch.float64, generator=g)
    gy = torch.randn(B, C * 16, 8, 8, dtype=torch.float64, generator=g)
    (want,) = torch.autograd.grad(torch.nn.functional.conv2d(x, w, None, 1, 1, 1, C), x, gy)
    got = torch.nn.functional.conv2d(gy, cpu_floor._dgrad_weight(w, C), None, 1, 1, 1, C)
    torch.testing.assert_close(got, want)


@pytest.mark.slow  # a whole (tiny) benchmark run: the full suite has it
def test_main_writes_the_table(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the test worker's threads alone
    rc = cpu_floor.main(["--clients", "2", "--batch", "2", "--reps", "1", "--rounds", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    md = next(tmp_path.glob("cpu-floor-*.md")).read_text()
    assert "| 2nd conv input gradient | oneDNN backward (used) |" in md
    assert "8x the sequential rate leaves" in md and "input gradient as a forward conv" in md


def test_the_swapped_backward_gives_the_engines_gradients():
    """The step row with the input gradient as a forward convolution computes what the engine does (float64)."""
    from fedopt_kernels.sim.batched.layers_engine import LayersLoss
    from fedopt_kernels.sim.models.build import build_model

    g = torch.Generator().manual_seed(4)
    C, B = 3, 2
    model = build_model("cnn", (1, 8, 8), 10).double()
    params = [
        p.detach().unsqueeze(0) + 0.1 * torch.randn(C, *p.shape, dtype=torch.float64, generator=g)
        for p in model.parameters()
    ]
    x = torch.randn(C, B, 1, 8, 8, dtype=torch.float64, generator=g)
    y = torch.randint(0, 10, (C, B), generator=g)
    w = torch.full((C, B), 1.0 / B, dtype=torch.float64)
    loss = LayersLoss(model, formulations={"Conv2d": "grouped-nhwc"})
    want, _ = loss.grads(params, x, y, w)
    got = []
    cpu_floor._swapped(lambda: got.extend(loss.grads(params, x, y, w)[0]))()
    assert len(got) == len(want)
    for a, b in zip(got, want):  # the layers engine's own float64 rounding budget (tests/test_sim_layers_engine.py)
        assert float((a - b).abs().max() / b.abs().max()) <= 1e6 * torch.finfo(torch.float64).eps
