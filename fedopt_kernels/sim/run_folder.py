"""Where ``fedopt-sim`` writes a run's files, so that a run never silently replaces an earlier one.

* No ``--out``: ``sim_runs/<algorithm>-<dataset>``, or, when an earlier run's files are there, the
  first free ``sim_runs/<algorithm>-<dataset>-2``, ``-3``, ...
* ``--out DIR`` holding an earlier run's files: refused (the caller exits 2) unless
  ``--overwrite``; the run then deletes those files (and only those) just before it writes its
  own, so no stale seed of the earlier run is left beside the new ones.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

# the files a run writes (cli._run); only these make a folder "an earlier run's"
RUN_FILES = ("metrics_seed*.json", "metrics_seed*.csv", "curves.png")


def run_files(folder: Path) -> List[Path]:
    """The files of an earlier run in ``folder`` (none when it does not exist)."""
    if not folder.is_dir():
        return []
    return sorted(p for pattern in RUN_FILES for p in folder.glob(pattern) if p.is_file())


def choose_out_dir(out: Optional[str], default: str, overwrite: bool) -> Path:
    """The folder this run writes to; ValueError naming ``out`` when it would replace a run's files."""
    if out is None:
        folder = Path(default)
        n = 1
        while run_files(folder):
            n += 1
            folder = Path(f"{default}-{n}")
        return folder
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"out (--out) must be a folder, but {folder} is a file")
    earlier = run_files(folder)
    if earlier and not overwrite:
        raise ValueError(f"out (--out) {folder} already holds an earlier run's files ({earlier[0].name}, ...); "
                         f"give another folder, or --overwrite to replace them")
    return folder


def clear_earlier_run(folder: Path) -> None:
    """Delete an earlier run's files from ``folder`` (``--overwrite``), nothing else."""
    for f in run_files(folder):
        f.unlink()
