"""The persistent autotuning cache: the winning kernel config per problem, kept across processes.

build(autotune=True) times candidate configs once per problem and stores the winner here, so a
second build of the same graph in a new process does no timing. Records are keyed by device
name, Triton version, kernel family and problem signature, and live in one JSON file,
$DNNGRAPH_CACHE_DIR/tuning.json (default ~/.cache/dnngraph/tuning.json):

    {"format": "dnngraph-tuning", "version": 1, "entries": {key: record, ...}}

The file is only ever replaced whole (temp file, fsync, rename), never edited in place, so a
reader sees either the old or the new file. Writers serialise on a sidecar lock file so two
processes storing at once do not lose each other's entries. A file that cannot be used (corrupt,
truncated, foreign, newer version) is ignored with a TuningCacheWarning and rewritten by the next
store: the cache only saves time, so it must never stop a build.

records() and merge() serve `python -m dnngraph tuning export|import` (tuning_transfer.py): a
strict read that says what is wrong with a file, and a merge of many records under the writer
lock in one atomic replace. A record's key names the GPU model (its device properties' name)
and the Triton version, so a record shipped from another machine is only ever found by a
lookup on the same model under the same Triton.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

try:
    import fcntl
except ImportError:  # not on POSIX: no advisory locks, so writers race (last rename wins)
    fcntl = None

FORMAT = "dnngraph-tuning"
VERSION = 1

# Bad file states already reported, as (path, inode, mtime_ns, size): every lookup and store
# re-examines the file, and one broken file should produce one warning, not one per call.
_warned: set[tuple] = set()
_default: TuningCache | None = None


class TuningCacheWarning(UserWarning):
    """The tuning cache file could not be read or written; tuning results are not reused."""


def tuning_cache_path() -> Path:
    """$DNNGRAPH_CACHE_DIR/tuning.json (default ~/.cache/dnngraph/tuning.json); makes the folder."""
    root = os.environ.get("DNNGRAPH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                 "dnngraph")
    folder = Path(root)
    # An uncreatable folder is reported by store(), which warns; a lookup then simply misses.
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    return folder / "tuning.json"


def tuning_key(device: str, triton_version: str, family: str, signature: str,
               dnngraph_version: str | None = None) -> str:
    """One readable key, e.g. "NVIDIA H100 80GB HBM3|triton 3.6.0|matmul|<signature>", with
    "|dnngraph <version>" after the Triton part when `dnngraph_version` is given (the tuner
    always gives it: a record written by another dnngraph is never used)."""
    # Escape the separator so that no two different tuples can produce the same key.
    parts = [str(part).replace("\\", "\\\\").replace("|", "\\|")
             for part in (device, triton_version, family, signature, dnngraph_version or "")]
    version = f"|dnngraph {parts[4]}" if dnngraph_version is not None else ""
    return f"{parts[0]}|triton {parts[1]}{version}|{parts[2]}|{parts[3]}"


class TuningKeyParts(NamedTuple):
    """What a tuning key names (tuning_key's arguments); dnngraph_version None when it names none."""

    device: str
    triton_version: str
    family: str
    signature: str
    dnngraph_version: str | None


def _split_escaped(key: str) -> list[str]:
    """`key` split at each unescaped "|", escapes undone (the inverse of tuning_key's quoting)."""
    parts, current, characters = [], [], iter(key)
    for character in characters:
        if character == "\\":
            escaped = next(characters, None)
            if escaped not in ("\\", "|"):
                raise ValueError(f"key {key!r} has a stray backslash")
            current.append(escaped)
        elif character == "|":
            parts.append("".join(current))
            current = []
        else:
            current.append(character)
    parts.append("".join(current))
    return parts


def _after_prefix(part: str, prefix: str, key: str) -> str:
    if not part.startswith(prefix):
        raise ValueError(f"key {key!r}: {part!r} does not start with {prefix!r}")
    return part[len(prefix):]


def parse_tuning_key(key: str) -> TuningKeyParts:
    """The parts of a key tuning_key() wrote; ValueError for a str it cannot have written."""
    if not isinstance(key, str):
        raise ValueError(f"key {key!r} is not a str")
    parts = _split_escaped(key)
    if len(parts) == 5:
        device, triton_part, dnngraph_part, family, signature = parts
        dnngraph_version = _after_prefix(dnngraph_part, "dnngraph ", key)
    elif len(parts) == 4:
        device, triton_part, family, signature = parts
        dnngraph_version = None
    else:
        raise ValueError(f"key {key!r} has {len(parts)} parts; a tuning key has 4 or 5")
    return TuningKeyParts(device, _after_prefix(triton_part, "triton ", key), family, signature,
                          dnngraph_version)


WARPS = (1, 2, 4, 8, 16)


def record_field(record: dict, field: str, kind: type, default=None):
    """`record[field]` checked to be exactly of `kind` (an int is not a bool, a float is not an
    int); raises ValueError naming the field otherwise. `default` stands in for a missing one."""
    value = record.get(field, default) if isinstance(record, dict) else None
    if value is None or type(value) is not kind:
        raise ValueError(f"{field} is {value!r}, not a {kind.__name__}")
    return value


def record_choice(record: dict, field: str, choices, default=None):
    """A str field that must be one of `choices`."""
    value = record_field(record, field, str, default)
    if value not in choices:
        raise ValueError(f"{field} {value!r} is not one of {sorted(choices)}")
    return value


def record_int(record: dict, field: str, low: int, high: int, power_of_two: bool = False,
               default=None) -> int:
    """An int field in [low, high] (and a power of two where asked)."""
    value = record_field(record, field, int, default)
    if not low <= value <= high or (power_of_two and value & (value - 1)):
        shape = "a power of two " if power_of_two else ""
        raise ValueError(f"{field} {value} is not {shape}in [{low}, {high}]")
    return value


def default_cache() -> TuningCache:
    """The TuningCache for the current tuning_cache_path(), reused while that path is unchanged."""
    global _default
    path = tuning_cache_path()
    if _default is None or _default.path != path:
        _default = TuningCache(path)
    return _default


def _stamp(stat: os.stat_result) -> tuple:
    # The inode changes on every store (each one renames a new file into place), which catches
    # two writes that land within one tick of the filesystem's mtime clock.
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


def _warn(path: Path, stamp, problem: str, stacklevel: int = 4):
    # stacklevel 4 points at the caller of lookup()/store() through _entries(); store's own
    # warning passes 3.
    if stamp is not None:
        if (str(path), stamp) in _warned:
            return
        _warned.add((str(path), stamp))
    warnings.warn(f"dnngraph tuning cache {path}: {problem}", TuningCacheWarning,
                  stacklevel=stacklevel)


def read_document(raw: bytes) -> dict:
    """The entries (key -> record, records unchecked) of the bytes of a tuning file; ValueError
    saying what is wrong when they are not a tuning document of this version."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError too
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"holds a JSON {type(data).__name__}, not a {FORMAT} object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format tag {data.get('format')!r}, expected {FORMAT!r}")
    version = data.get("version")
    if version != VERSION or isinstance(version, bool):
        raise ValueError(f"version {version!r}, this dnngraph reads version {VERSION}")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise ValueError(f"'entries' is a JSON {type(entries).__name__}, not an object")
    return entries


def _parse(raw: bytes) -> tuple[dict, str | None]:
    """(usable entries, what is wrong with the file or None) for the bytes of a cache file."""
    try:
        entries = read_document(raw)
    except ValueError as error:
        return {}, f"{error}; ignoring it, the next store rewrites it"
    bad = sorted(key for key, record in entries.items() if not isinstance(record, dict))
    if bad:
        entries = {key: record for key, record in entries.items() if isinstance(record, dict)}
        shown = ", ".join(repr(key) for key in bad[:3]) + (", ..." if len(bad) > 3 else "")
        return entries, f"dropping {len(bad)} entries whose record is not an object: {shown}"
    return entries, None


def write_document(path: Path, entries: dict) -> tuple:
    """Replace `path` atomically with a tuning document holding `entries` (temp file in the same
    folder, fsync, rename): a reader sees the old file or the new one, never a partial one.
    Returns the new file's stamp; OSError when it cannot be written (the old file stays)."""
    document = {"format": FORMAT, "version": VERSION, "entries": entries}
    # The same folder makes os.replace a rename within one filesystem, which is atomic.
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())  # the data is on disk before the rename publishes it
            stamp = _stamp(os.fstat(handle.fileno()))  # a rename keeps inode and mtime
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return stamp


# A NamedTuple, not a dataclass: tests load this module from its file, outside sys.modules,
# where a dataclass cannot resolve its annotations.
class MergeResult(NamedTuple):
    """What TuningCache.merge did with each incoming key (sorted): added (new here), identical
    (already here, equal), replaced (differed, overwritten) or kept (differed, local kept)."""

    added: tuple
    identical: tuple
    replaced: tuple
    kept: tuple


class TuningCache:
    """Tuning records in one JSON file, shared by every process that uses the same path."""

    def __init__(self, path: Path | None = None):
        """A cache backed by `path` (default tuning_cache_path()); nothing is read yet."""
        self.path = Path(path) if path is not None else tuning_cache_path()
        self._memo: tuple[tuple, dict] | None = None  # (stamp of the file parsed, its entries)

    def lookup(self, key: str) -> dict | None:
        """The record stored under `key`, or None (also when the file is missing or unusable)."""
        record = self._entries(fresh=False).get(key)
        # A copy via JSON, so a caller editing the result cannot change the memoised entries.
        return None if record is None else json.loads(json.dumps(record))

    def store(self, key: str, record: dict) -> None:
        """Add or replace `key`'s record atomically; I/O failures warn instead of raising.

        Raises TypeError only for a caller bug: a key that is not a str or a record that is not
        a JSON-able dict.
        """
        if not isinstance(key, str) or not isinstance(record, dict):
            raise TypeError("tuning cache key must be a str and record a dict")
        try:  # a JSON round trip both copies the record and checks it before touching the file
            record = json.loads(json.dumps(record))
        except (TypeError, ValueError) as error:  # ValueError: a circular reference
            raise TypeError(f"tuning cache record is not JSON-able: {error}") from error
        try:
            with self._lock():
                # Re-read under the lock (bypassing the memo) so entries other processes stored
                # since our last read are kept, not overwritten by a stale copy.
                entries = dict(self._entries(fresh=True))
                entries[key] = record
                self._write(entries)
        except OSError as error:
            _warn(self.path, None, f"could not store tuning results ({error}); they will not "
                                   "be reused by later processes", stacklevel=3)

    def records(self) -> dict:
        """Every entry of the file as it is now (a copy; records unchecked), {} when there is no
        file; ValueError saying what is wrong with a file that is not a tuning document."""
        try:
            raw = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return read_document(raw)

    def merge(self, incoming: dict, overwrite: bool = False) -> MergeResult:
        """Add every record of `incoming` (key -> record dict) in one atomic replace under the
        writer lock. A key already here with a different record keeps the local one, or takes
        the incoming one when `overwrite`. Unlike store(), I/O failures raise OSError: the
        caller asked for this write and must hear that it did not happen."""
        incoming = json.loads(json.dumps(incoming))  # a copy, and JSON-able before any write
        outcome = {"added": [], "identical": [], "replaced": [], "kept": []}
        with self._lock():
            entries = dict(self._entries(fresh=True))
            for key in sorted(incoming):
                local = entries.get(key)
                if local is None:
                    kind = "added"
                elif local == incoming[key]:
                    kind = "identical"
                else:
                    kind = "replaced" if overwrite else "kept"
                if kind in ("added", "replaced"):
                    entries[key] = incoming[key]
                outcome[kind].append(key)
            if outcome["added"] or outcome["replaced"]:
                self._write(entries)
        return MergeResult(**{kind: tuple(keys) for kind, keys in outcome.items()})

    @contextlib.contextmanager
    def _lock(self):
        if fcntl is None:
            yield
            return
        # A sidecar file, because the cache file itself is replaced (a lock on it would be a
        # lock on an inode that is about to be unlinked).
        with open(f"{self.path}.lock", "a") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _entries(self, fresh: bool) -> dict:
        try:
            if not fresh and self._memo is not None:
                if _stamp(os.stat(self.path)) == self._memo[0]:
                    return self._memo[1]
            with open(self.path, "rb") as handle:
                # Stamp the open descriptor, so the stamp belongs to exactly the bytes read even
                # if another process renames a new file into place meanwhile.
                stamp = _stamp(os.fstat(handle.fileno()))
                raw = handle.read()
        except (FileNotFoundError, NotADirectoryError):
            return {}  # nothing tuned yet (or no folder, which store() warns about): no warning
        except OSError as error:
            # Keyed by the error text: an unreadable file warns once, not on every lookup.
            _warn(self.path, ("unreadable", str(error)),
                  f"could not read it ({error}); tuning results are not reused")
            return {}
        entries, problem = _parse(raw)
        if problem is not None:
            _warn(self.path, stamp, problem)
        self._memo = (stamp, entries)
        return entries

    def _write(self, entries: dict):
        self._memo = (write_document(self.path, entries), entries)
