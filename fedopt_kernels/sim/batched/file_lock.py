"""An exclusive lock on a file that processes sharing a folder take in turn (``choice_cache.py``).

The lock is the operating system's, on an open lock file: ``fcntl.flock`` (POSIX) or
``msvcrt.locking`` (Windows). The system releases it when its holder ends, killed or not, so a
crashed writer never leaves a lock behind; the lock file itself stays (empty), as the next writer
uses it again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Union

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def exclusive(path: Union[str, os.PathLike]) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` (created if missing) while the block runs; waits for it."""
    fd = os.open(Path(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield  # closing the descriptor releases the lock
            return
        import msvcrt  # Windows: a lock on the file's first byte

        msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # retries for 10 s, then raises OSError
        try:
            yield
        finally:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    finally:
        os.close(fd)
