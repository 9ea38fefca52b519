"""build(autotune=True): time the model's top candidates, keep the fastest, remember it.

The family supplies its ranked candidates (plain data) and a way to time one; this module picks
how many to time, shows progress, and reads and writes the persistent tuning cache, so a second
build of the same problem (in any process) times nothing.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import triton

from ..target import Target
from ..versions import __version__
from .tuning_cache import TuningCache, TuningCacheWarning, default_cache, tuning_key

# Candidates timed per problem: the model's top 6 held the fastest of all candidates on 28 of
# the 32 problems of bench_matmul_heuristics.py (H100), and came within 0.99 of it on geometric
# mean (worst 0.88); BuildOptions.autotune_top (default $DNNGRAPH_AUTOTUNE_TOP, "all": None)
# sets another count.
DEFAULT_TOP = 6


@dataclass
class TuningRecord:
    """How a kernel's config was chosen: "model", "tuned" (timed now) or "cache" (timed before).

    timings: (config text, model rank, milliseconds) of every candidate timed, fastest first.
    family, signature: the tuning-cache key's family ("matmul", "conv", "rows") and problem
    signature; candidates: how many the model ranked, so that timed + failed + untimed add up to
    it. Set by the Tuner ("" and 0 on a model-only record built without one).
    """

    source: str
    chosen: str
    timings: tuple = ()
    family: str = ""
    signature: str = ""
    candidates: int = 0

    def describe(self) -> str:
        if self.source == "model" or not self.timings:
            return ""
        text, rank, ms = self.timings[0]
        origin = "cached autotune result" if self.source == "cache" else "autotuned"
        return (f"{origin}: {ms * 1e3:.1f} us, fastest of {len(self.timings)} timed candidates "
                f"(model rank {rank + 1})")


def _dnngraph_version() -> str:
    """This dnngraph's version, part of every tuning key."""
    return __version__


def _cached_choice(cached, ranked: list, from_record: Callable, text_of: Callable, **about):
    """(config, TuningRecord) from a cached record, or a str saying why the record is unusable.

    The record must decode (from_record validates variant, mode and sizes) and name one of
    this problem's candidates: a cache file is data from disk, and only configs the model would
    offer for this problem may reach a kernel."""
    try:
        if not isinstance(cached, dict) or not isinstance(cached.get("config"), dict):
            raise ValueError("it holds no config object")
        config = from_record(cached["config"])
        timings = tuple((str(t), int(r), float(ms)) for t, r, ms in cached.get("timings", ()))
    except (KeyError, TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    candidate = next((c for c in ranked if text_of(c) == text_of(config)), None)
    if candidate is None:
        return f"{text_of(config)} is not a candidate for this problem"
    return candidate, TuningRecord("cache", text_of(candidate), timings, **about)


BAR_WIDTH = 24  # characters of the autotune progress bar on a terminal


class Tuner:
    """Chooses configs by timing on a device of `target`, the best `top` of each ranking (None:
    all of them); one per build(autotune=True)."""

    def __init__(self, target: Target, cache: Optional[TuningCache] = None, progress: bool = True,
                 top: Optional[int] = DEFAULT_TOP):
        self.target, self.top = target, top
        self.cache = cache or default_cache()
        self.progress = progress and os.environ.get("DNNGRAPH_AUTOTUNE_QUIET", "0") in ("", "0")
        self.timed = 0  # candidates timed by this tuner (0 when everything came from the cache)

    def _say(self, text: str):
        if self.progress:
            print(f"dnngraph autotune: {text}", file=sys.stderr, flush=True)

    def _step(self, family: str, done: int, count: int, text: str):
        """One candidate timed: a progress bar redrawn in place on a terminal, a line otherwise."""
        if not self.progress:
            return
        if not sys.stderr.isatty():
            self._say(f"  [{done}/{count}] {text}")
            return
        filled = BAR_WIDTH * done // count
        print(f"\rdnngraph autotune: {family} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{count} "
              f"{text[:60]:<60}", end="" if done < count else "\n", file=sys.stderr, flush=True)

    def choose(self, family: str, signature: str, ranked: list, to_record: Callable, from_record: Callable,
               text_of: Callable, time_config: Callable):
        """(config, TuningRecord): the cached winner for this problem, else the fastest of the
        top-ranked candidates, timed with time_config(config) -> milliseconds."""
        key = tuning_key(self.target.name, triton.__version__, family, signature, _dnngraph_version())
        about = dict(family=family, signature=signature, candidates=len(ranked))
        cached = self.cache.lookup(key)
        if cached is not None:
            found = _cached_choice(cached, ranked, from_record, text_of, **about)
            if isinstance(found, str):  # an unusable record: warn, tune again and overwrite it
                warnings.warn(f"dnngraph tuning cache {self.cache.path}: ignoring the record of "
                              f"{family} {signature}: {found}", TuningCacheWarning, stacklevel=4)
            else:
                return found
        count = len(ranked) if self.top is None else min(len(ranked), self.top)
        self._say(f"{family} {signature}: timing {count} of {len(ranked)} candidates")
        results = []
        for rank, config in enumerate(ranked[:count]):
            try:
                ms = time_config(config)
            except Exception as error:  # a candidate that fails to compile or run is skipped
                self._step(family, rank + 1, count, f"{text_of(config)}: failed ({type(error).__name__}: "
                                                    f"{str(error).splitlines()[0] if str(error) else ''})")
                continue
            self.timed += 1
            results.append((text_of(config), rank, ms, config))
            self._step(family, rank + 1, count, f"{text_of(config)}: {ms * 1e3:.1f} us")
        if not results:
            return ranked[0], TuningRecord("model", text_of(ranked[0]), **about)
        results.sort(key=lambda r: r[2])
        best = results[0]
        timings = tuple(r[:3] for r in results)
        self.cache.store(key, {"config": to_record(best[3]), "timings": [list(t) for t in timings]})
        self._say(f"  chose {best[0]} (model rank {best[1] + 1})")
        return best[3], TuningRecord("tuned", best[0], timings, **about)
