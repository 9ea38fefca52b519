"""The plan cache: a second build of an identical graph in one process reuses the first plan.

The key holds everything a build reads, so a hit can never differ from what a build would make:

  * the graph as serialization writes it (uids, names, dims, strides, data types, outputs, op
    attributes, the graph's data types and allow_tf32), less the graph's own name, which no
    kernel sees (each graph's plan carries its own name);
  * the BuildOptions (autotune, workspace limit, backends, forced configs and thresholds, a
    target to plan for) and the preferred backends' signature (backends/registry.py: each
    backend object, its version, families and the code that lowers each family);
  * the device a build schedules for (type, index), its target (target.py: read from the
    driver, or the options') and whether kernels are interpreted;
  * the environment variables a build reads (BUILD_ENVIRONMENT);
  * with autotune, the state of the tuning-cache file (a store by any process changes it).

The heuristics read no module state a caller may set: what a build may be told goes through
BuildOptions. (Their tables are constants; a table changed in place is not seen: call clear()
after doing that.)

A cached plan is built on a private snapshot of the graph, so no later change to the graph that
was built first can reach it; each graph gets a plan of its own over the shared launches
(Plan.for_graph), which maps its own tensor handles and names. The cache is thread-safe.
"""
from __future__ import annotations

import collections
import os
import threading

from .tuning_cache import tuning_cache_path
from .interpreter import interpreting
from ..serialization import graph_document

PLAN_CACHE_ENTRIES = 128  # plans kept (least recently used dropped first)
# Every environment variable a build reads (HOME: the default cache folder lies under it);
# tests/runtime/test_plan_cache.py checks the sources read no other one but those in
# IGNORED_ENVIRONMENT.
BUILD_ENVIRONMENT = ("DNNGRAPH_CACHE_DIR", "HOME")
# Read by dnngraph but changing no plan, or only through a value the key holds: logging,
# autotune's progress output, the interpreter and the interpreter process's switch (both read
# once at import; interpreting() is in the key), the default of BuildOptions.autotune_top (read
# when the options are made; the options are in the key), and whether Triton's installation key
# comes from the cache folder (runtime/triton_key.py: the same key either way); PYTHONPATH is
# passed on to the process that compiles a shipped plan's binaries (runtime/kernel_binary.py);
# DNNGRAPH_POISON_WORKSPACE fills workspaces with NaN bytes when they are made (runtime/launch.py):
# a test aid that changes memory contents, never a plan.
IGNORED_ENVIRONMENT = ("DNNGRAPH_LOG", "DNNGRAPH_AUTOTUNE_QUIET", "TRITON_INTERPRET", "DNNGRAPH_INTERPRETER_WORKER",
                       "DNNGRAPH_AUTOTUNE_TOP", "DNNGRAPH_TRITON_KEY_CACHE", "PYTHONPATH", "DNNGRAPH_POISON_WORKSPACE")


def _environment() -> tuple:
    return tuple(os.environ.get(name) for name in BUILD_ENVIRONMENT)


def _tuning_state() -> tuple:
    """(inode, mtime, size) of the tuning-cache file, or () when there is none."""
    try:
        stat = os.stat(tuning_cache_path())
    except OSError:
        return ()
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


def _graph_signature(graph) -> str:
    document = graph_document(graph)
    del document["graph"]["name"]
    return repr(document)  # repr tells 2 from 2.0 and True, and -0.0 from 0.0, as JSON does


def plan_key(graph, options, device, target, backends: tuple) -> tuple:
    """Everything a build of `graph` under `options` (BuildOptions) for `device` and its
    `target` with the `backends` (each one's name, version and families: the registry's
    signature) reads, as one hashable value."""
    # a graph specialised at sizes of a bucket chooses its configs at the bucket's top (symbolic.BucketExtents)
    return (_graph_signature(graph), getattr(graph, "bucket", None), options, tuple(backends), device.type,
            device.index, target, interpreting(), _environment(), _tuning_state() if options.autotune else ())


class PlanCache:
    """Built plans by plan_key, least recently used dropped past `entries`; thread-safe."""

    def __init__(self, entries: int = PLAN_CACHE_ENTRIES):
        self.entries = entries
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        """The plan stored under `key`, or None."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                self.misses += 1
                return None
            self._plans.move_to_end(key)
            self.hits += 1
            return plan

    def put(self, key, plan):
        """Keep `plan` under `key`."""
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.entries:
                self._plans.popitem(last=False)

    def clear(self):
        """Forget every plan (the next build of any graph builds afresh)."""
        with self._lock:
            self._plans.clear()


PLANS = PlanCache()


def clear():
    """Forget every cached plan: needed only after changing a heuristics table in place."""
    PLANS.clear()
