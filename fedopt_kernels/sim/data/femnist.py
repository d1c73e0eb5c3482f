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

from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from .datasets import ArrayDataset
from .leaf_json import load_users

NUM_CLASSES = 62
_CANDIDATES = ("", "femnist/data", "data", "femnist")

HOW_TO_GET = (
    "FEMNIST is expected in LEAF's JSON layout, DIR/train/*.json (and DIR/test/*.json), with "
    "'users', 'num_samples' and 'user_data' {user: {'x': [[784 pixels]], 'y': [labels]}}: clone "
    "https://github.com/TalwalkarLab/leaf, run `./preprocess.sh -s niid --sf 0.05 -k 0 -t sample` in "
    "leaf/data/femnist (--sf: fraction of the data to keep, by writer) and pass "
    "--data-dir leaf/data/femnist/data. It is not downloaded by --download."
)


def _decode(path: Path, uid: str, n: int, u: dict, fail) -> Tuple[np.ndarray, np.ndarray]:
    """One writer's samples: uint8 pixels [n, 1, 28, 28] and int64 labels."""
    try:
        # no dtype here: None, strings or booleans would be converted silently (None -> NaN)
        x, y = np.asarray(u["x"]), np.asarray(u["y"])
    except (TypeError, ValueError):  # ragged lists
        x = y = np.empty(0, dtype=object)
    if x.dtype.kind not in "fiu" or y.dtype.kind not in "fiu":
        raise fail(path, f"user {uid!r}: 'x' must be a list of 784-number lists and 'y' a list of integers")
    x, y = x.astype(np.float32), y.astype(np.float64)
    if x.ndim != 2 or x.shape[1] != 784 or y.ndim != 1 or len(y) != len(x):
        raise fail(path, f"user {uid!r}: 'x' has shape {x.shape} and 'y' {y.shape}, expected [n, 784] and [n]")
    if len(y) != n:
        raise fail(path, f"user {uid!r}: num_samples says {n} but it has {len(y)} samples")
    if len(y) and (not np.all(np.isfinite(x)) or x.min() < -1e-6 or x.max() > 1 + 1e-6):
        raise fail(path, f"user {uid!r}: pixel values must lie in [0, 1] (LEAF's scaling)")
    if len(y) and (np.any(y != np.round(y)) or y.min() < 0 or y.max() >= NUM_CLASSES):
        raise fail(path, f"user {uid!r}: labels must be integers in 0..{NUM_CLASSES - 1}")
    pixels = np.rint(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8).reshape(-1, 1, 28, 28)
    return pixels, y.astype(np.int64)


def load_femnist(data_dir: Optional[str]) -> List[Tuple[str, ArrayDataset]]:
    """Every writer found under ``data_dir`` as (writer id, its samples), sorted by id; uint8 [n, 1, 28, 28].

    Loaded once per process (runs of several seeds share the arrays, which are read-only).
    """
    return load_users(data_dir, "femnist", "FEMNIST", _CANDIDATES, _decode, HOW_TO_GET, NUM_CLASSES)


def count_writers(data_dir: Optional[str]) -> int:
    """How many writers (with at least one sample) ``data_dir`` holds; loads (and caches) the data set."""
    return len(load_femnist(data_dir))
