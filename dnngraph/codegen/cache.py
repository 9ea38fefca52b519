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
import threading
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
        return getattr(module, kernel_name), path
    sys.modules.pop(module_name, None)  # a half-loaded module is never reused
    if not path.exists() or path.read_text() != source:
        logger.debug("kernel %s: source written (cache miss)", path.name)
        _write_atomically(path, source)
    else:
        logger.debug("kernel %s: source found on disk (cache hit)", path.name)
    return _import(module_name, path, kernel_name), path


# --- kernels for Triton's interpreter in a process that compiles for a GPU -----------------------
_INTERPRETED: dict = {}  # (source path, kernel name) -> interpreted kernel
_INTERPRETED_LOCK = threading.Lock()


@contextlib.contextmanager
def _jit_interprets():
    """@triton.jit makes interpreted functions while this is open."""
    from triton import knobs

    before = knobs.runtime.interpret
    knobs.runtime.interpret = True
    try:
        yield
    finally:
        knobs.runtime.interpret = before


def _interpreted_math():
    """codegen/triton_math.py loaded again with interpreted helpers (the kernels' `tm`)."""
    found = _INTERPRETED.get("triton_math")
    if found is None:
        from . import triton_math

        spec = importlib.util.spec_from_file_location("dnngraph_interpreted.triton_math", triton_math.__file__)
        found = importlib.util.module_from_spec(spec)
        with _jit_interprets():
            spec.loader.exec_module(found)
        _INTERPRETED["triton_math"] = found
    return found


def interpreted_kernel(path: Path, kernel_name: str):
    """The kernel of the generated file at `path` for Triton's interpreter, in a process whose
    kernels otherwise compile for a GPU (CPU tensors there): the file executed again while
    @triton.jit makes interpreted functions, its `tm` helpers interpreted too."""
    key = (str(path), kernel_name)
    found = _INTERPRETED.get(key)
    if found is not None:
        return found
    from ..runtime import widen_bfloat16_dots

    with _INTERPRETED_LOCK:
        found = _INTERPRETED.get(key)
        if found is None:
            widen_bfloat16_dots()
            namespace = {"__name__": f"dnngraph_interpreted.{path.stem}", "__file__": str(path)}
            with _jit_interprets():
                exec(compile(path.read_text(), str(path), "exec"), namespace)
            namespace["tm"] = _interpreted_math()
            found = _INTERPRETED[key] = namespace[kernel_name]
    return found
