import os
import sys

import pytest
import torch

# The helper modules (helpers, graphgen, pretend_gpu, ...) sit here, beside this file; the tests sit
# in one folder per layer below it (tests/models, the real-model suite, apart) and import the
# helpers as top-level modules, and at times another layer's test module (test basenames are
# unique across the folders). sm90_compile.py puts the same folders on its own path.
HERE = os.path.dirname(os.path.abspath(__file__))
LAYER_FOLDERS = sorted(os.path.join(HERE, name) for name in os.listdir(HERE)
                       if name not in ("models", "__pycache__") and os.path.isdir(os.path.join(HERE, name)))
for folder in reversed([HERE] + LAYER_FOLDERS):  # each once, tests/ first
    if folder not in sys.path:
        sys.path.insert(0, folder)


# Under pytest-xdist every worker's torch starts one intra-op thread per core: the GPU run's 14
# workers on 16 cores ran 14 x 16 threads, and every test's CPU work (float64 references,
# builds) waited on the others'. The workers share the cores instead.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "dnngraph-cache"))


@pytest.fixture(autouse=True)
def _compiled_kernels(monkeypatch):
    """Kernels compiled once per process (runtime/launch.py's shared_compile) are compiled once per
    test here: a test's stand-in compile never reaches another test."""
    from dnngraph.runtime import launch
    monkeypatch.setattr(launch, "_COMPILED", {})
