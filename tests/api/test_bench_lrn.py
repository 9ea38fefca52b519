"""benchmarks/bench_lrn.py keeps working without a GPU: its cases build, run and match torch's
float64 LRN (and its torch formulation of divisive normalization) on the CPU."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_lrn as bench  # noqa: E402


def test_cpu_cases_match_torch_in_both_schedules():
    for op, name, shape, size, attrs in bench.cases(quick=True):
        case = bench.prepared_case(op, name, shape, size, attrs, torch.float32, "nhwc", "cpu", bench.FORMS["both"])
        bench.first_runs(case)
        errors = bench.checked(case)
        assert set(errors) == {"tile", "persistent"} and all(e < 1e-5 for pair in errors.values() for e in pair)
        assert all(pick in ("tile", "persistent") for pick in case["picked"])


def test_gpu_rows_put_the_schedules_side_by_side(monkeypatch):
    """The GPU table's rows (timings stubbed on the CPU): one a schedule, each naming its form,
    the model's picks and its configs (persistent ones with their grid)."""
    monkeypatch.setattr(bench, "median_ms", lambda fn, **timing: (fn(), 1.0)[1])
    op, name, shape, size, attrs = next(bench.cases(quick=True))
    case = bench.prepared_case(op, name, shape, size, attrs, torch.float32, "nchw", "cpu", bench.FORMS["both"])
    bench.first_runs(case)
    rows = bench.measured_rows(case, 1.0, compile_anchor=False)
    assert [row[4] for row in rows] == ["tile", "persistent"]
    assert "schedule=tile" in rows[0][-1] and "persistent=" in rows[1][-1] and "persistent=" in rows[1][-2]


def test_gpu_cases_are_the_documented_sizes():
    names = [name for _, name, *_ in bench.cases(quick=False)]
    assert names == ["alexnet-lrn1", "alexnet-lrn2", "wide-even", "lcn-3x3", "lcn-5x5"]
