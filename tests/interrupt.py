"""Stand-in for a deadline: gpu_check stops a phase with SIGINT, which Python raises as KeyboardInterrupt."""

from contextlib import contextmanager
from typing import Any, Callable, Iterator


def interrupt_on_call(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``fn``, except that its ``n``-th call raises KeyboardInterrupt instead of running."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return wrapped


class Killed(Exception):
    """What SIGTERM raises under ``sigterm_guard`` when the code under test does not take it over."""


def kill_on_call(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``fn``, except that its ``n``-th call first sends this process SIGTERM (``kill``)."""
    import os
    import signal

    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered before the next bytecode
        return fn(*args, **kwargs)

    return wrapped


@contextmanager
def sigterm_guard() -> Iterator[Callable[..., None]]:
    """SIGTERM raises Killed inside the block (instead of ending the test session); yields that
    handler, so a test can check the code under test put it back."""
    import signal

    def outside(signum: int, frame: Any) -> None:
        raise Killed

    previous = signal.signal(signal.SIGTERM, outside)
    try:
        yield outside
    finally:
        signal.signal(signal.SIGTERM, previous)
