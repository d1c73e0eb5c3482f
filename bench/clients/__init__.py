"""``python -m bench clients``: the client-batched training benchmark (its command line and what it
measures: ``bench.clients.cli``).

- ``settings``: the models in their papers' settings, the modes, FedNAR's hyperparameters;
- ``workload``: a round's data and global model, and the round in each mode;
- ``peak_memory``: a round's peak memory (CUDA's allocator, or glibc's malloc on a CPU);
- ``measure``, ``layers``: one model at one C (modes, parts, layers), timed interleaved;
- ``run``: every model at every C; ``results``, ``goals``, ``report``: reading, judging and
  writing the result.
"""

from .cli import main
from .report import render, write

__all__ = ["main", "render", "write"]
