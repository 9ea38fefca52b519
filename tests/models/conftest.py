import glob
import json
import os

from model_results import coverage_line


def pytest_terminal_summary(terminalreporter, config):
    """The kernels per step and the ops left to torch of every model run this session (the
    results the xdist workers shared), one line per family and mode."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return
    lines = []
    for path in sorted(glob.glob(os.path.join(str(factory.getbasetemp()), "model-results", "*.json"))):
        with open(path) as f:
            lines += [coverage_line(result) for result in json.load(f)["results"].values()]
    if lines:
        terminalreporter.section("dnngraph kernels per step and aten ops left to torch")
        for line in sorted(lines):
            terminalreporter.write_line(line)
