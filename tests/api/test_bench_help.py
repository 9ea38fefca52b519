"""Every benchmark's command line prints its help: the commands BENCHMARKS.md cites start from
it, and argparse only formats a help text (a literal '%' in it fails) when asked."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(path for path in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 if "argparse" in (text := open(path).read()) and '__name__ == "__main__"' in text)


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_the_benchmark_prints_its_help(script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]
