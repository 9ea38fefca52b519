#!/usr/bin/env bash
# One device call: GPU tests, then every benchmark. Logs land in $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DNNGRAPH_CACHE_DIR=/tmp/dnngraph-cache
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest tests -m gpu -q -n 8 -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
python3 tests/fuzz_gpu.py --graphs 1000 --workers 14 --out "$OUT/fuzz" 2>&1 | tail -3
python3 benchmarks/run_all.py 2>&1 | tee "$OUT/bench.txt"
