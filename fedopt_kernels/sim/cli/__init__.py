"""The ``fedopt-sim`` command (``python -m fedopt_kernels.sim.cli`` runs it too).

``fedopt_sim`` (its flags and ``main``), ``help_format`` (``--help`` with the defaults),
``run_folder`` (where a run writes its files and checkpoints).
"""
