"""Real ``fedopt-sim`` processes killed with SIGKILL, then resumed with ``--resume``.

Two representative algorithms: SCAFFOLD one client after another (server and client control
variates) is killed three times before it may finish:

1. halfway through writing the state file of the checkpoint after round 2 (the testing hook of
   ``fedopt_kernels.fl.checkpoint``): the checkpoint of round 1 must still be the one in force;
2. after the state file of round 4 is in place but before the manifest names it: round 3's counts;
3. at whatever moment the process has reached once a checkpoint of round >= 6 exists;

PAdaMFed-VR client-batched (the initial round of controls, momentum, the anchor copy) once, at the
second point; SCAFFOLD client-batched with its clients' state in files (``--client-state-dir``)
inside a state file's write and anywhere, the store's writes of the killed round included. Each
finished run's metrics file and final checkpoint (model, server state, every client's kept state)
must equal, bit for bit, those of an uninterrupted run with the same flags. Every algorithm of the
registry is resumed in-process by ``test_sim_resume.py``; these tests show that it also holds across
processes and kills.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from fedopt_kernels.fl.checkpoint import KILL_HOOK, MANIFEST, CheckpointDir
from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.client_state import Layout
from fedopt_kernels.sim.client_state_files import ClientStateFiles
from fedopt_kernels.sim.client_state_memory import MIRROR

ROUNDS = 10
RUNS = {
    "scaffold": ["--algorithm", "scaffold", "--momentum", "0.5"],
    "padamfed-vr": ["--algorithm", "padamfed-vr", "--client-batched", "2"],
    "scaffold-files": [
        "--algorithm",
        "scaffold",
        "--client-batched",
        "2",
        "--clients-per-round",
        "4",
    ],  # + --client-state-dir
}
# where each run is killed before it may finish: inside a state file's write, between the state
# file and the manifest (the testing hook), and wherever it is once round 6 is checkpointed
KILLS = {
    "scaffold": ["2:payload", "4:commit", "anywhere"],
    "padamfed-vr": ["3:commit"],
    "scaffold-files": ["3:payload", "anywhere"],
}
COMMON = [
    "--clients",
    "8",
    "--rounds",
    str(ROUNDS),
    "--local-steps",
    "6",
    "--model",
    "mlp",
    "--finetune-steps",
    "2",
    "--device",
    "cpu",
    "--threads",
    "1",
    "--quiet",
    "--seeds",
    "3",
    "--checkpoint-every",
    "1",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def start(args, cwd: Path, hook: Optional[str] = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop(KILL_HOOK, None)
    if hook is not None:
        env[KILL_HOOK] = hook
    return subprocess.Popen(
        [sys.executable, "-m", "fedopt_kernels.sim.cli"] + args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> int:
    out, err = proc.communicate(timeout=600)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"fedopt-sim failed ({proc.returncode}):\n{out}\n{err}")
    return proc.returncode


def rounds_in_force(folder: Path) -> int:
    return json.loads((folder / MANIFEST).read_text())["rounds"]


def final_state(folder: Path, store: Optional[Path] = None) -> dict:
    """The final checkpoint's state, with ``"kept"``: every client's state, read from the store the
    checkpoint names (its copy in the checkpoint folder, or ``store``) at the position it recorded."""
    ckpt = CheckpointDir(folder, "fedopt-sim")
    settings = ckpt.manifest()["settings"]
    rounds, state = ckpt.load(settings)
    assert rounds == ROUNDS
    clients = state["client_state"]["current"].numel()  # the training clients
    files = ClientStateFiles(
        store or folder / MIRROR, Layout(state["global"]), clients, settings, torch.device("cpu"), mirror=store is None
    )
    files.load(folder, settings, state["client_state"])
    state["kept"] = {cid: files[cid] for cid in files}
    return state


def without_times(result: dict) -> dict:
    return {
        "history": [{k: v for k, v in r.items() if k != "seconds"} for r in result["history"]],
        "final": result["final"],
    }


def kill(flags, out, cwd: Path, ckpt: Path, point: str) -> None:
    """Run (resuming, if a checkpoint exists) until killed at ``point``; check what is left in force."""
    resume = ["--resume"] if (ckpt / MANIFEST).exists() else []
    if point == "anywhere":
        proc = start(flags + out + resume, cwd)
        while proc.poll() is None and not ((ckpt / MANIFEST).exists() and rounds_in_force(ckpt) >= 6):
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)  # wherever it is now (it may even have finished)
        finish(proc)
        return
    rounds, stage = point.split(":")
    assert finish(start(flags + out + resume, cwd, hook=point)) == -signal.SIGKILL
    assert rounds_in_force(ckpt) == int(rounds) - 1  # the checkpoint before is still the one in force
    if stage == "payload":
        assert list(ckpt.glob(f".state-r{int(rounds):06d}-*.tmp-*")), "the kill should leave a half-written file"
    else:
        assert len(list(ckpt.glob(f"state-r{int(rounds):06d}-*.pt"))) == 1  # written, but no manifest names it


@pytest.mark.parametrize("name", list(RUNS))
def test_killed_runs_resume_to_the_uninterrupted_result(tmp_path, name):
    flags = RUNS[name] + COMMON
    files = name.endswith("-files")
    store = (lambda run: ["--client-state-dir", str(tmp_path / f"{run}-state")]) if files else (lambda run: [])
    # the uninterrupted run, in this process
    assert fedopt_sim.main(flags + store("whole") + ["--out", str(tmp_path / "whole")]) == 0
    out = store("killed") + ["--out", str(tmp_path / "killed")]
    ckpt = tmp_path / "killed" / "checkpoints" / "seed3"
    for point in KILLS[name]:
        kill(flags, out, tmp_path, ckpt, point)
    assert finish(start(flags + out + ["--resume"], tmp_path)) == 0

    want = json.loads((tmp_path / "whole" / "metrics_seed3.json").read_text())
    got = json.loads((tmp_path / "killed" / "metrics_seed3.json").read_text())
    assert without_times(got) == without_times(want)
    where = (lambda run: tmp_path / f"{run}-state" / "seed3") if files else (lambda run: None)
    a = final_state(ckpt, where("killed"))
    b = final_state(tmp_path / "whole" / "checkpoints" / "seed3", where("whole"))
    assert len(a["kept"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"]))
    assert a["server"].keys() == b["server"].keys() and a["kept"].keys() == b["kept"].keys()
    for key in a["server"]:
        assert all(torch.equal(x, y) for x, y in zip(a["server"][key], b["server"][key]))
    for cid in a["kept"]:
        assert all(torch.equal(x, y) for x, y in zip(a["kept"][cid], b["kept"][cid]))
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".")] == []  # the leftovers were cleaned up
    assert len(list(ckpt.glob("state-r*.pt"))) == 1
