"""A small reference federated-learning simulator built on the package's optimizers (``fedopt-sim``).

    from fedopt_kernels.sim import SimConfig, Simulation
    result = Simulation(SimConfig(algorithm="feddecay", beta=0.5, rounds=50)).run()

Modules, one idea each: ``datasets`` (digits, Synthetic), ``partition`` (Dirichlet, shards, splits),
``federated_data`` (users and the new-user holdout), ``models``, ``strategy`` (an algorithm on the
round loop: its client optimizer and server rule, read from their descriptors), ``simulation`` (the round loop),
``evaluate`` (the per-user protocol), ``validate`` (backend vs reference), ``report``, ``cli``.
Client-parallel rounds (``--client-parallel N``, docs/client_batched.md): ``batched_round`` (the
round), ``batched_trainer`` (stacked clients + batched optimizer), ``client_loss`` (vmapped
gradients), ``client_batches`` (padded per-client batches), ``step_graph`` (CUDA-graph replay),
``parallel_size`` (``auto``).
"""
from .config import ALGORITHMS, SimConfig
from .simulation import Simulation
from .validate import validate_backend, validate_client_parallel

__all__ = ["ALGORITHMS", "SimConfig", "Simulation", "validate_backend", "validate_client_parallel"]
