"""The compile cache: generated Triton source files, keyed by a hash of their text.

Files live in $DNNGRAPH_CACHE_DIR (default ~/.cache/dnngraph) so explain() can point at them
and a user can read exactly what runs. Writes are atomic (temp file, then rename).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """The folder generated sources are written to."""
    root = os.environ.get("DNNGRAPH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                 "dnngraph")
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_atomically(path: Path, text: str):
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temp, path)


def load_kernel(source: str, kernel_name: str):
    """(kernel function, source path) for `source`, written to the cache and imported once."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    module_name = f"dnngraph_kernels.{kernel_name}_{digest}"
    module = sys.modules.get(module_name)
    path = cache_dir() / f"{kernel_name}_{digest}.py"
    if module is None:
        if not path.exists() or path.read_text() != source:
            _write_atomically(path, source)
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, kernel_name), path
