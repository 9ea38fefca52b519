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


def _result(ms: float, backends=("triton",)) -> dict:
    return {"status": "ok", "rel_error": 2e-3, "checked": True, "ms": ms, "tflops": 7.4 / ms,
            "plan": {"launches": 1, "backends": list(backends)}}


def _case(label: str, **providers) -> dict:
    return dict({"label": label, "shape": "N32 C64 K64 56x56 3x3/1 p1", "gflop": 7.4}, **providers)


def test_the_report_prints_rows_with_and_without_a_gluon_column(capsys):
    """A row timed without --gluon (the int8 rows) has no 'dg gluon' result: its tables print with
    no backend column; a row timed with it names the backend each Gluon build ran."""
    int8 = [_case("layer1.0.conv2", torch=_result(0.10), autograd=_result(0.027), dg=_result(0.046))]
    assert bench.report_row(bench.ROWS["int8_dgrad"], int8)
    printed = capsys.readouterr().out
    assert "dg gluon backend" not in printed and "layer1.0.conv2" in printed
    dgrad = [_case("layer1.0.conv2", torch=_result(0.10), autograd=_result(0.027), dg=_result(0.046),
                   dg_gluon=_result(0.040, backends=("gluon", "triton")))]
    assert bench.report_row(bench.ROWS["dgrad"], dgrad)
    printed = capsys.readouterr().out
    assert "dg gluon backend" in printed and "| gluon+triton |" in printed and "1.15" in printed
