"""FL concepts every front end shares: algorithm descriptors, a run's settings, the server rules
with their arithmetic, the client round, the catalogue of configurations and checkpoints.

Imports only the ``core`` layer (tests/test_layers.py); the optimizers (``optim``) register their
descriptors here when they are imported.
"""
