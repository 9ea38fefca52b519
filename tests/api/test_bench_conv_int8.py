"""benchmarks/bench_conv.py's int8 gradient rows keep working without a GPU: --check-cpu builds
each row's graph (int8 dgrad / wgrad with a dequantizing scale) on tiny shapes, runs it through
the interpreter against float64 torch, and cross-checks the script's references with
g.reference(); the rows' anchors are the bf16 gradients of the same layers."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_conv as bench  # noqa: E402


def test_int8_gradient_rows_pass_the_cpu_check(capsys):
    assert bench.check_cpu(bench.parse_args(["--check-cpu", "--rows", "int8_dgrad,int8_wgrad"])) == 0
    printed = capsys.readouterr().out
    assert printed.count("int8_dgrad cpu") == len(bench.CPU_SHAPES["int8_dgrad"])
    assert printed.count("int8_wgrad cpu") == len(bench.CPU_SHAPES["int8_wgrad"])


def test_int8_gradient_rows_are_anchored_on_the_bf16_gradients():
    for key, op in bench.INT8_GRADIENTS.items():
        row = bench.ROWS[key]
        assert set(row.anchors) == {"torch", "autograd"} and op in ("dgrad", "wgrad")
        assert bench.GRAPH_INPUTS[key][0] == "dy8"
