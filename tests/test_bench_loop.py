"""``python -m bench loop`` and ``python -m bench profile`` on the CPU: the machinery a GPU run uses.

Both run end to end on CPU tensors (a dry run: the cpu backend, nothing replays) and write their
tables; the interleaving of the loop's rows, the goals' rules and the profile's analysis of CUDA
events (on made-up events: this machine records none) are checked directly.
"""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loop as bench_loop  # noqa: E402
from bench import profile as bench_profile  # noqa: E402
from bench.timing import rotated  # noqa: E402
from fedopt_kernels.fl import catalogue  # noqa: E402

pytestmark = pytest.mark.skipif(
    "cpu" not in bench_loop.fused_backends(torch.device("cpu")), reason="the cpu backend is not built here"
)


def test_rows_run_in_a_rotated_order_each_round():
    """No row always runs first, nor always after the same neighbour."""
    rows = list("ABCDE")
    orders = [rotated(rows, r) for r in range(5)]
    assert {o[0] for o in orders} == set(rows)
    assert all(sorted(o) == rows for o in orders)
    after = {(o[i], o[i + 1]) for o in orders for i in range(len(o) - 1)}
    assert ("A", "B") in after and ("B", "A") in after


def test_loop_dry_run_writes_its_tables(tmp_path):
    rc = bench_loop.main(
        [
            "--device",
            "cpu",
            "--models",
            "small_cnn",
            "--rows",
            "FedDecaySGD",
            "FedNAR",
            "--blocks",
            "2",
            "--per-block",
            "2",
            "--warmup",
            "1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads(next(tmp_path.glob("loop-*.json")).read_text())
    names = [r["optimizer"] for r in result["rows"]]
    assert names[0] == bench_loop.BASELINE and "FedDecaySGD cpu eager" in names and "PAdaMFed cpu" not in names
    # the whole-iteration graphs need CUDA: listed, not run (torch's graph comes with the selected ones)
    not_run = [r["optimizer"] for r in result["rows"] if "not_run" in r]
    assert sorted(not_run) == sorted([bench_loop.TORCH_GRAPHED, "FedDecaySGD cpu graphed", "FedNAR cpu graphed"])
    for r in result["rows"]:
        assert "error" not in r, r
        if "not_run" in r:
            assert r["not_run"] == "needs CUDA" and "blocks_s" not in r
            continue
        assert len(r["blocks_s"]) == 2 and len(r["ratios"]) == 2 and r["address_sets"] >= 1
    md = next(tmp_path.glob("loop-*.md")).read_text()
    assert "rows interleaved: 2 rounds" in md and "## Goals" in md and ">= 1.0x torch.SGD(fused)" in md
    assert "| small_cnn | FedNAR cpu graphed | not run: needs CUDA |" in md
    assert "replay >= 90%" not in md and ">= 3x" not in md  # nothing replays or is graphed on a CPU


def test_goals_follow_the_medians():
    def row(name, blocks, base=(1.0, 1.0, 1.0), timed=None):
        r = {
            "model": "m",
            "optimizer": name,
            "median_s": sorted(blocks)[1],
            "blocks_s": list(blocks),
            "ratios": [b / s for b, s in zip(base, blocks)],
        }
        if timed is not None:
            r["replay_timed"] = timed
        return r

    rows = [
        row("FedDecaySGD cuda", (0.9, 0.95, 1.2)),
        row("FedDecaySGD cuda eager", (1.0, 1.0, 1.0)),
        row("FedNAR cuda", (1.1, 1.05, 0.9), timed={"eager": 1, "recorded": 1, "replayed": 8}),
        row("PAdaMFed cuda", (1.0, 1.0, 1.0), timed={"eager": 1, "recorded": 0, "replayed": 9}),
    ]
    got = {(g, r): (v, verdict) for g, r, v, verdict in bench_loop.goals(rows)}
    assert not any("graphed" in r for _, r in got)  # no graphed rows, no graph goals
    assert got[(">= 1.0x torch.SGD(fused)", "m / FedDecaySGD cuda")] == ("1.05x", "pass")
    assert got[(">= 1.0x torch.SGD(fused)", "m / FedNAR cuda")] == ("0.95x", "miss")
    assert got[("replaying never slower than eager", "m / FedDecaySGD cuda")][1] == "pass"
    assert got[("replay >= 90% of steps", "m / FedNAR cuda")] == ("80%", "miss")
    assert got[("replay >= 90% of steps", "m / PAdaMFed cuda")] == ("90%", "pass")


def test_graph_goals_follow_the_medians_on_the_small_cnn():
    """A graphed row of ours: >= 3x the eager torch loop (its ratio) and >= 1.0x torch's graphed row
    (the median over rounds of the two blocks' ratio), judged on the small CNN only."""

    def row(model, name, blocks):
        base = (3.0, 3.0, 3.0)
        return {
            "model": model,
            "optimizer": name,
            "median_s": sorted(blocks)[1],
            "blocks_s": list(blocks),
            "ratios": [b / s for b, s in zip(base, blocks)],
            "graphed": name.endswith(bench_loop.GRAPHED),
        }

    rows = [
        row("small_cnn", bench_loop.BASELINE, (3.0, 3.0, 3.0)),
        row("small_cnn", bench_loop.TORCH_GRAPHED, (1.0, 1.0, 1.0)),
        row("small_cnn", "FedNAR cuda graphed", (0.9, 0.95, 1.1)),  # 3.16x eager torch; 1.05x torch's graph
        row("small_cnn", "FedDecaySGD cuda graphed", (1.1, 1.2, 0.9)),  # 2.73x; 0.91x: both miss
        row("resnet18", "FedNAR cuda graphed", (9.0, 9.0, 9.0)),  # not judged
    ]
    got = {(g, r): (v, verdict) for g, r, v, verdict in bench_loop.goals(rows)}
    torch_graph = f">= 1.0x {bench_loop.TORCH_GRAPHED}"
    assert got[(">= 3x torch.SGD(fused)", "small_cnn / FedNAR cuda graphed")] == ("3.16x", "pass")
    assert got[(torch_graph, "small_cnn / FedNAR cuda graphed")] == ("1.05x", "pass")
    assert got[(">= 3x torch.SGD(fused)", "small_cnn / FedDecaySGD cuda graphed")] == ("2.73x", "miss")
    assert got[(torch_graph, "small_cnn / FedDecaySGD cuda graphed")] == ("0.91x", "miss")
    assert not [k for k in got if "resnet18" in k[1] or bench_loop.TORCH_GRAPHED in k[1]]
    md = bench_loop.markdown({"meta": _META, "rows": rows, "goals": bench_loop.goals(rows)})
    assert "| small_cnn | FedNAR cuda graphed | 950.000 | 3.16x [2.73-3.33] | in the graph |" in md


_META = {
    "device_name": "test",
    "date": "2026-01-01",
    "commit": "x",
    "torch": "x",
    "command": "python -m bench loop",
    "blocks": 3,
    "per_block": 2,
    "warmup": 1,
}


def test_profile_dry_run_writes_its_table(tmp_path):
    rc = bench_profile.main(
        [
            "--device",
            "cpu",
            "--models",
            "small_cnn",
            "--rows",
            "FedNAR",
            "--warmup",
            "1",
            "--iterations",
            "2",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads(next(tmp_path.glob("profile-*.json")).read_text())
    assert [r["optimizer"] for r in result["rows"]] == [bench_loop.BASELINE, "FedNAR cpu", "FedNAR cpu eager"]
    for r in result["rows"]:
        assert "error" not in r, r
        assert all(r[f"{p}_us"] > 0 for p in bench_profile.PHASES), r
        assert r["step_alone_us"] > 0 and r["step_in_loop_us"] > 0
        assert set(r["calls_per_step"]) == set(bench_profile.COLUMNS)
        assert "gpu_idle_us" not in r  # no CUDA activity on a CPU
    md = next(tmp_path.glob("profile-*.md")).read_text()
    assert "| small_cnn | FedNAR cpu |" in md and "in loop / alone" in md
    assert (
        bench_loop.main(
            [
                "--profile",
                "--device",
                "cpu",
                "--models",
                "small_cnn",
                "--rows",
                "FedNAR",
                "--warmup",
                "0",
                "--iterations",
                "1",
                "--no-write",
            ]
        )
        == 0
    )


def _event(name, start, end, device=False, self_bytes=0):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        device_type=torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU,
        self_device_memory_usage=self_bytes,
    )


def test_profile_analysis_of_cuda_events():
    """What a GPU run's events give: calls counted inside the step ranges only, allocations from the
    ops' own device memory, GPU idle time and the longest gap between device activities."""
    events = [
        _event("loop.zero_grad", 0, 10),
        _event("loop.forward", 10, 100),
        _event("loop.backward", 100, 300),
        _event("loop.step", 300, 340),
        _event("cudaLaunchKernel", 20, 22),
        _event("cudaLaunchKernel", 310, 312),
        _event("cudaGraphLaunch", 320, 325),
        _event("cudaStreamSynchronize", 330, 331),
        _event("aten::empty", 332, 333, self_bytes=512),
        _event("cudaMemcpyAsync", 334, 335),
        _event("kernel", 30, 200, device=True),
        _event("kernel", 250, 320, device=True),
        _event("graph kernel", 330, 335, device=True),
    ]
    out = bench_profile.analyse(events, iterations=1, cuda=True)
    assert (out["zero_grad_us"], out["forward_us"], out["backward_us"], out["step_us"]) == (10, 90, 200, 40)
    assert out["calls_per_step"] == {
        "syncs": 1,
        "event records": 0,
        "event waits": 0,
        "memcpys": 1,
        "allocations": 1,
        "graph launches": 1,
        "kernel launches": 1,
    }
    # busy 30-200, 250-320, 330-335 in the window 0-340: idle 30 + 50 + 10 + 5 = 95, longest 50
    assert out["gpu_idle_us"] == 95 and out["gpu_longest_gap_us"] == 50


def test_a_stopped_loop_keeps_the_models_it_timed(tmp_path, monkeypatch):
    """gpu_check stops a phase at its deadline with SIGINT: the models timed by then are written,
    the table marked interrupted."""
    real = bench_loop.run_model

    def second_model_stopped(model_name, *args, **kwargs):
        if model_name == "resnet18":
            raise KeyboardInterrupt
        return real(model_name, *args, **kwargs)

    monkeypatch.setattr(bench_loop, "run_model", second_model_stopped)
    rc = bench_loop.main(
        [
            "--device",
            "cpu",
            "--models",
            "small_cnn",
            "resnet18",
            "--rows",
            "FedNAR",
            "--blocks",
            "1",
            "--per-block",
            "1",
            "--warmup",
            "0",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads(next(tmp_path.glob("loop-*.json")).read_text())
    assert result["meta"]["interrupted"] and {r["model"] for r in result["rows"]} == {"small_cnn"}
    assert "(**interrupted**)" in next(tmp_path.glob("loop-*.md")).read_text()


@pytest.mark.parametrize("algo", list(catalogue.ALGOS))
def test_host_cost_runs_and_a_replayed_step_reads_no_tensor_per_parameter(algo):
    """``python -m bench host``'s replayed step of every algorithm (FedSAM: its two steps): its tensor
    accesses and Python calls do not grow with the tensor count (where the compiled GradWatch is built)."""
    from bench import host
    from fedopt_kernels.core import grad_watch

    if grad_watch._native_module() is None:
        pytest.skip("no compiled extension with GradWatch here")
    small, large = host.replayed_step(algo, 6, 5), host.replayed_step(algo, 62, 5)
    assert small["tensor_accesses"] == large["tensor_accesses"] and small["python_calls"] == large["python_calls"]


@pytest.mark.parametrize("triton", ["as installed", "hidden"])
def test_host_cost_command_runs(capsys, monkeypatch, triton):
    """The command on this machine: both measurements, a closure step's (FedSAM) and another's, and a
    name not in the catalogue refused; without triton (torch's CPU wheel has none) the replayed step
    alone, saying why."""
    from bench import host

    if triton == "hidden":
        monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    assert host.main(["--tensors", "3", "--reps", "2", "--algos", "fedsam", "fednar"]) == 0
    out = capsys.readouterr().out
    assert "FedSAM" in out and "FedNAR" in out and "replayed step" in out
    has_triton = importlib.util.find_spec("triton") is not None
    assert ("eager triton step, launches stubbed" in out) == has_triton, out
    assert ("no eager triton step: the triton package is an extra" in out) == (not has_triton), out
    with pytest.raises(SystemExit):
        host.main(["--algos", "sgd"])


def test_a_graphed_row_replays_the_iteration_it_captured(monkeypatch):
    """GraphedRow's recipe on the CPU, torch.cuda's streams and graph replaced by the stand-in graph
    (tests/graph_stand_in.py, which records every op of the capture, the model's included): each
    replay is the eager iteration with the gradients kept, bit for bit."""
    from graph_stand_in import StandInGraph, install

    install(monkeypatch)
    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: graph.capture())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    cpu = torch.device("cpu")
    makers = bench_loop.graphed(["cpu"])
    for name in (bench_loop.TORCH_GRAPHED, "FedNAR cpu graphed", "FedDecaySGD cpu graphed"):
        row, twin = (bench_loop.make_row("small_cnn", name, makers[name], cpu) for _ in range(2))
        assert isinstance(row, bench_loop.GraphedRow)
        row.capture(steps=20)
        twin.static = (twin.x.clone(), twin.y.clone())
        for _ in range(bench_loop.GRAPH_WARMUP + 3):  # the warm-up, then what the replays take
            twin.eager_iteration()
        for _ in range(3):
            row.iteration()
        for p, q in zip(row.model.parameters(), twin.model.parameters()):
            assert torch.equal(p, q), name
