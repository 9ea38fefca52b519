import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


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
