"""A small reference federated-learning simulator built on the package's optimizers (``fedopt-sim``).

    from fedopt_kernels.sim import SimConfig, Simulation
    result = Simulation(SimConfig(algorithm="feddecay", beta=0.5, rounds=50)).run()

Modules, one idea each: ``datasets`` (digits, Synthetic), ``partition`` (Dirichlet, shards, splits),
``federated_data`` (users and the new-user holdout), ``models``, ``local`` (client optimizers),
``strategy`` / ``scaffold`` / ``padamfed_server`` (server rules), ``simulation`` (the round loop),
``evaluate`` (the per-user protocol), ``validate`` (backend vs reference), ``report``, ``cli``.
"""
from .config import ALGORITHMS, SimConfig
from .simulation import Simulation
from .validate import validate_backend

__all__ = ["ALGORITHMS", "SimConfig", "Simulation", "validate_backend"]
