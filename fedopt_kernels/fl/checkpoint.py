"""Checkpoints that survive a kill at any moment, and files written whole or not at all.

A checkpoint folder holds two kinds of file:

* ``state-r<rounds>-<token>.pt``: the saved state, a ``torch.save`` file of tensors and plain data,
  written once and never changed;
* ``checkpoint.json``: the manifest, naming the state file that counts, its size and SHA-256,
  the number of completed rounds and the run's settings.

Every file is written to a temporary name in the same folder, flushed, ``fsync``-ed and renamed
into place (``os.replace`` is atomic on POSIX and Windows); the folder is ``fsync``-ed after the
rename where the platform allows it. The manifest is written last: replacing it is the moment a
new checkpoint counts, so a kill at any earlier moment leaves the previous checkpoint in force,
and a kill after it leaves the new one. State files the manifest does not name (an older
checkpoint, one whose manifest never got written) are deleted by the next save.

Loading checks the manifest, compares its settings with the caller's (``CheckpointError`` naming
every setting that differs), checks the state file's size and SHA-256, and only then reads it with
``torch.load(weights_only=True)``, which builds tensors and plain containers and never runs code
from the file. A damaged or truncated checkpoint is refused before anything of it is used.

Testing hook: with ``FEDOPT_TEST_KILL_IN_CHECKPOINT=<rounds>:<stage>`` in the environment, the
process kills itself (SIGKILL) while saving the checkpoint of ``<rounds>`` completed rounds:
``payload`` halfway through writing the state file, ``commit`` after the state file is in place
but before the manifest is replaced. The tests use it to kill runs inside a checkpoint write.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import random
import signal
import time
import uuid
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union, cast

import numpy as np
import torch

FORMAT = "fedopt_kernels checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"
STATE_GLOB = "state-r*.pt"
KILL_HOOK = "FEDOPT_TEST_KILL_IN_CHECKPOINT"
_CHUNK = 1 << 20

PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: damaged, truncated, or saved with other settings."""


# ---------------------------------------------------------------------------- atomic files
def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it replaces ``path`` whole.

    On an exception the temporary file is removed and ``path`` is left as it was. A kill leaves at
    most a ``.<name>.tmp-<pid>`` file behind, never a partial ``path``.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    f = open(tmp, mode, **open_kwargs)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: PathLike, text: str) -> None:
    """``Path(path).write_text(text)``, but a reader (or a kill) never sees half of it."""
    with atomic_file(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


# ---------------------------------------------------------------------------- random generators
def global_rng_state() -> Dict[str, Any]:
    """The process-wide generators: torch's CPU and (if initialised) CUDA ones, numpy's and Python's."""
    np_state = np.random.get_state(legacy=False)
    key = np_state["state"]["key"]
    return {
        "torch": torch.get_rng_state(),
        "torch_cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else [],
        "numpy": {
            **np_state,
            "state": {"key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(np_state["state"]["pos"])},
        },
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
    }


def set_global_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``global_rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    cuda = state["torch_cuda"]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    np_state = dict(state["numpy"])
    np_state["state"] = {
        "key": state["numpy"]["state"]["key"].numpy().astype(np.uint32),
        "pos": state["numpy"]["state"]["pos"],
    }
    np.random.set_state(np_state)
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))


def plain_settings(settings: Mapping[str, Any]) -> Dict[str, Any]:
    """``settings`` as JSON would give them back (tuples as lists), so saved and current compare equal."""
    return json.loads(json.dumps(dict(settings), sort_keys=True))


def settings_diff(
    saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "", saved_in: str = "the checkpoint"
) -> List[str]:
    """``"name: <saved> in the checkpoint, <current> now"`` for every setting that differs (a setting
    that is itself a dict is compared key by key, named ``outer.inner``; ``saved_in``: where the saved
    settings come from)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "(not set)"), current.get(key, "(not set)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += settings_diff(a, b, f"{prefix}{key}.", saved_in)
            continue
        same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
        if not same:
            out.append(f"{prefix}{key}: {a!r} in {saved_in}, {b!r} now")
    return out


# ---------------------------------------------------------------------------- the folder
class _HashingWriter(io.RawIOBase):
    """Passes ``torch.save``'s writes to a file and hashes them on the way (one pass over the bytes)."""

    def __init__(self, f: IO[bytes], kill_at: Optional[int]):
        super().__init__()
        self.f, self.sha, self.size, self.calls, self.kill_at = f, hashlib.sha256(), 0, 0, kill_at

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.calls += 1
        if self.kill_at is not None and self.calls == self.kill_at:
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # testing hook: a kill inside the state file's write
        n = self.f.write(b)
        self.sha.update(b)
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def _kill_hook(rounds: int) -> Optional[str]:
    spec = os.environ.get(KILL_HOOK)
    if not spec:
        return None
    at, _, stage = spec.partition(":")
    return stage if at.strip() == str(rounds) else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class CheckpointDir:
    """One run's checkpoints in ``folder`` (see the module docstring). ``kind`` names what saves
    them ("fedopt-sim", "flower-server", ...): a checkpoint of another kind is refused.
    ``renamed``: earlier name -> name of settings that were renamed; a checkpoint saved under an
    earlier name compares that setting as the new one."""

    def __init__(self, folder: PathLike, kind: str, renamed: Optional[Mapping[str, str]] = None):
        self.folder = Path(folder)
        self.kind = kind
        self.renamed = dict(renamed or {})

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST

    def exists(self) -> bool:
        """Is there a checkpoint (a manifest) in the folder?"""
        return self.manifest_path.is_file()

    # ------------------------------------------------------------------ save
    def save(self, rounds: int, settings: Mapping[str, Any], state: Mapping[str, Any]) -> Dict[str, Any]:
        """Write ``state`` (tensors and plain data) as the checkpoint after ``rounds`` completed rounds.

        Returns ``{"bytes": state file size, "seconds": wall time of the save}``.
        """
        start = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        hook = _kill_hook(rounds)
        name = f"state-r{rounds:06d}-{uuid.uuid4().hex[:8]}.pt"
        with atomic_file(self.folder / name, "wb") as f:
            writer = _HashingWriter(f, kill_at=2 if hook == "payload" else None)
            # a RawIOBase: a file object to torch.save, though typeshed's IO[bytes] is another class
            torch.save(dict(state), cast(IO[bytes], writer))
            size, digest = writer.size, writer.sha.hexdigest()
        if hook == "commit":
            os.kill(os.getpid(), signal.SIGKILL)  # testing hook: state file in place, manifest not yet
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "rounds": int(rounds),
            "state_file": name,
            "bytes": size,
            "sha256": digest,
            "torch": torch.__version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": plain_settings(settings),
        }
        write_text_atomic(self.manifest_path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        self._remove_unreferenced(keep=name)
        return {"bytes": size, "seconds": time.perf_counter() - start}

    def _remove_unreferenced(self, keep: str) -> None:
        for p in self.folder.glob(STATE_GLOB):
            if p.name != keep:
                with contextlib.suppress(OSError):
                    p.unlink()
        for p in self.folder.glob(".state-r*.pt.tmp-*"):  # a save killed halfway
            with contextlib.suppress(OSError):
                p.unlink()

    def clear(self) -> None:
        """Delete this folder's checkpoint files (and only those)."""
        with contextlib.suppress(OSError):
            self.manifest_path.unlink()
        self._remove_unreferenced(keep="")

    # ------------------------------------------------------------------ load
    def manifest(self) -> Dict[str, Any]:
        """The manifest, checked for form; CheckpointError if it is missing or damaged."""
        path = self.manifest_path
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint in {self.folder} (no {MANIFEST})") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                f"checkpoint manifest {path} is damaged ({exc}); it cannot be resumed from "
                f"(delete {self.folder} to start the run afresh)"
            ) from None
        need = {
            "format": str,
            "version": int,
            "kind": str,
            "rounds": int,
            "state_file": str,
            "bytes": int,
            "sha256": str,
            "settings": dict,
        }
        bad = [k for k, t in need.items() if not isinstance(m, dict) or not isinstance(m.get(k), t)]
        if bad or m["format"] != FORMAT:
            raise CheckpointError(
                f"{path} is not a fedopt_kernels checkpoint manifest (missing or malformed: "
                f"{bad or ['format']}); it cannot be resumed from"
            )
        if m["version"] != VERSION:
            raise CheckpointError(
                f"checkpoint {path} has format version {m['version']}; this fedopt_kernels reads version {VERSION}"
            )
        if m["kind"] != self.kind:
            raise CheckpointError(f"checkpoint {path} was saved by {m['kind']!r}, not {self.kind!r}")
        if Path(m["state_file"]).name != m["state_file"] or not m["state_file"].startswith("state-r"):
            raise CheckpointError(f"checkpoint manifest {path} names an invalid state file {m['state_file']!r}")
        return m

    def check_settings(self, settings: Mapping[str, Any]) -> Dict[str, Any]:
        """The manifest, after checking that it was saved with ``settings`` (CheckpointError naming each difference)."""
        m = self.manifest()
        saved = {self.renamed.get(k, k): v for k, v in m["settings"].items()}
        diff = settings_diff(saved, plain_settings(settings))
        if diff:
            raise CheckpointError(
                f"the checkpoint in {self.folder} was saved by a run with other settings; it "
                f"cannot continue this one. Differences: "
                + "; ".join(diff)
                + ". Resume with the checkpoint's settings, or use another checkpoint folder"
            )
        return m

    def load(
        self, settings: Mapping[str, Any], map_location: Optional[Union[str, torch.device]] = "cpu"
    ) -> Tuple[int, Dict[str, Any]]:
        """``(completed rounds, state)`` of the checkpoint, after every check of the module docstring."""
        m = self.check_settings(settings)
        path = self.folder / m["state_file"]
        what = f"checkpoint state file {path} (round {m['rounds']})"
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(f"{what} is missing; the checkpoint in {self.folder} is damaged") from None
        if size != m["bytes"]:
            raise CheckpointError(f"{what} is damaged or truncated: {size} bytes, the manifest says {m['bytes']}")
        if _sha256(path) != m["sha256"]:
            raise CheckpointError(f"{what} is damaged: its SHA-256 differs from the manifest's")
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:  # the hash matched, so this is a file torch cannot read here
            raise CheckpointError(f"{what} cannot be read: {type(exc).__name__}: {exc}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{what} does not hold a state dict")
        return m["rounds"], state
