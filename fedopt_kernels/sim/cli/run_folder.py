"""Where ``fedopt-sim`` writes a run's files, so that a run never silently replaces an earlier one.

* No ``--out``: ``sim_runs/<algorithm>-<dataset>``, or, when an earlier run's files are there, the
  first free ``sim_runs/<algorithm>-<dataset>-2``, ``-3``, ...
* ``--out DIR`` holding an earlier run's files: refused (the caller exits 2) unless
  ``--overwrite``; the run then deletes those files (and only those) just before it writes its
  own, so no stale seed of the earlier run is left beside the new ones.
* Checkpoints (``docs/checkpoints.md``): ``<out>/checkpoints/seed<k>`` unless
  ``--checkpoint-dir DIR`` (then ``DIR/seed<k>``). A folder holding a checkpoint is an earlier
  run's too; ``--resume`` continues it instead of refusing it. ``--overwrite`` lets a new run
  replace the checkpoints of its own seeds (each by its first save); a checkpoint of a seed the new
  run does not have is left as it is (it still holds that seed's run, settings and all).
* Client state in files (``--client-state-dir DIR``): ``DIR/seed<k>``. A folder holding a store is
  an earlier run's: ``--resume`` continues it, ``--overwrite`` lets the new run start it anew.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

from ...fl.checkpoint import MANIFEST
from ..client_state_files import HEADER

CHECKPOINTS = "checkpoints"
# the files a run writes (fedopt_sim._run); only these make a folder "an earlier run's"
RESULT_FILES = ("metrics_seed*.json", "metrics_seed*.csv", "curves.png")
RUN_FILES = RESULT_FILES + (f"{CHECKPOINTS}/seed*/{MANIFEST}",)


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
        resume = (
            " (or --resume to continue it from its checkpoints)" if any(p.name == MANIFEST for p in earlier) else ""
        )
        raise ValueError(
            f"out (--out) {folder} already holds an earlier run's files ({earlier[0].name}, ...); "
            f"give another folder, or --overwrite to replace them{resume}"
        )
    return folder


def clear_earlier_run(folder: Path) -> None:
    """Delete an earlier run's result files from ``folder`` (``--overwrite``), nothing else.

    Checkpoints stay: the new run's own seeds have replaced theirs by now."""
    for f in run_files(folder):
        if f.name != MANIFEST:
            f.unlink()


def checkpoint_folders(
    out_dir: Optional[Path], checkpoint_dir: Optional[str], every: int, seeds: Sequence[int]
) -> List[Optional[Path]]:
    """Each seed's checkpoint folder (None for all when checkpoints are off: ``every == 0`` or no files)."""
    root = Path(checkpoint_dir) if checkpoint_dir is not None else (None if out_dir is None else out_dir / CHECKPOINTS)
    if every == 0 or root is None:
        return [None] * len(seeds)
    return [root / f"seed{s}" for s in seeds]


def check_checkpoint_flags(
    resume: bool, overwrite: bool, every: int, checkpoint_dir: Optional[str], no_files: bool, validate: Optional[str]
) -> None:
    """ValueError naming the flags of a combination that cannot work."""
    if every < 0:
        raise ValueError(f"checkpoint_every (--checkpoint-every) must be >= 0 (0: no checkpoints), got {every}")
    if validate is not None and (resume or checkpoint_dir is not None):
        raise ValueError("--validate runs keep no checkpoints: drop --resume / --checkpoint-dir")
    if resume and overwrite:
        raise ValueError("give --resume (continue the run in --out) or --overwrite (replace it), not both")
    if resume and every == 0:
        raise ValueError("--resume continues from checkpoints, but --checkpoint-every 0 turns them off")
    if resume and no_files and checkpoint_dir is None:
        raise ValueError("--resume with --no-files needs --checkpoint-dir (where the run's checkpoints are)")


def refuse_earlier_checkpoints(folders: Sequence[Optional[Path]], resume: bool, overwrite: bool) -> None:
    """A new run (no --resume, no --overwrite) must not replace another run's checkpoint: ValueError."""
    if resume or overwrite:
        return
    for f in folders:
        if f is not None and (f / MANIFEST).is_file():
            raise ValueError(
                f"checkpoint_dir (--checkpoint-dir) {f.parent} already holds a run's checkpoint "
                f"({f / MANIFEST}); give --resume to continue that run, --overwrite to replace it, "
                f"or another folder"
            )


def client_state_folders(
    root: Optional[str], seeds: Sequence[int], resume: bool, overwrite: bool, validate: Optional[str]
) -> List[Optional[Path]]:
    """Each seed's client-state folder (None for all: host memory). ValueError naming the option for
    a folder that holds an earlier run's store, unless the run resumes or overwrites it."""
    if root is None:
        return [None] * len(seeds)
    if validate is not None:
        raise ValueError("--validate runs keep client state in host memory: drop --client-state-dir")
    base = Path(root)
    if base.exists() and not base.is_dir():
        raise ValueError(f"client_state_dir (--client-state-dir) must be a folder, but {base} is a file")
    folders: List[Optional[Path]] = [base / f"seed{s}" for s in seeds]
    if not (resume or overwrite):
        for f in folders:
            if f is not None and (f / HEADER).is_file():
                raise ValueError(
                    f"client_state_dir (--client-state-dir) {base} already holds a run's client state "
                    f"({f / HEADER}); give --resume to continue that run, --overwrite to replace it, or "
                    f"another folder"
                )
    return folders
