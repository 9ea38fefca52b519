"""The plan of a graph with dynamic extents (dnngraph/symbolic.py): one static Plan per set of
sizes, made on first use from the graph at those sizes, then found by one dictionary lookup.

The sizes an execute runs at are read from the bound tensors' dynamic axes (`DynamicExtents`),
each checked against its symbol's range and against every other tensor carrying the same symbol
before anything runs. A size seen before costs the lookup of its tuple of sizes and the static
plan's own execute. A new size costs the build of the graph at that size (partition, lowering,
rendering: host work); its kernels are named by content, so a kernel whose source a size of the
same bucket already produced is the same JITFunction, compiled once by Triton (which itself
specializes integer arguments only by divisibility). `kernels_by_bucket` says which kernel
sources each bucket (symbolic.bucket_of) has produced: the measure of compiles per bucket.

Layer 4 (runtime): the build hands in the function that builds the graph at given sizes.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable

import torch

from ..errors import ExecutionError, ValidationError
from ..symbolic import bucket_of, symbols_of
from .launch import persistent_buffer

# plans (or functions) kept per dynamic graph, the least recently used size dropped first: a sweep
# over every length of a range would otherwise hold one plan per length for the graph's lifetime
PLANS_KEPT = 64


class PerSize:
    """What a dynamic graph made per set of sizes (a plan, a function), made on first use, the
    last PLANS_KEPT used kept. A size seen before costs one short lock; a new size is made under
    another lock, so threads with sizes seen before never wait on a build."""

    def __init__(self):
        self._made: collections.OrderedDict = collections.OrderedDict()  # key -> what make(key) gave
        self._index_lock = threading.Lock()  # guards _made
        self._make_lock = threading.Lock()  # one make at a time: a size wanted twice is made once

    def get(self, key: tuple, make: Callable):
        """What `make()` gave for `key`, made now unless kept."""
        found = self._found(key)
        if found is not None:
            return found
        with self._make_lock:
            found = self._found(key)  # made by another thread while this one waited
            if found is None:
                found = make()
                with self._index_lock:
                    self._made[key] = found
                    while len(self._made) > PLANS_KEPT:
                        self._made.popitem(last=False)
        return found

    def _found(self, key: tuple):
        with self._index_lock:
            found = self._made.get(key)
            if found is not None:
                self._made.move_to_end(key)
            return found

    def items(self) -> list:
        with self._index_lock:
            return list(self._made.items())

    def keys(self) -> list:
        return [key for key, _ in self.items()]

    def __len__(self) -> int:
        return len(self._made)


class DynamicExtents:
    """Where each symbol's size is read from (the inputs' and outputs' dynamic axes), and the
    checks of those sizes."""

    def __init__(self, graph, tensors=None):
        tensors = list(graph.inputs()) + list(graph.outputs()) if tensors is None else list(tensors)
        self.symbols = tuple(sorted(symbols_of(tensors).values(), key=lambda s: s.name))
        index = {s.name: i for i, s in enumerate(self.symbols)}
        # (handle, name, axis, symbol index, coefficient) of each dynamic axis, inputs first: the
        # axis is coefficient times the symbol's size (a graph output of axis 2 * seq)
        self.sources = tuple((t, t.name, axis, index[s.symbol.name], s.coefficient) for t in tensors
                             for axis, s in enumerate(t.dynamic_dim_symbols or ()) if s is not None)
        self.handles = {t: t.name for t in graph.tensors}

    def key(self, bindings, what: str = "execute") -> tuple:
        """The sizes of the symbols (in name order) the bindings have, each checked."""
        if not isinstance(bindings, dict):
            raise ExecutionError(f"{what}: bindings must be a dict of Tensor or name -> torch.Tensor, "
                                 f"got {type(bindings).__name__}")
        found = [None] * len(self.symbols)
        for handle, name, axis, index, coefficient in self.sources:
            value = bindings.get(handle)
            if value is None:
                value = bindings.get(name)
            if value is None:
                continue  # the plan reports a missing binding
            self._take(found, index, self._size(value, name, axis, coefficient, what), name, axis, what)
        return self._checked(found, what)

    def key_of_values(self, values: list, positions: tuple, what: str) -> tuple:
        """key() for values by position (a function's arguments): `positions` holds (position,
        name, axis, symbol index, coefficient)."""
        found = [None] * len(self.symbols)
        for position, name, axis, index, coefficient in positions:
            self._take(found, index, self._size(values[position], name, axis, coefficient, what), name, axis, what)
        return self._checked(found, what)

    @staticmethod
    def _size(value, name: str, axis: int, coefficient: int, what: str) -> int:
        """The symbol's size `value`'s dynamic `axis` says: its extent over the axis's coefficient."""
        shape = getattr(value, "shape", None)
        if shape is None:
            raise ExecutionError(f"{what}: {name!r} must be a torch.Tensor, got {type(value).__name__}")
        if axis >= len(shape):
            raise ExecutionError(f"{what}: {name!r} has dynamic axis {axis}, got a tensor of shape {list(shape)}")
        size, remainder = divmod(shape[axis], coefficient)
        if remainder:
            raise ExecutionError(f"{what}: {name!r} axis {axis} is {coefficient} times a symbol's size, got "
                                 f"{shape[axis]} in a tensor of shape {list(shape)}")
        return size

    def _take(self, found: list, index: int, size: int, name: str, axis: int, what: str) -> None:
        if found[index] is None:
            found[index] = size
        elif found[index] != size:
            symbol = self.symbols[index]
            raise ExecutionError(f"{what}: {symbol.name!r} is {found[index]} in one tensor and {size} in "
                                 f"{name!r} (axis {axis}): tensors sharing a symbol must agree")

    def _checked(self, found: list, what: str) -> tuple:
        for symbol, size in zip(self.symbols, found):
            if size is None:
                raise ExecutionError(f"{what}: no bound tensor gives the size of {symbol!r}")
            if not symbol.min <= size <= symbol.max:
                raise ExecutionError(f"{what}: {symbol.name} = {size} is outside the declared range "
                                     f"[{symbol.min}, {symbol.max}] of {symbol!r}")
        return tuple(found)

    def sizes(self, bindings, what: str = "execute") -> dict:
        """key() as symbol name -> size."""
        return dict(zip((s.name for s in self.symbols), self.key(bindings, what)))

    def by_name(self, bindings: dict) -> dict:
        """`bindings` keyed by tensor names (a graph of another size has other handles)."""
        return {self.handles.get(key, key): value for key, value in bindings.items()}


class SharedWorkspaces:
    """One workspace per (device, stream) for every size of a dynamic graph, with the lock that
    keeps one execute's launches together over it (a plan per size with a workspace of its own
    would hold one buffer per size kept). Sized at `bound` (the largest sizes' need, which bounds
    every size's: build._within_largest); a plan that needs more, or one executing under a CUDA
    graph capture (whose pool a buffer shared outside it must not come from), takes its own."""

    def __init__(self, bound: Callable):
        self._bound = bound  # device -> bytes
        self._made: dict = {}  # (device type, index, raw stream) -> (buffer, lock)
        self._lock = threading.Lock()

    def __call__(self, device, stream, nbytes: int):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        with self._lock:
            key = (device.type, device.index, stream)
            made = self._made.get(key)
            if made is None:
                made = self._made[key] = (persistent_buffer(max(nbytes, self._bound(device)), device),
                                          threading.Lock())
        return made if made[0].numel() >= nbytes else None


class DynamicPlan:
    """A graph's plans by the sizes of its dynamic extents: execute() runs the plan of the
    bindings' sizes, built by `build_at(sizes)` (symbol name -> size; returns a Plan of the graph
    at those sizes) on first use."""

    def __init__(self, graph, build_at: Callable, options=None):
        self.graph_name = graph.name
        self.options = options  # the BuildOptions every size is built with (a blob ships them)
        self.extents = DynamicExtents(graph)
        self._build_at = build_at
        self._handles = tuple((t, t.name) for t in graph.tensors)
        self._plans = PerSize()  # tuple of sizes -> Plan taking this graph's handles and names
        self._workspaces = SharedWorkspaces(lambda device: self.workspace_size(device))
        self.builds = 0  # plans built (host work; a size is built again only once PerSize dropped it)
        self.adopted = ()  # the sizes whose plans were made elsewhere (loaded from a blob)

    def plan_for(self, key: tuple, executing: bool = True):
        """The plan at sizes `key` (symbols in name order), built on first use; a shape rule that
        refuses these sizes raises ExecutionError when `executing`, else its ValidationError."""
        return self._plans.get(key, lambda: self._built(key, executing))

    def _built(self, key: tuple, executing: bool):
        sizes = dict(zip((s.name for s in self.extents.symbols), key))
        try:
            plan = self._build_at(sizes)
        except ValidationError as error:  # a shape rule that holds at some sizes of the range only
            if not executing:
                raise
            raise ExecutionError(f"graph {self.graph_name!r} at {sizes}: {error}") from None
        self.builds += 1
        plan.shared_workspace = self._workspaces
        return _taking_handles(plan, self._handles)

    def adopt(self, key: tuple, plan) -> None:
        """Hold `plan` (of the graph at sizes `key`, made elsewhere: loaded from a blob) as the
        plan of those sizes; nothing is built."""
        plan.shared_workspace = self._workspaces
        self._plans.get(key, lambda: _taking_handles(plan, self._handles))
        self.adopted += (key,)

    def held(self) -> list:
        """(sizes, plan) of each plan held now (the last PLANS_KEPT used)."""
        return self._plans.items()

    def execute(self, bindings, workspace=None) -> None:
        self.plan_for(self.extents.key(bindings)).execute(bindings, workspace)

    @property
    def sizes_built(self) -> list:
        """The size tuples (symbols in name order) a plan exists for."""
        return self._plans.keys()

    def bucket(self, key: tuple) -> tuple:
        """The bucket of each size of `key` (its upper bound)."""
        return tuple(bucket_of(size, symbol) for size, symbol in zip(key, self.extents.symbols))

    def kernels_by_bucket(self) -> dict:
        """bucket -> the names (content digests) of the kernels its sizes' plans launch."""
        found: dict = {}
        for key, plan in self._plans.items():
            names = found.setdefault(self.bucket(key), set())
            names.update(launch.kernel.__name__ for launch in plan.launches)
        return found

    def workspace_size(self, device=None, sizes=None) -> int:
        """Bytes of workspace an execute needs: at `sizes` (a key), else the most any size of the
        range needs (the plan at every symbol's max)."""
        key = sizes if sizes is not None else tuple(s.max for s in self.extents.symbols)
        return self.plan_for(key).workspace_size(device)

    @property
    def launches(self) -> list:
        return self.plan_for(tuple(s.max for s in self.extents.symbols)).launches

    def explain(self) -> str:
        symbols = ", ".join(repr(s) for s in self.extents.symbols)
        lines = [f"dynamic graph {self.graph_name!r}: {symbols}; one plan per size seen, kernels shared by content",
                 f"sizes kept (the last {PLANS_KEPT} used): {sorted(self._plans.keys())}"]
        if self.adopted:
            lines.append(f"sizes loaded from a serialized blob (nothing lowered or compiled): {sorted(self.adopted)}")
        for bucket, names in sorted(self.kernels_by_bucket().items()):
            lines.append(f"bucket {list(bucket)}: {len(names)} kernel source(s)")
        lines.append("at the largest sizes:")
        lines.append(self.plan_for(tuple(s.max for s in self.extents.symbols)).explain())
        return "\n".join(lines)


def _taking_handles(plan, handles: tuple):
    """`plan` (of a graph at some sizes, with its own handles) also taking the dynamic graph's
    handles for the tensors of the same names."""
    by_name = {name: plan.key_to_uid[name] for _, name in handles if name in plan.key_to_uid}
    plan.key_to_uid = {**plan.key_to_uid, **{handle: by_name[name] for handle, name in handles if name in by_name}}
    return plan

