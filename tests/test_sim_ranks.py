"""One run on several processes (torchrun; fedopt_kernels.sim.ranks): every rank ends each round with
the same model and server state, and the run equals the one-process run to rounding.

Real ``torchrun`` launches (the split alone: test_ranks_split.py) on this machine's CPU (gloo): every
registered algorithm variant, one client after another and client-batched, on 2 processes against
1; ``fedopt-sim`` under torchrun twice (the same files but for times), on two "machines" (two
launches with ``--nnodes 2``), and with one rank killed mid-run and restarted by torchrun.
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fedopt_kernels.sim.config import VARIANTS

HERE = Path(__file__).resolve().parent
TORCHRUN = shutil.which("torchrun")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("FEDOPT_TEST_KILL_RANK", None)
    return env


def _torchrun(args, cwd, nproc=2, extra=(), env=None, timeout=900):
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), *extra, *args]
    done = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def _close(a: float, b: float, rel: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _assert_same_to_rounding(one: dict, two: dict, name: str) -> None:
    """Losses within 1e-4 relative, accuracies within 0.1 pp (the one-process run's sums are added
    in another order: the runs agree to rounding, not bit for bit)."""
    for a, b in zip(one["history"], two["history"], strict=True):
        assert a["clients"] == b["clients"] and a.get("left_out") == b.get("left_out"), name
        assert _close(a["train_loss"], b["train_loss"], 1e-4), (name, a, b)
        if "val_loss" in a:
            assert _close(a["val_loss"], b["val_loss"], 1e-4) and abs(a["val_acc"] - b["val_acc"]) <= 1e-3, name
    for group in ("global", "finetuned"):
        for users in one["final"][group]:
            x, y = one["final"][group][users], two["final"][group][users]
            assert x["users"] == y["users"] and abs(x["mean"] - y["mean"]) <= 1e-3, (name, group, users, x, y)
    assert abs(one["final"]["pooled_test_acc"] - two["final"]["pooled_test_acc"]) <= 1e-3, name
    for p, q in zip(one["params"], two["params"], strict=True):
        flat_p, flat_q = _flat(p), _flat(q)
        scale = max(max(abs(v) for v in flat_p), 1e-12)
        assert max(abs(u - v) for u, v in zip(flat_p, flat_q)) <= 1e-4 * scale, name


def _flat(x):
    return [v for e in x for v in _flat(e)] if isinstance(x, list) else [x]


@needs_torchrun
@pytest.mark.slow
def test_every_algorithm_on_two_processes_agrees_with_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    _torchrun(["--standalone", str(HERE / "ranks_child.py"), str(two)], tmp_path, nproc=2)
    subprocess.run([sys.executable, str(HERE / "ranks_child.py"), str(one)], check=True, cwd=tmp_path, env=_env())
    names = [f"{v}-{m}" for v in VARIANTS for m in ("sequential", "client-batched")]
    for name in names:
        a, b = (json.loads((d / f"{name}.json").read_text()) for d in (one, two))
        assert b["ranks"]["world_size"] == 2 and sum(b["ranks"]["clients"]) == 3 * 5
        assert min(b["ranks"]["clients"]) > 0
        _assert_same_to_rounding(a, b, name)


@needs_torchrun
def test_two_algorithms_on_two_processes_agree_with_one(tmp_path):
    """A short share of the test above: SCAFFOLD's and PAdaMFed's client state in shared files."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    _torchrun(["--standalone", str(HERE / "ranks_child.py"), str(two), "scaffold", "padamfed"], tmp_path)
    subprocess.run(
        [sys.executable, str(HERE / "ranks_child.py"), str(one), "scaffold", "padamfed"], check=True, env=_env()
    )
    for name in ("scaffold-sequential", "scaffold-client-batched", "padamfed-sequential", "padamfed-client-batched"):
        a, b = (json.loads((d / f"{name}.json").read_text()) for d in (one, two))
        _assert_same_to_rounding(a, b, name)


@needs_torchrun
@pytest.mark.slow
def test_uneven_work_on_two_processes_agrees_with_one(tmp_path):
    """Clients with 1..6 steps and stragglers: each rank's share balanced by its clients' steps."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    env = {**_env(), "FEDOPT_TEST_UNEVEN": "1"}
    variants = ["fedavg", "fednova", "scaffold"]
    _torchrun(["--standalone", str(HERE / "ranks_child.py"), str(two), *variants], tmp_path, env=env)
    subprocess.run([sys.executable, str(HERE / "ranks_child.py"), str(one), *variants], check=True, env=env)
    for name in [f"{v}-{m}" for v in variants for m in ("sequential", "client-batched")]:
        a, b = (json.loads((d / f"{name}.json").read_text()) for d in (one, two))
        assert all("steps" in r for r in b["history"]) and a["history"][0]["steps"] == b["history"][0]["steps"]
        assert min(b["ranks"]["clients"]) > 0
        _assert_same_to_rounding(a, b, name)


SIM = ["-m", "fedopt_kernels.sim.cli", "--dataset", "synthetic", "--clients", "16", "--rounds", "6"]
SIM += ["--clients-per-round", "5", "--local-steps", "3", "--finetune-steps", "1", "--quiet", "--checkpoint-every", "2"]


def _without_times(path: Path) -> dict:
    result = json.loads(path.read_text())

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not (k.endswith("seconds") or k.endswith("_s"))}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    out = strip(result)
    out.pop("evaluation", None)  # seconds and FLOP rates of this process's passes
    return out


@needs_torchrun
@pytest.mark.slow
def test_fedopt_sim_under_torchrun_twice_on_one_and_on_two_machines_writes_the_same_files(tmp_path):
    args = ["--algorithm", "scaffold", "--client-batched", "2"]
    for name in ("a", "b"):
        _torchrun(["--standalone", *SIM, *args, "--out", str(tmp_path / name)], tmp_path)
    port = _free_port()
    launches = [
        subprocess.Popen(
            [
                TORCHRUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-machines",
                *SIM,
                *args,
                "--out",
                str(tmp_path / "nodes"),
            ],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in launches:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-4000:]
    a, b, c = (_without_times(tmp_path / n / "metrics_seed0.json") for n in ("a", "b", "nodes"))
    assert a == b == c
    assert a["ranks"]["world_size"] == 2


@needs_torchrun
@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_ends_where_the_uninterrupted_one_does(tmp_path):
    args = ["--algorithm", "padamfed", "--out"]
    _torchrun(["--standalone", *SIM, *args, str(tmp_path / "whole")], tmp_path)
    env = _env()
    env["FEDOPT_TEST_KILL_RANK"] = "1:3"  # rank 1 kills itself (SIGKILL) after round 3, once
    done = _torchrun(
        ["--standalone", *SIM, *args, str(tmp_path / "killed")], tmp_path, extra=["--max-restarts", "1"], env=env
    )
    assert "Signals.SIGKILL" in done.stderr or "exitcode  : -9" in done.stderr or str(-signal.SIGKILL) in done.stderr
    a, b = (_without_times(tmp_path / n / "metrics_seed0.json") for n in ("whole", "killed"))
    assert a["history"] == b["history"] and a["final"] == b["final"]
    assert b["resumed_from_round"] == 2
