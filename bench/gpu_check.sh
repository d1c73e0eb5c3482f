#!/usr/bin/env bash
# One command for a GPU machine: install + build, the whole test suite (GPU tests included), the
# benchmark; everything lands in one folder, bench/results/gpu-<device>-<date>/, copied to
# $OUT/<same name>/ when $OUT is set (the lent machine's return folder: at most 8 files come back,
# so exactly 8 are written there). Finishes inside 10 minutes: each phase runs under a deadline.
#
#   FEDOPT_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh            # on the GPU machine
#   bash bench/gpu_check.sh --no-gpu --skip-install --pytest-args "tests/test_api.py"   # CPU dry run
#
# Options:
#   --no-gpu            dry run without CUDA: bench/results/tmp/cpu-dryrun-<date>, benchmark --smoke,
#                       and the install phase as `pip install --dry-run` (resolves, builds nothing)
#   --skip-install      do not pip install / build (use what is installed)
#   --skip-tests        do not run pytest
#   --skip-bench        do not run the benchmark
#   --bench-mode MODE   full | quick | smoke (default: quick; it has all three sizes on CUDA)
#   --pytest-args ARGS  what to test first (default: the GPU-relevant tests, -k "cuda or gpu or triton or
#                       replay", which takes the tests marked gpu too, without the three wide dtype sweeps
#                       and the tests marked long_compile; the CPU-only tests are CI's job)
#   --wide-args ARGS    what to test with the time left after the benchmarks (default: the long_compile
#                       tests, then those sweeps' GPU cases; "" skips the phase)
#   --budget SECONDS    total wall-time budget (default 540; the lent machine's limit is 600)
#   --results-dir DIR   the results folder instead of the dated one above (two dry runs at once, as
#                       parallel tests run them, must not share a folder)
# Phases, in this order so that a run cut short still measures: install, tests, bench
# (python -m bench, fused backends and torch's alternatives), bench_loop (python -m bench loop),
# bench_clients (python -m bench clients), clients_sim (python -m bench clients-sim, stand-in
# Fashion-MNIST), then with the time left: paper_slice (experiments/paper_commands.py --time),
# tests_wide. bench/gpu_loop.sh is the second call: the loop at length and where its time goes
# (python -m bench profile); the first call keeps no time for the profile, so that the tests get theirs.
# install: offline with every test extra; else offline the package alone (a lent GPU machine has
# torch, triton, pytest, pytest-xdist, pytest-timeout and hypothesis but no flwr: the tests that need
# a missing extra skip with the reason); else with the registry. tests: in parallel when pytest-xdist
# is installed. The commit is $FEDOPT_COMMIT when set, else HEAD when this folder is a checkout's
# top level (never an enclosing repository's), else "unknown". The summary lists the tests that
# failed or errored by node id, from both test phases' junit files (bench/junit_failures.py).
set -u -o pipefail
cd "$(dirname "$0")/.."

NO_GPU=0; SKIP_INSTALL=0; SKIP_TESTS=0; SKIP_BENCH=0; BENCH_MODE=quick; BUDGET=540; RESULTS_DIR=
# the wide sweeps: on an H200 they hold most of the selection's cases and time (2,600 cases of the
# rest ran in 86 s with 14 workers; the whole selection needs about 500 s)
WIDE_FILES="tests/test_equivalence.py tests/test_batched.py tests/test_compile.py"
GPU_K='-k "cuda or gpu or triton or replay"'
# the GPU tests that compile for a minute or more (marked long_compile) wait for the time left, first
# in it; the test phase keeps one case of each step form (tests/test_whole_iteration_graph.py)
LONG_COMPILE="tests/test_whole_iteration_graph.py::test_reduce_overhead_compile_of_the_whole_step_takes_the_eager_steps"
PYTEST_ARGS="tests $(for f in $WIDE_FILES; do printf -- '--ignore=%s ' "$f"; done)$GPU_K -m \"not long_compile\""
WIDE_ARGS="$LONG_COMPILE $WIDE_FILES $GPU_K -m \"long_compile or not gpu\""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-gpu) NO_GPU=1 ;;
    --skip-install) SKIP_INSTALL=1 ;;
    --skip-tests) SKIP_TESTS=1 ;;
    --skip-bench) SKIP_BENCH=1 ;;
    --bench-mode) BENCH_MODE="$2"; shift ;;
    --pytest-args) PYTEST_ARGS="$2"; shift ;;
    --wide-args) WIDE_ARGS="$2"; shift ;;
    --budget) BUDGET="$2"; shift ;;
    --results-dir) RESULTS_DIR="$2"; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$BENCH_MODE" in full|quick|smoke) ;; *) echo "gpu_check.sh: --bench-mode must be full, quick or smoke" >&2; exit 2 ;; esac

T0=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }

# torch first: everything else (device name, the build) needs it. The lent machines have it; a
# machine with network access gets it from the registry.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "gpu_check: torch is not importable with $PY; trying pip install torch"
  "$PY" -m pip install --retries 1 --timeout 20 torch || { echo "gpu_check: cannot install torch" >&2; exit 3; }
fi

if [ "$NO_GPU" = 0 ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device (use --no-gpu for a dry run)" >&2; exit 4
  fi
  DEVICE=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
  PREFIX=gpu
  BENCH_ARGS="--device cuda"
else
  DEVICE=cpu
  PREFIX=cpu-dryrun
  BENCH_MODE=smoke
  BENCH_ARGS="--device cpu"
fi
SLUG=$(echo "$DEVICE" | tr 'A-Z' 'a-z' | sed -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//' | cut -c1-40)
DATE=$(date -u +%Y-%m-%d)
NAME="$PREFIX-$SLUG-$DATE"
[ "$PREFIX" = cpu-dryrun ] && NAME="cpu-dryrun-$DATE"
RES="bench/results/$NAME"
# dry runs go to the git-ignored tmp folder: they are checks of this script, not results
[ "$NO_GPU" = 1 ] && RES="bench/results/tmp/$NAME"
[ -n "$RESULTS_DIR" ] && RES="$RESULTS_DIR"
rm -rf "$RES"; mkdir -p "$RES"
if [ -n "${FEDOPT_COMMIT:-}" ]; then
  COMMIT=$FEDOPT_COMMIT
elif [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
  COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
else
  COMMIT=unknown
fi
export FEDOPT_COMMIT="$COMMIT"
SUMMARY="$RES/summary.md"

{
  echo "# GPU check: $DEVICE"
  echo
  echo "- date (UTC): $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: \`$COMMIT\`"
  echo "- host: $(uname -n), $(nproc) cores, kernel $(uname -r)"
  echo "- python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  echo "- torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
  echo "- triton: $("$PY" -c 'import triton; print(triton.__version__)' 2>/dev/null || echo not installed)"
  echo "- nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo none)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "- nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -1)"
  fi
  echo
  echo "| phase | exit status | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

FAILED=0
# phase NAME SECONDS CMD...: run CMD under a deadline, log to $RES/NAME.log, add a summary row.
# SIGINT first (pytest then still writes its summary and junit file), SIGKILL 20 s later.
phase() {
  local name=$1 limit=$2; shift 2
  local start=$(date +%s) rc
  if [ "$limit" -lt 10 ]; then
    echo "| $name | skipped: no time left | 0 |" >> "$SUMMARY"; FAILED=1; return
  fi
  echo "gpu_check: $name (deadline ${limit}s)"
  timeout -s INT -k 20 "$limit" "$@" > "$RES/$name.log" 2>&1
  rc=$?
  [ $rc = 124 ] && echo "(stopped at the ${limit}s deadline)" >> "$RES/$name.log"
  [ $rc != 0 ] && FAILED=1
  echo "| $name | $rc$([ $rc = 124 ] && echo ' (deadline)') | $(( $(date +%s) - start )) |" >> "$SUMMARY"
  tail -3 "$RES/$name.log"
}

install_pkg() {
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  # build for this GPU only (a third of the compile time of the default architecture list)
  if [ "$NO_GPU" = 0 ] && [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    export TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  fi
  # a dry run of this script must not rebuild or reinstall the checkout it checks
  local dry=""; [ "$NO_GPU" = 1 ] && dry="--dry-run"
  echo "== offline, with the test extra"
  "$PY" -m pip install $dry --no-index -e ".[test]" --no-build-isolation && return 0
  echo "== offline, the package alone (tests that need a missing extra skip, saying which)"
  if "$PY" -m pip install $dry --no-index --no-deps -e . --no-build-isolation; then
    "$PY" - <<'PYEOF'
import importlib.util
wanted = {"flwr": "[flower]", "sklearn": "[sim]", "matplotlib": "[sim]", "tqdm": "[sim]",
          "hypothesis": "[test]", "pytest_benchmark": "[bench]", "xdist": "pytest-xdist",
          "pytest_timeout": "pytest-timeout", "triton": "[triton]"}
missing = [f"{m} ({extra})" for m, extra in wanted.items() if importlib.util.find_spec(m) is None]
print("missing here:", ", ".join(missing) if missing else "nothing")
PYEOF
    return 0
  fi
  echo "== with the registry"
  "$PY" -m pip install $dry --retries 1 --timeout 20 -e ".[test]" --no-build-isolation
}
# `timeout` runs programs, not shell functions: the phase runs the function in a child bash
export -f install_pkg
export PY NO_GPU

if [ "$SKIP_INSTALL" = 0 ]; then
  phase install $(( $(left) - 200 < 300 ? $(left) - 200 : 300 )) bash -c install_pkg
else
  echo "| install | skipped (--skip-install) | 0 |" >> "$SUMMARY"
fi
BACKENDS=$("$PY" -c "import fedopt_kernels as f; print(repr(f.available_backends()).replace(chr(10), '; '))" 2>&1 | tail -1)

# shares of the budget (seconds) from an H100 (install 43, loop 25, small-CNN clients 41) and an
# H200 (tests ~90, bench ~90 without the reference rows, the four models' clients 144 cut before
# ResNet's largest C, clients_sim 39); clients at most 170 with its formulation search, clients_sim 60;
# bench 90 (cut at its deadline, it writes the groups of cases it finished). Reserved ahead: only what
# comes before paper_slice (45 s on the H100) and tests_wide, which take what is left
TESTS_S=120; BENCH_S=90; LOOP_S=40; CLIENTS_S=170; CLIENTS_SIM_S=60; PAPER_S=90
PAR=""
if "$PY" -c "import xdist" >/dev/null 2>&1; then
  # a worker per core but two (GPU tests share one device), at most 14
  W=$(( $(nproc) - 2 )); [ "$W" -gt 14 ] && W=14; [ "$W" -lt 1 ] && W=1
  PAR="-n $W"
fi
"$PY" -c "import pytest_timeout" >/dev/null 2>&1 && PAR="$PAR --timeout 240"
# run_tests PHASE DEADLINE ARGS: pytest under the phase's deadline, its junit file beside its log
run_tests() {
  # shellcheck disable=SC2086
  eval phase "$1" "$2" "$PY" -m pytest $3 $PAR -q -rfEs -p no:cacheprovider --junitxml="$RES/junit-$1.xml"
}
if [ "$SKIP_TESTS" = 0 ]; then
  T=$(( $(left) - 15 - BENCH_S - LOOP_S - CLIENTS_S - CLIENTS_SIM_S )); [ "$T" -gt "$TESTS_S" ] && T=$TESTS_S
  run_tests tests "$T" "$PYTEST_ARGS"
else
  echo "| tests | skipped (--skip-tests) | 0 |" >> "$SUMMARY"
fi

if [ "$SKIP_BENCH" = 0 ]; then
  # shellcheck disable=SC2086
  # the reference backend's rows (plain PyTorch, 1-14 s each on a GPU) belong to the CPU table:
  # here the time goes to the fused backends and torch's own optimizers
  BENCH_ONLY=""
  if [ "$NO_GPU" = 0 ]; then
    FUSED=$("$PY" -c "import fedopt_kernels as f; print(' '.join(b for b in f.available_backends('cuda') if b != 'reference'))" 2>/dev/null)
    [ -n "$FUSED" ] && BENCH_ONLY="--backends $FUSED"
  fi
  B=$(( $(left) - 15 - LOOP_S - CLIENTS_S - CLIENTS_SIM_S )); [ "$B" -gt "$BENCH_S" ] && B=$BENCH_S
  phase bench "$B" "$PY" -m bench --"$BENCH_MODE" $BENCH_ARGS $BENCH_ONLY --out-dir "$RES"
  # a user's training loop (zero_grad(set_to_none=True), forward, backward, step): GPU only
  if [ "$NO_GPU" = 0 ]; then
    L=$(( $(left) - 15 - CLIENTS_S - CLIENTS_SIM_S )); [ "$L" -gt "$LOOP_S" ] && L=$LOOP_S
    phase bench_loop "$L" "$PY" -m bench loop --device cuda --blocks 5 --per-block 15 --warmup 15 --out-dir "$RES"
  fi
  # client-batched training on the four models: sequential vs vmap vs the layers engine with its
  # default and its measured formulations (+ replayed from a CUDA graph, + chunks); two timed rounds
  # per mode, every model's smallest C first (a deadline's SIGINT still writes the cases measured);
  # the formulation search at most 8 s per model and C, its in-context times instead of the
  # layers-alone table
  CLIENTS_ARGS="--rounds 2 --search-budget 8 --no-layers"
  [ "$BENCH_MODE" = smoke ] && CLIENTS_ARGS="--smoke"
  # shellcheck disable=SC2086
  C=$(( $(left) - 15 - CLIENTS_SIM_S )); [ "$C" -gt "$CLIENTS_S" ] && C=$CLIENTS_S
  phase bench_clients "$C" "$PY" -m bench clients $CLIENTS_ARGS $BENCH_ARGS --out-dir "$RES"
  # a simulator run, sequential vs client-batched side by side: FedAvg CNN on stand-in Fashion-MNIST
  # (no data on a lent machine), 100 clients, 20 per round, 5 local epochs, two of the 50 rounds: GPU only
  if [ "$NO_GPU" = 0 ]; then
    S=$(( $(left) - 15 )); [ "$S" -gt "$CLIENTS_SIM_S" ] && S=$CLIENTS_SIM_S
    phase clients_sim "$S" "$PY" -m bench clients-sim --stand-in --rounds 2 --device cuda --out-dir "$RES"
  fi
else
  echo "| bench | skipped (--skip-bench) | 0 |" >> "$SUMMARY"
fi

# the papers' own settings (CIFAR-10, ResNet-18 / CNN): a slice of each command, timed on a stand-in
# CIFAR-10 (a lent machine has no data and no network), for the wall-time estimates in
# experiments/results_real.md
if [ "$SKIP_BENCH" = 0 ] && [ "$NO_GPU" = 0 ]; then
  P=$(( $(left) - 15 )); [ "$P" -gt "$PAPER_S" ] && P=$PAPER_S
  if [ "$P" -ge 40 ]; then
    phase paper_slice "$P" "$PY" experiments/paper_commands.py --time --device cuda --out-dir "$RES"
  else
    echo "| paper_slice | not run: $(left) s left | 0 |" >> "$SUMMARY"
  fi
fi

if [ "$SKIP_TESTS" = 0 ] && [ -n "$WIDE_ARGS" ]; then
  if [ "$(left)" -gt 40 ]; then
    run_tests tests_wide $(( $(left) - 10 )) "$WIDE_ARGS"
  else
    echo "| tests_wide | not run: $(left) s left | 0 |" >> "$SUMMARY"
  fi
fi

{
  echo
  echo "- backends: $BACKENDS"
  echo "- test selection: pytest $PYTEST_ARGS; then, with the time left: pytest $WIDE_ARGS"
  grep -h '^missing here:' "$RES/install.log" 2>/dev/null | sed 's/^/- /'
  for t in tests tests_wide; do
    [ -f "$RES/$t.log" ] && echo "- $t: $(grep -E '(passed|failed|error|no tests ran)' "$RES/$t.log" | tail -1)"
  done
  echo "- wall time: $(elapsed) s of a ${BUDGET} s budget"
  echo
  # the failing tests by node id (both test phases), so that the summary alone says what to look at
  JUNITS=$(ls "$RES"/junit-*.xml 2>/dev/null)
  if [ "$SKIP_TESTS" = 0 ]; then
    # shellcheck disable=SC2086
    "$PY" -m bench.junit_failures $JUNITS || echo "(the junit files could not be read)"
    echo
  fi
  BENCH_MD=$(ls "$RES"/*.md 2>/dev/null | grep -v -e summary.md -e LATEST.md -e /clients- -e /loop- -e /profile- | head -1)
  if [ -n "$BENCH_MD" ]; then
    echo "## Benchmark goals ($(basename "$BENCH_MD"))"
    echo
    sed -n '/^## Goals/,/^## Results/p' "$BENCH_MD" | grep '^|'
  fi
  LOOP_MD=$(ls "$RES"/loop-*.md 2>/dev/null | head -1)
  if [ -n "$LOOP_MD" ]; then
    echo
    echo "## Training loop ($(basename "$LOOP_MD"))"
    sed -n '2,$p' "$LOOP_MD"
  fi
  PROFILE_MD=$(ls "$RES"/profile-*.md 2>/dev/null | head -1)
  if [ -n "$PROFILE_MD" ]; then
    echo
    echo "## Where an iteration's time goes ($(basename "$PROFILE_MD"))"
    sed -n '2,$p' "$PROFILE_MD"
  fi
  PAPER_MD="$RES/paper-commands-cuda.md"
  [ -f "$PAPER_MD" ] && { echo; cat "$PAPER_MD"; }
  CLIENTS_MD=$(ls "$RES"/clients-*.md 2>/dev/null | grep -v /clients-sim- | head -1)
  if [ -n "$CLIENTS_MD" ]; then
    # the whole table here: only its JSON travels back (redraw: python -m bench clients --render X.json)
    echo
    echo "## Client-batched benchmark ($(basename "$CLIENTS_MD"))"
    sed -n '/^## Goals/,$p' "$CLIENTS_MD"
  fi
  CLIENTS_SIM_MD=$(ls "$RES"/clients-sim-*.md 2>/dev/null | head -1)
  if [ -n "$CLIENTS_SIM_MD" ]; then
    echo
    sed '1s/^# /## /' "$CLIENTS_SIM_MD"
  fi
} >> "$SUMMARY"
cat "$SUMMARY"

# $OUT: 8 files at most. summary (with the client-batched table), tests.log (both test phases),
# bench.log (the benchmarks' logs, clients_sim's included), junit.tar.gz, the benchmark's json/md/png, the client-batched json; install.log
# only when the install failed (in place of the client-batched json, which then means nothing).
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/$NAME"
  [ -f "$RES/bench_loop.log" ] && { echo; echo "=== bench_loop ==="; cat "$RES/bench_loop.log"; } >> "$RES/bench.log"
  [ -f "$RES/bench_profile.log" ] && { echo; echo "=== bench_profile ==="; cat "$RES/bench_profile.log"; } >> "$RES/bench.log"
  [ -f "$RES/bench_clients.log" ] && { echo; echo "=== bench_clients ==="; cat "$RES/bench_clients.log"; } >> "$RES/bench.log"
  [ -f "$RES/clients_sim.log" ] && { echo; echo "=== clients_sim ==="; cat "$RES/clients_sim.log"; } >> "$RES/bench.log"
  [ -f "$RES/paper_slice.log" ] && { echo; echo "=== paper_slice ==="; cat "$RES/paper_slice.log"; } >> "$RES/bench.log"
  [ -f "$RES/tests_wide.log" ] && { echo; echo "=== tests_wide ==="; cat "$RES/tests_wide.log"; } >> "$RES/tests.log"
  (cd "$RES" && ls junit-*.xml >/dev/null 2>&1 && tar czf junit.tar.gz junit-*.xml)
  EXTRA=$(ls "$RES"/clients-*.json 2>/dev/null | grep -v /clients-sim- | head -1)
  grep -q '^| install | 0 |' "$SUMMARY" || grep -q '^| install | skipped' "$SUMMARY" || EXTRA="$RES/install.log"
  for f in "$RES"/summary.md "$RES"/tests.log "$RES"/bench.log "$RES"/junit.tar.gz \
           $(ls "$RES"/*.json "$RES"/*.png 2>/dev/null | grep -v -e /clients- -e /loop- -e /profile-) "${BENCH_MD:-}" "$EXTRA"; do
    [ -f "$f" ] && cp "$f" "$OUT/$NAME/"
  done
  echo "gpu_check: copied $(ls "$OUT/$NAME" | wc -l) files to \$OUT/$NAME"
fi
echo "gpu_check: results in $RES ($(elapsed) s)"
exit $FAILED
