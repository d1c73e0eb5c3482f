"""Python code run in a child process, for checks of how a process ends: an abort at interpreter exit
(a C++ assertion in a destructor) cannot be caught by the process that aborts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[1]


def run_child(code: str, timeout: float = 240.0, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository root (so it imports this checkout's package), its output
    captured; ``env`` is added to this process's environment."""
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )


def ending(proc: subprocess.CompletedProcess) -> str:
    """How the child ended, for an assertion message: its exit status (the signal's name when a signal
    ended it) and the end of what it wrote."""
    rc = proc.returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    return f"{how}\n--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
