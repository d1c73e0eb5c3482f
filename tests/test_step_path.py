"""How far a reader goes through one ``step()``: the files and functions it runs stay few.

``bench/calls.py`` records every Python call of one step (``python -m bench calls`` prints them for
every optimizer). Structural, not timing: FedNAR's reference step, cached and first, stays within
its file budget, runs its math in ``functional.fednar`` from the reference op, and the learning
rate reaches the kernels under one name, in the column each op declares.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Tuple

from bench import calls
from fedopt_kernels.core.ops import OPS

# files of the package one step runs: optimizer, stepper, plan, the op's reference function (which
# reads its arguments by name) and its math (functional.py)
CACHED_FILES = 5
# a new optimizer's first step (its plan built): the above plus the class's checks (optim/, checks.py),
# the plan's inputs and hp rows, the backend's resolution and the gradient watch; in a fresh process
# too (bench calls prints that figure)
FIRST_FILES = 10


def _steps() -> Tuple[calls.Calls, calls.Calls]:
    """FedNAR's first and cached steps, recorded in a new process after one step of a throwaway
    optimizer (what the package loads once per process is loaded): what another test left in this
    process (caches, loaded backends) cannot change the count."""
    code = (
        "import json, sys, torch; import fedopt_kernels as fk; from bench import calls; "
        "p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2); "
        "fk.FedNAR([p], lr=0.1, weight_decay=0.0, backend='reference').step(); "
        "first, cached = calls.optimizer_steps('fednar'); "
        "json.dump([[c.files, c.functions] for c in (first, cached)], sys.stdout)"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, check=True)
    (f_files, f_funcs), (c_files, c_funcs) = json.loads(out.stdout)
    as_calls = calls.Calls
    return (
        as_calls(tuple(f_files), tuple(tuple(f) for f in f_funcs)),
        as_calls(tuple(c_files), tuple(tuple(f) for f in c_funcs)),
    )


def test_fednar_reference_step_stays_within_its_files():
    first, cached = _steps()
    short = cached.short_files()
    assert len(cached.files) <= CACHED_FILES, short
    assert len(first.files) <= FIRST_FILES, first.short_files()
    # the cached step is the class, the plan and the math: nothing is rebuilt or re-checked
    assert os.path.join("fedopt_kernels", "functional.py") in short
    assert os.path.join("fedopt_kernels", "core", "reference.py") in short
    names = {name for _, name in cached.functions}
    assert "fednar" in names and "fednar_step" in names
    assert not {"plan_inputs", "group_inputs", "gather"} & {n.rsplit(".", 1)[-1] for n in names}


def test_the_recorder_sees_what_a_step_calls():
    """Not vacuous: a first step (the plan built) runs more files and functions than a cached one."""
    first, cached = _steps()
    assert set(cached.files) < set(first.files)
    assert len(first.functions) > len(cached.functions) > 10


def test_every_op_declares_its_learning_rate_column():
    """The lr column is declared (``OpSpec.lr``) and named ``lr`` in every op that has one."""
    for spec in OPS.values():
        if spec.base == "sam_ascent" or spec.name == "sam_ascent":
            assert spec.lr is None and spec.lr_column is None
        else:
            assert spec.lr == "lr" and spec.hps[spec.lr_column] == "lr", spec.name
