"""User-level differential privacy, the slower half (docs/privacy.md): accounting against
``dp-accounting`` for both samplings and PLD, calibration, then the simulator's rounds under DP
(the clip's bound, epsilon per round, reproducibility, resume, the budget stop, bad input)."""

import math
import sys

import pytest
import torch
from test_sim_resume import assert_same_run, make, model_fn, tiny_config, tiny_images

from fedopt_kernels.privacy import Sampling, calibrate, epsilon
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.simulation import Simulation

dp = pytest.importorskip("dp_accounting")

pytestmark = pytest.mark.usefixtures("one_thread")


def norm64(tensors) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten().tolist()))


# -------------------------------------------------------------------------------------- accounting
def library_epsilon(kind, sampling, z, rounds, delta, accountant="rdp"):
    if kind == "poisson":
        event = dp.PoissonSampledDpEvent(sampling.rate, dp.GaussianDpEvent(z))
        acc = dp.rdp.RdpAccountant() if accountant == "rdp" else dp.pld.PLDAccountant()
    else:
        event = dp.SampledWithoutReplacementDpEvent(sampling.population, sampling.per_round, dp.GaussianDpEvent(z))
        acc = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
    return acc.compose(dp.SelfComposedDpEvent(event, rounds)).get_epsilon(delta)


@pytest.mark.parametrize("kind", ["poisson", "fixed"])
def test_epsilon_equals_dp_accounting(kind):
    sampling = Sampling(kind, 1000, per_round=30, rate=0.03)
    for z, rounds, delta in ((0.8, 1, 1e-5), (1.1, 37, 1e-6), (2.5, 500, 1e-3)):
        ours = epsilon(sampling, z, rounds, delta)
        assert ours == pytest.approx(library_epsilon(kind, sampling, z, rounds, delta), rel=1e-6)


def test_pld_epsilon_equals_dp_accounting_and_needs_poisson():
    sampling = Sampling("poisson", 1000, rate=0.05)
    ours = epsilon(sampling, 1.0, 20, 1e-5, "pld")
    assert ours == pytest.approx(library_epsilon("poisson", sampling, 1.0, 20, 1e-5, "pld"), rel=1e-6)
    with pytest.raises(ValueError, match="poisson"):
        epsilon(Sampling("fixed", 10, per_round=2), 1.0, 3, 1e-5, "pld")


def test_calibrate_meets_the_target_and_refuses_an_unreachable_one():
    sampling = Sampling("poisson", 500, rate=0.1)
    z = calibrate(sampling, 3.0, 50, 1e-5)
    assert epsilon(sampling, z, 50, 1e-5) <= 3.0
    assert epsilon(sampling, z * 0.99, 50, 1e-5) > 3.0  # the smallest z, to a percent
    with pytest.raises(ValueError, match="dp_target_epsilon=0.001 cannot be reached in 50 rounds"):
        calibrate(sampling, 1e-3, 50, 1e-5)


# ------------------------------------------------------------------------------------- the simulator
def dp_config(algorithm="fedavg", **kw):
    base = dict(dp_clip=0.05, dp_noise_multiplier=0.7, dp_delta=1e-3)
    base.update(kw)
    return tiny_config(algorithm, **base)


def test_with_no_noise_each_aggregate_is_within_the_clip():
    """z = 0 and C below every update's norm: FedAvg (server_lr 1) moves the model by at most C a round."""
    C = 1e-3
    for cfg, bounded in (
        (dp_config(dp_clip=C, dp_noise_multiplier=0.0, server_lr=1.0, rounds=4), True),
        (tiny_config("fedavg", server_lr=1.0, rounds=4), False),
    ):
        sim = Simulation(cfg, data=tiny_images(), model_fn=model_fn, dtype=torch.float64)
        steps = []
        for t in range(cfg.rounds):
            before = [p.clone() for p in sim.global_params]
            sim.run_round(t)
            moved = norm64([a - b for a, b in zip(sim.global_params, before)])
            # x + a - x in float64 errs by at most half an ulp of x per element
            slack = math.sqrt(sum(p.numel() for p in before)) * max(float(p.abs().max()) for p in before) * 2**-53
            steps.append((moved, slack))
        if bounded:
            assert all(moved <= C * (1 + 1e-12) + slack for moved, slack in steps), steps
        else:  # without the clip the same rounds move further: the bound above is the clip's
            assert all(moved > 10 * C for moved, _ in steps), steps


def test_epsilon_in_every_round_equals_dp_accounting():
    for kind in ("fixed", "poisson"):
        sim = make(dp_config(sampling=kind, rounds=3))
        result = sim.run()
        s = sim.privacy.sampling
        for rec in result["history"]:
            want = library_epsilon(kind, s, 0.7, rec["round"], 1e-3)
            assert rec["dp_epsilon"] == pytest.approx(want, rel=1e-6)
        assert result["privacy"]["epsilon"] == result["history"][-1]["dp_epsilon"]


@pytest.mark.parametrize("mode", [{}, {"client_batched": 2}])
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "padamfed"])
def test_same_seed_same_run_and_resume_is_bitwise(tmp_path, algorithm, mode):
    cfg = dp_config(
        algorithm, dp_adaptive_quantile=0.5, sampling="poisson", clients_per_round=3, dp_noise_multiplier=0.1, **mode
    )
    whole = make(cfg)
    want = whole.run()
    twin = make(cfg)
    assert_same_run(whole, want, twin, twin.run())
    first = make(cfg, tmp_path)
    first.run_round(0)
    first.save_checkpoint()
    first.run_round(1)  # lost with the process
    del first
    again = make(cfg, tmp_path)
    got = again.run(resume=True)
    assert again.resumed_from == 1
    assert_same_run(whole, want, again, got)
    assert got["privacy"] == want["privacy"]
    assert [r["dp_clip"] for r in got["history"]] == [r["dp_clip"] for r in want["history"]]


def test_a_run_stops_before_the_round_that_would_pass_the_budget(tmp_path):
    cfg = dp_config(rounds=3)
    eps = [make(cfg).privacy.epsilon_after(r) for r in (1, 2)]
    limited = cfg.replace(dp_max_epsilon=(eps[0] + eps[1]) / 2)
    sim = make(limited, tmp_path)
    result = sim.run()
    assert len(result["history"]) == 1 and "stopped before round 2" in result["privacy"]["stopped"]
    # checkpointed: a larger budget continues it where it stopped
    more = make(limited.replace(dp_max_epsilon=100.0), tmp_path)
    assert more.load_checkpoint() and len(more.history) == 1
    assert len(more.run(resume=True)["history"]) == 3


def test_poisson_rounds_draw_sorted_clients_and_survive_an_empty_one():
    sim = make(dp_config(sampling="poisson", clients_per_round=1, rounds=12))
    result = sim.run()
    sizes = [len(r["clients"]) for r in result["history"]]
    assert all(r["clients"] == sorted(r["clients"]) for r in result["history"])
    assert 0 in sizes and max(sizes) > 1, sizes  # this seed draws an empty round and a crowded one
    assert all(math.isfinite(p.abs().sum().item()) for p in sim.global_params)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"dp_clip": 0.0}, "dp_clip"),
        ({"dp_clip": -1.0}, "dp_clip"),
        ({"dp_noise_multiplier": -0.5}, "dp_noise_multiplier"),
        ({"dp_delta": 1.0}, "dp_delta"),
        ({"dp_delta": 0.0}, "dp_delta"),
        ({"dp_noise_multiplier": None}, "exactly one"),
        ({"dp_noise_multiplier": None, "dp_target_epsilon": 1e-6}, "cannot be reached"),
        ({"dp_accountant": "pld"}, "poisson"),
        ({"dp_adaptive_quantile": 1.5}, "dp_adaptive_quantile"),
        ({"dp_clip_lr": 0.0}, "dp_clip_lr"),
        ({"sampling": "sometimes"}, "sampling"),
    ],
)
def test_bad_privacy_settings_are_named(change, named):
    with pytest.raises(ValueError, match=named):
        make(dp_config(**change))


def test_dp_settings_without_dp_clip_are_refused():
    with pytest.raises(ValueError, match=r"dp_noise_multiplier applies .* dp_clip"):
        tiny_config("fedavg", dp_noise_multiplier=1.0).validate()


def test_dp_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed
    with pytest.raises(ValueError, match=r"fedopt_kernels\[privacy\]"):
        dp_config().validate()
    SimConfig().validate()  # a run without DP needs no extra


# ------------------------------------------------------------------------------ fedopt-sim, ranks
DP_ARGS = ["--algorithm", "scaffold", "--dp-clip", "0.3", "--dp-noise-multiplier", "0.05", "--sampling", "poisson"]
DP_ARGS += ["--dp-adaptive-quantile", "0.5", "--dp-delta", "1e-3", "--client-batched", "2"]


def test_fedopt_sim_twice_and_on_two_ranks_writes_the_same_dp_run(tmp_path):
    """The same seed twice: the same files but for times; on two ranks (torchrun): the noise is added
    once after the merge, identically, so the run equals one process's to rounding, twice bitwise."""
    import subprocess

    from test_sim_ranks import SIM, TORCHRUN, _env, _torchrun, _without_times

    for name in ("one-a", "one-b"):
        done = subprocess.run(
            [sys.executable, *SIM, *DP_ARGS, "--out", str(tmp_path / name)],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "epsilon" in done.stderr  # the summary line says what the run spent
    one_a, one_b = (_without_times(tmp_path / n / "metrics_seed0.json") for n in ("one-a", "one-b"))
    assert one_a == one_b
    assert one_a["privacy"]["rounds"] == 6 and all("dp_epsilon" in r for r in one_a["history"])
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed")
    for name in ("two-a", "two-b"):
        _torchrun(["--standalone", *SIM, *DP_ARGS, "--out", str(tmp_path / name)], tmp_path)
    two_a, two_b = (_without_times(tmp_path / n / "metrics_seed0.json") for n in ("two-a", "two-b"))
    assert two_a == two_b and two_a["ranks"]["world_size"] == 2
    for a, b in zip(one_a["history"], two_a["history"], strict=True):
        assert a["clients"] == b["clients"] and a["dp_epsilon"] == b["dp_epsilon"]
        assert a["dp_clip"] == pytest.approx(b["dp_clip"], rel=1e-9)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    assert one_a["privacy"]["epsilon"] == two_a["privacy"]["epsilon"]
