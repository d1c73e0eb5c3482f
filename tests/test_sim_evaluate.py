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


# ------------------------------------------------------------------ one pass each, and client-batched
from fedopt_kernels.sim.data.image_input import ImageClassifier, InputSpec  # noqa: E402
from fedopt_kernels.sim.evaluate import EvalCost, split_scores  # noqa: E402
from fedopt_kernels.sim.models.small import SmallCNN  # noqa: E402


class _Counting(nn.Module):
    """Wraps a network; counts the samples it sees in eval mode (what a test pass sends through it),
    in a list that the evaluation engines' copies of the module share."""

    sample_wise = True

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.seen = [0]

    def forward(self, x):
        if not self.training:
            self.seen[0] += x.shape[0]
        return self.net(x)


def image_users(sizes, seed=0, dtype=torch.float64, raw=False):
    g = torch.Generator().manual_seed(seed)
    users = []
    for i, (n_train, n_test) in enumerate(sizes):
        y = torch.randint(0, 4, (n_train + n_test,), generator=g)
        if raw:
            x = torch.randint(0, 256, (n_train + n_test, 1, 8, 8), generator=g, dtype=torch.uint8)
        else:
            x = (torch.randn(n_train + n_test, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1) * 0.7).to(dtype)
        users.append(ClientData(i, x[:n_train], y[:n_train], x[:0], y[:0], x[n_train:], y[n_train:]))
    return users


SIZES = [(3, 5), (9, 2), (14, 7), (6, 1), (1, 4)]  # a user smaller than the batch, uneven test splits


def _streams(batch):
    return lambda u: BatchStream(u.train_x, u.train_y, batch, np.random.default_rng(u.client_id))


def test_the_global_model_sees_each_test_image_once():
    torch.manual_seed(0)
    model = _Counting(SmallCNN((1, 8, 8), 4)).double()
    params = [p.detach().clone() for p in model.parameters()]
    existing, new = image_users(SIZES[:3]), image_users(SIZES[3:], seed=1)
    n_test = sum(u.test_y.shape[0] for u in existing + new)
    want_pooled = pooled_metrics(model, existing + new, "test")["acc"]
    for at_once in (None, 2):
        model.seen[0] = 0
        out = evaluate_users(
            model,
            params,
            {"existing": existing, "new": new},
            steps=0,
            lr=0.1,
            make_stream=_streams(4),
            at_once=at_once,
        )
        assert model.seen[0] == n_test  # pooled and per-user numbers from one pass
        assert out["pooled_test_acc"] == pytest.approx(want_pooled)
        model.seen[0] = 0
        evaluate_users(
            model,
            params,
            {"existing": existing, "new": new},
            steps=2,
            lr=0.1,
            make_stream=_streams(4),
            at_once=at_once,
        )
        # the global model once; each fine-tuned model once (stacked: padded to the chunk's longest split)
        # existing test sizes (5, 2, 7) in chunks {5, 2} {7}, new (1, 4) in one: 2 * 5 + 7 + 2 * 4
        padded = n_test if at_once is None else 2 * 5 + 7 + 2 * 4
        assert model.seen[0] == n_test + padded


def test_split_scores_are_per_user_and_cost_counts_flops():
    torch.manual_seed(0)
    model = SmallCNN((1, 8, 8), 4).double()
    users = image_users(SIZES)
    cost = EvalCost()
    s = split_scores(model, users, "test", cost)
    for i, u in enumerate(users):
        loss, correct = 0.0, 0
        with torch.no_grad():
            out = model(u.test_x)
        loss = float(torch.nn.functional.cross_entropy(out, u.test_y, reduction="sum"))
        correct = int((out.argmax(1) == u.test_y).sum())
        assert s.count[i] == u.test_y.shape[0] and s.correct[i] == correct
        assert s.loss[i] == pytest.approx(loss, rel=1e-12)
    # FedAvg-style count: conv 1->8 and 8->16 (3x3, 8x8 'same'), linear 256->4: 2 x MACs per sample
    per_sample = 2 * (64 * 8 * 9 + 64 * 16 * 72 + 256 * 4)
    assert cost.flops == per_sample * sum(u.test_y.shape[0] for u in users) and cost.seconds > 0


@pytest.mark.parametrize("augment", [False, True])
def test_client_batched_finetuning_is_each_users_own(augment):
    """at_once=N fine-tunes N users at a time (stacked, padded batches) and tests them stacked: every
    user's fine-tuned accuracy equals the one-after-another protocol's (float64; with augmentation,
    the same random crops in the same order)."""
    torch.manual_seed(0)
    spec = InputSpec(augment=True, padding=2) if augment else None

    def make():
        torch.manual_seed(0)
        net = SmallCNN((1, 8, 8), 4)
        return (ImageClassifier(net, spec) if spec else net).double()

    users = image_users(SIZES, raw=augment)
    new = image_users([(4, 3), (8, 6)], seed=3, raw=augment)
    results = []
    for at_once in (None, 2, 3):
        model = make()
        params = [p.detach().clone() for p in model.parameters()]
        cost = EvalCost()
        out = evaluate_users(
            model,
            params,
            {"existing": users, "new": new},
            steps=5,
            lr=0.5,
            make_stream=_streams(4),
            at_once=at_once,
            cost=cost,
        )
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        assert cost.flops > 0 and set(cost.parts) == {"forward test", "fine-tune"} | (
            {"forward fine-tuned"} if at_once else set()
        )
        results.append(out)
    assert results[0]["finetuned"] != results[0]["global"]  # fine-tuning changed something
    for out in results[1:]:
        assert out == results[0]


def test_flop_counts_are_each_models_own_at_a_reused_address(monkeypatch):
    """A freed model's FLOP counts never answer for a new model that CPython puts at its address (the
    counts were once cached by ``id()``): every model here reports the same ``id``, as reused addresses
    would, and each still gets its own count, forward and training step."""
    from torch.utils.flop_counter import FlopCounterMode

    from fedopt_kernels.sim import evaluate

    monkeypatch.setattr(evaluate, "id", lambda obj: 1, raising=False)  # one address for every model
    x, y = torch.randn(2, 1, 8, 8), torch.tensor([0, 1])
    for channels in [(3, 4), (8, 16), (5, 2)]:
        model = SmallCNN((1, 8, 8), 4, channels=channels)
        with torch.no_grad(), FlopCounterMode(display=False) as fwd:
            model.eval()(x[:1])
        with FlopCounterMode(display=False) as train:
            torch.nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()
        model.zero_grad(set_to_none=True)
        assert evaluate.forward_flops(model, x) == fwd.get_total_flops()
        assert evaluate._train_flops(model, x, y) == train.get_total_flops()
        del model
