"""--client-batched: the client-batched round reproduces the sequential one, for every algorithm.

Tiny image data (8x8, 4 classes) on the simulator's CNN, clients of very different sizes (one
smaller than the batch size, others whose epochs end in a short batch), chunks that leave an
inactive slot. The sequential run (one client after another, per-client optimizers) is the
reference: the client-batched run must stay within rounding of it. The validations run in float64
(validate.py's docstring says why): rounding-only divergences are then ~1e-16 relative on any CPU
(observed 1.2e-16), so ``ROUNDING_RTOL`` (float64's eps times 1e6 for the amplification by
normalised or cancelling updates) still sits six orders of magnitude below the documented 1e-4.
"""

import math
from typing import Any, Dict

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedopt_kernels
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.sim.batched.batches import BatchPool
from fedopt_kernels.sim.batched.loss import VmapLoss
from fedopt_kernels.sim.batched.size import MAX_AUTO, activation_bytes, auto_clients_at_once
from fedopt_kernels.sim.batched.trainer import clip_per_client_
from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import VARIANTS, SimConfig
from fedopt_kernels.sim.data.clients import BatchStream, ClientData
from fedopt_kernels.sim.federated_data import FederatedData
from fedopt_kernels.sim.models.small import SmallCNN
from fedopt_kernels.sim.simulation import Simulation
from fedopt_kernels.sim.validate import PARAM_RTOL, validate_client_batched

ROUNDING_RTOL = 1e6 * torch.finfo(torch.float64).eps
SIZES = (3, 9, 14, 6, 22)  # batch size 4: client 0 always short, the others end epochs short
SHAPE = (1, 8, 8)
ROUNDS = 2


# the simulator's tiny models: one torch thread (conftest.py), as fedopt-sim's --threads default
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_images(sizes=SIZES) -> FederatedData:
    g = torch.Generator().manual_seed(0)
    users = []
    for i, n in enumerate(sizes):
        y = torch.randint(0, 4, (n + 2,), generator=g)
        x = torch.randn(n + 2, *SHAPE, generator=g) + y.view(-1, 1, 1, 1) * 0.5  # learnable
        users.append(ClientData(i, x[:n], y[:n], x[n : n + 1], y[n : n + 1], x[n + 1 :], y[n + 1 :]))
    return FederatedData(users, [], SHAPE, 4)


def model_fn() -> nn.Module:
    return SmallCNN(SHAPE, 4, channels=(3, 4))


def tiny_config(algorithm: str, **kw) -> SimConfig:
    base: Dict[str, Any] = dict(
        algorithm=algorithm,
        clients=len(SIZES),
        holdout_fraction=0.0,
        clients_per_round=4,
        local_steps=3,
        batch_size=4,
        rounds=ROUNDS,
        lr=0.1,
        backend="reference",
        device="cpu",
        finetune_steps=0,
        client_batched=3,
    )  # 4 sampled -> chunks of 2 + 2
    base.update(kw)
    return SimConfig(**base)


# options that make each algorithm's round inputs and update rule matter (momentum, clipping, decays)
EXTRA = {
    "feddecay": dict(momentum=0.9, clip_norm=0.5, round_decay=0.9, beta=0.7),
    "fednlr": dict(momentum=0.5, weight_decay=1e-3),
    "fedprox": dict(prox_mu=0.5),
    "fednar": dict(clip_norm=0.5, weight_decay=1e-2),
    "fednar-fedprox": dict(prox_mu=0.5),
    "fednar-scaffold": dict(clip_norm=1.0),
    "scaffold": dict(momentum=0.5),
    "fedavg": dict(clients_per_round=5),
}  # 5 sampled: chunks of 2, 2 and 1 (one inactive slot)


def _op(algorithm: str) -> str:
    return SimConfig(algorithm=algorithm).algo.op.name + "_batched"


@pytest.mark.parametrize("backend", _registry.BACKENDS)
@pytest.mark.parametrize("algorithm", list(VARIANTS))
def test_client_batched_reproduces_the_sequential_run(algorithm, backend):
    why = _registry.unavailable_reason(backend, torch.device("cpu"), _op(algorithm))
    if why is not None:
        pytest.skip(str(why))
    cfg = tiny_config(algorithm, backend=backend, **EXTRA.get(algorithm, {}))
    v = validate_client_batched(cfg, data=tiny_images(), model_fn=model_fn)
    assert v.passed, v.report()
    # backends with float64 kernels: rounding only (vmap's convolutions sum in another order), so a
    # bound far below the documented tolerance catches a wrong term early
    assert v.max_rel <= (ROUNDING_RTOL if v.dtype == "float64" else PARAM_RTOL), v.report()
    assert len(v.rounds) == ROUNDS


def test_validation_catches_padding_counted_as_samples(monkeypatch):
    """Not vacuous: averaging over the padded batch (padding counted as data) fails validation."""
    draw = BatchPool.draw

    def wrong(self, *args, **kwargs):
        rb = draw(self, *args, **kwargs)
        rb.w = torch.full_like(rb.w, 1.0 / rb.w.shape[-1])
        return rb

    monkeypatch.setattr(BatchPool, "draw", wrong)
    v = validate_client_batched(tiny_config("fedavg"), data=tiny_images(), model_fn=model_fn)
    assert not v.passed and v.max_rel > 1e-4, v.report()


def _train(cfg, emulate: bool):
    sim = Simulation(cfg, data=tiny_images(), model_fn=model_fn)
    if emulate:
        assert sim.batched is not None  # the config trains client-batched
        sim.batched.replay_mode = "emulate"
    for t in range(cfg.rounds):
        sim.run_round(t)
    return sim


@pytest.mark.parametrize(
    "algorithm", ["feddecay", "fednlr", "fednar-scaffold", "padamfed-vr", "fedsam-scaffold", "fedasam"]
)
def test_replay_bookkeeping_replays_exactly(algorithm):
    """The replay path's state/hp handling, emulated on the CPU: the recorded optimizer calls
    replayed with the captured tensors over 3 rounds (round 0: 2 eager steps, capture, replays;
    later rounds: replays only) equal the eager client-batched run bit for bit. FedSAM's step is
    captured whole: ascent, the closure's second gradients, restore and descent."""
    cfg = tiny_config(algorithm, rounds=3, local_steps=4, clients_per_round=5, **EXTRA.get(algorithm, {}))
    eager, replayed = _train(cfg, False), _train(cfg, True)
    g = replayed.batched.trainer.replay
    assert g.plan is not None and g.recorded and g.eager_steps == 2
    closure_step = cfg.algo.closure_step
    assert len(g.recorded) == (3 if closure_step else 1)  # FedSAM: the ascent, the restore, the descent
    assert [after for after, *_ in g.recorded] == ([False, True, True] if closure_step else [False])
    for a, b in zip(eager.global_params, replayed.global_params):
        assert torch.equal(a, b)
    assert [h["train_loss"] for h in eager.history] == [h["train_loss"] for h in replayed.history]
    if algorithm == "padamfed-vr":
        for cid, ci in eager.strategy.c_local.items():
            assert all(torch.equal(x, y) for x, y in zip(ci, replayed.strategy.c_local[cid]))


# ------------------------------------------------------------------ unequal batches
def test_padded_batches_give_each_clients_mean_gradient():
    data = tiny_images((1, 6, 4))
    clients = data.train_clients
    pool = BatchPool(clients, batch_size=4)
    streams = {c.client_id: BatchStream(c.train_x, c.train_y, 4, np.random.default_rng(c.client_id)) for c in clients}
    twins = {c.client_id: BatchStream(c.train_x, c.train_y, 4, np.random.default_rng(c.client_id)) for c in clients}
    rb = pool.draw(streams, [0, 1, 2], steps=2)
    assert rb.x.shape == (2, 3, 4) + SHAPE and rb.counts.tolist() == [[1, 4, 4], [1, 2, 4]]
    assert torch.allclose(rb.w.sum(-1), torch.ones(2, 3))
    model = model_fn()
    loss = VmapLoss(model)
    stacked = [
        p.detach().unsqueeze(0).repeat(3, *([1] * p.dim())) + 0.01 * torch.randn(3, *p.shape)
        for p in model.parameters()
    ]
    for k in range(2):
        grads, losses = loss.grads(stacked, rb.x[k], rb.y[k], rb.w[k])
        for c in range(3):
            x, y = twins[c].next()  # the same batch, unpadded, as the sequential run sees it
            assert rb.counts[k, c] == len(y)
            ps = [s[c].clone().requires_grad_() for s in stacked]
            ref = F.cross_entropy(torch.func.functional_call(model, dict(zip(loss.names, ps)), (x,)), y)
            want = torch.autograd.grad(ref, ps)
            torch.testing.assert_close(losses[c], ref.detach(), rtol=1e-6, atol=1e-7)
            for g, w in zip(grads, want):
                torch.testing.assert_close(g[c], w, rtol=1e-5, atol=1e-7)


def test_augmentation_draws_the_sequential_random_crops(tmp_path):
    """CIFAR with --augment: the input stage runs outside vmap, batch by batch, client after client
    (and PAdaMFed-VR's anchor model from its own stream), so the crops are the sequential run's."""
    from sim_data_files import write_cifar10

    write_cifar10(tmp_path, per_batch=8, test=4)
    cfg = SimConfig(
        algorithm="padamfed-vr",
        dataset="cifar10",
        data_dir=str(tmp_path),
        model="cnn",
        augment=True,
        clients=6,
        holdout_fraction=0.0,
        rounds=2,
        local_steps=2,
        batch_size=3,
        clients_per_round=3,
        finetune_steps=1,
        backend="reference",
        device="cpu",
        client_batched=2,
    )
    v = validate_client_batched(cfg)
    assert v.passed and v.dtype == "float64" and v.max_rel <= ROUNDING_RTOL, v.report()


@pytest.mark.parametrize("algorithm", ["fednar-scaffold", "padamfed"])
def test_fedavg_cnn_on_cifar_matches_the_sequential_run(tmp_path, algorithm):
    """The FedAvg paper's CNN (2.2M parameters, 5x5 convs, two pools) with augmentation, on the fused
    backend auto picks: client-batched rounds reproduce the sequential ones. (In float32 this failed
    on AVX-512 CPUs: a max-pool/ReLU decision taken differently by the two roundings of oneDNN's
    convolutions moved one client's conv gradient by 1e-3 relative; the validation runs in float64.)"""
    from sim_data_files import write_cifar10

    write_cifar10(tmp_path, per_batch=12, test=6)
    cfg = SimConfig(
        algorithm=algorithm,
        dataset="cifar10",
        data_dir=str(tmp_path),
        model="fedavg-cnn",
        augment=True,
        clients=6,
        holdout_fraction=0.0,
        rounds=2,
        local_steps=2,
        batch_size=4,
        clients_per_round=3,
        finetune_steps=0,
        backend="auto",
        device="cpu",
        client_batched=3,
    )
    v = validate_client_batched(cfg)
    assert v.passed and v.dtype == "float64" and v.max_rel <= ROUNDING_RTOL, v.report()


_OTHER_ISA = """
import sys, tempfile, pathlib
import torch
torch.set_num_threads(1)
from sim_data_files import write_cifar10
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.validate import validate_client_batched
root = pathlib.Path(tempfile.mkdtemp())
write_cifar10(root, per_batch=12, test=6)
for algorithm in ("padamfed",):
    cfg = SimConfig(algorithm=algorithm, dataset="cifar10", data_dir=str(root), model="fedavg-cnn", augment=True,
                    clients=6, holdout_fraction=0.0, rounds=2, local_steps=2, batch_size=4, clients_per_round=3,
                    finetune_steps=0, backend="auto", device="cpu", client_batched=3)
    v = validate_client_batched(cfg)
    print(algorithm, v.passed, v.dtype, repr(v.max_rel))
"""


def test_validation_holds_on_other_cpu_kernels():
    """The CIFAR validation above in a fresh process that selects other CPU kernels: oneDNN limited to
    AVX2 and ATen's baseline kernels, one thread, PAdaMFed (whose failure on AVX-512 was reported
    first). The in-process runs cover this machine's defaults; docs/testing.md has the full sweep
    over instruction sets and threads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(
        os.environ,
        ONEDNN_MAX_CPU_ISA="AVX2",
        ATEN_CPU_CAPABILITY="default",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_ISA], env=env, cwd=tests.parent, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert [r[0] for r in rows] == ["padamfed"], out.stdout
    for _name, passed, dtype, rel in rows:
        assert passed == "True" and dtype == "float64" and float(rel) <= ROUNDING_RTOL, out.stdout


def test_per_client_clipping_is_clip_grad_norm():
    grads = [torch.randn(3, 4, 5), torch.randn(3, 7)]
    for g in grads:
        g[1] *= 1e-3  # client 1 is under the threshold: unchanged
    before = [g.clone() for g in grads]
    want = []
    for c in range(3):
        ps = [torch.zeros_like(t[c], requires_grad=True) for t in grads]
        for p, t in zip(ps, grads):
            p.grad = t[c].clone()
        torch.nn.utils.clip_grad_norm_(ps, 0.5)  # what the sequential run does per client
        want.append([p.grad for p in ps])
    clip_per_client_(grads, 0.5)
    for c in range(3):
        for g, w in zip(grads, want[c]):
            torch.testing.assert_close(g[c], w)
    assert all(torch.equal(g[1], b[1]) for g, b in zip(grads, before))
    assert not torch.equal(grads[0][0], before[0][0])


# ------------------------------------------------------------------ models vmap cannot carry
class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(72, 4)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).flatten(1))


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 4)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.fc(x.flatten(1) * self.scale)


@pytest.mark.parametrize(
    "model,names", [(WithBatchNorm, r"BatchNorm layer\(s\) bn"), (WithBuffer, r"buffer\(s\) scale")]
)
def test_batchnorm_or_buffers_are_refused_by_name(model, names):
    with pytest.raises(ValueError, match=r"--client-batched needs a BatchNorm- and buffer-free model") as exc:
        Simulation(tiny_config("fedavg"), data=tiny_images(), model_fn=model)
    assert exc.match(names)
    Simulation(tiny_config("fedavg", client_batched=1), data=tiny_images(), model_fn=model)  # sequential: fine


# ------------------------------------------------------------------ auto and bad values
def test_auto_fits_the_estimate():
    model = model_fn()
    x, y = torch.randn(4, *SHAPE), torch.randint(0, 4, (4,))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    per_client = param_bytes * (4 + 2) + 2 * activation_bytes(model, x, y)
    assert activation_bytes(model, x, y) > x.numel() * 4  # at least the conv outputs are saved
    assert auto_clients_at_once(model, x, y, 2, 1000, budget=3 * per_client + 1) == 3
    assert auto_clients_at_once(model, x, y, 2, 1000, budget=per_client // 2) == 1  # never below 1
    assert auto_clients_at_once(model, x, y, 2, 7, budget=1 << 40) == 7  # never above the sampled
    assert auto_clients_at_once(model, x, y, 2, 5000, budget=1 << 40) == MAX_AUTO  # nor past the cap
    # formulations="default": nothing timed, the largest number that fits
    cfg = tiny_config("padamfed", client_batched="auto", formulations="default")
    sim = Simulation(cfg, data=tiny_images(), model_fn=model_fn)
    assert sim.batched.at_once == sim.batched.size == 4  # a tiny model: every sampled client at once
    assert sim.model.training  # the measurement left the model as it was
    # measured ("auto"): one of the equal chunk sizes that fit, largest first (batched/choose.py)
    sim = Simulation(cfg.replace(formulations="auto"), data=tiny_images(), model_fn=model_fn)
    assert sim.batched.size in (4, 2, 1) and sim.batched.at_once == sim.batched.size
    assert sim.model.training


SHORT = [
    "--clients",
    "10",
    "--rounds",
    "2",
    "--local-steps",
    "2",
    "--clients-per-round",
    "3",
    "--finetune-steps",
    "1",
    "--quiet",
    "--no-files",
]


@pytest.mark.parametrize(
    "args,names",
    [
        (["--client-batched", "0"], "--client-batched"),
        (["--client-batched", "-3"], "--client-batched"),
        (["--client-batched", "many"], "--client-batched"),
        (["--client-batched", "1.5"], "--client-batched"),
        (["--validate", "sequential"], "--client-batched"),
        (["--replay"], "--replay"),
        (["--client-batched", "2", "--replay", "--device", "cpu"], "--replay"),
    ],
)
def test_bad_client_batched_input_exits_2_naming_it(args, names, capsys):
    with pytest.raises(SystemExit) as exc:
        fedopt_sim.main(SHORT + args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert names in err, err


def test_config_refuses_bad_values():
    for bad in (0, -1, 2.0, True, "all"):
        with pytest.raises(ValueError, match="client_batched"):
            SimConfig(client_batched=bad).validate()


def test_cli_validate_sequential_on_digits(capsys):
    status = fedopt_sim.main(
        SHORT + ["--algorithm", "fednar-scaffold", "--client-batched", "2", "--validate", "sequential"]
    )
    out = capsys.readouterr().out
    assert status == 0 and "PASS" in out, out
    assert "sequential [" in out and "client-batched 2 [" in out
    assert "client-batched" in fedopt_sim.build_parser().format_help()


def test_validate_sequential_without_float64_kernels_checks_paths_and_kernels_apart():
    """triton (interpreted here) has no float64 kernels: the two gradient paths are validated in
    float64 on a stand-in backend, and triton's batched kernels against the reference batched op on
    the client-batched path in float32. A wrong kernel fails the second part."""
    why = _registry.unavailable_reason("triton", torch.device("cpu"), "fednar_batched")
    if why is not None:
        pytest.skip(why)
    cfg = tiny_config(
        "fednar-scaffold",
        **dict(EXTRA.get("fednar-scaffold", {}), backend="triton", rounds=2, local_steps=2, clients_per_round=3),
    )
    v = validate_client_batched(cfg, data=tiny_images(), model_fn=model_fn)
    assert v.passed, v.report()
    assert [p.dtype for p in v.parts] == ["float64"] and v.dtype == "float32"
    assert "[reference]" in v.parts[0].backend and "[triton]" in v.backend
    assert "PASS" in v.report("x")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("algorithm", ["feddecay", "fednar-scaffold", "padamfed-vr", "fedsam-scaffold"])
def test_replay_matches_eager_on_gpu(algorithm, backend):
    """The real capture: a fused batched backend on CUDA, replay vs eager (same backend); then
    ``--validate sequential`` with replay: in float64 on cuda; on triton (no float64 kernels) the
    paths in float64 on cuda and triton's kernels against the reference on the client-batched path."""
    why = _registry.unavailable_reason(backend, torch.device("cuda"), _op(algorithm))
    if why is not None:
        pytest.skip(why)
    kw = dict(EXTRA.get(algorithm, {}), device="cuda", backend=backend, rounds=3, local_steps=4, clients_per_round=5)
    cfg = tiny_config(algorithm, **kw)
    data = tiny_images()
    data = FederatedData(
        [
            ClientData(c.client_id, *(t.cuda() for t in (c.train_x, c.train_y, c.val_x, c.val_y, c.test_x, c.test_y)))
            for c in data.train_clients
        ],
        [],
        SHAPE,
        4,
    )
    eager = Simulation(cfg, data=data, model_fn=model_fn)
    replayed = Simulation(cfg.replace(replay=True), data=data, model_fn=model_fn)
    for t in range(cfg.rounds):
        eager.run_round(t)
        replayed.run_round(t)
    assert replayed.batched.trainer.replay.graph is not None
    for a, b in zip(eager.global_params, replayed.global_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    seq = validate_client_batched(cfg.replace(replay=True), data=data, model_fn=model_fn)
    assert seq.passed, seq.report()
    assert math.isfinite(seq.max_rel)
    if backend == "cuda":
        assert seq.dtype == "float64" and not seq.parts
    else:
        assert seq.dtype == "float32" and [p.dtype for p in seq.parts] == ["float64"]
        assert "[reference]" in seq.reference and "[triton]" in seq.backend
    assert fedopt_kernels.available_backends("cuda")
