#!/usr/bin/env bash
# The second call on a lent GPU machine, after bench/gpu_check.sh: a user's training loop at length
# (python -m bench loop: every row interleaved, 11 rounds) and where its time goes (python -m bench
# profile: 10 profiled iterations per row). About 5 minutes. Results in
# bench/results/gpu-loop-<device>-<date>/, copied to $OUT/<same name>/ when $OUT is set (7 files).
#
#   FEDOPT_COMMIT=$(git rev-parse HEAD) bash bench/gpu_loop.sh       # on the GPU machine
#   bash bench/gpu_loop.sh --no-gpu                                   # CPU dry run (small CNN, short)
#
# A machine handed back between two calls comes back bare: the package is installed first when its
# CUDA extension does not import (offline, the package alone, as gpu_check.sh does).
set -u -o pipefail
cd "$(dirname "$0")/.."

NO_GPU=0; BUDGET=300
while [ $# -gt 0 ]; do
  case "$1" in
    --no-gpu) NO_GPU=1 ;;
    --budget) BUDGET="$2"; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "gpu_loop.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
T0=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

if [ "$NO_GPU" = 0 ]; then
  DEVICE=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))") || { echo "gpu_loop: no CUDA device" >&2; exit 4; }
  ARGS="--device cuda"; LOOP_ARGS="--blocks 11 --warmup 30"; PROFILE_ARGS="--iterations 10"
else
  DEVICE=cpu; ARGS="--device cpu --models small_cnn"; LOOP_ARGS="--blocks 2 --per-block 3 --warmup 2"
  PROFILE_ARGS="--iterations 2 --warmup 2"
fi
SLUG=$(echo "$DEVICE" | tr 'A-Z' 'a-z' | sed -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//' | cut -c1-40)
NAME="gpu-loop-$SLUG-$(date -u +%Y-%m-%d)"
RES="bench/results/$NAME"
[ "$NO_GPU" = 1 ] && RES="bench/results/tmp/cpu-dryrun-loop-$(date -u +%Y-%m-%d)"
rm -rf "$RES"; mkdir -p "$RES"
export FEDOPT_COMMIT="${FEDOPT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
SUMMARY="$RES/summary.md"
{
  echo "# Training loop and profile: $DEVICE"
  echo
  echo "- date (UTC): $(date -u +%Y-%m-%dT%H:%M:%SZ); commit \`$FEDOPT_COMMIT\`"
  echo "- torch: $("$PY" -c 'import torch; print(torch.__version__)'); triton: $("$PY" -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
  echo
  echo "| phase | exit status | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

FAILED=0
phase() {  # phase NAME SECONDS CMD...: CMD under a deadline (SIGINT, then SIGKILL 20 s later)
  local name=$1 limit=$2; shift 2
  local start=$(date +%s) rc
  if [ "$limit" -lt 10 ]; then echo "| $name | skipped: no time left | 0 |" >> "$SUMMARY"; FAILED=1; return; fi
  echo "gpu_loop: $name (deadline ${limit}s)"
  timeout -s INT -k 20 "$limit" "$@" > "$RES/$name.log" 2>&1
  rc=$?
  [ $rc != 0 ] && FAILED=1
  echo "| $name | $rc$([ $rc = 124 ] && echo ' (deadline)') | $(( $(date +%s) - start )) |" >> "$SUMMARY"
  tail -3 "$RES/$name.log"
}

if [ "$NO_GPU" = 0 ] && ! "$PY" -c "import fedopt_kernels._C_cuda" >/dev/null 2>&1; then
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  phase install 150 "$PY" -m pip install --no-index --no-deps -e . --no-build-isolation
fi
L=$(( $(left) - 100 )); [ "$L" -gt 150 ] && L=150
# shellcheck disable=SC2086
phase loop "$L" "$PY" -m bench loop $ARGS $LOOP_ARGS --out-dir "$RES"
P=$(( $(left) - 10 )); [ "$P" -gt 120 ] && P=120
# shellcheck disable=SC2086
phase profile "$P" "$PY" -m bench profile $ARGS $PROFILE_ARGS --out-dir "$RES"

for f in "$RES"/loop-*.md "$RES"/profile-*.md; do
  [ -f "$f" ] && { echo; sed -n '1,$p' "$f"; } >> "$SUMMARY"
done
echo "- wall time: $(( $(date +%s) - T0 )) s of a $BUDGET s budget" >> "$SUMMARY"
cat "$SUMMARY"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/$NAME"
  for f in "$SUMMARY" "$RES"/loop.log "$RES"/profile.log "$RES"/install.log "$RES"/loop-*.json "$RES"/profile-*.json \
           "$RES"/loop-*.md "$RES"/profile-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/$NAME/"
  done
  echo "gpu_loop: copied $(ls "$OUT/$NAME" | wc -l) files to \$OUT/$NAME"
fi
echo "gpu_loop: results in $RES"
exit $FAILED
