"""Stopped runs keep what they measured: SIGTERM (what ``kill`` and most job schedulers send) is
raised as KeyboardInterrupt, like SIGINT, so the code that writes a partial table on Ctrl-C or at
gpu_check's deadline also runs when the run is killed. A process started in the background by a
non-interactive shell ignores SIGINT; SIGTERM still reaches it."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside the block, SIGTERM raises KeyboardInterrupt in the main thread; the previous handler is
    restored afterwards. Elsewhere than the main thread (where Python delivers signals) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
