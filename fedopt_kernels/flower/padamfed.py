"""The earlier name of ``fedopt_kernels.flower.initial_controls`` (deprecated): imports from here still
work, with a ``DeprecationWarning``. That module holds the strategy of every server rule with an
initial round of client controls, of which PAdaMFed's is one."""

import warnings as _warnings

from .initial_controls import INIT_MESSAGE_TYPE, InitialControlsStrategy

__all__ = ["INIT_MESSAGE_TYPE", "InitialControlsStrategy"]


# stacklevel 2: warnings skips importlib's own frames, so this names the importing line
_warnings.warn(
    "fedopt_kernels.flower.padamfed (deprecated) is fedopt_kernels.flower.initial_controls",
    DeprecationWarning,
    stacklevel=2,
)
