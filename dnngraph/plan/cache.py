"""The plan cache: a second build of an identical graph in one process reuses the first plan.

The key holds everything a build reads, so a hit can never differ from what a build would make:

  * the graph as serialization writes it (uids, names, dims, strides, data types, outputs, op
    attributes, the graph's data types and allow_tf32), less the graph's own name, which no
    kernel sees (each graph's plan carries its own name);
  * the build arguments (autotune, workspace_limit) and the kernel builders by family;
  * the device a build schedules for (type, index, model) and whether kernels are interpreted;
  * the environment variables a build reads (BUILD_ENVIRONMENT);
  * with autotune, the state of the tuning-cache file (a store by any process changes it);
  * the values of every module of dnngraph, by identity (FORCE_CONFIG, SPLIT_MIN_REDUCED,
    device_model..., whether set by a test's monkeypatch, a sweep script or a user), so a build
    after any assignment misses. (Watching assignments instead, by giving the modules a class
    of their own, broke Triton, which accepts only plain modules as a kernel's globals, and
    pickling.) Tables changed in place
    (`rows.SOME_TABLE[key] = ...`) are not seen: call clear() after doing that.

A cached plan is built on a private snapshot of the graph, so no later change to the graph that
was built first can reach it; each graph gets a plan of its own over the shared launches
(Plan.for_graph), which maps its own tensor handles and names. The cache is thread-safe.
"""
from __future__ import annotations

import collections
import operator
import os
import sys
import threading
import types

from ..heuristics import device_model
from ..heuristics.tuning_cache import tuning_cache_path
from ..runtime import interpreting
from ..serialization import graph_document

PLAN_CACHE_ENTRIES = 128  # plans kept (least recently used dropped first)
# Every environment variable a build reads (HOME: the default cache folder lies under it);
# tests/test_plan_cache.py checks the sources read no other one but those in IGNORED_ENVIRONMENT.
BUILD_ENVIRONMENT = ("DNNGRAPH_CACHE_DIR", "DNNGRAPH_AUTOTUNE_TOP", "HOME")
# Read by dnngraph but changing no plan: logging, autotune's progress output, the interpreter
# and the interpreter process's switch (both read once at import; interpreting() is in the key).
IGNORED_ENVIRONMENT = ("DNNGRAPH_LOG", "DNNGRAPH_AUTOTUNE_QUIET", "TRITON_INTERPRET", "DNNGRAPH_INTERPRETER_WORKER")
WATCHED_PACKAGE = "dnngraph"


class _Values:
    """Module-level values, compared by identity. A key holds the values themselves, so while a
    plan is cached none of them can be freed and its id reused: equal ids are the same objects."""

    __slots__ = ("entries", "values", "ids", "_hash")

    def __init__(self, entries: tuple, values: tuple):
        self.entries, self.values = entries, values  # entries: what was read (for unchanged())
        self.ids = tuple(map(id, values))
        self._hash = hash(self.ids)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Values) and self.ids == other.ids

    def __hash__(self) -> int:
        return self._hash


def _reader(namespace: dict) -> list:
    """[namespace, its length, a C getter of its public values]: FORCE_* knobs, tables,
    functions; not submodules (an import binds them) nor private names, which hold the modules'
    own running state (a started interpreter process, a switch) that no plan reads."""
    names = [name for name, value in namespace.items()
             if name[:1] != "_" and value.__class__ is not types.ModuleType]
    return [namespace, len(namespace), operator.itemgetter("__name__", *names)]  # always a tuple


class _Modules:
    """dnngraph's modules (found again whenever the process imports more), read without a
    Python call per module (a plan-cache hit stays a few hundred calls)."""

    def __init__(self):
        self.seen, self.readers = -1, []

    def state(self) -> _Values:
        """Every public module-level value of dnngraph as it is now: an assignment of any of
        them, by a test's monkeypatch, a sweep or a user, changes it (an equal new object
        too: identity is what is compared)."""
        if len(sys.modules) != self.seen:
            self.seen = len(sys.modules)
            self.readers = [_reader(vars(module)) for name, module in sorted(sys.modules.items())
                            if name == WATCHED_PACKAGE or name.startswith(WATCHED_PACKAGE + ".")]
        return self._read(self.readers)

    @staticmethod
    def _read(readers: list) -> _Values:
        values = []
        for reader in readers:
            namespace, length, getter = reader
            if len(namespace) != length:  # a name added or removed: read the names again
                reader[:] = _reader(namespace)
                getter = reader[2]
            values += getter(namespace)
        return _Values(tuple(readers), tuple(values))

    def unchanged(self, earlier: _Values) -> bool:
        """Do the modules `earlier` read still hold the same values?"""
        return self._read(list(earlier.entries)).ids == earlier.ids


MODULES = _Modules()


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


def plan_key(graph, autotune: bool, workspace_limit, device, builders: dict) -> tuple:
    """Everything a build of `graph` for `device` with the kernel `builders` (family -> builder)
    reads, as one hashable value."""
    return (_graph_signature(graph), bool(autotune), workspace_limit, tuple(builders.items()), device.type, device.index,
            device_model(device), interpreting(), _environment(), _tuning_state() if autotune else (),
            MODULES.state())


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
