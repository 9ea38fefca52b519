"""benchmarks/bench_before_after.py keeps working: its CPU smoke run (both trees this checkout,
children through Triton's interpreter, tiny shapes) prints the table with a time for every case."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_before_after.py")

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_before_after as bench  # noqa: E402


def test_cpu_smoke_times_every_case_in_both_trees(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--before", ROOT, "--after", ROOT],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "| case | family | before ms | after ms | after/before speed ratio |" in text
    cases = bench.case_list("cpu")
    assert len(cases) == len(bench.CASES)
    for name, _, family, _ in cases:
        row = re.search(rf"^\| {re.escape(name)} \| {family} \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", text, re.M)
        assert row, f"no row for {name}:\n{text}"
        before, after, ratio = (cell.strip() for cell in row.groups())
        assert float(before) > 0 and float(after) > 0, row.group(0)
        assert ratio.endswith("x") and float(ratio[:-1]) > 0, row.group(0)
    assert re.search(r"^minimum ratio \d+\.\d+x \(family \w+: ", text, re.M), text
    saved = json.loads((tmp_path / "before_after.json").read_text())
    assert set(saved["rows"]) == {name for name, _, _, _ in cases}
    assert all(isinstance(r["ratio"], float) for r in saved["rows"].values())
    assert len(saved["runs"]["before"]) == len(saved["runs"]["after"]) == 2  # alternated twice


def test_quick_and_full_lists_cover_every_family():
    families = {spec[0] for spec in bench.CASES.values()}
    for mode in ("full", "quick"):
        assert {family for _, _, family, _ in bench.case_list(mode)} == families
    assert "matmul 4096x4096x4096 (MxNxK)" in [name for name, _, _, _ in bench.case_list("full")]


def test_a_dead_child_gives_errors_not_a_crash():
    rows = bench.compare({"before": [{"x": 1.0}], "after": [{"x": "error: boom"}]}, "cpu")
    assert all(r["ratio"] is None for r in rows.values())
    assert bench.best(["error: a", 2.0, 1.5]) == 1.5 and bench.best(["error: a"]) == "error: a"
