"""LEAF's JSON layout, shared by the FEMNIST and Shakespeare loaders.

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) writes
``<data_dir>/train/*.json`` and ``<data_dir>/test/*.json``, each file ``{"users": [id, ...],
"num_samples": [n, ...], "user_data": {id: {"x": [...], "y": [...]}}}``. This module checks that
structure and walks the folders; each data set decodes one user's ``x``/``y`` itself.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .datasets import ArrayDataset
from .folder import data_root

Arrays = Tuple[np.ndarray, np.ndarray]
# (file, user id, its num_samples, its user_data entry, fail) -> (x, y); fail(path, msg) makes the error
Decoder = Callable[[Path, str, int, dict, Callable[[Path, str], ValueError]], Arrays]


@functools.cache
def _failer(how_to_get: str) -> Callable[[Path, str], ValueError]:
    def fail(path: Path, msg: str) -> ValueError:
        return ValueError(f"{str(path)!r}: {msg}. {how_to_get}")

    return fail


def read_file(path: Path, decode: Decoder, how_to_get: str) -> Dict[str, Arrays]:
    """One LEAF JSON file as {user id: (x, y)}; a malformed file is a ValueError naming it."""
    fail = _failer(how_to_get)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as exc:
        raise fail(
            path, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); the file is damaged or truncated"
        ) from None
    except (UnicodeDecodeError, OSError) as exc:
        raise fail(path, f"cannot be read as a UTF-8 JSON file ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or not all(k in obj for k in ("users", "num_samples", "user_data")):
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise fail(path, f"expected an object with 'users', 'num_samples' and 'user_data', got {keys}")
    users, counts, data = obj["users"], obj["num_samples"], obj["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or not isinstance(data, dict):
        raise fail(path, "'users' and 'num_samples' must be lists and 'user_data' an object")
    if len(users) != len(counts):
        raise fail(path, f"{len(users)} users but {len(counts)} entries in 'num_samples'")
    for i, (uid, n) in enumerate(zip(users, counts, strict=True)):  # ids are the keys of 'user_data': JSON strings
        if not isinstance(uid, str):
            raise fail(
                path,
                f"'users' must hold user ids (strings, the keys of 'user_data'), got "
                f"{type(uid).__name__} {uid!r} at position {i}",
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise fail(path, f"'num_samples' must hold integers >= 0, got {n!r} for user {uid!r}")
    out: Dict[str, Arrays] = {}
    for uid, n in zip(users, counts, strict=True):
        u = data.get(uid)
        if not isinstance(u, dict) or "x" not in u or "y" not in u:
            raise fail(path, f"user {uid!r} is listed in 'users' but has no {{'x', 'y'}} in 'user_data'")
        x, y = decode(path, uid, n, u, fail)
        prev = out.get(uid)
        if prev is not None:  # the same user twice in one file: keep both parts
            x, y = np.concatenate([prev[0], x]), np.concatenate([prev[1], y])
        out[uid] = (x, y)
    return out


def _json_files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix == ".json" and p.is_file())


@functools.lru_cache(maxsize=2)
def _load_cached(
    base: str, stamp: Tuple, decode: Decoder, how_to_get: str, num_classes: int
) -> Tuple[Tuple[str, ArrayDataset], ...]:
    parts: Dict[str, List[Arrays]] = {}
    for sub in ("train", "test"):
        folder = Path(base) / sub
        if not folder.is_dir():
            continue
        for path in _json_files(folder):
            for uid, xy in read_file(path, decode, how_to_get).items():
                parts.setdefault(uid, []).append(xy)
    users = []
    for uid in sorted(parts):
        x = np.concatenate([p[0] for p in parts[uid]])
        y = np.concatenate([p[1] for p in parts[uid]])
        if len(y) == 0:
            continue
        x.flags.writeable = False  # shared by every run of this process (cached)
        y.flags.writeable = False
        users.append((uid, ArrayDataset(x=x, y=y, num_classes=num_classes)))
    return tuple(users)


def load_users(
    data_dir: Optional[str],
    name: str,
    title: str,
    candidates: Sequence[str],
    decode: Decoder,
    how_to_get: str,
    num_classes: int,
) -> List[Tuple[str, ArrayDataset]]:
    """Every user under ``data_dir`` (train/ and test/ pooled) as (user id, its samples), sorted by id.

    ``candidates``: sub-folders of ``data_dir`` that may hold train/ (LEAF's ``data`` folder and
    its parents). Loaded once per process: runs of several seeds share the read-only arrays.
    """
    root = data_root(data_dir, name, how_to_get)
    bases = [root / c if c else root for c in candidates]
    base = next((b for b in bases if (b / "train").is_dir()), None)
    if base is None:
        looked = ", ".join(repr(str(b / "train")) for b in bases)
        raise ValueError(
            f"the {title} folder train/ was not found under data_dir {str(root)!r} (looked for {looked}). {how_to_get}"
        )
    train_files = _json_files(base / "train")
    if not train_files:
        raise ValueError(f"{str(base / 'train')!r} holds no *.json files. {how_to_get}")
    files = train_files + (_json_files(base / "test") if (base / "test").is_dir() else [])
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    users = list(_load_cached(str(base.resolve()), stamp, decode, how_to_get, num_classes))
    if not users:
        raise ValueError(f"the {title} files under {str(base)!r} hold no samples. {how_to_get}")
    return users
