"""Names in generated source: one allocator per kernel, and the only way user text reaches it.

Every identifier a kernel uses is either one of the kernel's fixed names (written by the
renderer, reserved up front) or handed out by the kernel's NameAllocator from a hint chosen by
the renderer ("x", "bias", "out", "v"). User tensor and node names never reach a generated source
at all, not even its comments: kernels are named by the digest of their text (runtime/kernel_files.py),
so the same kernel of two groups or graphs must be the same text. explain() names the group, its
ops and its tensors. Descriptions written into a source's docstring still pass through
comment_text(), which keeps them on one line of printable ASCII with no quotes or backslashes.
"""
from __future__ import annotations

import builtins
import keyword
import re

from ....errors import GraphError

# Module aliases every generated file imports.
MODULE_ALIASES = frozenset({"tl", "triton", "tm", "tr", "lib", "math"})
RESERVED = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins)) | MODULE_ALIASES
COMMENT_LIMIT = 160  # characters of user text per comment
_HINT = re.compile(r"[A-Za-z][A-Za-z0-9]*(_[A-Za-z0-9]+)*")


def _stems_of(name: str) -> set:
    """Every `stem` with `name` starting `stem_` ("x_stride_0": "x", "x_stride")."""
    return {name[:i] for i, c in enumerate(name) if c == "_"}


RESERVED_STEMS = frozenset().union(*(_stems_of(name) for name in RESERVED))


class NameAllocator:
    """Owns the identifiers of one kernel.

    `fixed` names are those the renderer writes literally; they are reserved along with Python
    keywords, builtins and the module aliases. fresh() hands out a new identifier from a hint;
    prefix() hands out a stem that owns every name `stem_*` too (an operand's `x_ptr`,
    `x_stride_0`), so no later identifier can land inside that family.
    """

    def __init__(self, fixed=()):
        self._taken: set[str] = set(RESERVED)
        self._stems: set[str] = set(RESERVED_STEMS)  # s such that some taken name starts s_
        self._prefixes: set[str] = set()
        self.reserve(*fixed)

    def reserve(self, *names: str):
        """Mark fixed identifiers of the kernel as used."""
        for name in names:
            _check_hint(name)
            self._take(name)

    def _take(self, name: str):
        self._taken.add(name)
        self._stems |= _stems_of(name)

    def reserve_stems(self, *stems: str):
        """Mark fixed stems of the kernel as used, each with every `stem_*` name."""
        self.reserve(*stems)
        self._prefixes.update(stems)

    def _inside_prefix(self, name: str) -> bool:
        return any(name.startswith(stem + "_") for stem in self._prefixes)

    def _free(self, name: str, as_prefix: bool) -> bool:
        if name in self._taken or self._inside_prefix(name):
            return False
        return not as_prefix or name not in self._stems

    def _allocate(self, hint: str, as_prefix: bool) -> str:
        _check_hint(hint)
        if self._inside_prefix(hint):  # every name from it would lie inside another stem
            raise GraphError(f"internal error: hint {hint!r} lies inside a stem of this kernel")
        name, count = hint, 0
        while not self._free(name, as_prefix):
            count += 1
            name = f"{hint}{count}" if hint[-1].isalpha() else f"{hint}_{count}"
        self._take(name)
        if as_prefix:
            self._prefixes.add(name)
        return name

    def fresh(self, hint: str) -> str:
        """A new identifier built from `hint` (a name chosen by code, never by a user)."""
        return self._allocate(hint, as_prefix=False)

    def prefix(self, hint: str) -> str:
        """A new stem from `hint`; the stem and every `stem_*` name belong to its owner."""
        return self._allocate(hint, as_prefix=True)

    def owns(self, name: str) -> bool:
        """True where `name` was reserved or handed out by this allocator (or lies in a stem)."""
        return name in self._taken or self._inside_prefix(name)


def _check_hint(hint: str):
    # hints and fixed names come from code: anything else is a bug in a renderer
    if not isinstance(hint, str) or not _HINT.fullmatch(hint):
        raise GraphError(f"internal error: {hint!r} is not a valid identifier hint")


def comment_text(text, limit: int = COMMENT_LIMIT) -> str:
    """User text made safe for a `#` comment or a docstring: one line of printable ASCII
    without quotes or backslashes, at most `limit` characters."""
    cleaned = "".join(c if " " <= c <= "~" and c not in "\"'\\`" else "?" for c in str(text))
    return cleaned if len(cleaned) <= limit else cleaned[:limit - 3] + "..."
