"""Triton's installation key, computed once per installation instead of once per process.

Every compile, a hit in Triton's on-disk cache included, keys on `triton.runtime.cache.triton_key()`:
a sha256 of Triton's compiler, backends and language sources and of libtriton (hundreds of MB),
which Triton computes once per process (0.38 s on an H200 host, 0.5 s on a CPU machine): most of a
warm build in a new process. Triton 3.6 offers no hook to supply it (no knob or variable; the
function is an lru_cache, which cannot be seeded), so `install()` replaces the module global
`triton.runtime.cache.triton_key`, the name `get_cache_key` calls it through, with
`cached_triton_key`, which returns the same string read from
`$DNNGRAPH_CACHE_DIR/triton/key-<stamp>.txt`, or computes it with Triton's own function and
writes it there.

The stamp (`installation_stamp`) is a sha256 of Triton's version, its package folder and the
(path, size, mtime, ctime, inode) of every file under the folders triton_key reads (compiler/,
backends/, language/, _C/libtriton and runtime/cache.py), a superset of the files it hashes:
any file added, removed, rewritten or replaced gives another stamp (ctime cannot be set back
by a user), so a stale key is never used; a copy of the same installation merely computes the
key once more. The stamp costs a few ms (stat calls, no file read). A key file that is not a
key of this Triton's form (`<version><sha256 hex>-...`) is ignored and recomputed.

DNNGRAPH_TRITON_KEY_CACHE=0 (read by install) leaves Triton's function alone. Only the
compiling (CUDA) path installs it; the interpreter never computes the key.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sysconfig
import tempfile
import threading
from pathlib import Path

_LOCK = threading.Lock()
_ORIGINAL = None  # Triton's own triton_key once install() replaced it
_KEY = None  # the key, once this process has it

# triton_key(): f"{__version__}" + "-".join(sha256 hexes of the files it reads)
_KEY_FORM = r"[0-9a-f]{64}(-[0-9a-f]{64})*"


def enabled() -> bool:
    """False when DNNGRAPH_TRITON_KEY_CACHE says 0 (Triton computes its key itself)."""
    return os.environ.get("DNNGRAPH_TRITON_KEY_CACHE", "1") not in ("", "0")


def _triton_root() -> str:
    import triton

    return os.path.dirname(os.path.abspath(triton.__file__))


def _stat_entries(folder: str, out: list) -> None:
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:
        out.append((folder, "missing"))
        return
    for entry in entries:
        if entry.name == "__pycache__":
            continue
        if entry.is_dir(follow_symlinks=True):
            _stat_entries(entry.path, out)
        else:
            stat = entry.stat(follow_symlinks=True)
            out.append((entry.path, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))


def installation_stamp() -> str:
    """A cheap fingerprint of every file triton_key() reads (see the module docstring)."""
    import triton

    root = _triton_root()
    # the interpreter's extension suffix: one folder may hold libtriton builds for several ABIs
    found = [("version", triton.__version__, root), ("abi", sysconfig.get_config_var("EXT_SUFFIX"))]
    for name in ("compiler", "backends", "language", "_C"):
        _stat_entries(os.path.join(root, name), found)
    cache_py = os.path.join(root, "runtime", "cache.py")
    stat = os.stat(cache_py)
    found.append((cache_py, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return hashlib.sha256(repr(found).encode()).hexdigest()[:32]


def key_path(stamp: str) -> Path:
    root = os.environ.get("DNNGRAPH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dnngraph")
    return Path(root) / "triton" / f"key-{stamp}.txt"


def _well_formed(key: str, version: str) -> bool:
    return key.startswith(version) and re.fullmatch(_KEY_FORM, key[len(version):]) is not None


def _computed() -> str:
    original = _ORIGINAL
    if original is None:
        from triton.runtime import cache

        original = cache.triton_key
    return original()


def cached_triton_key() -> str:
    """triton_key() of the installed Triton, from the key file of its installation stamp when
    there is a well-formed one, else computed by Triton's function and written there (a write
    that fails is skipped: the key is then computed again by the next process)."""
    global _KEY
    if _KEY is not None:
        return _KEY
    with _LOCK:
        if _KEY is not None:
            return _KEY
        import triton

        path = key_path(installation_stamp())
        try:
            key = path.read_text()
        except (OSError, UnicodeDecodeError):
            key = None
        if key is None or not _well_formed(key, triton.__version__):
            key = _computed()
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".txt")
                try:
                    with os.fdopen(fd, "w") as handle:
                        handle.write(key)
                    os.replace(temp, path)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(temp)
                    raise
        _KEY = key
        return key


def install() -> bool:
    """Make Triton's compile path use cached_triton_key (once per process; idempotent). False,
    changing nothing, when DNNGRAPH_TRITON_KEY_CACHE=0."""
    global _ORIGINAL
    if not enabled():
        return False
    from triton.runtime import cache

    with _LOCK:
        if _ORIGINAL is None:
            _ORIGINAL = cache.triton_key
        cache.triton_key = cached_triton_key
    return True


def uninstall() -> None:
    """Give Triton its own function back and forget this process's key (tests)."""
    global _ORIGINAL, _KEY
    from triton.runtime import cache

    with _LOCK:
        if _ORIGINAL is not None:
            cache.triton_key = _ORIGINAL
        _ORIGINAL = _KEY = None
