"""fedopt_kernels microbenchmarks.

- ``python -m bench [--quick | --smoke]``: the report. For each algorithm x backend x size it
  prints and writes median step time, effective GB/s (``bench.traffic``), % of the copy bandwidth
  measured in the same run, speedups over ``reference`` and over ``torch.optim.SGD`` (fused and
  foreach, where the work is comparable), peak memory, and on CUDA the CUDA-graph step time; the
  project's performance goals are judged per row (``bench.goals``). Files go to
  ``bench_runs/<device>-<date>.{json,md,png}`` and ``bench_runs/LATEST.md`` (git-ignored), or to
  ``--out-dir``; the committed tables live in ``bench/results/`` (``--out-dir bench/results``).
- ``pytest bench/``: the same cases as pytest-benchmark microbenchmarks.
- ``bash bench/gpu_check.sh``: install, build, full test suite and benchmark on a GPU machine.
"""
