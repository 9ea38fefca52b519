"""The backends a build can choose from, by name: one registry line per backend.

choose() takes the first backend of the build's preference order (BuildOptions.backends) that
supports a problem; families() is every group kind some backend lowers (what the partition may
form groups for); signature() is what the plan key holds of them.
"""
from __future__ import annotations

from ..errors import UnsupportedError
from .contract import supported
from .triton.backend import TRITON

BACKENDS = {TRITON.name: TRITON}


def names() -> tuple:
    """The registered backend names, in registry order."""
    return tuple(BACKENDS)


def families(names_=None) -> frozenset:
    """The group kinds any backend of `names_` (None: every registered one) supports."""
    chosen = BACKENDS.values() if names_ is None else [BACKENDS[n] for n in names_ if n in BACKENDS]
    found = frozenset()
    for backend in chosen:
        found |= frozenset(backend.families)
    return found


def signature(names_) -> tuple:
    """What a plan built with the backends `names_` depends on of them, one entry per name in
    order: the backend object itself (another instance registered under the name misses the
    cache) and its cache_key() (name, version, families and the code that lowers each: a
    builder swapped in place misses it too); an unregistered name as itself (choose() refuses it)."""
    return tuple((name, id(BACKENDS[name]), BACKENDS[name].cache_key()) if name in BACKENDS else (name,)
                 for name in names_)


def choose(problem, target, options, interpreted: bool = False):
    """The first backend of options.backends that supports `problem` on `target` (when the
    kernels run in the interpreter, one whose kernels can); UnsupportedError naming the node and
    the backends tried when none does."""
    tried = []
    for name in options.backends:
        backend = BACKENDS.get(name)
        if backend is None:
            tried.append(f"{name}: not registered")
            continue
        if interpreted and not backend.interpretable:
            tried.append(f"{name}: its kernels cannot run in Triton's interpreter")
            continue
        ok, why = supported(backend, problem, target)
        if ok:
            return backend
        tried.append(f"{name}: {why}")
    raise UnsupportedError(
        f"{problem.where}: no {problem.family} kernel exists yet in the backends tried "
        f"({'; '.join(tried)}), so the group [{', '.join(problem.node_names)}] cannot run; "
        f"graph.reference() computes it")
