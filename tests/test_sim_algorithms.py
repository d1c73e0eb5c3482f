"""Each algorithm's rounds against a hand computation, on a tiny linear model with full-batch steps.

Three clients of different sizes, all sampled (no sampling randomness), batch size larger than any
client (every step sees the whole train split, so batch order does not matter), two rounds (so the
per-round lr decay, FedNAR's annealing and the control variates all take effect). The hand versions
below use autograd only for gradients and write every update rule out.
"""

from typing import Any, Dict, List, Optional, cast

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedopt_kernels import neuron_lr_scales, theory_hparams
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data.clients import ClientData
from fedopt_kernels.sim.federated_data import FederatedData
from fedopt_kernels.sim.simulation import Simulation

SIZES = (2, 3, 5)
K, ROUNDS, LR, SERVER_LR = 2, 2, 0.3, 0.7


# the simulator's tiny models: one torch thread (conftest.py), as fedopt-sim's --threads default
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_data(sizes=SIZES, new=0) -> FederatedData:
    g = torch.Generator().manual_seed(0)
    users = []
    for i, n in enumerate(list(sizes) + [3] * new):
        x, y = torch.randn(n + 2, 3, generator=g), torch.randint(0, 2, (n + 2,), generator=g)
        users.append(ClientData(i, x[:n], y[:n], x[n : n + 1], y[n : n + 1], x[n + 1 :], y[n + 1 :]))
    return FederatedData(users[: len(sizes)], users[len(sizes) :], (3,), 2)


def tiny_config(algorithm: str, **kw) -> SimConfig:
    base: Dict[str, Any] = dict(
        algorithm=algorithm,
        clients=len(SIZES),
        holdout_fraction=0.0,
        clients_per_round=len(SIZES),
        local_steps=K,
        batch_size=100,
        rounds=ROUNDS,
        lr=LR,
        server_lr=SERVER_LR,
        backend="reference",
        device="cpu",
        finetune_steps=0,
    )
    base.update(kw)
    return SimConfig(**base)


def run_sim(cfg: SimConfig, data: Optional[FederatedData] = None) -> Simulation:
    sim = Simulation(cfg, data=data or tiny_data(), model_fn=lambda: nn.Linear(3, 2))
    for t in range(cfg.rounds):
        sim.run_round(t)
    return sim


def grad(params: List[torch.Tensor], c: ClientData) -> List[torch.Tensor]:
    w, b = [p.detach().clone().requires_grad_() for p in params]
    loss = F.cross_entropy(c.train_x @ w.T + b, c.train_y)
    return list(torch.autograd.grad(loss, [w, b]))


def norm(ts: List[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(cast(torch.Tensor, sum((t.double() ** 2).sum() for t in ts)))  # ts is never empty


def weighted_avg_update(x, ys, weights, server_lr):
    tot = sum(weights)
    return [xj + server_lr * sum(w * (y[j] - xj) for y, w in zip(ys, weights)) / tot for j, xj in enumerate(x)]


def initial_params(cfg: SimConfig) -> List[torch.Tensor]:
    sim = Simulation(cfg, data=tiny_data(), model_fn=lambda: nn.Linear(3, 2))
    return [p.clone() for p in sim.global_params]


def assert_close(got: List[torch.Tensor], want: List[torch.Tensor], tol: float = 2e-6):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=tol, atol=tol)


# ---------------------------------------------------------------- SGD family (FedDecaySGD)
def hand_sgd_family(cfg: SimConfig, scaffold: bool = False, nlr: bool = False) -> Dict:
    hp = cfg.hparams()
    data = tiny_data()
    x = initial_params(cfg)
    beta, mu, wd, rd = hp["beta"], hp["prox_mu"], cfg.weight_decay, hp["round_decay"]
    c = [torch.zeros_like(p) for p in x]
    ci = {i: [torch.zeros_like(p) for p in x] for i in range(len(SIZES))}
    for t in range(cfg.rounds):
        ys, new_ci = [], {}
        for i, cl in enumerate(data.train_clients):
            y = [p.clone() for p in x]
            scales = None
            if nlr:
                lin = nn.Linear(3, 2)
                with torch.no_grad():
                    lin.weight.copy_(x[0]), lin.bias.copy_(x[1])
                r = neuron_lr_scales(lin, [(cl.train_x, cl.train_y)])
                scales = [r[lin.weight][:, None], r[lin.bias]]
            lrs = [hp["lr"] * rd**t * beta**k for k in range(K)]
            for k in range(K):
                g = grad(y, cl)
                if cfg.clip_norm is not None:
                    coef = min(1.0, cfg.clip_norm / (float(norm(g)) + 1e-6))
                    g = [gj * coef for gj in g]
                d = [
                    gj + wd * yj + mu * (yj - xj) + (cj - cij if scaffold else 0)
                    for gj, yj, xj, cj, cij in zip(g, y, x, c, ci[i])
                ]
                if scales is not None:
                    d = [dj * s for dj, s in zip(d, scales)]
                y = [yj - lrs[k] * dj for yj, dj in zip(y, d)]
            ys.append(y)
            if scaffold:  # option II with the sum of the step sizes
                new_ci[i] = [cij - cj + (xj - yj) / sum(lrs) for cij, cj, xj, yj in zip(ci[i], c, x, y)]
        x = weighted_avg_update(x, ys, list(SIZES), hp["server_lr"])
        if scaffold:
            for i, n in new_ci.items():
                c = [cj + (nj - oj) / len(SIZES) for cj, nj, oj in zip(c, n, ci[i])]
                ci[i] = n
    return {"x": x, "c": c, "ci": ci}


@pytest.mark.parametrize(
    "algorithm,kw",
    [
        ("fedavg", {}),
        ("fedavg", {"round_decay": 0.5, "clip_norm": 0.05}),  # FedNAR's baseline: lr decay + gradient clipping
        ("fedsgd", {}),
        ("feddecay", {"beta": 0.4}),
        ("feddecay", {"beta": 0.4, "weight_decay": 0.1}),
        ("fedprox", {"prox_mu": 0.5}),
    ],
)
def test_fedavg_family_matches_hand(algorithm, kw):
    cfg = tiny_config(algorithm, **kw)
    assert_close(run_sim(cfg).global_params, hand_sgd_family(cfg)["x"])


def test_fednlr_matches_hand():
    cfg = tiny_config("fednlr")
    assert_close(run_sim(cfg).global_params, hand_sgd_family(cfg, nlr=True)["x"])


@pytest.mark.parametrize("kw", [{}, {"beta": 0.5, "decay_every": 1}])
def test_scaffold_matches_hand(kw):
    cfg = tiny_config("scaffold", **kw)
    sim = run_sim(cfg)
    want = hand_sgd_family(cfg, scaffold=True)
    assert_close(sim.global_params, want["x"])
    assert_close(sim.strategy.c, want["c"])
    for i in range(len(SIZES)):
        assert_close(sim.strategy.c_local[i], want["ci"][i])


# ---------------------------------------------------------------- FedNAR on FedAvg / FedProx / SCAFFOLD
def hand_fednar(cfg: SimConfig, scaffold: bool = False) -> List[torch.Tensor]:
    hp = cfg.hparams()
    data = tiny_data()
    x = initial_params(cfg)
    c = [torch.zeros_like(p) for p in x]
    ci = {i: [torch.zeros_like(p) for p in x] for i in range(len(SIZES))}
    for t in range(cfg.rounds):
        lr_t = hp["lr"] * hp["round_decay"] ** t  # FedNAR's annealing: the optimizer must see t = round
        ys, new_ci = [], {}
        for i, cl in enumerate(data.train_clients):
            y = [p.clone() for p in x]
            for _ in range(K):
                g = grad(y, cl)
                d = [
                    gj + cfg.weight_decay * yj + hp["prox_mu"] * (yj - xj) + (cj - cij if scaffold else 0)
                    for gj, yj, xj, cj, cij in zip(g, y, x, c, ci[i])
                ]
                coef = min(1.0, hp["clip_norm"] / (float(norm(d)) + 1e-6))
                y = [yj - lr_t * coef * dj for yj, dj in zip(y, d)]
            ys.append(y)
            if scaffold:
                new_ci[i] = [cij - cj + (xj - yj) / (K * lr_t) for cij, cj, xj, yj in zip(ci[i], c, x, y)]
        x = weighted_avg_update(x, ys, list(SIZES), hp["server_lr"])
        for i, n in new_ci.items():
            c = [cj + (nj - oj) / len(SIZES) for cj, nj, oj in zip(c, n, ci[i])]
            ci[i] = n
    return x


@pytest.mark.parametrize("algorithm", ["fednar", "fednar-fedprox", "fednar-scaffold"])
def test_fednar_matches_hand(algorithm):
    cfg = tiny_config(
        algorithm, weight_decay=0.1, clip_norm=0.2, round_decay=0.5, prox_mu=0.3 if "prox" in algorithm else None
    )
    sim = run_sim(cfg)
    assert_close(sim.global_params, hand_fednar(cfg, scaffold=algorithm.endswith("scaffold")))


def test_fednar_sees_global_round_index():
    """A client that sits out rounds must still anneal by the global round index t."""
    cfg = tiny_config("fednar", rounds=4, clients_per_round=1, weight_decay=0.1, round_decay=0.5)
    sim = Simulation(cfg, data=tiny_data(), model_fn=lambda: nn.Linear(3, 2))
    seen = []
    begin = sim.strategy.opts.begin

    def recording(cid, client, t, **inputs):
        opt = begin(cid, client, t, **inputs)
        seen.append((cid, t, opt.round_index))
        return opt

    sim.strategy.opts.begin = recording
    for t in range(cfg.rounds):
        sim.run_round(t)
    assert [t for _, t, _ in seen] == list(range(cfg.rounds))
    assert all(index == t for _, t, index in seen)
    sat_out = [t for cid, t, _ in seen if t > 0 and all(c != cid for c, u, _ in seen if u < t)]
    assert sat_out, "some client must first train after round 1 (the case this test is for)"


# ---------------------------------------------------------------- PAdaMFed
def hand_padamfed(cfg: SimConfig, vr: bool) -> Dict:
    hp = cfg.hparams()
    eta, gamma, beta = hp["lr"], hp["server_lr"], hp["beta"]
    data = tiny_data()
    x = initial_params(cfg)
    n = len(SIZES)
    ci = {i: grad(x, cl) for i, cl in enumerate(data.train_clients)}  # mean of K full-batch grads at x0
    c = [cast(torch.Tensor, sum(ci[i][j] for i in range(n))) / n for j in range(len(x))]  # n >= 1 clients
    m = [cj.clone() for cj in c]
    for _ in range(cfg.rounds):
        ys, new_ci = [], {}
        for i, cl in enumerate(data.train_clients):
            y = [p.clone() for p in x]
            D = [beta * (cj - cij) + (1 - beta) * mj for cj, cij, mj in zip(c, ci[i], m)]
            acc = [torch.zeros_like(p) for p in x]
            H = grad(x, cl)
            for _ in range(K):
                G = grad(y, cl)
                v = [Gj + Dj - (1 - beta) * Hj if vr else beta * Gj + Dj for Gj, Dj, Hj in zip(G, D, H)]
                nv = max(float(norm(v)), 1e-12)
                y = [yj - eta * vj / nv for yj, vj in zip(y, v)]
                acc = [a + Gj for a, Gj in zip(acc, G)]
            ys.append(y)
            new_ci[i] = [a / K for a in acc]
        S = len(ys)
        dc = [sum(new_ci[i][j] - ci[i][j] for i in new_ci) for j in range(len(x))]
        x = [xj - gamma * sum(xj - y[j] for y in ys) / S / (eta * K) for j, xj in enumerate(x)]
        m = [beta * (dcj / S + cj) + (1 - beta) * mj for dcj, cj, mj in zip(dc, c, m)]
        c = [cj + dcj / n for cj, dcj in zip(c, dc)]
        ci.update(new_ci)
    return {"x": x, "c": c, "m": m, "ci": ci}


@pytest.mark.parametrize("algorithm", ["padamfed", "padamfed-vr"])
def test_padamfed_matches_hand(algorithm):
    cfg = tiny_config(algorithm, lr=None, server_lr=None)  # theory step sizes
    hp = cfg.hparams()
    assert (hp["lr"], hp["server_lr"], hp["beta"]) == theory_hparams(len(SIZES), K, ROUNDS, algorithm.endswith("vr"))
    cfg = cfg.replace(beta=0.6)  # theory gives beta = 1 here; exercise the momentum terms
    sim = run_sim(cfg)
    want = hand_padamfed(cfg, vr=algorithm.endswith("vr"))
    assert_close(sim.global_params, want["x"], tol=1e-5)
    assert_close(sim.strategy.c, want["c"], tol=1e-5)
    assert_close(sim.strategy.m, want["m"], tol=1e-5)


# ---------------------------------------------------------------- control-variate bookkeeping, partial participation
def controls(st, n_clients):
    """Every training client's control (SCAFFOLD: zero until the client first trains)."""
    return {
        i: [v.clone() for v in st.c_local[i]] if i in st.c_local else [torch.zeros_like(v) for v in st.c]
        for i in range(n_clients)
    }


@pytest.mark.parametrize("algorithm", ["scaffold", "fednar-scaffold", "padamfed"])
def test_control_variates_under_partial_participation(algorithm):
    sizes = (2, 3, 4, 5, 6)
    padam = algorithm == "padamfed"
    cfg = tiny_config(
        algorithm,
        clients=len(sizes),
        clients_per_round=2,
        rounds=5,
        lr=None if padam else LR,
        server_lr=None if padam else SERVER_LR,
    )
    sim = Simulation(cfg, data=tiny_data(sizes), model_fn=lambda: nn.Linear(3, 2))
    st, beta = sim.strategy, cfg.hparams()["beta"]
    sim.load_global()
    st.setup()
    sim.setup_done = True
    seen = set()
    for t in range(cfg.rounds):
        before = controls(st, len(sizes))
        c_old = [v.clone() for v in st.c]
        m_old = [v.clone() for v in st.m] if padam else None
        sampled = sim.run_round(t)["clients"]
        seen.update(sampled)
        after = controls(st, len(sizes))
        assert len(sampled) == 2
        # clients that sat out keep their control; the sampled ones got a new one
        for i in range(len(sizes)):
            if i not in sampled:
                assert_close(after[i], before[i], tol=0)
        # c stays the mean over ALL training clients: c' = c + sum_{i in S}(c_i' - c_i) / N
        assert_close(st.c, [sum(cs[j] for cs in after.values()) / len(sizes) for j in range(len(st.c))], tol=1e-6)
        dc = [sum(after[i][j] - before[i][j] for i in sampled) for j in range(len(st.c))]
        assert_close(st.c, [c + d / len(sizes) for c, d in zip(c_old, dc)], tol=1e-6)
        if padam:  # m' = beta * (dc / S + c) + (1 - beta) * m, with the old c
            assert_close(st.m, [beta * (d / 2 + c) + (1 - beta) * m for d, c, m in zip(dc, c_old, m_old)], tol=1e-6)
    if not padam:
        assert set(st.c_local) == seen


def test_padamfed_initialisation():
    """c_i = mean of K gradients at x0 for every training client; c = mean_i c_i; m = c (Alg. 1 line 1)."""
    cfg = tiny_config("padamfed", lr=None, server_lr=None)
    sim = Simulation(cfg, data=tiny_data(), model_fn=lambda: nn.Linear(3, 2))
    sim.load_global()
    sim.strategy.setup()
    x = [p.clone() for p in sim.global_params]
    for i, cl in enumerate(sim.train_clients):
        assert_close(sim.strategy.c_local[i], grad(x, cl))
    assert_close(sim.strategy.c, [sum(sim.strategy.c_local[i][j] for i in range(3)) / 3 for j in range(2)])
    assert_close(sim.strategy.m, sim.strategy.c, tol=0)


def flat_state(state) -> List[torch.Tensor]:
    """Every tensor of a server state (lists, and dicts of lists by client id) in a fixed order."""
    out = []
    for key in sorted(state):
        v = state[key]
        for ts in [v[i] for i in sorted(v)] if isinstance(v, dict) else [v]:
            out += ts
    return out


@pytest.mark.parametrize("algorithm", ["scaffold", "padamfed-vr", "fednar"])
def test_sync_from_restores_the_whole_server_state(algorithm):
    """--validate re-synchronises a run to the reference each round: global model + server state suffice."""
    padam = algorithm.startswith("padamfed")
    cfg = tiny_config(
        algorithm,
        clients=5,
        clients_per_round=2,
        rounds=3,
        lr=None if padam else LR,
        server_lr=None if padam else SERVER_LR,
    )
    a, b = (Simulation(cfg, data=tiny_data((2, 3, 4, 5, 6)), model_fn=lambda: nn.Linear(3, 2)) for _ in range(2))
    for t in range(2):
        a.run_round(t)
        b.run_round(t)
    with torch.no_grad():  # knock b off course: model and every server tensor
        for x in b.global_params + flat_state(b.strategy.server_state()):
            x.add_(0.1)
    b.sync_from(a)
    a.run_round(2)
    b.run_round(2)
    assert_close(b.global_params, a.global_params, tol=0)
    assert_close(flat_state(b.strategy.server_state()), flat_state(a.strategy.server_state()), tol=0)
