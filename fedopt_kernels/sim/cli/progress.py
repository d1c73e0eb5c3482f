"""fedopt-sim's progress bar: one tick a round, with the round's loss, validation accuracy and, under
user-level DP, the privacy spent so far."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict


class NoBar:
    """Stands in for a tqdm bar when there is none to draw (--quiet, no terminal, tqdm missing)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def advance(bar: Any, show_metrics: bool = False) -> Callable[[Dict[str, Any]], None]:
    """The per-round callback that moves ``bar`` on by one round (and shows the round's loss and
    validation accuracy where it has them, with ``show_metrics``)."""

    def tick(rec: Dict[str, Any]) -> None:
        bar.update(1)
        eps = {"eps": f"{rec['dp_epsilon']:.3g}"} if "dp_epsilon" in rec else {}
        if show_metrics and "val_acc" in rec:
            bar.set_postfix(loss=f"{rec['train_loss']:.3f}", val_acc=f"{rec['val_acc']:.3f}", **eps)

    return tick


def progress_bar(total: int, desc: str, quiet: bool) -> Any:
    """A tqdm bar over ``total`` rounds, or one that draws nothing (--quiet, no terminal, no tqdm)."""
    if quiet or not sys.stderr.isatty():
        return NoBar()  # tqdm is not even imported: --quiet runs need no [sim] extra for it
    from ...core.extras import hint, optional

    tqdm = optional("tqdm")
    if tqdm is None:
        print(f"fedopt-sim: no progress bar: tqdm is not installed ({hint('tqdm')})", file=sys.stderr)
        return NoBar()
    return tqdm.tqdm(total=total, desc=desc, leave=False)
