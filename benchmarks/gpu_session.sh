#!/usr/bin/env bash
# GPU work in stages, each one device call (a call may run 10 minutes): logs land in $OUT (or
# ./gpu-out). Each stage runs under `timeout -s INT`, so pytest still prints its summary (the
# failures, -rf) when the limit cuts it.
#
#   bash benchmarks/gpu_session.sh tests      # the GPU suite but the real models (~10 min on an H200)
#   TESTS=tests/ops bash benchmarks/gpu_session.sh tests   # one part of it, when the whole outgrows a call
#   bash benchmarks/gpu_session.sh models     # tests/models at realistic sizes, bf16 (~4 min vision)
#   bash benchmarks/gpu_session.sh fuzz       # 1000 random graphs of every family
#   bash benchmarks/gpu_session.sh gluon      # the Gluon backend's GPU tests (matmul, attention; opt-in)
#   bash benchmarks/gpu_session.sh refactor   # bench_before_after.py against $BEFORE (a tree)
#   bash benchmarks/gpu_session.sh bench      # run_all.py: pointwise, memory-bound, matmul tables
set -uo pipefail
STAGE=${1:-tests}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-540}  # seconds a stage may run (under the device's 600 per call)
export PYTHONUNBUFFERED=1 DNNGRAPH_CACHE_DIR=/tmp/dnngraph-cache
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
# tests/models names the backend without importing dnngraph: its entry point must be installed
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1  # the python that runs the tests
# -k 60: after the INT, pytest-xdist needs time to stop its workers and print the summary
limited() { timeout -s INT -k 60 "$LIMIT" "$@"; }
# each test's outcome as it finishes (-v), so a run the limit cuts still names its failures
failures() { grep -E "(FAILED|ERROR) tests/|^(FAILED|ERROR)|passed|failed" "$1" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u | cut -c1-300 | tail -40; }
case "$STAGE" in
  tests)
    limited python3 -m pytest ${TESTS:-tests} -m gpu -v -n 14 -rf --tb=short -p no:cacheprovider --ignore=tests/models \
      -W ignore --durations=10 > "$OUT/gpu-tests.txt" 2>&1
    failures "$OUT/gpu-tests.txt" ;;
  models)
    limited python3 -m pytest tests/models -m gpu -v -n 9 -rA -p no:cacheprovider -W ignore > "$OUT/gpu-models.txt" 2>&1
    failures "$OUT/gpu-models.txt" ;;
  fuzz)
    limited python3 tests/fuzz_gpu.py --graphs 1000 --workers 14 --out "$OUT/fuzz" > "$OUT/fuzz.txt" 2>&1
    grep -E "^seed|FUZZ|graphs," "$OUT/fuzz.txt" | cut -c1-300 | tail -20 ;;
  gluon)
    limited python3 -m pytest tests/backends/test_gluon.py tests/backends/test_gluon_attention.py \
      tests/backends/test_gluon_conv.py tests/backends/test_gluon_wgrad.py -m gpu -v -n 8 -rf \
      --tb=short -p no:cacheprovider --durations=5 \
      -W ignore > "$OUT/gluon.txt" 2>&1
    failures "$OUT/gluon.txt" ;;
  refactor)
    limited python3 benchmarks/bench_before_after.py --before "${BEFORE:?the old tree}" --after . --rounds 2 \
      > "$OUT/before_after.txt" 2>&1
    tail -25 "$OUT/before_after.txt" ;;
  bench)
    limited python3 benchmarks/run_all.py 2>&1 | tee "$OUT/bench.txt" ;;
  *)
    echo "no stage $STAGE (tests, models, fuzz, gluon, refactor, bench)" >&2; exit 2 ;;
esac
