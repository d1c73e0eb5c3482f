"""``FedOptimizer``: the base of every optimizer of the package (docs/dispatch.md, "Extending FedOptimizer").

A subclass names its op (``_spec``, from ``ops.py``), validates its hyperparameters
(``_validate_group``), turns a param group into its row of the op's ``hp`` tensor (``_hp_columns``
or ``_hp_row``), says which state tensors a parameter's step needs (``_step_tensors``) and, when its
step runs a second op, declares it (``_other_ops``) and calls ``_run_op``. The base does the rest,
one concern per module, each class built on the one before (``algorithm_hooks.py`` lists them):
the hooks and their defaults (``algorithm_hooks.py``), a CUDA graph of the caller's
(``caller_graph.py``), parameter checks (``param_checks.py``, ``checks.py``), the plan's inputs
(``gather.py``), ``start_round`` (``round_api.py``), ``step()`` and its launch (``dispatch.py``),
other ops (``other_ops.py``), the simulator's captured steps (``captured_steps.py``), and
``state_dict`` and copies (``state_format.py``). This module puts them together and sets the state
they share.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch

from . import registry as _registry
from . import replay as _replay
from . import step_op as _step_op
from .checks import check_lr_tensor, check_number, check_tensor_list
from .ops import OpSpec, state_dtype
from .plan import HpCache, StepPlan
from .replay import replayable
from .state_format import ROUND_KEY, StateFormat, round_entry

__all__ = [
    "FedOptimizer",
    "ROUND_KEY",
    "check_lr_tensor",
    "check_number",
    "check_tensor_list",
    "replayable",
    "round_entry",
    "state_dtype",
]


class FedOptimizer(StateFormat):
    """Base class: an optimizer with the FL round API of docs/algorithms.md and a pluggable backend.

    A subclass sets the class attributes and overrides the ``_``-prefixed hooks listed, each with
    its contract, in docs/dispatch.md ("Extending FedOptimizer: its hooks"); nothing else.
    """

    _spec: OpSpec  # required: the op step() runs (declared in AlgorithmHooks; named here for the hook table)

    def __init__(
        self, params: Iterable, defaults: Dict[str, Any], backend: str = "auto", replay: Optional[bool] = None
    ):
        if not isinstance(backend, str) or (backend != "auto" and backend not in _registry.BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {_registry.BACKENDS}, got {backend!r}")
        self.backend = backend
        self._replay_on = _replay.resolve_switch(replay)  # docs/replay.md
        self._replay = _replay.StepReplay() if self._replay_on else None
        self._prologue = None
        self._t = -1
        self._k_host = 0
        self._k_dev = None
        self._host_steps = 0
        self._params_flat: List[torch.Tensor] = []
        self._plan = None
        self._ones = {}
        self._hp_cache = HpCache()
        self._handle = _step_op.register(self._run)
        self._hp_names = tuple(defaults)
        self._lr_checked = []
        self._runners = self._new_runners()
        self._graph_plan: Optional[StepPlan] = None
        self._graph_cover = None
        self._retired = []
        self._capture_steps = 0  # prepare_capture's steps per round (0: not called)
        super().__init__(params, defaults)
