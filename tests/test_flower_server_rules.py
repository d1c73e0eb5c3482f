"""The shared server rules (fedopt_kernels.fl.server_rules) against the formulas written out by hand.

These functions are the one implementation both front ends call (the simulator's strategies and
the Flower strategies); the simulator's hand-computed tests (test_sim_algorithms.py) pin them
end to end, these pin each rule alone, its purity and its bad-input errors. No Flower needed.
"""

import pytest
import torch

from fedopt_kernels.fl.algorithms.padamfed import padamfed_init, padamfed_step  # noqa: E402
from fedopt_kernels.fl.server_rules import scaffold_control_step, scaffold_local_control, weighted_average_step


def tensors(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


SHAPES = ((3, 2), (2,))


def test_weighted_average_step_matches_hand():
    x = tensors(*SHAPES, seed=1)
    deltas = [tensors(*SHAPES, seed=s) for s in (2, 3, 4)]
    weights = [1.0, 3.0, 6.0]
    out = weighted_average_step(x, deltas, weights, server_lr=0.7)
    for j in range(len(x)):
        expect = x[j] + 0.7 * sum(w * d[j] for w, d in zip(weights, deltas)) / sum(weights)
        torch.testing.assert_close(out[j], expect)


@pytest.mark.parametrize(
    "weights", [[1e308, 1e308], [1e308, 1e308, 1.0], [2.0**53, 1.0, 3.0], [1.7e308, 5e-324], [5e-324, 5e-324]]
)
def test_weighted_average_weights_sum_to_one_without_overflow(weights):
    """Finite positive weights of any size: the step is the weighted mean, never a frozen model (a sum of
    weights that overflows to inf once made every weight 0)."""
    x = tensors(*SHAPES, seed=1)
    deltas = [tensors(*SHAPES, seed=s) for s in range(2, 2 + len(weights))]
    out = weighted_average_step(x, deltas, weights, server_lr=1.0)
    top = max(weights)
    rel = [w / top for w in weights]  # the same mean, from weights that cannot overflow
    for j in range(len(x)):
        expect = x[j] + sum(r * d[j] for r, d in zip(rel, deltas)) / sum(rel)
        torch.testing.assert_close(out[j], expect, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(out[j]).all() and not torch.equal(out[j], x[j])


def test_scaffold_rules_match_hand():
    ci, c, delta = tensors(*SHAPES, seed=1), tensors(*SHAPES, seed=2), tensors(*SHAPES, seed=3)
    new = scaffold_local_control(ci, c, delta, lr_sum=0.25)
    for j in range(len(ci)):
        torch.testing.assert_close(new[j], ci[j] - c[j] - delta[j] / 0.25)  # c_i - c + (x - y_i) / lr_sum
    kept = scaffold_local_control(ci, c, delta, lr_sum=0.0)
    assert all(torch.equal(a, b) and a is not b for a, b in zip(kept, ci))
    dcs = [tensors(*SHAPES, seed=s) for s in (4, 5)]
    out = scaffold_control_step(c, dcs, num_clients=8)
    for j in range(len(c)):
        torch.testing.assert_close(out[j], c[j] + (dcs[0][j] + dcs[1][j]) / 8)


def test_padamfed_rules_match_hand():
    cis = [tensors(*SHAPES, seed=s) for s in (1, 2, 3)]
    c, m = padamfed_init(cis, num_clients=4)  # a fourth client without a control counts as zero
    for j in range(len(c)):
        torch.testing.assert_close(c[j], sum(ci[j] for ci in cis) / 4)
        torch.testing.assert_close(m[j], c[j])
    x = tensors(*SHAPES, seed=9)
    deltas = [tensors(*SHAPES, seed=s) for s in (10, 11)]
    dcs = [tensors(*SHAPES, seed=s) for s in (12, 13)]
    eta, K, gamma, beta, N = 0.05, 4, 0.6, 0.3, 4
    nx, nc, nm = padamfed_step(x, c, m, deltas, dcs, num_clients=N, lr=eta, local_steps=K, server_lr=gamma, beta=beta)
    for j in range(len(x)):
        dc = dcs[0][j] + dcs[1][j]
        torch.testing.assert_close(nx[j], x[j] - gamma * ((-deltas[0][j] - deltas[1][j]) / 2) / (eta * K))
        torch.testing.assert_close(nm[j], beta * (dc / 2 + c[j]) + (1 - beta) * m[j])
        torch.testing.assert_close(nc[j], c[j] + dc / N)


def test_rules_do_not_modify_their_inputs():
    x, c, m = tensors(*SHAPES, seed=1), tensors(*SHAPES, seed=2), tensors(*SHAPES, seed=3)
    deltas, dcs = [tensors(*SHAPES, seed=4)], [tensors(*SHAPES, seed=5)]
    before = [t.clone() for t in x + c + m + deltas[0] + dcs[0]]
    weighted_average_step(x, deltas, [2.0], 1.0)
    scaffold_control_step(c, dcs, 3)
    scaffold_local_control(c, m, deltas[0], 0.5)
    padamfed_init([c, m], 2)
    padamfed_step(x, c, m, deltas, dcs, num_clients=3, lr=0.1, local_steps=2, server_lr=1.0, beta=0.5)
    assert all(torch.equal(a, b) for a, b in zip(before, x + c + m + deltas[0] + dcs[0]))


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda x, d: weighted_average_step(x, [], [], 1.0), "deltas"),
        (lambda x, d: weighted_average_step(x, [d[:1]], [1.0], 1.0), "deltas[0]"),
        (lambda x, d: weighted_average_step(x, [[d[1], d[0]]], [1.0], 1.0), "deltas[0][0]"),
        (lambda x, d: weighted_average_step(x, [d], [0.0], 1.0), "weights"),
        (lambda x, d: weighted_average_step(x, [d], [1.0, 2.0], 1.0), "weights"),
        (lambda x, d: scaffold_control_step(x, [d], 0), "num_clients"),
        (lambda x, d: padamfed_init([], 3), "local_controls"),
        (
            lambda x, d: padamfed_step(x, x, x, [d], [], num_clients=2, lr=0.1, local_steps=1, server_lr=1, beta=0.5),
            "dcs",
        ),
    ],
)
def test_bad_input_names_the_argument(call, names):
    x, d = tensors(*SHAPES, seed=1), tensors(*SHAPES, seed=2)
    with pytest.raises(ValueError, match=rf"^{names.replace('[', '.').replace(']', '.')}"):
        call(x, d)
