"""The plan: the build passes (partition, then one builder per kernel family) and execute().

Launches are bound at build (see launch.py); execute() checks bindings and runs them in order.
"""
from __future__ import annotations

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


def _build_pointwise(graph, group, index, tuner=None):
    sched = schedule_pointwise(group, device_model())
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


def _row_kinds(problem, group) -> dict:
    """uid -> 'tile' | 'row' | 'col' | 'scalar' for every tensor a row group touches."""
    kinds = {}
    tensors = list(group.inputs) + [t for n in group.nodes for t in n.output_tensors()]
    for tensor in tensors:
        strides = problem.strides(tensor)
        over_r = any(s for a, s in enumerate(strides) if a in problem.reduced_axes)
        over_k = any(s for a, s in enumerate(strides) if a not in problem.reduced_axes)
        kinds[tensor.uid] = {(True, True): "tile", (True, False): "row", (False, True): "col",
                             (False, False): "scalar"}[(over_k, over_r)]
    return kinds


def _row_launch(spec, programs, num_warps, scratch_buffers=()):
    source, arguments = render_rows(spec)
    kernel, path = load_kernel(source, spec.name)
    cfg, geo = spec.schedule.config, spec.schedule.geometry
    config_text = (f"{spec.shape} ({cfg.mode}) BLOCK_K={cfg.block_k} BLOCK_R={cfg.block_r} "
                   f"SPLITS={cfg.splits} num_warps={num_warps} grid={programs} "
                   f"K={list(geo.k_sizes)} R={list(geo.r_sizes)}" + (" int64-index" if geo.index_64 else ""))
    return KernelLaunch(spec.group, kernel, path, arguments, programs, num_warps, config_text,
                        spec.schedule.reason, scratch_buffers)


def _row_launches(graph, group, name, problem, recipe_of, stores, tuner=None):
    """The launches of one row problem: one kernel, or partial + combine (+ apply) when split;
    the model's config, or with `tuner` the fastest of its top candidates."""
    kinds = _row_kinds(problem, group)
    tensors = list(group.inputs) + [t for t in group.outputs if t.uid in stores]
    operands = [(t.uid, t.data_type, problem.strides(t), t.uid in stores) for t in tensors]
    main = next((i for i, t in enumerate(group.inputs) if kinds[t.uid] == "tile"), 0)
    geo = row_geometry(problem.domain, problem.reduced_axes, operands, main)
    recipe = recipe_of(group.anchor, kinds)
    tile_stores = tuple(u for u in stores if kinds[u] in ("tile", "col"))
    row_stores = tuple(u for u in stores if u not in tile_stores)
    traits = RowTraits(len(recipe.stages_for("looped")), bool(tile_stores), recipe.splittable,
                       recipe.live_tiles)
    bytes_of = lambda wanted: sum(t.data_type.itemsize for t in tensors if kinds[t.uid] in wanted)
    sched = schedule_rows(geo, traits, bytes_of(("tile", "col")) or 4, bytes_of(("row", "scalar")),
                          device_model())
    record = TuningRecord("model", sched.config.text)
    build = lambda chosen: _row_schedule_launches(graph, group, name, chosen, recipe, stores, kinds,
                                                  tile_stores, row_stores)
    if tuner is not None:
        device = tuning_device()
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


def _row_schedule_launches(graph, group, name, sched, recipe, stores, kinds, tile_stores, row_stores):
    cfg, geo = sched.config, sched.geometry
    common = dict(schedule=sched, recipe=recipe, group=group, kinds=kinds,
                  loads=tuple(t.uid for t in group.inputs), compute=graph.compute_data_type.triton_type,
                  description=group.describe())
    if cfg.mode != "split":
        spec = RowKernelSpec(name, "main", stores=tuple(stores), **common)
        return [_row_launch(spec, sched.programs, cfg.num_warps)]
    (accumulators, _), = recipe.stages_for("split")
    names = [f"{a.name}_{p}" if a.combine == "welford" else a.name
             for a in accumulators for p in (WELFORD_PARTS if a.combine == "welford" else ("",))]
    partials = {n: scratch((cfg.splits, geo.rows)) for n in names}
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


def _build_rows(graph, group, index, tuner=None):
    """Reductions, softmax and norms; norm backward adds a kernel for dscale/dbias unless they
    are per-row sums of the dx kernel (batchnorm)."""
    anchor, name = group.anchor, kernel_name(group, index)
    problem = row_problem(anchor)
    stores = [t.uid for t in group.outputs]
    if anchor.opdef.family == "norm" and anchor.op.endswith("_backward"):
        params = {t.uid for t in anchor.outputs[1:] if t is not None}
        scale_strides = problem.strides(anchor.inputs[2])
        kept = [a for a, size in enumerate(problem.domain) if a not in problem.reduced_axes and size > 1]
        if not all(scale_strides[a] for a in kept):  # dscale is not one value per dx row
            param_problem = problem.with_reduced(a for a, s in enumerate(scale_strides) if s == 0)
            return (_row_launches(graph, group, name, problem, RECIPES[anchor.op],
                                  [u for u in stores if u not in params], tuner)
                    + _row_launches(graph, group, name + "_params", param_problem, norm_parameter_grads,
                                    [u for u in stores if u in params], tuner))
    return _row_launches(graph, group, name, problem, RECIPES[anchor.op], stores, tuner)


def _build_pooling(graph, group, index, tuner=None):
    """The pooling kernel of a group."""
    sched = schedule_pooling(group, device_model())
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
    groups = partition(graph)
    tuner = Tuner(device_model()) if autotune else None
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
            launches.append(_build_pointwise(graph, stored, index))
        built = builder(graph, group, index, tuner)
        launches.extend(built if isinstance(built, list) else [built])
    return Plan(graph, groups, launches)


class Plan:
    """Launches in order over bound tensors and one workspace for values between kernels."""

    def __init__(self, graph, groups, launches):
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
        self.dtypes = {t.uid: t.data_type.torch_dtype for t in graph.tensors}
        self.dtypes.update({s.uid: s.torch_dtype for launch in launches for s in launch.scratch})
        self.workspace_tensors, self.workspace_bytes = self._layout_workspace(groups, launches)
        self._workspaces: dict = {}
        if torch.cuda.is_available() and not interpreting():
            for launch in launches:
                launch.bind(torch.cuda.current_device(), self.dtypes)

    @staticmethod
    def _layout_workspace(groups, launches):
        """(uid, dim, stride, torch dtype, byte offset) of every workspace tensor, total bytes."""
        buffers = [(t.uid, tuple(t.dim), tuple(t.stride), t.data_type.torch_dtype, _extent_bytes(t))
                   for g in groups for t in g.outputs if t.is_virtual]
        buffers += [(s.uid, s.dim, None, s.torch_dtype, s.nbytes) for launch in launches for s in launch.scratch]
        placed, offset = [], 0
        for uid, dim, stride, torch_dtype, nbytes in buffers:
            placed.append((uid, dim, stride, torch_dtype, nbytes, offset))
            offset += -(-max(nbytes, 1) // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
        return placed, offset

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

    def _workspace_views(self, device, tensors):
        views = self._workspaces.get(device)
        if views is None:
            buffer = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
            views = {}
            for uid, dim, stride, torch_dtype, nbytes, offset in self.workspace_tensors:
                typed = buffer[offset:offset + nbytes].view(torch_dtype)
                views[uid] = typed.view(dim) if stride is None else typed.as_strided(dim, stride)
            self._workspaces[device] = views
        tensors.update(views)

    def execute(self, bindings):
        """Check every binding, then launch every kernel; nothing is written on error."""
        tensors = self._resolve(bindings)
        device = self._check(tensors)
        if self.workspace_tensors:
            self._workspace_views(device, tensors)
        aligned = all(tensors[s.uid].data_ptr() % POINTER_ALIGNMENT == 0 for s in self.specs)
        if device.type == "cuda" and not interpreting():
            run_launches(self.launches, tensors, device, self.dtypes, aligned)
        elif interpreting():
            run_launches(self.launches, tensors, torch.device("cpu"), self.dtypes, aligned)
        else:
            raise ExecutionError(f"tensors are on {device}, but kernels compile for CUDA here; "
                                 f"set TRITON_INTERPRET=1 before importing dnngraph to run on CPU")

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
