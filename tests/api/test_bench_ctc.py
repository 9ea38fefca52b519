"""benchmarks/bench_ctc.py keeps working without a GPU: it parses, has --help, and its speech case
is the issue's shape."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_ctc.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_ctc as bench  # noqa: E402


def test_help_runs():
    done = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--cases" in done.stdout


def test_speech_case_is_the_goal_shape():
    assert bench.CASES["speech"] == (500, 32, 29, 100)
