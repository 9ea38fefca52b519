"""Inspection: the dnngraph logger, Graph.to_dot, and `python -m dnngraph explain|bench|dot`."""
import logging
import subprocess
import sys

import dnngraph as dg
from dnngraph.__main__ import main


def _graph(name="demo"):
    g = dg.Graph(name=name)
    x, w = g.tensor(name="x", dim=[6, 8]), g.tensor(name="w", dim=[8, 4])
    y = g.relu(g.matmul(g.transpose(g.transpose(x, [1, 0]), [1, 0]), w))
    g.concatenate([y, g.exp(y)], axis=0).set_output(True)
    return g


def test_build_logs_groups_kernels_configs_and_cache_use(caplog):
    with caplog.at_level(logging.DEBUG, logger="dnngraph"):
        _graph().build()
    text = caplog.text
    assert "built graph 'demo'" in text and "kernel(s)" in text
    assert "group [matmul]" in text and "BLOCK" in text or "warps" in text
    assert "source written" in text or "loaded in this process" in text  # the kernel file, or this process


def test_the_environment_sets_the_level():
    code = ("import logging, dnngraph; from dnngraph.log import logger; "
            "print(logger.level == logging.INFO, len(logger.handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DNNGRAPH_LOG": "info", "PATH": "", "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.split() == ["True", "1"], out.stderr


def test_to_dot_has_a_cluster_per_kernel_and_escapes_names():
    g = _graph('we"ird\nname')
    text = g.to_dot()
    assert text.startswith('digraph "we\\"ird\\nname" {')
    # matmul with relu and exp in its epilogue, both written in place into the concatenate (relu's
    # value, read by exp too, is read there from registers)
    assert text.count("subgraph cluster_") == 1
    assert text.count("(view)") == 3  # the two transposes and the concatenate: no kernel
    g.build()
    assert g.to_dot().count("subgraph cluster_") == len(g.plan.launches)


def test_command_line_explain_bench_and_dot(tmp_path, capsys):
    path = tmp_path / "graph.json"
    path.write_text(_graph().to_json())
    assert main(["explain", str(path)]) == 0
    assert "kernel 0 [matmul]" in capsys.readouterr().out
    assert main(["bench", str(path), "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "| kernel | kind |" in table and "| all |" in table
    assert main(["dot", str(path)]) == 0
    assert capsys.readouterr().out.startswith("digraph")
