"""``python -m bench clients --smoke`` runs every CPU mode and writes valid JSON/MD/PNG (never into bench/results)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from fedopt_kernels.sim.batched.layers import FORMULATIONS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.clients.workload import plain_fednar_  # noqa: E402


def test_plain_torch_fednar_is_fednar_per_client():
    """The plain-torch baseline does FedNAR's work: each client equals the package's FedNAR alone."""
    from fedopt_kernels import FedNAR

    g = torch.Generator().manual_seed(0)
    stacked = [torch.randn(3, 4, 5, generator=g), torch.randn(3, 7, generator=g)]
    grads = [torch.randn(s.shape, generator=g) * 3 for s in stacked]
    want = []
    for c in range(3):
        ps = [torch.nn.Parameter(s[c].clone()) for s in stacked]
        for p, gr in zip(ps, grads):
            p.grad = gr[c].clone()
        FedNAR(ps, lr=0.05, weight_decay=0.1, max_norm=1.0, backend="reference").step()
        want.append([p.detach() for p in ps])
    plain_fednar_(stacked, grads, lr=0.05, weight_decay=0.1, max_norm=1.0)
    for c in range(3):
        for s, w in zip(stacked, want[c]):
            torch.testing.assert_close(s[c], w, rtol=1e-5, atol=1e-6)


def test_peak_memory_sees_what_was_allocated_inside():
    from bench.clients.peak_memory import PeakMemory, _mallinfo

    if _mallinfo() is None:
        pytest.skip("needs glibc's mallinfo2")
    keep = torch.ones(1 << 20)  # allocated before: not counted
    with PeakMemory(torch.device("cpu")) as m:
        a = torch.ones(4 << 20)  # 16 MiB
        b = a + 1  # another 16 MiB at the peak
        del a, b
    assert 32 << 20 <= m.peak < 40 << 20 and keep.numel()


def test_flops_per_client_step_are_the_models():
    """small-cnn at batch 10: forward 2 x MACs (conv 1->8, conv 8->16 on 8x8, linear 256->10), backward
    the same twice over, less the first layer's input gradient."""
    from bench.clients.settings import SETTINGS
    from bench.clients.workload import client_step_flops

    fwd = 2 * (64 * 8 * 9 + 64 * 16 * 72 + 256 * 10)
    bwd = 2 * fwd - 2 * 64 * 8 * 9
    assert client_step_flops(SETTINGS["small-cnn"], 10, torch.device("cpu")) == 10 * (fwd + bwd)
    # the LSTM is counted written out: 4 gates x (input + hidden) x hidden per step and layer, 80 steps
    H, T, E, V = 256, 80, 8, 80
    lstm_fwd = 2 * T * 4 * H * ((E + H) + (H + H))
    flops = client_step_flops(SETTINGS["char-lstm"], 10, torch.device("cpu"))
    assert flops >= 10 * 3 * lstm_fwd - 10 * 2 * T * 4 * H * E  # forward + 2x backward, no input grad
    assert flops <= 10 * 3 * (lstm_fwd + 2 * H * V)


def test_smoke_run_writes_valid_files(tmp_path, capsys):
    from bench.__main__ import main

    threads = torch.get_num_threads()
    try:  # in-process (a subprocess would import torch again): `python -m bench clients --smoke ...`
        assert main(["clients", "--smoke", "--threads", "1", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    jsons = list(tmp_path.glob("clients-cpu-*-smoke.json"))
    assert len(jsons) == 1, sorted(p.name for p in tmp_path.iterdir())
    result = json.loads(jsons[0].read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["mode"] == "clients" and meta["models"] == ["small-cnn", "char-lstm"] and meta["threads"] == 1
    assert meta["clients"] == {"small-cnn": [2, 4], "char-lstm": [2, 4]}
    runs = {(r["model"], r["clients"], r["mode"]) for r in rows if "client_steps_per_s" in r}
    batched = {"batched-plain-torch", "batched-fused-default", "batched-fused"}
    want = {(m, c, b) for m in meta["models"] for c in (2, 4) for b in batched | {"sequential"}}  # CPU: seq at every C
    want |= {("small-cnn", c, "batched-vmap") for c in (2, 4)}
    # chunks only where the measured chunk size is below C (a timing decision: either may happen)
    assert want <= runs and {mode for _, _, mode in runs - want} <= {"batched-fused-chunked"}, runs ^ want
    for m in meta["models"]:
        for c in (2, 4):
            chosen = [r for r in rows if r["model"] == m and r["clients"] == c and "choice" in r]
            assert len(chosen) == 1, (m, c)
            forms, why = chosen[0]["choice"]["formulations"], chosen[0]["choice"]["why"]
            assert set(forms) == set(why) and all(why.values()), chosen[0]
            assert forms.get("head") in ("bmm", "loop")
    skipped = {(r["model"], r["clients"], r["mode"]): r["skipped"] for r in rows if "skipped" in r}
    assert "vmap cannot batch the fused recurrent layer" in skipped[("char-lstm", 2, "batched-vmap")]
    for r in rows:
        assert "error" not in r, r
        if "client_steps_per_s" in r:
            assert r["client_steps_per_s"] == pytest.approx(r["clients"] * 2 / r["round_s"])
            assert r["peak_bytes_per_client"] > 0
    assert result["models"]["small-cnn"]["flops_per_client_step"] == 4_761_600
    assert len(result["peak"]) == 2 and all(p["peak_flops_per_s"] > 0 for p in result["peak"])
    parts = {(r["model"], r["clients"], r["part"]) for r in rows if "part" in r}
    assert ("small-cnn", 4, "grad vmap") in parts and ("char-lstm", 4, "update fused") in parts
    layers = [r for r in rows if "layer" in r]
    assert {r["formulation"] for r in layers if r["layer"] == "lstm"} == set(FORMULATIONS["LSTM"])
    # every parameterised layer is timed, the convolutions of a grouped run included
    assert {r["layer"] for r in layers if r["model"] == "small-cnn"} == {"features.0", "features.2", "head"}
    names = {(r["model"], r["layer"]) for r in layers}
    assert all(sum(r["default"] for r in layers if (r["model"], r["layer"]) == n) == 1 for n in names)
    # the small CNN's goals are at C=50, not measured in a smoke run (the FedAvg CNN's is not in it)
    assert [g["verdict"] for g in result["goals"]] == ["n/a"] * 3
    md = jsons[0].with_suffix(".md").read_text()
    assert md.splitlines()[0] in stdout and "| 4 | batched-fused |" in md and "## char-lstm" in md
    assert jsons[0].with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert jsons[0].name in (tmp_path / "LATEST.md").read_text()


def test_clients_sim_times_both_runs_side_by_side(tmp_path):
    """``python -m bench clients-sim`` on stand-in images: both runs train the same clients (same
    accuracies: FedAvg on the cpu backend, float32, a few steps), every evaluated round is timed and
    counted (validation FLOPs = images x the model's forward FLOPs), the tables are written."""
    from bench.__main__ import main

    threads = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "clients-sim",
                    "--stand-in",
                    "--stand-in-size",
                    "1200",
                    "--clients",
                    "10",
                    "--clients-per-round",
                    "4",
                    "--local-steps",
                    "2",
                    "--rounds",
                    "2",
                    "--device",
                    "cpu",
                    "--out-dir",
                    str(tmp_path),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    js = list(tmp_path.glob("clients-sim-cpu-*.json"))
    assert len(js) == 1
    result = json.loads(js[0].read_text())
    meta = result["meta"]
    assert meta["algorithm"] == "fedavg" and meta["client_batched"] == 4 and meta["local_steps"] == 2
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    per_image = 24_546_304  # the FedAvg CNN's forward on one 28x28 image (2 x MACs)
    for r in result["rounds"]:
        for name in ("sequential", "client-batched"):
            assert r[name]["eval_flops"] == per_image * meta["val_samples"] and r[name]["eval_s"] > 0
        assert abs(r["sequential"]["val_acc"] - r["client-batched"]["val_acc"]) <= 0.05
    for name in ("sequential", "client-batched"):
        assert result["final"][name]["cost"]["flops"] > 2 * per_image * meta["test_samples"]  # + fine-tuning
    md = js[0].with_suffix(".md").read_text()
    assert "| training per round, rounds 2-2 (mean) |" in md and "validation FLOP/s" in md
