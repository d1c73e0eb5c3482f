"""Shared checks for data sets read from ``--data-dir``: one clear ValueError per problem.

Each message names the path, says what was expected there and how to get it, so that a missing or
damaged file never surfaces as a traceback from deep inside pickle or json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


def data_root(data_dir: Optional[str], dataset: str, how_to_get: str) -> Path:
    """``data_dir`` as an existing directory, or ValueError naming ``dataset`` and ``how_to_get``."""
    if data_dir is None or str(data_dir) == "":
        raise ValueError(
            f"dataset={dataset!r} is read from a local folder: pass data_dir (--data-dir DIR). {how_to_get}"
        )
    root = Path(data_dir).expanduser()
    if not root.exists():
        raise ValueError(f"data_dir {str(root)!r} does not exist. {how_to_get}")
    if not root.is_dir():
        raise ValueError(f"data_dir {str(root)!r} is not a directory. {how_to_get}")
    return root


def first_existing_dir(root: Path, candidates: Sequence[str], what: str, how_to_get: str) -> Path:
    """The first of ``root/candidate`` that is a directory, or ValueError listing every place looked."""
    for c in candidates:
        p = root / c if c else root
        if p.is_dir():
            return p
    looked = ", ".join(repr(str(root / c if c else root)) for c in candidates)
    raise ValueError(f"{what} not found under data_dir {str(root)!r} (looked for {looked}). {how_to_get}")


def require_file(path: Path, what: str, how_to_get: str) -> Path:
    if not path.is_file():
        raise ValueError(f"missing file {str(path)!r}: expected {what}. {how_to_get}")
    return path
