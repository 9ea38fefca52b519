"""Run every benchmark in one process (one device call): python benchmarks/run_all.py"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import bench_matmul  # noqa: E402
import bench_matmul_heuristics  # noqa: E402
import bench_memory_bound  # noqa: E402
import bench_pointwise  # noqa: E402

if __name__ == "__main__":
    bench_pointwise.main()
    bench_memory_bound.main([])
    bench_matmul.main([])
    bench_matmul_heuristics.main([])
