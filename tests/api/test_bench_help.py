"""Every benchmark's command line prints its help: the commands BENCHMARKS.md cites start from
it, and argparse only formats a help text (a literal '%' in it fails) when asked.

One process imports torch and dnngraph (what every benchmark imports; three quarters of a
script's start) and runs each script as `python SCRIPT --help` would, as __main__ with that
argv and its folder first on sys.path, in a fork of its own: no script sees another's
imports, path or globals."""
import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(path for path in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 if "argparse" in (text := open(path).read()) and '__name__ == "__main__"' in text)

RUNNER = r"""
import json, os, runpy, sys, tempfile
import torch, dnngraph

def help_of(script):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv = [script, "--help"]
            sys.path[0] = os.path.dirname(script)
            code = 0
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0); err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(errors="replace"), err.read().decode(errors="replace")

print(json.dumps({script: help_of(script) for script in sys.argv[1:]}))
"""


@pytest.fixture(scope="module")
def helps():
    """script -> (exit code, stdout, stderr) of its --help."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", RUNNER, *SCRIPTS], capture_output=True, text=True, env=env,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_the_benchmark_prints_its_help(helps, script):
    code, stdout, stderr = helps[script]
    assert code == 0 and "usage:" in stdout, stderr[-2000:]
