"""benchmarks/bench_lrn.py keeps working without a GPU: its cases build, run and match torch's
float64 LRN (and its torch formulation of divisive normalization) on the CPU."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_lrn as bench  # noqa: E402


def test_cpu_cases_match_torch():
    for op, name, shape, size, attrs in bench.cases(quick=True):
        row = bench.run_case(op, name, shape, size, attrs, torch.float32, "nhwc", "cpu")
        assert row[0] == name and all(float(error) < 1e-5 for error in row[3:])


def test_gpu_cases_are_the_documented_sizes():
    names = [name for _, name, *_ in bench.cases(quick=False)]
    assert names == ["alexnet-lrn1", "alexnet-lrn2", "wide-even", "lcn-3x3", "lcn-5x5"]
