"""The benchmark report machinery (bench/) runs end to end in its quickest mode and writes valid files.

Runs ``python -m bench --smoke`` into a temporary folder (never into bench/results) and checks the
JSON, the markdown table, the PNG and LATEST.md; plus the pieces the figures rest on: the exact
ResNet-18 shape list and the docs/backends.md byte counts.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shapes import SIZES, total_numel  # noqa: E402
from bench.traffic import Traffic, bytes_per_element, bytes_per_step  # noqa: E402


def test_shape_lists():
    assert (len(SIZES["resnet18"]), total_numel(SIZES["resnet18"])) == (62, 11_689_512)
    assert total_numel(SIZES["large"]) >= 100_000_000
    assert len(SIZES["small_cnn"]) <= 8 and total_numel(SIZES["small_cnn"]) < 100_000


def test_small_cnn_matches_simulator():
    small = pytest.importorskip("fedopt_kernels.sim.models.small")
    model = small.SmallCNN((1, 8, 8), 10)
    assert [tuple(p.shape) for p in model.parameters()] == SIZES["small_cnn"]


def test_bytes_per_element_matches_spec_table():
    f32 = torch.float32
    state = ("D", "acc")
    assert bytes_per_element(Traffic("sgd"), f32) == 12
    assert bytes_per_element(Traffic("sgd", ("momentum_buffer",)), f32) == 20
    assert bytes_per_element(Traffic("fednar"), f32) == 20
    assert bytes_per_element(Traffic("fednar", ("correction",)), f32) == 28
    assert bytes_per_element(Traffic("fednar", ("correction", "x0")), f32) == 36
    assert bytes_per_element(Traffic("padamfed", state), f32) == 32
    assert bytes_per_element(Traffic("padamfed", state + ("anchor_grad",)), f32) == 40
    # element size scales parameter streams, not PAdaMFed's float32 state
    assert bytes_per_element(Traffic("sgd", ("momentum_buffer",)), torch.bfloat16) == 10
    assert (
        bytes_per_element(Traffic("padamfed", state), torch.bfloat16) == 4 * 2 + 4 * 4
    )  # g, g, x, x at 2 B; D, acc, acc, D at 4 B
    assert bytes_per_element(Traffic("padamfed", state), torch.float64) == 64
    # neuron scales are read once per row
    shapes = [(3, 5), (3,)]
    assert bytes_per_step(Traffic("sgd", ("neuron_scale",)), shapes, f32) == 18 * 12 + 6 * 4


def test_smoke_run_writes_valid_files(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--device", "cpu", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jsons = list(tmp_path.glob("cpu-*-smoke.json"))
    assert len(jsons) == 1, sorted(p.name for p in tmp_path.iterdir())
    result = json.loads(jsons[0].read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["device_type"] == "cpu" and meta["mode"] == "smoke" and meta["commit"]
    assert "reference" in result["backends"] and "triton" not in result["backends"]
    # every core algorithm on every timed backend, plus torch SGD baselines for the SGD family
    got = {(r["algorithm"], r["backend"]) for r in rows}
    for algo in ("feddecay", "neuronlr", "fednar", "padamfed"):
        for backend in result["backends"]:
            assert (algo, backend) in got
    assert ("feddecay", "torch.SGD(fused)") in got and ("feddecay", "torch.SGD(foreach)") in got
    for r in rows:
        assert "error" not in r, r
        assert r["median_s"] > 0 and r["reps"] >= 3
        assert math.isclose(r["gbps"], r["bytes_per_step"] / r["median_s"] / 1e9, rel_tol=1e-9)
        assert r["copy_gbps"] > 0 and math.isclose(r["pct_copy"], 100 * r["gbps"] / r["copy_gbps"], rel_tol=1e-9)
        assert "other_load_cores" in r and r["attempts"] >= 1
        assert r["step_extra_bytes"] is None or r["step_extra_bytes"] >= 0
        if r["algorithm"] == "feddecay":  # one float32 momentum buffer per parameter, whoever steps
            assert r["state_bytes"] == 4 * r["numel"], r
    ref = {r["algorithm"]: r for r in rows if r["backend"] == "reference"}
    assert all(math.isclose(r["speedup_ref"], 1.0) for r in ref.values())
    assert [g["goal"] for g in result["goals"]] and all("verdict" in g for g in result["goals"])
    # markdown: one table line per row, printed and written
    md = jsons[0].with_suffix(".md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and ln.count("|") > 10]
    assert len(table) == len(rows) + 1  # + header
    assert "% copy" in md and md.splitlines()[0] in proc.stdout
    png = jsons[0].with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    latest = (tmp_path / "LATEST.md").read_text()
    assert jsons[0].name in latest and jsons[0].with_suffix(".md").name in latest


def test_checkpoint_benchmark_runs(capsys):
    """``python -m bench checkpoints`` at its smallest: a row per model, the default run's share."""
    from bench.checkpoints import main as checkpoints_main

    assert checkpoints_main(["--clients", "3", "--repeats", "1", "--rounds", "11", "--models", "small_cnn"]) == 0
    out = capsys.readouterr().out
    assert "small_cnn" in out, out


def test_an_interrupted_run_writes_the_rows_it_timed(tmp_path, monkeypatch):
    """gpu_check stops a phase at its deadline with SIGINT: the rows timed until then are written,
    and the report says the table is partial."""
    from interrupt import interrupt_on_call

    import bench.__main__ as bench_main
    import bench.runner as runner

    # the cases of one algorithm and size are timed together: stopped in the second group, the
    # first group's rows are written
    monkeypatch.setattr(runner, "measure_group", interrupt_on_call(runner.measure_group, 2))
    assert bench_main.main(["--smoke", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("cpu-*-smoke.json")).read_text())
    rows = result["rows"]
    assert result["interrupted"] is True and len(rows) >= 2
    assert {(r["algorithm"], r["size"]) for r in rows} == {(rows[0]["algorithm"], rows[0]["size"])}
    assert all("median_s" in r and r["gbps"] > 0 for r in rows)
    assert f"**interrupted** after {len(rows)} rows" in next(tmp_path.glob("cpu-*-smoke.md")).read_text()


def test_a_killed_run_writes_the_rows_it_timed(tmp_path, monkeypatch):
    """kill (SIGTERM) stops a run as SIGINT does: the rows timed so far are written; outside a run
    SIGTERM keeps its previous handler."""
    import signal

    from interrupt import kill_on_call, sigterm_guard

    import bench.__main__ as bench_main
    import bench.runner as runner

    monkeypatch.setattr(runner, "measure_group", kill_on_call(runner.measure_group, 2))
    with sigterm_guard() as outside:
        assert bench_main.main(["--smoke", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
        assert signal.getsignal(signal.SIGTERM) is outside
    result = json.loads(next(tmp_path.glob("cpu-*-smoke.json")).read_text())
    rows = result["rows"]
    assert result["interrupted"] is True and len(rows) >= 2
    assert {(r["algorithm"], r["size"]) for r in rows} == {(rows[0]["algorithm"], rows[0]["size"])}


def test_the_loop_benchmark_counts_gradient_address_sets():
    """The loop table's last column: gradients kept in place are one address set; gradients kept
    alive by the caller at every step (so none is freed for reuse) are as many as the iterations."""
    from bench import loop

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    kept = []

    def iteration(set_to_none: bool) -> None:
        opt.zero_grad(set_to_none=set_to_none)
        model(x).sum().backward()
        kept.append(model.weight.grad)
        opt.step()

    assert loop.address_sets(lambda: iteration(False), list(model.parameters()), 5) == 1
    assert loop.address_sets(lambda: iteration(True), list(model.parameters()), 5) == 5
    table = loop.markdown(
        {
            "meta": {
                "device_name": "d",
                "date": "t",
                "commit": "c",
                "torch": "v",
                "command": "x",
                "blocks": 1,
                "per_block": 1,
                "warmup": 1,
            },
            "rows": [
                {
                    "model": "m",
                    "optimizer": "torch.SGD(fused)",
                    "median_s": 1e-3,
                    "ratios": [1.0, 1.0],
                    "address_sets": 2,
                }
            ],
        }
    )
    assert "| m | torch.SGD(fused) | 1.000 | 1.00x [1.00-1.00] | — | 2 |" in table
