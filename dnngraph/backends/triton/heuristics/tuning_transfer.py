"""The tuning cache shipped between machines: `python -m dnngraph tuning export|import FILE`.

An exported file is a tuning document like the cache file itself (tuning_cache.py), holding the
records that pass the same checks an import makes, optionally only one GPU model's. An import
reads the whole file and checks every record before touching the cache: the key must be one the
tuner writes (GPU model, Triton version, dnngraph version, a family that is tuned, a problem
signature) and the record exactly what that family's config writes, with timings of the right
types, so a hand-edited file cannot bring a config the family would not produce. One bad record
refuses the whole file and nothing changes. The checked records are then merged under the cache's
writer lock in one atomic replace; a key already present with a different record keeps the local
one unless `overwrite`.

A record is only ever found by a lookup on the GPU model and Triton version its key names
(autotune.py builds the key from the device's properties), so records of other machines can be
imported side by side and are simply not used here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ....errors import SerializationError
from ....versions import __version__
from .depthwise import DepthwiseConfig
from .matmul import MatmulConfig
from .rows import RowConfig
from ....runtime.tuning_cache import (MergeResult, TuningCache, TuningKeyParts, default_cache,
                           parse_tuning_key, read_document, write_document)

# The tuner's families (the first argument of Tuner.choose in plan/) and the config class whose
# to_record wrote their records.
FAMILY_CONFIGS = {"matmul": MatmulConfig, "conv": MatmulConfig, "rows": RowConfig,
                  "depthwise": DepthwiseConfig}
RECORD_FIELDS = {"config", "timings"}
SHOWN_PROBLEMS = 5  # bad records named in a refusal


@dataclass(frozen=True)
class ExportReport:
    """What export_tuning wrote: records exported, records of the cache it skipped as unusable
    (their keys), and the GPU models that hold records in the cache."""

    destination: Path
    exported: int
    skipped: tuple
    devices: tuple


@dataclass(frozen=True)
class ImportReport:
    """What import_tuning did: the merge's outcome per key, the cache it wrote, and how many
    imported records name another Triton or dnngraph version than this process (kept, unused)."""

    source: Path
    cache_path: Path
    merged: MergeResult
    other_versions: int


def _check_timings(timings) -> None:
    if not isinstance(timings, list):
        raise ValueError(f"timings is a {type(timings).__name__}, not a list")
    for timing in timings:
        if not (isinstance(timing, list) and len(timing) == 3):
            raise ValueError(f"timing {timing!r} is not a [config text, rank, milliseconds] list")
        text, rank, ms = timing
        if type(text) is not str or type(rank) is not int or rank < 0:
            raise ValueError(f"timing {timing!r}: config text must be a str and rank an int >= 0")
        if type(ms) not in (int, float) or not math.isfinite(ms) or ms < 0:
            raise ValueError(f"timing {timing!r}: milliseconds must be a finite number >= 0")


def check_entry(key: str, record) -> TuningKeyParts:
    """The parts of `key` when key and record are what the tuner writes; ValueError saying what
    is not (an unknown family, a config its family would not write, timings of wrong types)."""
    parts = parse_tuning_key(key)
    if parts.dnngraph_version is None:
        raise ValueError("the key names no dnngraph version (the tuner never uses such a record)")
    if not parts.device or not parts.triton_version or not parts.signature:
        raise ValueError("the key's device, Triton version or signature is empty")
    config_class = FAMILY_CONFIGS.get(parts.family)
    if config_class is None:
        raise ValueError(f"family {parts.family!r} is not one of {sorted(FAMILY_CONFIGS)}")
    if not isinstance(record, dict):
        raise ValueError(f"the record is a JSON {type(record).__name__}, not an object")
    unknown = sorted(set(record) - RECORD_FIELDS)
    if unknown or "config" not in record:
        raise ValueError(f"the record must hold 'config' (and optionally 'timings'), not {sorted(record)}")
    config = config_class.from_record(record["config"])
    if config.to_record() != record["config"]:
        raise ValueError(f"config {record['config']!r} is not what {config_class.__name__} writes "
                         f"({config.to_record()!r})")
    _check_timings(record.get("timings", []))
    return parts


def _problems(entries: dict) -> list[str]:
    """'key: what is wrong' for every entry check_entry refuses."""
    problems = []
    for key, record in entries.items():
        try:
            check_entry(key, record)
        except ValueError as error:
            problems.append(f"{key!r}: {error}")
    return problems


def export_tuning(destination, device: Optional[str] = None,
                  cache: Optional[TuningCache] = None) -> ExportReport:
    """Write the cache's usable records (only GPU model `device`'s when given) to `destination`
    as one tuning document, replaced atomically. SerializationError when the cache file itself
    is not a tuning document (nothing is written); OSError when `destination` cannot be."""
    cache = cache or default_cache()
    try:
        entries = cache.records()
    except ValueError as error:
        raise SerializationError(f"tuning cache {cache.path}: {error}; nothing was exported") from None
    chosen, skipped, devices = {}, [], set()
    for key, record in sorted(entries.items()):
        try:
            parts = check_entry(key, record)
        except ValueError:
            skipped.append(key)
            continue
        devices.add(parts.device)
        if device is None or parts.device == device:
            chosen[key] = record
    destination = Path(destination)
    write_document(destination, chosen)
    return ExportReport(destination, len(chosen), tuple(skipped), tuple(sorted(devices)))


def _read_import(source: Path) -> dict:
    """The checked entries of the tuning document at `source`; SerializationError otherwise."""
    try:
        raw = source.read_bytes()
    except OSError as error:
        raise SerializationError(f"cannot read {source}: {error.strerror or error}") from None
    try:
        entries = read_document(raw)
    except ValueError as error:
        raise SerializationError(f"{source} is not a dnngraph tuning file: {error}; "
                                 f"nothing was imported") from None
    problems = _problems(entries)
    if problems:
        shown = "; ".join(problems[:SHOWN_PROBLEMS])
        more = f" (and {len(problems) - SHOWN_PROBLEMS} more)" if len(problems) > SHOWN_PROBLEMS else ""
        raise SerializationError(f"{source}: {len(problems)} of {len(entries)} records are not valid "
                                 f"tuning records: {shown}{more}; nothing was imported")
    return entries


def import_tuning(source, overwrite: bool = False, cache: Optional[TuningCache] = None) -> ImportReport:
    """Merge the records of the tuning document at `source` into the cache: new keys are added,
    equal ones left, a differing record keeps the local one (or replaces it when `overwrite`).
    SerializationError for an unreadable, malformed or foreign file or any invalid record, with
    the cache unchanged; OSError when the cache cannot be written (unchanged as well)."""
    import triton

    cache = cache or default_cache()
    source = Path(source)
    entries = _read_import(source)
    merged = cache.merge(entries, overwrite=overwrite)
    other_versions = sum(1 for key in entries
                         if (parts := parse_tuning_key(key)).triton_version != triton.__version__
                         or parts.dnngraph_version != __version__)
    return ImportReport(source, cache.path, merged, other_versions)
