"""What a benchmark ran on and from: the device, the commit, the load; the header of every result."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent


def slug(text: str) -> str:
    """``text`` as a file-name part: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "unknown"


def utc_date() -> str:
    """Today in UTC, as a result's file name and header give it."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")


def git(*args: str, root: Path = ROOT) -> Optional[str]:
    """``git <args>`` in ``root`` when ``root`` is a checkout's top level: its stdout, or None (no git,
    not a checkout, an error). A copy of the tree inside another repository is not a checkout of
    this project: git would answer for the enclosing one."""

    def run(*a: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = run("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        return None
    return run(*args)


def commit_of(root: Path = ROOT) -> str:
    """The commit a result was made from: ``FEDOPT_COMMIT`` when set (the lent GPU machines get a copy
    of the tree without .git), else the checkout's HEAD, else "unknown" - never a guess."""
    return os.environ.get("FEDOPT_COMMIT") or git("rev-parse", "HEAD", root=root) or "unknown"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> Optional[float]:
    """1-minute load average: other processes competing for the cores distort CPU timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def device_meta(device: torch.device) -> Dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return {
            "device_name": name,
            "device_slug": "cuda-" + slug(name),
            "device_type": "cuda",
            "cuda": torch.version.cuda,
        }
    name = f"{cpu_name()} ({os.cpu_count()} cores)"
    return {"device_name": name, "device_slug": f"cpu-{slug(cpu_name())}-{os.cpu_count()}c", "device_type": "cpu"}


def run_meta(device: torch.device, command: str) -> Dict[str, Any]:
    """Device, date, commit (``commit_of``), whether tracked files differ from it,
    the command, versions and thread count: what makes a result reproducible."""
    now = dt.datetime.now(dt.timezone.utc)
    status = git("status", "--porcelain", "--untracked-files=no")
    meta = device_meta(device)
    meta.update(
        date=now.strftime("%Y-%m-%d"),
        timestamp=now.isoformat(timespec="seconds"),
        commit=commit_of(),
        dirty=bool(status) if status is not None else None,
        command=command,
        torch=torch.__version__,
        python=platform.python_version(),
        threads=torch.get_num_threads(),
    )
    return meta
