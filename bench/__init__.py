"""fedopt_kernels benchmarks: one suite, ``python -m bench [COMMAND]`` (``bench/__main__.py`` lists them).

- ``python -m bench [--quick | --smoke]``: the step table. For each algorithm x backend x size it
  prints and writes median step time, effective GB/s (``bench.traffic``), % of the copy bandwidth
  measured in the same run, speedups over ``reference`` and over ``torch.optim.SGD`` (fused and
  foreach, where the work is comparable), peak memory, and on CUDA the CUDA-graph step time; the
  project's performance goals are judged per row (``bench.step_goals``).
- ``python -m bench clients | clients-sim | sharded | loop | profile | host | cpu-floor | checkpoints``:
  the other benchmarks, each a module (``bench.clients`` a package) with its own ``main``.
- ``pytest bench/``: the step table's cases as pytest-benchmark microbenchmarks.
- ``bash bench/gpu_check.sh``: install, build, the GPU tests and the benchmarks on a GPU machine.

What every benchmark shares: ``bench.timing`` (device sync, warm-up, rounds in a rotated order,
medians, the disturbance check of ``bench.contention``), ``bench.goals`` (goals and their verdicts),
``bench.report`` (the result files: ``bench_runs/<name>.{json,md,png}`` and LATEST.md, git-ignored,
or ``--out-dir``; the committed tables live in ``bench/results/``), ``bench.machine`` (what a result
ran on) and ``bench.cli`` (the command-line options they have in common).
"""
