"""The Triton versions dnngraph supports, checked when dnngraph is imported.

dnngraph's kernels are written against one Triton release series: Gluon's API (experimental,
changing between minor releases), the interpreter patches in runtime.py and the fast launch path
(runtime/launch.py reads the compiled launcher's internals) are tested on 3.6.0. Another minor
release would fail far from its cause (a kernel that no longer compiles, a launch refused), so
the import fails instead, naming both versions. pyproject.toml declares the same range
(TRITON_REQUIREMENT; tests/api/test_versions.py keeps them one).
"""
from __future__ import annotations

import importlib.metadata
import re

__version__ = "0.1.0"  # dnngraph's own, as pyproject.toml says it (the package re-exports it)
TRITON_OLDEST = (3, 6, 0)  # supported: from this release ...
TRITON_BEYOND = (3, 7, 0)  # ... up to, not including, this one
TRITON_REQUIREMENT = "triton>=3.6.0,<3.7"  # as pyproject.toml's dependencies say it
# the distributions that install the `triton` module (PyTorch's nightlies name theirs apart)
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton")


class UnsupportedTritonError(ImportError):
    """The installed Triton is outside the versions dnngraph supports."""


def _release(version: str) -> tuple:
    """(major, minor, patch) of a version string such as '3.6.0', '3.6.0+git1a2b' or '3.7.0rc1'
    (a missing patch is 0); UnsupportedTritonError when it has none."""
    found = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if found is None:
        raise UnsupportedTritonError(f"dnngraph cannot read the installed triton's version {version!r}; it "
                                     f"supports {TRITON_REQUIREMENT} (pip install '{TRITON_REQUIREMENT}')")
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


def check_triton_version(installed: str) -> None:
    """Raise UnsupportedTritonError (an ImportError) naming `installed` and the supported versions
    unless `installed` is one of them."""
    if not TRITON_OLDEST <= _release(installed) < TRITON_BEYOND:
        raise UnsupportedTritonError(f"dnngraph supports {TRITON_REQUIREMENT}; triton {installed} is installed "
                                     f"(pip install '{TRITON_REQUIREMENT}')")


def installed_triton_version() -> str:
    """The installed Triton's version, read from its distribution's metadata: importing Triton
    to ask would decorate triton.language's own jitted helpers before runtime.py has chosen
    between the GPU and the interpreter."""
    for name in TRITON_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UnsupportedTritonError(f"dnngraph needs triton, and no triton distribution is installed "
                                 f"(pip install '{TRITON_REQUIREMENT}')")


def check_installed_triton() -> None:
    """check_triton_version of the installed Triton (dnngraph's import calls it)."""
    check_triton_version(installed_triton_version())
