"""A built plan: launches in order over bound tensors, one workspace for the values between
kernels, a set of launches per target (built through the plan's `rebuild` when a device of another
model executes it), checked bindings, streams and explain().

Launches are bound at build (see launch.py); execute() checks bindings and runs them in order.
A plan may be executed from many threads and streams at once: each (device, stream) gets its own
workspace (or the caller passes one), and each target (device model) its own launches.
"""
from __future__ import annotations

import concurrent.futures
import copy
import operator
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import dtypes
from ..errors import ExecutionError
from ..target import Target, target_of
from ..tensor import blend_factor_uids
from .binding_guard import guard_of, still_bound
from .bindings import check_bindable, resolved_input
from .interpreter import interpreting
from . import launch as launch_module
from .launch import (LaunchRefused, created_once, launch_on_device, persistent_buffer, run_launches,
                     time_launches)
from .in_place import in_place_pairs
from .overlap import StridedBytes, share_a_byte
from .workspace import WorkspaceBudget

# Threads compiling one plan's kernels at once (a cold build of several kernels).
COMPILE_THREADS = max(1, min(8, os.cpu_count() or 1))
POINTER_ALIGNMENT = 16  # bytes; Triton specializes pointers on it (vectorized access)
WORKSPACE_ALIGNMENT = 256
READY_BINDING_SETS = 64  # checked binding sets a plan remembers (forgotten all at once past it)
_data_ptr = operator.methodcaller("data_ptr")  # mapped over a call's values: no comprehension's frame
# torch dtypes of block-scale types, bound to kernels as their bytes (dtypes.kernel_torch_dtype)
BYTE_BOUND = frozenset(t.torch_dtype for t in dtypes.ALL_TYPES if t.is_block_scale_storage)


@dataclass(frozen=True)
class BindingSpec:
    """What execute() expects of one bound tensor."""

    uid: int
    name: str
    shape: tuple
    stride: tuple
    torch_dtype: torch.dtype
    checked_axes: tuple  # axes whose stride matters (size > 1)
    extent_bytes: int
    is_output: bool


def _storage(tensor) -> tuple:
    """(shape, strides) of the torch tensor that holds `tensor` (packed fp4: half the items)."""
    return dtypes.storage_layout(tensor.dim, tensor.stride, tensor.data_type)


def _extent_bytes(tensor) -> int:
    shape, strides = _storage(tensor)
    span = sum((size - 1) * stride for size, stride in zip(shape, strides)) + 1
    return span * tensor.data_type.itemsize


def _binding_spec(tensor) -> BindingSpec:
    shape, strides = _storage(tensor)
    axes = tuple(a for a, size in enumerate(shape) if size > 1)
    return BindingSpec(tensor.uid, tensor.name, shape, strides,
                       tensor.data_type.torch_dtype, axes, _extent_bytes(tensor), tensor.is_output)



def _blend_factor_uids(groups) -> set:
    """uids of the one-element tensors the groups' blended outputs take alpha or beta from."""
    return {uid for g in groups for uid in blend_factor_uids(g.outputs)}


def _as_bytes(tensors: dict) -> None:
    """Block-scale types bound as their bytes (kernels read and write them as uint8), in place."""
    for uid, value in tensors.items():
        if value.dtype in BYTE_BOUND:
            tensors[uid] = value.view(torch.uint8)


def keys_of(graph) -> dict:
    """Binding key (Tensor handle or name) -> uid for every tensor of `graph`."""
    keys = {}
    for tensor in graph.tensors:
        keys[tensor] = keys[tensor.name] = tensor.uid
    return keys



class DeviceLaunches:
    """A plan's launches for one target (SM count, compute capability, ...) and the workspace
    layout they need: (uid, dim, stride, torch dtype, bytes, byte offset) of every tensor in it."""

    def __init__(self, target, launches, groups, graph_dtypes):
        self.target, self.launches = target, launches
        self.dtypes = dict(graph_dtypes)
        self.dtypes.update({t.uid: dtypes.kernel_torch_dtype(t.data_type) for g in groups for t in g.inputs + g.outputs})
        self.dtypes.update({s.uid: s.torch_dtype for launch in launches for s in launch.scratch})
        self.layout(groups)

    def bind(self, device_index: int):
        """Compile every launch for a CUDA device (one of this model), in parallel (Triton's
        compiler runs ptxas and its passes outside the GIL), then lay the workspace out:
        compiling tells which kernels need global scratch in it."""
        if len(self.launches) < 2:
            for launch in self.launches:
                launch.bind(device_index, self.dtypes)
            return
        workers = min(len(self.launches), COMPILE_THREADS)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dnngraph-compile") as pool:
            for done in [pool.submit(launch.bind, device_index, self.dtypes) for launch in self.launches]:
                done.result()  # a kernel that fails to compile raises here

    def layout(self, groups):
        """Place virtual tensors (not views of other memory), split partials and kernels' global
        scratch in one buffer."""
        views = groups.views
        owned = {}
        for t in [t for g in groups for t in g.outputs] + views.virtual_roots():
            if t.is_virtual and t.uid not in views.aliases:
                owned.setdefault(t.uid, t)
        buffers = [(t.uid, *_storage(t), dtypes.kernel_torch_dtype(t.data_type), _extent_bytes(t))
                   for t in owned.values()]
        buffers += [(s.uid, s.dim, None, s.torch_dtype, s.nbytes) for launch in self.launches for s in launch.scratch]
        buffers += [(launch.global_scratch.uid, launch.global_scratch.dim, None, torch.uint8,
                     launch.global_scratch.nbytes) for launch in self.launches if launch.global_scratch is not None]
        # the base address a workspace needs: what kernels assume of pointers and of global scratch
        self.alignment = max([POINTER_ALIGNMENT] + [launch.global_scratch_align for launch in self.launches])
        unit = max(WORKSPACE_ALIGNMENT, self.alignment)
        placed, offset = [], 0
        for uid, dim, stride, torch_dtype, nbytes in buffers:
            placed.append((uid, dim, stride, torch_dtype, nbytes, offset))
            offset += -(-max(nbytes, 1) // unit) * unit
        self.workspace_tensors, self.workspace_bytes = placed, offset

    def views(self, buffer: torch.Tensor) -> dict:
        """uid -> the tensor each workspace entry is, inside a flat uint8 `buffer`."""
        views = {}
        for uid, dim, stride, torch_dtype, nbytes, offset in self.workspace_tensors:
            typed = buffer[offset:offset + nbytes].view(torch_dtype)
            views[uid] = typed.view(dim) if stride is None else typed.as_strided(dim, stride)
        return views


def _check_outputs_apart(bound: list, in_place: frozenset = frozenset()) -> None:
    """Raise when an output shares an element with any other binding, but for an output bound
    to exactly the view of an input it may overwrite (`in_place`: (output uid, input uid) pairs,
    runtime/in_place.py); inputs may share memory. `bound` holds (StridedBytes, spec) per
    binding. Views interleaved in one buffer without a common element (dQ, dK and dV of one dQKV
    tensor, rotary halves) pass. One sweep over the views sorted by first byte finds the pairs
    whose byte ranges meet; overlap.share_a_byte decides those exactly."""
    reaching = []  # (end, view, spec) of the views swept so far that reach the current start
    for view, spec in sorted((b for b in bound if not b[0].empty), key=lambda b: b[0].start):
        reaching = [entry for entry in reaching if entry[0] > view.start]
        for _, other, other_spec in reaching:
            if (spec.is_output or other_spec.is_output) and share_a_byte(other, view):
                output, another = (spec, other_spec) if spec.is_output else (other_spec, spec)
                if (output.uid, another.uid) in in_place and _same_elements(view, other):
                    continue
                why = (" (an output may overwrite an input only bound to the very same view, where every "
                       "kernel reading the input reads each element before the writer stores it: an "
                       "elementwise one-to-one kernel run after every other reader)")
                raise ExecutionError(f"output {output.name!r} overlaps {another.name!r} in memory "
                                     f"(an element in common){why if not another.is_output else ''}")
        reaching.append((view.end, view, spec))


def _same_elements(first: StridedBytes, second: StridedBytes) -> bool:
    """Whether two views address the same bytes in the same index order (size-1 axes aside)."""
    walk = lambda view: tuple(axis for axis in view.axes if axis[0] > 1)
    return first.start == second.start and walk(first) == walk(second)


@dataclass
class ReadyBindings:
    """A binding set execute() has checked: the uid of each binding (in the bindings' order), the
    tensors' device, where kernels run, their launches, whether every pointer is aligned, and
    (CUDA, aligned) per raw stream the lock and the launch calls with addresses filled in."""

    uids: tuple
    device: torch.device
    kernel_device: torch.device
    built: "DeviceLaunches"
    aligned: bool
    streams: Optional[dict]
    negated: frozenset = frozenset()  # uids of lazily negated inputs, resolved at each launch
    index: Optional[int] = None  # kernel_device.index, read once (a torch.device attribute costs a call)
    # binding_guard.guard_of of the set, made when it comes again right after its full check (a
    # set bound once never pays for it); False: none (a caller workspace, a negated input, ...)
    quick: Optional[tuple] = None


@dataclass
class StreamWorkspace:
    """The workspace of one (device, stream): the lock keeps one execute's launches together on
    the stream, so two threads sharing a stream cannot interleave kernels over it."""

    buffer: torch.Tensor
    views: dict
    lock: threading.Lock


class Plan:
    """Launches in order over bound tensors and one workspace for values between kernels.

    Safe to execute from many threads and streams at once: workspaces are per (device, stream) or
    the caller's, launches are per target and built or bound once under a lock."""

    def __init__(self, graph, groups, launches, device, options, rebuild: Callable, budget=None):
        """`launches` are for `device`'s target under `options` (a BuildOptions); `rebuild(graph,
        groups, device, options, budget)` builds the launches for another device's target."""
        self.graph_name = graph.name
        self.groups, self.launches = groups, launches
        self.views = groups.views
        used = {self.views.root_of(t.uid) for g in groups for t in g.inputs}
        used |= _blend_factor_uids(groups)  # one-element tensors blended stores read
        self.specs = [_binding_spec(t) for t in graph.inputs() if t.uid in used]
        self.specs += [_binding_spec(t) for t in graph.outputs()]
        self.key_to_uid = keys_of(graph)
        # unused inputs may be bound (and are ignored); virtual tensors may not
        self.bindable = {s.uid for s in self.specs} | {t.uid for t in graph.inputs()}
        self.names = {t.uid: t.name for t in graph.tensors}
        self.in_place = in_place_pairs(graph, groups)  # outputs that may overwrite an input's memory
        self._graph = graph
        self.options, self._rebuild = options, rebuild
        self.origin = ""  # how the plan came to be when not built here (explain() says it)
        self._budget = budget if budget is not None else WorkspaceBudget()
        self._graph_dtypes = {t.uid: dtypes.kernel_torch_dtype(t.data_type) for t in graph.tensors}
        self._lock = threading.Lock()  # guards the three dicts below when they grow
        self._by_target: dict = {}  # launch_set_key (target, interpreted) -> DeviceLaunches
        self._by_device: dict = {}  # (device type, index) -> DeviceLaunches
        self._streams: dict = {}  # (device type, index, raw stream) -> StreamWorkspace
        self._ready: dict = {}  # the stamp of a binding set (see execute) -> ReadyBindings
        # (device, raw stream, bytes) -> (buffer, lock) shared with other plans, or None: a plan
        # of its own (the sizes of a dynamic graph share one: runtime/dynamic_plan.py)
        self.shared_workspace: Optional[Callable] = None
        # (stamp, ReadyBindings) of the last binding set checked in full: a call that repeats it
        # compares its stamp with it (no hash); one tuple, so a thread reads a stamp with its own
        # set. Not moved on a lookup hit: sets used in turn cost no write per call.
        self._last: tuple = (None, None)
        built = self._derive(device, launches)
        self.target = built.target  # the build's (others derive launches of their own at execute)
        self.dtypes = built.dtypes
        self.views_aligned = self.views.aligned(lambda uid: self.dtypes[uid].itemsize)
        self.workspace_tensors, self.workspace_bytes = built.workspace_tensors, built.workspace_bytes

    def for_graph(self, graph) -> "Plan":
        """This plan for `graph`, identical to the graph it was built from (the plan cache's key
        makes sure): the graph's own name and tensor handles over the same launches; the
        workspaces are its own."""
        plan = copy.copy(self)
        plan.graph_name = graph.name
        plan.key_to_uid = keys_of(graph)
        plan._streams, plan._ready, plan._last = {}, {}, (None, None)
        return plan

    # --- one set of launches per target ----------------------------------------------------------
    def _derive(self, device, launches=None) -> DeviceLaunches:
        """Build (unless given) and bind the launches for `device`'s target; caller holds the lock
        or is the constructor."""
        target = target_for(device, self.options)
        if launches is None:
            launches = self._rebuild(self._graph, self.groups, device, self.options, self._budget.fresh())
        built = DeviceLaunches(target, launches, self.groups, self._graph_dtypes)
        if device.type == "cuda":
            built.bind(device.index)
            built.layout(self.groups)
        self._by_target[launch_set_key(device, self.options)] = built
        self._by_device[(device.type, device.index)] = built
        return built

    def _launches_for(self, device) -> DeviceLaunches:
        """The launches for `device` (the interpreter's for CPU), built or bound on first use."""
        found = self._by_device.get((device.type, device.index))
        if found is not None:
            return found
        with self._lock:
            found = self._by_device.get((device.type, device.index))
            if found is not None:
                return found
            found = next((self._by_target[key] for key in launch_set_keys(device, self.options)
                          if key in self._by_target), None)
            if found is None:
                return self._derive(device)
            if device.type == "cuda":
                found.bind(device.index)
            self._by_device[(device.type, device.index)] = found
            return found

    def workspace_size(self, device=None) -> int:
        """Bytes of workspace an execute on `device` (a torch.device or name; default: the device
        the plan was built for) needs: allocate `torch.empty(n, dtype=torch.uint8)` there and pass
        it as execute(..., workspace=)."""
        if device is None:
            return self.workspace_bytes
        return self._launches_for(_kernel_device(torch.device(device))).workspace_bytes

    # --- execute ---------------------------------------------------------------------------------
    def _resolve(self, bindings) -> dict:
        if not isinstance(bindings, dict):
            raise ExecutionError(f"bindings must be a dict of Tensor or name -> torch.Tensor, "
                                 f"got {type(bindings).__name__}")
        resolved = {}
        for key, value in bindings.items():
            uid = self.key_to_uid.get(key)
            if uid is None:
                raise ExecutionError(f"binding key {key!r} is not a tensor of graph {self.graph_name!r}")
            if uid not in self.bindable:
                raise ExecutionError(f"tensor {self.names[uid]!r} is virtual: it lives inside the plan and "
                                     f"takes no binding (mark it with set_output(True) to read it)")
            resolved[uid] = value
        return resolved

    def _check(self, resolved: dict) -> tuple:
        """(device, aligned, negated): every binding checked against its spec (a kind of tensor
        kernels can bind, dims, strides on the axes that matter, one device, outputs sharing no
        element with another binding); aligned when every pointer is POINTER_ALIGNMENT-aligned;
        negated: the uids of lazily negated inputs (resolved at launch)."""
        device, bound, aligned, negated = None, [], True, set()
        for spec in self.specs:
            value = resolved.get(spec.uid)
            kind = "output" if spec.is_output else "input"
            if value is None:
                raise ExecutionError(f"missing binding for {kind} {spec.name!r}")
            if not isinstance(value, torch.Tensor):
                raise ExecutionError(f"{spec.name!r} is bound to {type(value).__name__}, not a torch.Tensor")
            check_bindable(value, f"{kind} {spec.name!r}", spec.is_output)
            if value.is_neg():
                negated.add(spec.uid)
            if value.dtype != spec.torch_dtype:
                raise ExecutionError(f"{spec.name!r} expects {spec.torch_dtype}, got {value.dtype}")
            if value.shape != spec.shape:
                raise ExecutionError(f"{spec.name!r} expects shape {list(spec.shape)}, got {list(value.shape)}")
            stride = value.stride()
            if stride != spec.stride and any(stride[a] != spec.stride[a] for a in spec.checked_axes):
                raise ExecutionError(f"{spec.name!r} expects strides {list(spec.stride)}, got {list(stride)} "
                                     f"(declare the layout with tensor_like or set_stride)")
            if device is None:
                device, first = value.device, spec.name
            elif value.device != device:
                raise ExecutionError(f"{spec.name!r} is on {value.device} and {first!r} on {device}: "
                                     f"bind every tensor on one device")
            start = _address(value, f"{kind} {spec.name!r}")
            aligned = aligned and start % POINTER_ALIGNMENT == 0
            bound.append((StridedBytes.of(start, spec.shape, stride, value.element_size()), spec))
        _check_outputs_apart(bound, self.in_place)
        return device, aligned, frozenset(negated)

    def _stream_workspace(self, built: DeviceLaunches, device, stream) -> StreamWorkspace:
        """The workspace of (device, stream), created once (launch.persistent_buffer: torch's
        caching allocator never hands its memory to another use while the stream's kernels read it)."""
        def make() -> StreamWorkspace:
            shared = self.shared_workspace and self.shared_workspace(device, stream, built.workspace_bytes)
            if shared is not None:
                buffer, lock = shared
                return StreamWorkspace(buffer, built.views(buffer), lock)
            buffer = persistent_buffer(built.workspace_bytes, device)
            return StreamWorkspace(buffer, built.views(buffer), threading.Lock())

        return created_once(self._streams, (device.type, device.index, stream), self._lock, make)

    def _caller_workspace(self, workspace, built: DeviceLaunches, device, tensors) -> dict:
        """Views into a workspace the caller passed, after checking it can hold them."""
        where = "the workspace"
        if not isinstance(workspace, torch.Tensor):
            raise ExecutionError(f"{where} must be a torch.Tensor of uint8, got {type(workspace).__name__}")
        check_bindable(workspace, where, is_output=False)  # scratch: a negative bit changes nothing
        if workspace.dtype != torch.uint8:
            raise ExecutionError(f"{where} must be uint8, got {workspace.dtype}")
        if workspace.device != device:
            raise ExecutionError(f"{where} is on {workspace.device}, the bound tensors on {device}")
        if not workspace.is_contiguous():
            raise ExecutionError(f"{where} must be contiguous")
        if workspace.numel() < built.workspace_bytes:
            raise ExecutionError(f"{where} holds {workspace.numel()} bytes; graph {self.graph_name!r} needs "
                                 f"{built.workspace_bytes} on {device} (plan.workspace_size())")
        start = workspace.data_ptr()
        if built.workspace_bytes and start % built.alignment:
            raise ExecutionError(f"{where} must start at a multiple of {built.alignment} bytes "
                                 f"(a fresh torch.empty does)")
        end = start + built.workspace_bytes
        for spec in self.specs:
            other = tensors[spec.uid].data_ptr()
            if built.workspace_bytes and other < end and start < other + spec.extent_bytes:
                raise ExecutionError(f"{where} overlaps {spec.name!r} in memory")
        return built.views(workspace.view(-1))

    def execute(self, bindings, workspace=None):
        """Check every binding (and `workspace`, if given), then launch every kernel on the current
        stream of the tensors' device; nothing is written on error.

        Internal tensors live in `workspace` (uint8, contiguous, at least workspace_size() bytes,
        on the tensors' device) when given: the caller then keeps concurrent executes apart.
        Without it each (device, stream) uses a workspace of its own, made on first use.

        A binding set is checked once: an execute whose keys, tensor types, addresses, dtypes,
        shapes, strides, devices and negative bits (and workspace) all match an earlier one's
        reuses its checks and, on a GPU, its launches' argument lists with the addresses filled
        in. The last set checked in full is recognised first by a quick check that reads the same
        fields in one C call (runtime/binding_guard.py)."""
        # The stamp: what the checks read of a binding set, per binding the key (and its type) and
        # the value's type, address, dtype, shape, strides, device and negative bit (and the same of
        # the workspace). Contents are not in it: writing into a bound tensor keeps its binding
        # valid. Every field is read on every call, for a tensor can change each of them in place
        # while it stays the same Python object (its id; its _cdata too, but for
        # torch.utils.swap_tensors): set_, resize_, as_strided_, t_ and the other in-place view ops,
        # a storage resize and share_memory_ move or reshape it; `.data =` can change any one field
        # alone (the dtype, by a view of its own memory; the negative bit, by a negated view), and
        # neither it, share_memory_ nor a storage resize bumps _version (which a write of contents
        # does). So no subset of these reads, nor the object's identity, tells that a tensor is
        # still what was checked. The key's type is in it so that a key comparing equal to a graph
        # tensor without being one (an __eq__ that says yes to anything) never matches the last
        # set, which is compared without a hash. Built here, not in a function: a call less.
        # First the quick check (runtime/binding_guard.py): the last set checked in full, again,
        # its fields compared in one C call; then the stamp.
        last, ready = self._last
        try:
            if (ready is None or not ready.quick or workspace is not None or bindings.__class__ is not dict
                    or not still_bound(ready.quick, bindings)):
                if bindings.__class__ is dict:
                    parts = []
                    for key, value in bindings.items():
                        parts += (key, key.__class__, value.__class__, value.data_ptr(), value.dtype, value.shape,
                                  value.stride(), value.device, value.is_neg())
                    if workspace is not None:
                        parts += (workspace.__class__, workspace.data_ptr(), workspace.dtype, workspace.shape,
                                  workspace.stride(), workspace.device)
                    stamp = tuple(parts)
                else:
                    stamp = None
                if stamp != last:  # the last set checked, again, is one comparison; another is a lookup
                    ready = self._ready.get(stamp)
                elif ready.quick is None:  # it came again: worth its quick check (made once, ~6 us)
                    ready.quick = guard_of(tuple(bindings), tuple(bindings.values())) or False
        except Exception:  # a value that is no tensor, an unhashable key: the checks say which
            stamp = ready = None
        if ready is None:
            ready = self._prepare(bindings, workspace, stamp)
        if launch_module.POISON_EACH_EXECUTE:
            self._poison_workspace(ready, workspace)
        streams = ready.streams
        if streams is None:
            self._execute_tensors(ready, bindings.values(), workspace)
            return
        # _launch_ready, inlined (a call less per execute)
        index = ready.index
        stream = torch._C._cuda_getCurrentRawStream(index)
        lock, calls = streams.get(stream) or self._bind_stream(ready, bindings.values(), workspace, stream)
        try:
            launch_on_device(calls, index, lock)
        except LaunchRefused as refused:
            raise self._refused(ready.built.launches[refused.position], refused) from refused.error

    def execute_conformed(self, token, keys: tuple, values: list, device=None) -> None:
        """execute() for a caller that made every value itself in its key's declared dtype, shape
        and strides (GraphFunction: inputs conformed, outputs freshly allocated), passing the same
        `keys` under the same hashable `token` each call: a repeated call reads only the values'
        addresses and device, a new set of addresses is checked in full once. `device`: the
        values' device when the caller has it (else read from the first value)."""
        stamp = (token, values[0].device if device is None else device, *map(_data_ptr, values))
        last, ready = self._last
        if stamp != last:
            ready = self._ready.get(stamp)
            if ready is None:
                ready = self._prepare(dict(zip(keys, values)), None, stamp)
        if launch_module.POISON_EACH_EXECUTE:
            self._poison_workspace(ready, None)
        self._launch_ready(ready, values, None)

    def _poison_workspace(self, ready: "ReadyBindings", workspace) -> None:
        """DNNGRAPH_POISON_WORKSPACE=each (runtime/launch.py): the workspace this execute will use
        (the caller's, or the plan's own on the current stream) filled with the poison byte, on
        that stream, before its launches: contents are undefined between executes by contract."""
        built = ready.built
        if not built.workspace_tensors:
            return
        if workspace is not None:
            workspace.view(-1)[:built.workspace_bytes].fill_(launch_module.POISON_BYTE)
            return
        kernel_device = ready.kernel_device
        stream = torch._C._cuda_getCurrentRawStream(kernel_device.index) if kernel_device.type == "cuda" else None
        shared = self._stream_workspace(built, ready.device, stream)
        with shared.lock:
            shared.buffer.fill_(launch_module.POISON_BYTE)

    def _launch_ready(self, ready: "ReadyBindings", values, workspace) -> None:
        """Run the launches of a checked binding set on the current stream of its device."""
        if ready.streams is None:
            self._execute_tensors(ready, values, workspace)
            return
        index = ready.index
        stream = torch._C._cuda_getCurrentRawStream(index)
        lock, calls = ready.streams.get(stream) or self._bind_stream(ready, values, workspace, stream)
        try:
            launch_on_device(calls, index, lock)
        except LaunchRefused as refused:
            raise self._refused(ready.built.launches[refused.position], refused) from refused.error

    @staticmethod
    def _refused(launch, refused: LaunchRefused) -> ExecutionError:
        """The typed error of a launch whose launcher refused its prepared arguments, naming the
        kernel and what each side counts."""
        bound = next(iter(launch._bound.values()), None)
        name, parameters = bound.compiled_as if bound is not None else ("?", "?")
        return ExecutionError(f"kernel {launch.source_path.name} ({launch.config_text}) was refused its "
                              f"arguments by its launcher: {refused.error}; the call passed {refused.given} "
                              f"values for a kernel of {len(launch.kernel.arg_names)} parameters and "
                              f"{len(launch.template)} prepared arguments; the launcher was compiled as "
                              f"{name} of {parameters} parameters")

    def _prepare(self, bindings, workspace, stamp) -> "ReadyBindings":
        """Check a binding set (and workspace) in full and remember it under `stamp`."""
        tensors = self._resolve(bindings)
        device, aligned, negated = self._check(tensors)
        aligned = aligned and self.views_aligned
        kernel_device = _kernel_device(device)
        built = self._launches_for(kernel_device)
        if workspace is not None:
            self._caller_workspace(workspace, built, device, tensors)
        uids = tuple(self.key_to_uid[key] for key in bindings)
        # a negated input is resolved into fresh memory at each launch: no addresses to bind
        bound = kernel_device.type == "cuda" and aligned and not negated
        ready = ReadyBindings(uids, device, kernel_device, built, aligned, {} if bound else None, negated,
                              kernel_device.index)
        if stamp is None or workspace is not None or negated:
            ready.quick = False  # no quick check for it (made when the set comes again, else)
        if stamp is not None:
            if len(self._ready) >= READY_BINDING_SETS:
                self._ready.clear()
            self._ready[stamp] = ready
            self._last = (stamp, ready)
        return ready

    def _execute_tensors(self, ready: "ReadyBindings", values, workspace):
        """Launch with torch tensors as arguments: the interpreter, or pointers below alignment."""
        tensors = dict(zip(ready.uids, values))
        _as_bytes(tensors)
        for uid in ready.negated:
            tensors[uid] = resolved_input(tensors[uid])
        built, device, kernel_device = ready.built, ready.device, ready.kernel_device
        stream = torch._C._cuda_getCurrentRawStream(kernel_device.index) if kernel_device.type == "cuda" else None
        if workspace is not None:
            tensors.update(built.views(workspace.view(-1)))
        elif built.workspace_tensors:
            shared = self._stream_workspace(built, device, stream)
            with shared.lock:
                tensors.update(shared.views)
                self.views.materialize(tensors)
                run_launches(built.launches, tensors, kernel_device, built.dtypes, ready.aligned, stream)
            return
        self.views.materialize(tensors)
        run_launches(built.launches, tensors, kernel_device, built.dtypes, ready.aligned, stream)

    def _bind_stream(self, ready: "ReadyBindings", values, workspace, stream) -> tuple:
        """(lock or None, ((launcher, arguments), ...)) of a checked binding set on `stream`: every
        tensor argument is a device address (bound tensors, workspace entries, views into them),
        so a launch converts nothing."""
        built, device = ready.built, ready.device
        addresses = dict(zip(ready.uids, (value.data_ptr() for value in values)))
        lock = None
        if workspace is not None:
            base = workspace.data_ptr()
        elif built.workspace_tensors:
            shared = self._stream_workspace(built, device, stream)
            base, lock = shared.buffer.data_ptr(), shared.lock
        for uid, _, _, _, _, offset in built.workspace_tensors:
            addresses[uid] = base + offset
        for uid, alias in self.views.aliases.items():
            addresses[uid] = addresses[alias.root] + alias.offset * built.dtypes[alias.root].itemsize
        index = ready.kernel_device.index
        calls = tuple(launch.bind(index, built.dtypes).call(addresses, stream) for launch in built.launches)
        ready.streams[stream] = (lock, calls)
        return lock, calls

    def profile(self, bindings) -> list:
        """(launch, median milliseconds) of each kernel run alone on `bindings` (as execute
        takes them; outputs are written, a blended one blended again on every timed run, and an
        in-place one overwritten as often)."""
        tensors = self._resolve(bindings)
        device, _, negated = self._check(tensors)
        tensors.update({uid: resolved_input(tensors[uid]) for uid in negated})
        _as_bytes(tensors)
        kernel_device = _kernel_device(device)
        built = self._launches_for(kernel_device)
        workspace = torch.empty(built.workspace_bytes, dtype=torch.uint8, device=device)
        tensors.update(built.views(workspace))
        self.views.materialize(tensors)
        return [(launch, time_launches([launch], tensors, kernel_device, built.dtypes)) for launch in built.launches]

    # --- explain ---------------------------------------------------------------------------------
    def _describe(self, tensor) -> str:
        alias = self.views.aliases.get(tensor.uid)
        if alias is not None:
            where = f"view of {self.views.tensors[alias.root].name} at element {alias.offset}"
        else:
            where = "workspace" if tensor.is_virtual else ("output" if tensor.is_output else "input")
            blend = getattr(tensor, "blend", None)
            if blend is not None:
                alpha, beta = (repr(f) if isinstance(f, (int, float)) else f"tensor {f.name!r}" for f in blend)
                where += f", stored as {alpha} * result + {beta} * prior"
        return f"{tensor.name} {list(tensor.dim)} {tensor.data_type.name} stride {list(tensor.stride)} ({where})"

    def explain(self) -> str:
        """Human-readable plan: groups, configs and why, source paths."""
        lines = [f"graph {self.graph_name!r}: {sum(len(g.nodes) for g in self.groups)} ops in "
                 f"{len(self.launches)} kernel(s), workspace {self.workspace_bytes} bytes"]
        chosen = ", ".join(f"{name}={_option_text(value)}" for name, value in self.options.forced().items())
        lines.append(f"built for {self.target.name}; options: {chosen or 'the defaults'}")
        if self.origin:
            lines.append(self.origin)
        group_index = {id(group): position for position, group in enumerate(self.groups)}
        for index, launch in enumerate(self.launches):
            group = launch.group
            # kernels are named by content: the group (and its ops and tensors below) tell apart
            # launches of one kernel
            name = getattr(launch.kernel, "__name__", "")
            lines.append(f"kernel {index} [{group.kind}] {name} (group {group_index.get(id(group), '?')})")
            lines.append(f"  backend: {launch.backend or '?'}")
            if getattr(launch, "backend_reason", ""):
                lines.append(f"  ranked: {launch.backend_reason}")
            if getattr(launch, "backend_refusals", ""):
                lines.append(f"  refused: {launch.backend_refusals}")
            lines.append(f"  ops:    {', '.join(f'{n.op}({n.name})' for n in group.nodes)}")
            lines.append(f"  reads:  {', '.join(self._describe(t) for t in group.inputs)}")
            lines.append(f"  writes: {', '.join(self._describe(t) for t in group.outputs)}")
            lines.append(f"  config: {launch.config_text}")
            lines.append(f"  why:    {launch.reason}")
            lines.append(f"  source: {launch.source_path}")
        return "\n".join(lines)


def _option_text(value) -> str:
    """An option's value as explain() shows it: a config by its text, a target by its name."""
    if isinstance(value, Target):
        return value.name
    return getattr(value, "text", None) or repr(value)


def _address(value: torch.Tensor, what: str) -> int:
    """The address of `value`'s first element; a typed error for a tensor without one (a
    subclass wrapping no storage)."""
    try:
        return value.data_ptr()
    except RuntimeError as error:
        raise ExecutionError(f"{what} has no memory kernels can address: {error}") from error


def _kernel_device(device: torch.device) -> torch.device:
    """Where kernels for tensors on `device` run: that GPU, or the interpreter (CPU tensors; every
    tensor when this process interprets)."""
    if device.type not in ("cuda", "cpu"):
        raise ExecutionError(f"tensors are on {device}: kernels run on CUDA devices, and on CPU tensors "
                             f"through Triton's interpreter")
    if interpreting() or device.type == "cpu":
        return torch.device("cpu")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def launch_set_key(device: torch.device, options) -> tuple:
    """What a plan's launches built for `device` are kept under: the target they are planned
    for and whether they run in Triton's interpreter. A named target (BuildOptions.target) is
    the same for a GPU and for CPU tensors, but the launches are not: a GPU build may choose a
    backend whose kernels cannot be interpreted (gluon)."""
    return target_for(device, options), device.type == "cpu"


def launch_set_keys(device: torch.device, options) -> tuple:
    """The keys (launch_set_key) of the launches `device` may run, first preferred: CPU tensors
    only interpreted ones; a GPU its own, else interpreted ones of its target (a plan built
    where only the interpreter runs, for this GPU's model by name: Triton's, which compile)."""
    target = target_for(device, options)
    return ((target, True),) if device.type == "cpu" else ((target, False), (target, True))


def target_for(device: torch.device, options):
    """The target a plan's launches for `device` are built for: the options' where they name
    one, else the device's own."""
    return options.target if options.target is not None else target_of(device)
