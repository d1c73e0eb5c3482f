"""Stand-in for a deadline: gpu_check stops a phase with SIGINT, which Python raises as KeyboardInterrupt."""
from typing import Any, Callable


def interrupt_on_call(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``fn``, except that its ``n``-th call raises KeyboardInterrupt instead of running."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return wrapped
