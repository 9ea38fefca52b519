"""The plan: the build passes (partition, then one builder per kernel family) and execute().

Launches are bound at build (see launch.py); execute() checks bindings and runs them in order.
A plan may be executed from many threads and streams at once: each (device, stream) gets its own
workspace (or the caller passes one), and each device model its own launches.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from .codegen.cache import load_kernel
from .codegen.pointwise import render as render_pointwise
from .codegen.pooling import prologue_values_to_store, render as render_pooling
from .codegen.recipes import RECIPES, norm_parameter_grads
from .codegen.rows import RowKernelSpec, WELFORD_PARTS, render as render_rows
from .errors import ExecutionError, UnsupportedError, ValidationError
from .fusion import partition
from .heuristics import device_model
from .heuristics.autotune import Tuner, TuningRecord
from .heuristics.pointwise import schedule as schedule_pointwise
from .heuristics.pooling import schedule as schedule_pooling
from .heuristics.rows import (RowConfig, RowTraits, geometry as row_geometry, row_problem,
                              schedule as schedule_rows)
from .launch import (KernelLaunch, kernel_name, run_launches, sample_tensors, scratch, time_candidate,
                     tuning_device)
from .matmul_plan import build_matmul
from .runtime import interpreting

# The split combine kernel folds [SPLITS, BLOCK_K] partials: a few hundred values per program.
COMBINE_WARPS = 4
POINTER_ALIGNMENT = 16  # bytes; Triton specializes pointers on it (vectorized access)
WORKSPACE_ALIGNMENT = 256


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


def _extent_bytes(tensor) -> int:
    span = sum((size - 1) * stride for size, stride in zip(tensor.dim, tensor.stride)) + 1
    return span * tensor.data_type.itemsize


def _binding_spec(tensor) -> BindingSpec:
    axes = tuple(a for a, size in enumerate(tensor.dim) if size > 1)
    return BindingSpec(tensor.uid, tensor.name, tuple(tensor.dim), tuple(tensor.stride),
                       tensor.data_type.torch_dtype, axes, _extent_bytes(tensor), tensor.is_output)


def _build_pointwise(graph, group, index, tuner=None, device=None):
    sched = schedule_pointwise(group, device_model(device))
    description = group.describe()
    source, arguments = render_pointwise(kernel_name(group, index), sched, group.nodes,
                                         graph.compute_data_type, description)
    kernel, path = load_kernel(source, kernel_name(group, index))
    cfg = sched.config
    config_text = (f"BLOCK_R={cfg.block_rows} BLOCK_C={cfg.block_cols} num_warps={cfg.num_warps} "
                   f"grid={sched.programs} space={list(sched.space.sizes)}"
                   + (" int64-index" if sched.space.index_64 else ""))
    return KernelLaunch(group, kernel, path, arguments, sched.programs, cfg.num_warps, config_text,
                        sched.reason)


KIND_OF_SPAN = {(True, True): "tile", (True, False): "row", (False, True): "col", (False, False): "scalar"}


def _row_kinds(problem, group, tile_outputs=()) -> dict:
    """uid -> 'tile' | 'row' | 'col' | 'scalar' for every tensor a row group touches.

    A tensor spans a side (kept K, reduced R) when it walks an axis of size > 1 there; its size-1
    axes say nothing, so spans are also inherited: the anchor's element outputs (`tile_outputs`,
    from the recipe) span R, and a fused node's output spans what its operands span. Otherwise a
    softmax over an axis of size 1 would be taken for a row output and never stored.
    """
    spans = {}
    for tensor in group.inputs:
        spans[tensor.uid] = _strided_span(problem, tensor)
    for node in group.nodes:
        inherited = [spans.get(t.uid, (False, False)) for t in node.input_tensors()]
        for tensor in node.output_tensors():
            over_k, over_r = _strided_span(problem, tensor)
            if node is not group.anchor:
                over_k = over_k or any(k for k, _ in inherited)
                over_r = over_r or any(r for _, r in inherited)
            elif tensor.uid in tile_outputs:
                over_r = True
            spans[tensor.uid] = (over_k, over_r)
    return {uid: KIND_OF_SPAN[span] for uid, span in spans.items()}


def _strided_span(problem, tensor) -> tuple:
    """(walks a kept axis, walks a reduced axis) of size > 1."""
    strides = problem.strides(tensor)
    over_r = any(s for a, s in enumerate(strides) if a in problem.reduced_axes)
    over_k = any(s for a, s in enumerate(strides) if a not in problem.reduced_axes)
    return over_k, over_r


def _row_launch(spec, programs, num_warps, scratch_buffers=()):
    source, arguments = render_rows(spec)
    kernel, path = load_kernel(source, spec.name)
    cfg, geo = spec.schedule.config, spec.schedule.geometry
    config_text = (f"{spec.shape} ({cfg.mode}) BLOCK_K={cfg.block_k} BLOCK_R={cfg.block_r} "
                   f"SPLITS={cfg.splits} num_warps={num_warps} grid={programs} "
                   f"K={list(geo.k_sizes)} R={list(geo.r_sizes)}" + (" int64-index" if geo.index_64 else ""))
    return KernelLaunch(spec.group, kernel, path, arguments, programs, num_warps, config_text,
                        spec.schedule.reason, scratch_buffers, fp_fusion=spec.recipe.fp_fusion)


def _row_launches(graph, group, name, problem, recipe_of, stores, tuner=None, device=None, epilogue=None):
    """The launches of one row problem: one kernel, or partial + combine (+ apply) when split;
    the model's config, or with `tuner` the fastest of its top candidates. `epilogue`: the group's
    epilogue nodes these kernels run (None: all)."""
    recipe = recipe_of(group.anchor, _row_kinds(problem, group))
    kinds = _row_kinds(problem, group, tuple(recipe.tile_outputs))
    tensors = list(group.inputs) + [t for t in group.outputs if t.uid in stores]
    operands = [(t.uid, t.data_type, problem.strides(t), t.uid in stores) for t in tensors]
    main = next((i for i, t in enumerate(group.inputs) if kinds[t.uid] == "tile"), 0)
    geo = row_geometry(problem.domain, problem.reduced_axes, operands, main)
    tile_stores = tuple(u for u in stores if kinds[u] in ("tile", "col"))
    row_stores = tuple(u for u in stores if u not in tile_stores)
    traits = RowTraits(len(recipe.stages_for("looped")), bool(tile_stores), recipe.splittable,
                       recipe.live_tiles)
    bytes_of = lambda wanted: sum(t.data_type.itemsize for t in tensors if kinds[t.uid] in wanted)
    sched = schedule_rows(geo, traits, bytes_of(("tile", "col")) or 4, bytes_of(("row", "scalar")),
                          device_model(device))
    record = TuningRecord("model", sched.config.text)
    build = lambda chosen: _row_schedule_launches(graph, group, name, chosen, recipe, stores, kinds,
                                                  tile_stores, row_stores, epilogue)
    if tuner is not None:
        device = tuning_device(device)
        tensors = sample_tensors(group, device)
        config, record = tuner.choose(
            "rows", f"{group.anchor.op} {sched.signature(traits)}", list(sched.ranked), RowConfig.to_record,
            RowConfig.from_record, lambda c: c.text,
            lambda c: time_candidate(build(replace(sched, config=c)), tensors, device))
        sched = replace(sched, config=config, reason=record.describe() or sched.reason)
    launches = build(sched)
    for launch in launches:
        launch.tuning = record
    return launches


def _row_schedule_launches(graph, group, name, sched, recipe, stores, kinds, tile_stores, row_stores,
                           epilogue=None):
    cfg, geo = sched.config, sched.geometry
    common = dict(schedule=sched, recipe=recipe, group=group, kinds=kinds,
                  loads=_row_loads(group, epilogue), compute=graph.compute_data_type.triton_type,
                  description=group.describe(), epilogue=epilogue)
    if cfg.mode != "split":
        spec = RowKernelSpec(name, "main", stores=tuple(stores), **common)
        return [_row_launch(spec, sched.programs, cfg.num_warps)]
    (accumulators, _), = recipe.stages_for("split")
    names = [f"{a.name}_{p}" if a.combine == "welford" else a.name
             for a in accumulators for p in (WELFORD_PARTS if a.combine == "welford" else ("",))]
    partials = {n: scratch((cfg.splits, geo.rows), PARTIAL_TYPES[recipe.kind]) for n in names}
    stash = {n: scratch((geo.rows,)) for n in recipe.stash} if tile_stores else {}
    row_blocks = sched.programs // cfg.splits
    launches = [
        _row_launch(RowKernelSpec(name + "_partial", "partial", stores=(),
                                  partials={n: s.uid for n, s in partials.items()}, **common),
                    sched.programs, cfg.num_warps, partials.values()),
        _row_launch(RowKernelSpec(name + "_combine", "combine", stores=row_stores,
                                  partials={n: s.uid for n, s in partials.items()},
                                  stash={n: s.uid for n, s in stash.items()}, **common),
                    row_blocks, COMBINE_WARPS, stash.values())]
    if tile_stores:
        launches.append(_row_launch(RowKernelSpec(name + "_apply", "apply", stores=tile_stores,
                                                  stash={n: s.uid for n, s in stash.items()}, **common),
                                    sched.programs, cfg.num_warps))
    return launches


def _row_loads(group, epilogue) -> tuple:
    """uids of the group inputs a row kernel reads: all, but those only skipped epilogue nodes read."""
    if epilogue is None:
        return tuple(t.uid for t in group.inputs)
    running = [n for n in group.nodes if n not in group.epilogue or n in epilogue]
    read = {t.uid for n in running for t in n.input_tensors()}
    return tuple(t.uid for t in group.inputs if t.uid in read)


# split partials hold the accumulator's type: integer sums and products stay exact in int64
PARTIAL_TYPES = {"f": torch.float32, "l": torch.int64}


def _require_floating_inputs(anchor):
    """Row and pooling kernels accumulate in floating point: integer inputs would be rounded."""
    for tensor in anchor.input_tensors():
        if not tensor.data_type.is_floating:
            raise UnsupportedError(
                f"node {anchor.name!r} ({anchor.op}) reads {tensor.name!r} of type {tensor.data_type.name}: "
                f"its kernel computes in floating point and would round integers; cast the input to a "
                f"floating type first")


def _build_rows(graph, group, index, tuner=None, device=None):
    """Reductions, softmax and norms; norm backward adds a kernel for dscale/dbias unless they
    are per-row sums of the dx kernel (batchnorm)."""
    anchor, name = group.anchor, kernel_name(group, index)
    if anchor.op != "reduction":  # the reduction recipe accumulates integers in int64
        _require_floating_inputs(anchor)
    problem = row_problem(anchor)
    stores = [t.uid for t in group.outputs]
    if anchor.opdef.family == "norm" and anchor.op.endswith("_backward"):
        params = {t.uid for t in anchor.outputs[1:] if t is not None}
        # by the scale's dims, not its strides: an expanded scale is still one parameter per index
        scale_extent = problem.extent(anchor.inputs[2])
        kept = [a for a, size in enumerate(problem.domain) if a not in problem.reduced_axes and size > 1]
        per_row = all(scale_extent[a] for a in kept) and not any(scale_extent[a] for a in problem.reduced_axes)
        if not per_row:  # dscale is not one value per dx row
            param_problem = problem.with_reduced(a for a, spans in enumerate(scale_extent) if not spans)
            # the epilogue consumes dx, which only the first kernel computes
            return (_row_launches(graph, group, name, problem, RECIPES[anchor.op],
                                  [u for u in stores if u not in params], tuner, device)
                    + _row_launches(graph, group, name + "_params", param_problem, norm_parameter_grads,
                                    [u for u in stores if u in params], tuner, device, epilogue=()))
    return _row_launches(graph, group, name, problem, RECIPES[anchor.op], stores, tuner, device)


def _build_pooling(graph, group, index, tuner=None, device=None):
    """The pooling kernel of a group."""
    _require_floating_inputs(group.anchor)
    sched = schedule_pooling(group, device_model(device))
    name = kernel_name(group, index)
    source, arguments = render_pooling(name, sched, group, graph.compute_data_type, group.describe())
    kernel, path = load_kernel(source, name)
    return KernelLaunch(group, kernel, path, arguments, sched.programs, sched.config.num_warps,
                        sched.config_text, sched.reason)


# Families whose loads may visit an input element several times (or never): prologue values that
# are outputs are written first by a pointwise kernel of the prologue.
PROLOGUE_STORED_APART = frozenset({"pooling", "matmul"})

KERNEL_BUILDERS = {"pointwise": _build_pointwise, "reduction": _build_rows, "softmax": _build_rows,
                   "norm": _build_rows, "pooling": _build_pooling, "matmul": build_matmul}


def _check_outputs_dense(graph):
    for tensor in graph.outputs():
        for size, stride in zip(tensor.dim, tensor.stride):
            if size > 1 and stride == 0:
                raise ValidationError(f"output {tensor.name!r} has stride 0 on an axis of size {size}: "
                                      f"its elements would overlap")


def build_plan(graph, autotune: bool = False) -> "Plan":
    """Partition, schedule (or autotune) and generate every kernel of a validated graph."""
    _check_outputs_dense(graph)
    groups = partition(graph, frozenset(KERNEL_BUILDERS))
    device = _build_device()
    return Plan(graph, groups, build_launches(graph, groups, device, autotune), device, autotune)


def _build_device() -> torch.device:
    """The device a plan is first built for: the current GPU, else the interpreter (CPU). Only a
    first guess: a plan executed on a device of another model builds launches for that one."""
    if torch.cuda.is_available() and not interpreting():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_launches(graph, groups, device: torch.device, autotune: bool = False) -> list:
    """The launches of every group, scheduled for `device`'s model (autotuned on `device`)."""
    tuner = Tuner(device_model(device)) if autotune else None
    launches = []
    for index, group in enumerate(groups):
        builder = KERNEL_BUILDERS.get(group.kind)
        if builder is None:
            anchor = group.anchor or group.nodes[0]
            raise UnsupportedError(
                f"node {anchor.name!r} ({anchor.op}): no {group.kind} kernel exists yet, so the group "
                f"[{', '.join(n.name for n in group.nodes)}] cannot run; graph.reference() computes it")
        stored = prologue_values_to_store(group) if group.kind in PROLOGUE_STORED_APART else None
        if stored is not None:
            launches.append(_build_pointwise(graph, stored, index, device=device))
        built = builder(graph, group, index, tuner, device)
        launches.extend(built if isinstance(built, list) else [built])
    return launches


class DeviceLaunches:
    """A plan's launches for one device model (SM count, compute capability) and the workspace
    layout they need: (uid, dim, stride, torch dtype, bytes, byte offset) of every tensor in it."""

    def __init__(self, model, launches, groups, graph_dtypes):
        self.model, self.launches = model, launches
        self.dtypes = dict(graph_dtypes)
        self.dtypes.update({s.uid: s.torch_dtype for launch in launches for s in launch.scratch})
        self.layout(groups)

    def bind(self, device_index: int):
        """Compile every launch for a CUDA device (one of this model), then lay the workspace out:
        compiling tells which kernels need global scratch in it."""
        for launch in self.launches:
            launch.bind(device_index, self.dtypes)

    def layout(self, groups):
        """Place virtual tensors, split partials and kernels' global scratch in one buffer."""
        buffers = [(t.uid, tuple(t.dim), tuple(t.stride), t.data_type.torch_dtype, _extent_bytes(t))
                   for g in groups for t in g.outputs if t.is_virtual]
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
    the caller's, launches are per device model and built or bound once under a lock."""

    def __init__(self, graph, groups, launches, device=None, autotune: bool = False):
        self.graph_name = graph.name
        self.groups, self.launches = groups, launches
        used = {t.uid for g in groups for t in g.inputs}
        self.specs = [_binding_spec(t) for t in graph.inputs() if t.uid in used]
        self.specs += [_binding_spec(t) for t in graph.outputs()]
        self.key_to_uid = {}
        for tensor in graph.tensors:
            self.key_to_uid[tensor] = tensor.uid
            self.key_to_uid[tensor.name] = tensor.uid
        # unused inputs may be bound (and are ignored); virtual tensors may not
        self.bindable = {s.uid for s in self.specs} | {t.uid for t in graph.inputs()}
        self.names = {t.uid: t.name for t in graph.tensors}
        self._graph, self._autotune = graph, autotune
        self._graph_dtypes = {t.uid: t.data_type.torch_dtype for t in graph.tensors}
        self._lock = threading.Lock()  # guards the three dicts below when they grow
        self._by_model: dict = {}  # DeviceModel -> DeviceLaunches
        self._by_device: dict = {}  # (device type, index) -> DeviceLaunches
        self._streams: dict = {}  # (device type, index, raw stream) -> StreamWorkspace
        device = torch.device("cpu") if device is None else device
        built = self._derive(device, launches)
        self.dtypes = built.dtypes
        self.workspace_tensors, self.workspace_bytes = built.workspace_tensors, built.workspace_bytes

    # --- one set of launches per device model ----------------------------------------------------
    def _derive(self, device, launches=None) -> DeviceLaunches:
        """Build (unless given) and bind the launches for `device`'s model; caller holds the lock
        or is the constructor."""
        model = device_model(device)
        if launches is None:
            if self._graph.plan is not self:
                raise ExecutionError(f"graph {self.graph_name!r} changed since this plan was built, and "
                                     f"{device} needs launches of its own: build the graph again")
            launches = build_launches(self._graph, self.groups, device, self._autotune)
        built = DeviceLaunches(model, launches, self.groups, self._graph_dtypes)
        if device.type == "cuda":
            built.bind(device.index)
            built.layout(self.groups)
        self._by_model[model] = built
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
            found = self._by_model.get(device_model(device))
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

    def _check(self, resolved: dict):
        device, ranges = None, []
        for spec in self.specs:
            value = resolved.get(spec.uid)
            if value is None:
                kind = "output" if spec.is_output else "input"
                raise ExecutionError(f"missing binding for {kind} {spec.name!r}")
            if not isinstance(value, torch.Tensor):
                raise ExecutionError(f"{spec.name!r} is bound to {type(value).__name__}, not a torch.Tensor")
            if value.dtype != spec.torch_dtype:
                raise ExecutionError(f"{spec.name!r} expects {spec.torch_dtype}, got {value.dtype}")
            if value.shape != spec.shape:
                raise ExecutionError(f"{spec.name!r} expects shape {list(spec.shape)}, got {list(value.shape)}")
            stride = value.stride()
            if stride != spec.stride and any(stride[a] != spec.stride[a] for a in spec.checked_axes):
                raise ExecutionError(f"{spec.name!r} expects strides {list(spec.stride)}, got {list(stride)} "
                                     f"(declare the layout with tensor_like or set_stride)")
            if device is None:
                device = value.device
            elif value.device != device:
                raise ExecutionError(f"{spec.name!r} is on {value.device}, other tensors on {device}")
            start = value.data_ptr()
            ranges.append((start, start + spec.extent_bytes, spec))
        for start, end, spec in ranges:
            if not spec.is_output:
                continue
            for other_start, other_end, other in ranges:
                if other is not spec and start < other_end and other_start < end:
                    raise ExecutionError(f"output {spec.name!r} overlaps {other.name!r} in memory")
        return device

    def _stream_workspace(self, built: DeviceLaunches, device, stream) -> StreamWorkspace:
        """The workspace of (device, stream), created once; allocated on that stream, so torch's
        caching allocator never hands its memory to another stream while kernels use it."""
        key = (device.type, device.index, stream)
        found = self._streams.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._streams.get(key)
            if found is None:
                buffer = torch.empty(built.workspace_bytes, dtype=torch.uint8, device=device)
                found = StreamWorkspace(buffer, built.views(buffer), threading.Lock())
                self._streams[key] = found
        return found

    def _caller_workspace(self, workspace, built: DeviceLaunches, device, tensors) -> dict:
        """Views into a workspace the caller passed, after checking it can hold them."""
        where = "the workspace"
        if not isinstance(workspace, torch.Tensor):
            raise ExecutionError(f"{where} must be a torch.Tensor of uint8, got {type(workspace).__name__}")
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
        Without it each (device, stream) uses a workspace of its own, made on first use."""
        tensors = self._resolve(bindings)
        device = self._check(tensors)
        kernel_device = _kernel_device(device)
        built = self._launches_for(kernel_device)
        aligned = all(tensors[s.uid].data_ptr() % POINTER_ALIGNMENT == 0 for s in self.specs)
        stream = torch._C._cuda_getCurrentRawStream(device.index) if kernel_device.type == "cuda" else None
        if workspace is not None:
            tensors.update(self._caller_workspace(workspace, built, device, tensors))
        elif built.workspace_tensors:
            shared = self._stream_workspace(built, device, stream)
            with shared.lock:
                tensors.update(shared.views)
                run_launches(built.launches, tensors, kernel_device, built.dtypes, aligned, stream)
            return
        run_launches(built.launches, tensors, kernel_device, built.dtypes, aligned, stream)

    # --- explain ---------------------------------------------------------------------------------
    def explain(self) -> str:
        """Human-readable plan: groups, configs and why, source paths."""
        lines = [f"graph {self.graph_name!r}: {sum(len(g.nodes) for g in self.groups)} ops in "
                 f"{len(self.launches)} kernel(s), workspace {self.workspace_bytes} bytes"]
        for index, launch in enumerate(self.launches):
            group = launch.group
            lines.append(f"kernel {index} [{group.kind}] {launch.kernel.__name__ if hasattr(launch.kernel, '__name__') else ''}")
            lines.append(f"  ops:    {', '.join(f'{n.op}({n.name})' for n in group.nodes)}")
            lines.append(f"  reads:  {', '.join(_describe(t) for t in group.inputs)}")
            lines.append(f"  writes: {', '.join(_describe(t) for t in group.outputs)}")
            lines.append(f"  config: {launch.config_text}")
            lines.append(f"  why:    {launch.reason}")
            lines.append(f"  source: {launch.source_path}")
        return "\n".join(lines)


def _describe(tensor) -> str:
    where = "workspace" if tensor.is_virtual else ("output" if tensor.is_output else "input")
    return f"{tensor.name} {list(tensor.dim)} {tensor.data_type.name} stride {list(tensor.stride)} ({where})"


def _kernel_device(device: torch.device) -> torch.device:
    """Where kernels for tensors on `device` run: that GPU, or the interpreter (on CPU)."""
    if interpreting():
        return torch.device("cpu")
    if device.type != "cuda":
        raise ExecutionError(f"tensors are on {device}, but kernels compile for CUDA here; "
                             f"set TRITON_INTERPRET=1 before importing dnngraph to run on CPU")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
