"""The formulation choices of earlier runs, kept in a JSON file (``--formulation-cache PATH``).

An entry is keyed by everything the choice depends on: the device's name (and, on a CPU, the
threads torch uses), torch's, CUDA's and cuDNN's versions, this package's version, the precision
and the backend switches it sets (``precision.backend_flags``), the clients and batch per step, the
sample order and every client layer's signature and candidate formulations. The key is stored
beside the choice and compared whole on reading (the file name of an entry is only its hash), so an
entry measured elsewhere, with other libraries, or for other shapes, is never used.

The file is plain data: JSON, never unpickled or executed. Runs may share it, at once: a write
holds an exclusive lock on ``PATH.lock`` (a lock file beside it, ``file_lock.py``) while it reads
the file, adds its entry and writes the whole file to a temporary file in the same folder renamed
over the old one, so no process's entry is lost, and a reader (who takes no lock) sees either
version, never half of one. A file or entry that does not parse, or does not match, is ignored
(once, with a warning) and the choice is measured again; the next write replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .file_lock import exclusive
from .precision import backend_flags

FORMAT = 1


def device_name(device: torch.device) -> str:
    """What the choice's speed depends on about the device: its name (CPU: model and torch threads)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{device.type}: {model}, {torch.get_num_threads()} threads"


def step_key(
    device: torch.device, layers: Dict[str, Any], clients: int, batch: int, order: str, precision: str
) -> Tuple[str, Dict[str, Any]]:
    """(hash, key): the key of one step's choice (module docstring) and its SHA-256."""
    from ... import __version__

    cuda = device.type == "cuda"
    described = {
        "device": device_name(device),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "fedopt_kernels": __version__,
        "precision": precision,
        "flags": backend_flags(precision, device),
        "clients": clients,
        "batch": batch,
        "order": order,
        "layers": layers,
    }
    text = json.dumps(described, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest(), described


class ChoiceCache:
    """A JSON file of formulation choices (module docstring)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        self._warned = False

    def reject(self, key: str, why: str) -> None:
        """Say (once per file) that the entry ``key`` is not used, and why."""
        self._warn(f"entry {key[:12]} {why}; ignored")

    def _warn(self, why: str) -> None:
        if not self._warned:
            warnings.warn(f"formulation cache {self.path}: {why}; measuring again", RuntimeWarning, stacklevel=3)
            self._warned = True

    def _read(self) -> Dict[str, Any]:
        """The file's entries; {} when it is missing or not a cache this version wrote."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._warn(f"cannot be read ({exc})")
            return {}
        try:
            data = json.loads(text)
        except ValueError as exc:
            self._warn(f"is not JSON ({exc}); ignored")
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            self._warn(f"is not a format-{FORMAT} formulation cache; ignored")
            return {}
        return data["entries"]

    def get(self, key: str, described: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The saved choice for ``key``, if its entry parses and its stored key equals ``described``."""
        entry = self._read().get(key)
        if entry is None:
            return None
        if not isinstance(entry, dict) or entry.get("key") != described or not isinstance(entry.get("choice"), dict):
            self._warn(f"entry {key[:12]} does not match what it is stored under; ignored")
            return None
        return entry["choice"]

    def put(self, key: str, described: Dict[str, Any], choice: Dict[str, Any]) -> None:
        """Add (or replace) an entry: under the file's lock, read it, add the entry, write the whole
        file atomically; a failure to write warns."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with exclusive(self.path.with_name(self.path.name + ".lock")):
                entries = self._read()
                entries[key] = {"key": described, "choice": choice}
                text = json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(text)
                    os.replace(tmp, self.path)
                except BaseException:
                    os.unlink(tmp)
                    raise
        except OSError as exc:
            warnings.warn(f"formulation cache {self.path}: cannot be written ({exc})", RuntimeWarning, stacklevel=2)
