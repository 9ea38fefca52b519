#!/usr/bin/env bash
# One device call: GPU tests, then every benchmark. Logs land in $OUT (or ./gpu-out).
# The real-model suite (tests/models, fresh processes at realistic sizes) runs apart from the
# rest so that a slow model cannot keep the kernel tests from printing their failures (-rf).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DNNGRAPH_CACHE_DIR=/tmp/dnngraph-cache
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
# tests/models names the backend without importing dnngraph: its entry point must be installed
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1  # the python that runs the tests
python3 -m pytest tests -m gpu -q -n 14 -rf -p no:cacheprovider --ignore=tests/models 2>&1 | tail -40 | tee "$OUT/gpu-tests.txt"
python3 -m pytest tests/models -m gpu -q -n 4 -rf -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu-models.txt"
python3 tests/fuzz_gpu.py --graphs 1000 --workers 14 --out "$OUT/fuzz" 2>&1 | tail -3
python3 benchmarks/run_all.py 2>&1 | tee "$OUT/bench.txt"
