"""FL concepts every front end shares: algorithm descriptors (``algorithm.py``, each algorithm's in
``algorithms/``), a run's settings, the server rules with their arithmetic, the client round, the
catalogue of configurations and checkpoints.

Imports the layers below it, ``core``, ``batched`` and ``optim`` (tests/test_layers.py): a
descriptor names the optimizer classes it builds, which know nothing of FL.
"""
