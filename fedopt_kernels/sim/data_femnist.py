"""FEMNIST from LEAF's JSON files, one client per writer (its natural partition).

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) writes, after
``./preprocess.sh`` in ``leaf/data/femnist``::

    <data_dir>/train/*.json   and   <data_dir>/test/*.json      (test/ optional here)

each file ``{"users": [id, ...], "num_samples": [n, ...], "user_data": {id: {"x": [[784 floats in
[0, 1]], ...], "y": [label, ...]}}}``, labels 0..61 (10 digits, 26 upper-, 26 lower-case letters),
images 28x28 row-major. ``data_dir`` may also be LEAF's ``data`` folder (holding ``femnist/data/``) or
``femnist/``. A writer's train and test samples are pooled: the simulator splits every user's data
into its own train/val/test (``split``). Pixels are stored as uint8 (``round(255 x)``): LEAF's values
are multiples of 1/255, so nothing is lost, at a quarter of float32's memory.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .data_folder import data_root
from .datasets import ArrayDataset

NUM_CLASSES = 62
_CANDIDATES = ("", "femnist/data", "data", "femnist")

HOW_TO_GET = ("FEMNIST is expected in LEAF's JSON layout, DIR/train/*.json (and DIR/test/*.json), with "
              "'users', 'num_samples' and 'user_data' {user: {'x': [[784 pixels]], 'y': [labels]}}: clone "
              "https://github.com/TalwalkarLab/leaf, run `./preprocess.sh -s niid --sf 0.05 -k 0 -t sample` in "
              "leaf/data/femnist (--sf: fraction of the data to keep, by writer) and pass "
              "--data-dir leaf/data/femnist/data. It is not downloaded by --download.")


def _fail(path: Path, msg: str) -> ValueError:
    return ValueError(f"{str(path)!r}: {msg}. {HOW_TO_GET}")


def _read_file(path: Path) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as exc:
        raise _fail(path, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); the file is "
                          f"damaged or truncated") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise _fail(path, f"cannot be read as a UTF-8 JSON file ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or not all(k in obj for k in ("users", "num_samples", "user_data")):
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise _fail(path, f"expected an object with 'users', 'num_samples' and 'user_data', got {keys}")
    users, counts, data = obj["users"], obj["num_samples"], obj["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or not isinstance(data, dict):
        raise _fail(path, "'users' and 'num_samples' must be lists and 'user_data' an object")
    if len(users) != len(counts):
        raise _fail(path, f"{len(users)} users but {len(counts)} entries in 'num_samples'")
    for i, (uid, n) in enumerate(zip(users, counts)):  # ids are the keys of 'user_data': JSON strings
        if not isinstance(uid, str):
            raise _fail(path, f"'users' must hold user ids (strings, the keys of 'user_data'), got "
                              f"{type(uid).__name__} {uid!r} at position {i}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise _fail(path, f"'num_samples' must hold integers >= 0, got {n!r} for user {uid!r}")
    out: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for uid, n in zip(users, counts):
        u = data.get(uid)
        if not isinstance(u, dict) or "x" not in u or "y" not in u:
            raise _fail(path, f"user {uid!r} is listed in 'users' but has no {{'x', 'y'}} in 'user_data'")
        try:
            # no dtype here: None, strings or booleans would be converted silently (None -> NaN)
            x, y = np.asarray(u["x"]), np.asarray(u["y"])
        except (TypeError, ValueError):  # ragged lists
            x = y = np.empty(0, dtype=object)
        if x.dtype.kind not in "fiu" or y.dtype.kind not in "fiu":
            raise _fail(path, f"user {uid!r}: 'x' must be a list of 784-number lists and 'y' a list of "
                              f"integers")
        x, y = x.astype(np.float32), y.astype(np.float64)
        if x.ndim != 2 or x.shape[1] != 784 or y.ndim != 1 or len(y) != len(x):
            raise _fail(path, f"user {uid!r}: 'x' has shape {x.shape} and 'y' {y.shape}, expected [n, 784] "
                              f"and [n]")
        if len(y) != n:
            raise _fail(path, f"user {uid!r}: num_samples says {n} but it has {len(y)} samples")
        if len(y) and (not np.all(np.isfinite(x)) or x.min() < -1e-6 or x.max() > 1 + 1e-6):
            raise _fail(path, f"user {uid!r}: pixel values must lie in [0, 1] (LEAF's scaling)")
        if len(y) and (np.any(y != np.round(y)) or y.min() < 0 or y.max() >= NUM_CLASSES):
            raise _fail(path, f"user {uid!r}: labels must be integers in 0..{NUM_CLASSES - 1}")
        pixels = np.rint(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8).reshape(-1, 1, 28, 28)
        prev = out.get(str(uid))
        labels = y.astype(np.int64)
        if prev is not None:  # the same writer twice in one file: keep both parts
            pixels, labels = np.concatenate([prev[0], pixels]), np.concatenate([prev[1], labels])
        out[str(uid)] = (pixels, labels)
    return out


def _json_files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix == ".json" and p.is_file())


@functools.lru_cache(maxsize=2)
def _load_cached(base: str, stamp: Tuple) -> Tuple[Tuple[str, ArrayDataset], ...]:
    parts: Dict[str, List[Tuple[np.ndarray, np.ndarray]]] = {}
    for sub in ("train", "test"):
        folder = Path(base) / sub
        if not folder.is_dir():
            continue
        for path in _json_files(folder):
            for uid, xy in _read_file(path).items():
                parts.setdefault(uid, []).append(xy)
    writers = []
    for uid in sorted(parts):
        x = np.concatenate([p[0] for p in parts[uid]])
        y = np.concatenate([p[1] for p in parts[uid]])
        if len(y) == 0:
            continue
        x.flags.writeable = False  # shared by every run of this process (cached)
        y.flags.writeable = False
        writers.append((uid, ArrayDataset(x=x, y=y, num_classes=NUM_CLASSES)))
    return tuple(writers)


def load_femnist(data_dir: Optional[str]) -> List[Tuple[str, ArrayDataset]]:
    """Every writer found under ``data_dir`` as (writer id, its samples), sorted by id; uint8 [n, 1, 28, 28].

    Loaded once per process (runs of several seeds share the arrays, which are read-only).
    """
    root = data_root(data_dir, "femnist", HOW_TO_GET)
    bases = [root / c if c else root for c in _CANDIDATES]
    base = next((b for b in bases if (b / "train").is_dir()), None)
    if base is None:
        looked = ", ".join(repr(str(b / "train")) for b in bases)
        raise ValueError(f"the FEMNIST folder train/ was not found under data_dir {str(root)!r} (looked for "
                         f"{looked}). {HOW_TO_GET}")
    train_files = _json_files(base / "train")
    if not train_files:
        raise ValueError(f"{str(base / 'train')!r} holds no *.json files. {HOW_TO_GET}")
    files = train_files + (_json_files(base / "test") if (base / "test").is_dir() else [])
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    writers = list(_load_cached(str(base.resolve()), stamp))
    if not writers:
        raise ValueError(f"the FEMNIST files under {str(base)!r} hold no samples. {HOW_TO_GET}")
    return writers


def count_writers(data_dir: Optional[str]) -> int:
    """How many writers (with at least one sample) ``data_dir`` holds; loads (and caches) the data set."""
    return len(load_femnist(data_dir))
