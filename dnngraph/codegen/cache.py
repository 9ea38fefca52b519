"""The compile cache: generated Triton source files, keyed by a hash of their text.

Files live in $DNNGRAPH_CACHE_DIR (default ~/.cache/dnngraph) so explain() can point at them
and a user can read exactly what runs. Writes are atomic (temp file, then rename).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from ..errors import UnsupportedError
from ..log import logger


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


def _import(module_name: str, path: Path, kernel_name: str):
    """Import the file at `path` as `module_name` and return its kernel; on any failure the
    module is taken out of sys.modules and the file removed, and a typed error is raised."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        return getattr(module, kernel_name)
    except Exception as error:  # SyntaxError, NameError, AttributeError, a Triton error...
        sys.modules.pop(module_name, None)
        with contextlib.suppress(OSError):
            path.unlink()  # never reuse a file that failed to load
        raise UnsupportedError(f"generated kernel {kernel_name!r} failed to load from {path}: "
                               f"{type(error).__name__}: {error}") from error


def load_kernel(source: str, kernel_name: str):
    """(kernel function, source path) for `source`, written to the cache and imported once.

    A source that fails to load raises UnsupportedError naming the kernel and the file, and
    leaves nothing behind: the next build starts afresh."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    module_name = f"dnngraph_kernels.{kernel_name}_{digest}"
    path = cache_dir() / f"{kernel_name}_{digest}.py"
    module = sys.modules.get(module_name)
    if module is not None and hasattr(module, kernel_name):
        logger.debug("kernel %s: loaded in this process", path.name)
        if not path.exists():  # another cache folder since, or the file was removed: the path named holds it
            _write_atomically(path, source)
        return getattr(module, kernel_name), path
    sys.modules.pop(module_name, None)  # a half-loaded module is never reused
    if not path.exists() or path.read_text() != source:
        logger.debug("kernel %s: source written (cache miss)", path.name)
        _write_atomically(path, source)
    else:
        logger.debug("kernel %s: source found on disk (cache hit)", path.name)
    kernel = _import(module_name, path, kernel_name)
    sys.modules[module_name].__dnngraph_source__ = source  # what kernel_source() gives if the file goes
    return kernel, path


def kernel_source(kernel, path: Path) -> str:
    """The source text `kernel` (loaded by load_kernel from `path`) was made from: the file, or,
    where the file has gone since (a cleaned folder), the text kept with the loaded module."""
    try:
        return path.read_text()
    except OSError:
        module = sys.modules.get(getattr(getattr(kernel, "fn", kernel), "__module__", ""))
        text = getattr(module, "__dnngraph_source__", None)
        if text is None:
            raise
        return text
