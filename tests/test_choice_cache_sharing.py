"""The formulation cache shared by runs at once (sim/batched/choice_cache.py, file_lock.py).

Two processes writing 40 entries each into one file keep all 80: each write reads, adds and
replaces the file under the file's lock. The key holds what the choice depends on beyond the
shapes (CUDA's and cuDNN's versions, the precision's backend switches), and a choice whose timed
calls spread as on a shared device is used but not written.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import time

import pytest
import torch

from fedopt_kernels.sim.batched import choice_cache, choose, timing
from fedopt_kernels.sim.batched.choice_cache import ChoiceCache, step_key
from fedopt_kernels.sim.batched.choose import Chooser
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.precision import backend_flags
from fedopt_kernels.sim.models.build import build_model

WRITES = 40


def _writer(path: str, who: int, start, race: bool) -> None:
    """``WRITES`` entries of their own into the cache at ``path``, once ``start`` lets every writer go;
    ``race``: without the lock, and a pause between reading the file and writing it back."""
    if race:
        read = ChoiceCache._read

        def slow_read(self):
            out = read(self)
            time.sleep(0.005)
            return out

        setattr(ChoiceCache, "_read", slow_read)  # noqa: B010 - the child process's own copy
        setattr(choice_cache, "exclusive", lambda path: contextlib.nullcontext())  # noqa: B010
    cache = ChoiceCache(path)
    start.wait()
    for n in range(WRITES):
        cache.put(f"{who}-{n}", {"writer": who, "n": n}, {"formulations": {}})


def _two_writers(tmp_path, race: bool) -> int:
    ctx = multiprocessing.get_context("fork")
    path = tmp_path / "choices.json"
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(path), who, start, race)) for who in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return len(json.loads(path.read_text())["entries"])


def test_two_processes_writing_at_once_lose_no_entry(tmp_path):
    assert _two_writers(tmp_path, race=False) == 2 * WRITES
    assert not list(tmp_path.glob(".choices.json.*"))  # no temporary file left behind


def test_the_sharing_check_can_fail(tmp_path):
    """Without the lock, reads and writes of the two processes interleave and entries are lost."""
    assert _two_writers(tmp_path, race=True) < 2 * WRITES


def test_the_key_holds_the_libraries_and_the_precisions_switches():
    layers = {"head": {"signature": "Linear(...)", "candidates": ["bmm", "loop"]}}
    cpu = torch.device("cpu")
    _, described = step_key(cpu, layers, 4, 8, "client", "fp32")
    assert {"cuda", "cudnn", "flags"} <= set(described) and described["flags"] == backend_flags("fp32", cpu)
    assert described["cuda"] is None and described["cudnn"] is None  # a CPU's choice depends on neither
    keys = {step_key(cpu, layers, 4, 8, "client", p)[0] for p in ("fp32", "tf32", "bf16")}
    assert len(keys) == 3


def _noisy_clock(monkeypatch, noisy: bool):
    """Layers alone 1 s and steps their sum; ``noisy``: every other call of a trial 60% longer, as
    when another process's kernels run between them."""
    seen: dict = {}

    def measure(self, trial):
        seen[trial] = seen.get(trial, 0) + 1
        base = 1.0 if trial[0] == "alone" else float(len(self.assignments[trial[1]]))
        return base * (1.6 if noisy and seen[trial] % 2 else 1.0)

    monkeypatch.setattr(timing.Timer, "measure", measure)


@pytest.mark.parametrize("noisy", [False, True])
def test_a_measurement_of_a_shared_device_is_not_cached(monkeypatch, tmp_path, noisy):
    monkeypatch.setattr(choose, "_PROCESS", {})
    _noisy_clock(monkeypatch, noisy)
    torch.manual_seed(0)
    model = build_model("cnn", (1, 8, 8), 10)

    def inputs(C):
        params = [p.detach().unsqueeze(0).repeat(C, *([1] * p.dim())) for p in model.parameters()]
        return params, torch.randn(C, 4, 1, 8, 8), torch.randint(0, 10, (C, 4)), torch.full((C, 4), 0.25)

    path = tmp_path / "choices.json"
    chooser = Chooser(LayersLoss(model), inputs, mode="measure", cache=ChoiceCache(path))
    _, choice = chooser.plan(6, 6, 10**6, fixed=6)
    assert (choice.spread > timing.SHARED_SPREAD) == noisy
    assert path.exists() != noisy
    assert ("not cached" in choice.note) == noisy and (not noisy or "shared" in choice.note)
