"""Where an experiment's run came from: the commit, whether the tree differed from it, the device,
the versions and the command, so that every number on a results page can be traced to its source.

``provenance()`` is computed once per command, before it writes anything; each run adds its own UTC
start and end (``stamp``). ``source_key`` names what must be equal for runs to share a table cell:
the commit, and whether the tree was dirty.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
UNRECORDED = "unrecorded"  # runs written before run files carried their provenance


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def dirty_files(exclude: Sequence[Path] = ()) -> Optional[List[str]]:
    """Tracked files changed and untracked files not ignored, outside ``exclude`` (the results
    folder a command writes into); None outside a git checkout."""
    spec = [":(exclude)" + p.resolve().relative_to(REPO).as_posix() for p in exclude if _inside(p)]
    out = _git("status", "--porcelain", "--", ".", *spec)
    return None if out is None else [line for line in out.splitlines() if line]


def _inside(path: Path) -> bool:
    try:
        path.resolve().relative_to(REPO)
    except ValueError:
        return False
    return True


def device_name(device: str) -> str:
    """The processor or GPU a run trains on, as the machine names it."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (unavailable)"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(device: str, argv: Sequence[str], exclude: Sequence[Path] = (), script: str = "") -> Dict[str, Any]:
    """The facts every run file of one command shares (see the module's docstring)."""
    import numpy
    import torch

    dirty = dirty_files(exclude)
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if dirty is None else bool(dirty),
        "dirty_files": (dirty or [])[:20],
        "device": device,
        "device_name": device_name(device),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "command": shlex.join(["python", script or sys.argv[0], *argv]),
    }


def stamp(prov: Dict[str, Any], started: str, ended: str) -> Dict[str, Any]:
    """One run's provenance: the command's, with the run's own UTC start and end."""
    return dict(prov, started_utc=started, ended_utc=ended)


def source_key(run: Dict[str, Any]) -> str:
    """The commit a run came from (``+dirty`` when the tree differed from it), or ``unrecorded``."""
    prov = run.get("provenance")
    if not prov or not prov.get("commit"):
        return UNRECORDED
    return prov["commit"] + ("+dirty" if prov.get("dirty") else "")
