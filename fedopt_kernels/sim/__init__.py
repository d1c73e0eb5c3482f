"""A small reference federated-learning simulator built on the package's optimizers (``fedopt-sim``).

    from fedopt_kernels.sim import SimConfig, Simulation
    result = Simulation(SimConfig(algorithm="feddecay", beta=0.5, rounds=50)).run()

Layers, lowest first; each imports only from those before it:

- ``data/``: data sets and their file readers, partitions, each client's batch stream, and the
  image input stage.
- ``models/``: the models, built from their names (``models.build``).
- ``batched/``: the client-batched engine (``--client-batched N``, docs/client_batched.md):
  stacked clients, vmapped gradients, padded batches, CUDA-graph replay, ``auto``'s size; and
  ``precision`` (fp32, tf32, bf16: what every forward and backward pass of a run computes in).
- the round loop, in this folder: ``config`` (``SimConfig``), ``federated_data`` (from a config to
  the users and the new-user holdout), ``strategy`` (an algorithm on the round loop: its client
  optimizer and server rule, read from their descriptors), ``screen`` (the check of client updates
  before aggregation), ``batched_round`` (a round on the client-batched engine), ``evaluate``
  (the per-user protocol), ``resume`` (checkpoints), ``simulation`` (the round loop), ``validate``
  (a backend against the reference), ``report`` (a run's results as files and a table).
- ``cli/``: the ``fedopt-sim`` command.
"""

from typing import Any

from .config import VARIANTS, SimConfig
from .simulation import Simulation
from .validate import validate_backend, validate_client_batched

__all__ = ["VARIANTS", "SimConfig", "Simulation", "validate_backend", "validate_client_batched"]


def __getattr__(name: str) -> Any:
    if name == "ALGORITHMS":  # the earlier name of VARIANTS (deprecated: it holds variants)
        import warnings

        # warned here, not through config.ALGORITHMS: the warning names the caller's line, not this one
        warnings.warn(
            "fedopt_kernels.sim.ALGORITHMS is fedopt_kernels.sim.VARIANTS (variants, not "
            "algorithms: fedopt_kernels.fl.algorithm.ALGORITHMS holds those)",
            DeprecationWarning,
            stacklevel=2,
        )
        return VARIANTS
    if name == "validate_client_parallel":  # its earlier name (deprecated)
        import warnings

        warnings.warn(
            "fedopt_kernels.sim.validate_client_parallel (deprecated) is fedopt_kernels.sim.validate_client_batched",
            DeprecationWarning,
            stacklevel=2,
        )
        return validate_client_batched
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
