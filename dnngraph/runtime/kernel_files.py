"""The compile cache: generated Triton source files, each kernel named by its content.

A renderer writes a kernel under a stem made of family words (`dnngraph_matmul_relu`) and
nothing particular to the graph or group it came from; load_kernel names the kernel
`<stem>_<digest of that text>`. Identical kernels of different groups or graphs are therefore
one module and one JITFunction, and Triton's own caches (in memory and on disk) compile them
once. Files live in $DNNGRAPH_CACHE_DIR (default ~/.cache/dnngraph) so explain() can point at them
and a user can read exactly what runs. Writes are atomic (temp file, then rename). The files are
written, never read to run: a module is made from the generated text itself (see load_kernel).
"""
from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import re
import sys
import tempfile
import threading
import types
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


def source_digest(source: str) -> str:
    """The hash that names a generated source: of its text as rendered under its stem."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _definition(name: str) -> "re.Pattern":
    return re.compile(rf"^def {re.escape(name)}\(", re.MULTILINE)


def _renamed(source: str, old: str, new: str) -> str:
    return _definition(old).sub(f"def {new}(", source, count=1)


def named_source(source: str, stem: str) -> tuple:
    """(kernel name, text) of `source`, rendered with its kernel defined as `stem`: the name is
    `<stem>_<digest of source>`, and the text is `source` with that name in the definition (the
    one place a renderer writes the stem; anything else is a renderer's bug)."""
    if len(re.findall(rf"\b{re.escape(stem)}\b", source)) != 1 or not _definition(stem).search(source):
        raise UnsupportedError(f"internal error: generated kernel {stem!r} must name itself once, in its definition")
    name = f"{stem}_{source_digest(source)}"
    return name, _renamed(source, stem, name)


def stem_of(name: str) -> str:
    """The stem a kernel was rendered under: its name without the digest named_source adds."""
    return name.rsplit("_", 1)[0]


def rendered_source(text: str, name: str):
    """The source a renderer wrote, of which `text` is the kernel named `name`; None where
    `text` is not exactly what named_source gives that source (so not the text its name hashes).
    How another process checks a text it is sent, before running any of it."""
    stem = stem_of(name)
    source = _renamed(text, name, stem)
    try:
        return source if named_source(source, stem) == (name, text) else None
    except UnsupportedError:
        return None


def _write_atomically(path: Path, text: str):
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temp, path)


class _GeneratedSource:
    """The loader of a kernel module: gives the text the module was made from, so inspect (and
    through it Triton's JIT and its interpreter, which read a kernel's source when decorating it
    and, interpreted, again when it first runs) finds that text even after linecache is cleared."""

    def __init__(self, source: str):
        self.source = source

    def get_source(self, module_name: str) -> str:
        return self.source


def _source_name(path: Path) -> str:
    """The file name a kernel module's code carries: a path inside the cache file, which no file
    can have while the cache file is one (a sibling such as `<path>#generated` could be planted
    in a shared cache folder), so neither linecache nor inspect ever reads the source back from
    disk: it comes from the module's loader (a cache file changed after the build, in a shared
    or writable DNNGRAPH_CACHE_DIR, is never what runs)."""
    return f"{path}/generated"


def _execute_source(module_name: str, source: str, path: Path, kernel_name: str):
    """The kernel of `source` run as module `module_name` (its code named after `path`, its text
    registered with linecache, where entries without a modification time are never checked
    against a file); on any failure the module is taken out of sys.modules and the file removed,
    and a typed error is raised."""
    filename = _source_name(path)
    module = types.ModuleType(module_name)
    module.__loader__ = _GeneratedSource(source)
    module.__dnngraph_source__ = source  # what kernel_source() gives
    sys.modules[module_name] = module
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
        return getattr(module, kernel_name)
    except Exception as error:  # SyntaxError, NameError, AttributeError, a Triton error...
        sys.modules.pop(module_name, None)
        linecache.cache.pop(filename, None)
        with contextlib.suppress(OSError):
            path.unlink()  # never reuse a file that failed to load
        raise UnsupportedError(f"generated kernel {kernel_name!r} failed to load from {path}: "
                               f"{type(error).__name__}: {error}") from error


def _file_holds(path: Path, source: str) -> bool:
    try:
        return path.read_text() == source
    except (OSError, UnicodeDecodeError):
        return False


_LOAD_LOCK = threading.RLock()


def load_kernel(source: str, stem: str):
    """(kernel function, source path) for `source`, rendered with its kernel defined as `stem`:
    the kernel is named by content (named_source), and the module is made from the named text
    itself, once per process: kernels of the same text, from any group of any graph, are one
    JITFunction. The cache file `<name>.py` is (re)written whenever it does not hold exactly
    that text, so explain() points at what runs. Nothing is ever run from the file: only the
    source a plan generated (and named by its hash) runs, in any process.

    A source that fails to load raises UnsupportedError naming the kernel and the file, and
    leaves nothing behind: the next build starts afresh."""
    kernel_name, source = named_source(source, stem)
    module_name = f"dnngraph_kernels.{kernel_name}"
    path = cache_dir() / f"{kernel_name}.py"
    with _LOAD_LOCK:  # builds in several threads: one module per kernel, never one seen half-made
        if not _file_holds(path, source):  # missing, another cache folder, or changed since written
            logger.debug("kernel %s: source written", path.name)
            _write_atomically(path, source)
        module = sys.modules.get(module_name)
        if getattr(module, "__dnngraph_source__", None) == source and hasattr(module, kernel_name):
            logger.debug("kernel %s: loaded in this process", path.name)
            return getattr(module, kernel_name), path
        sys.modules.pop(module_name, None)  # a half-loaded module is never reused
        return _execute_source(module_name, source, path, kernel_name), path


def kernel_source(kernel) -> str:
    """The source text `kernel` (loaded by load_kernel) was made from: kept with its module,
    never read back from the cache file."""
    module = sys.modules.get(getattr(getattr(kernel, "fn", kernel), "__module__", ""))
    text = getattr(module, "__dnngraph_source__", None)
    if text is None:
        raise ValueError(f"{kernel!r} was not loaded by load_kernel: its generated source is unknown")
    return text
