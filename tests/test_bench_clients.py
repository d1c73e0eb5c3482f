"""``python -m bench clients --smoke`` runs every CPU mode and writes valid JSON/MD/PNG (never into bench/results)."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.clients import plain_fednar_  # noqa: E402


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
    assert meta["mode"] == "clients" and meta["clients"] == [2, 4] and meta["threads"] == 1
    runs = {(r["clients"], r["mode"]) for r in rows if "client_steps_per_s" in r}
    assert runs == {(c, m) for c in (2, 4) for m in ("sequential", "batched-plain-torch", "batched-fused")}
    for r in rows:
        assert "error" not in r, r
        if "client_steps_per_s" in r:
            assert r["client_steps_per_s"] == pytest.approx(r["clients"] * 2 / r["round_s"])
    parts = {(r["clients"], r["part"]) for r in rows if "part" in r}
    assert len(parts) == 6 and all(r["step_s"] > 0 for r in rows if "part" in r)
    assert [g["verdict"] for g in result["goals"]] == ["n/a", "n/a"]  # C=50 not measured in a smoke run
    md = jsons[0].with_suffix(".md").read_text()
    assert md.splitlines()[0] in stdout and "| 4 |" in md
    assert jsons[0].with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert jsons[0].name in (tmp_path / "LATEST.md").read_text()
