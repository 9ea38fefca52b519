"""benchmarks/bench_moe.py keeps working without a GPU: it parses, has --help, and its routed
counts and offsets are what the kernels take."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_moe.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_moe as bench  # noqa: E402


def test_help_runs():
    done = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--cases" in done.stdout


def test_routed_counts_and_offsets():
    counts = bench.routed_counts(8, 100, 2)
    assert len(counts) == 8 and sum(counts) == 200
    offsets = bench.first_token_offsets(counts)
    assert offsets[0] == 0 and all(int(b) - int(a) == c for a, b, c in zip(offsets, offsets[1:], counts))
    assert set(bench.CASES) >= {"mixtral"} and bench.CASES["mixtral"] == (8, 4096, 2, 4096, 14336)
