"""The per-user evaluation protocol on constructed cases where every number is known."""

import numpy as np
import pytest
import torch
from torch import nn

from fedopt_kernels.sim.data.clients import BatchStream, ClientData
from fedopt_kernels.sim.evaluate import evaluate_users, pooled_metrics, user_summary


class ConstantClass(nn.Module):
    """Predicts class ``bias.argmax()`` for every input; one trainable bias vector."""

    def __init__(self, cls: int, classes: int = 3):
        super().__init__()
        self.bias = nn.Parameter(torch.full((classes,), -1.0))
        with torch.no_grad():
            self.bias[cls] = 1.0

    def forward(self, x):
        return self.bias.expand(x.shape[0], -1)


def user(cid: int, test_labels, train_labels=(0,)) -> ClientData:
    ty = torch.tensor(test_labels)
    tr = torch.tensor(train_labels)
    return ClientData(
        cid,
        torch.zeros(len(tr), 2),
        tr,
        torch.zeros(0, 2),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(len(ty), 2),
        ty,
    )


def test_user_summary():
    accs = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    s = user_summary(accs)
    assert s["mean"] == pytest.approx(np.mean(accs))
    assert s["std"] == pytest.approx(np.std(accs))  # population std across users
    assert s["bottom10"] == pytest.approx(0.25)  # 10th percentile: index 0.1 * 10 = 1 -> 0.25
    assert s["users"] == 11
    assert user_summary([0.5, 1.0])["bottom10"] == pytest.approx(0.55)  # linear interpolation
    assert np.isnan(user_summary([])["mean"])


def test_global_and_finetuned_accuracy_on_constructed_users():
    # the model always says class 0: user accuracy = share of label 0 in its test split
    existing = [user(0, [0, 0, 1, 2]), user(1, [0, 1, 1, 1]), user(2, [0, 0, 0, 0])]
    new = [user(3, [1, 1]), user(4, [0, 2])]
    model = ConstantClass(0)
    params = [p.detach().clone() for p in model.parameters()]

    def stream(u):
        return BatchStream(u.train_x, u.train_y, 4, np.random.default_rng(0))

    out = evaluate_users(model, params, {"existing": existing, "new": new}, steps=0, lr=0.1, make_stream=stream)
    assert out["global"]["existing"]["mean"] == pytest.approx((0.5 + 0.25 + 1.0) / 3)
    assert out["global"]["new"]["mean"] == pytest.approx(0.25)
    assert out["global"]["new"]["std"] == pytest.approx(0.25)
    assert out["finetuned"] == out["global"]  # zero fine-tuning steps

    # fine-tuning on train labels "1" moves the bias towards class 1 (users whose train split is all 1)
    relabelled = [user(5, [1, 1, 0], train_labels=(1, 1)), user(6, [0, 0], train_labels=(0,))]
    out = evaluate_users(model, params, {"existing": relabelled}, steps=5, lr=5.0, make_stream=stream)
    assert out["global"]["existing"]["mean"] == pytest.approx((1 / 3 + 1.0) / 2)
    assert out["finetuned"]["existing"]["mean"] == pytest.approx((2 / 3 + 1.0) / 2)
    # the model is left holding the global weights
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_users_without_test_data_are_skipped():
    model = ConstantClass(0)
    params = [p.detach().clone() for p in model.parameters()]
    users = [user(0, [0, 1]), user(1, [])]
    out = evaluate_users(
        model,
        params,
        {"existing": users, "new": []},
        steps=0,
        lr=0.0,
        make_stream=lambda u: BatchStream(u.train_x, u.train_y, 1, np.random.default_rng(0)),
    )
    assert out["global"]["existing"]["users"] == 1 and out["global"]["existing"]["mean"] == 0.5
    assert out["global"]["new"]["users"] == 0


def test_pooled_metrics():
    model = ConstantClass(2)
    users = [user(0, [2, 2, 0]), user(1, [2])]
    m = pooled_metrics(model, users, "test")
    assert m["acc"] == pytest.approx(3 / 4)
    logp = torch.log_softmax(torch.tensor([-1.0, -1.0, 1.0]), 0)
    assert m["loss"] == pytest.approx(float(-(3 * logp[2] + logp[0]) / 4), rel=1e-6)
