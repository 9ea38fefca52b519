"""Build the launches of a convolution group: pose the implicit GEMMs, choose configs, render.

A group is a conv node with a pointwise prologue on its gathered operand (a previous
batchnorm's scale-bias-relu on x, applied at load) and a pointwise epilogue chain (bias,
activations, residual, scale, cast; values inside the chain stored as extra outputs).

  fprop  one GEMM per group of the convolution: rows (n, output pixel), columns (filters),
         k (tap, channel) over x gathered and the filter; with few channels per group the taps
         fold into k (heuristics/conv.py fold_taps): K = taps x channels walked whole, each k
         its own (tap, channel), the filter read as [taps x channels, filters];
  dgrad  one stride-1 GEMM per stride phase (heuristics/conv.py dgrad_phases): rows (n, phase
         pixel), columns (channels), k (tap reaching the phase, filter) over dy gathered and the
         filter read transposed; each phase writes dx at stride * t + phase, so no zero is
         inserted and no multiply is wasted. Few filters per group fold as fprop's channels do.
  wgrad  k over N x output pixels (split-K), rows (filters): one GEMM per group and filter tap
         with columns (channels), or, with few channels per group, one per group with columns
         (channel, taps...), x gathered at each column's tap (WgradBuild).

The group index is the GEMM's batch axis: every operand carries its group offset as a batch
stride. A 1x1 stride-1 unpadded pose whose gathered pixels merge into one row axis is a matmul
and takes the matmul loaders and schedule (TMA included).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..codegen.conv import (ActivationGather, ConvGeometry, FilterLoader, FoldedTapGather, FoldedTapWalk,
                           GradientLoader, PixelGather, PixelWalk, TapWalk, padded_pixels, render_pixel_major,
                           render_reduction_major, staged_filter_strides)
from ..codegen.gemm import ExitPlan, GemmKernelSpec, GemmOperand, LinearK
from ..codegen.matmul import DescriptorLoader, StridedLoader
from .... import dtypes
from ....errors import UnsupportedError
from ..heuristics import conv as conv_heuristics
from ..heuristics import matmul as matmul_heuristics
from ..heuristics.layout import INT32_LIMIT, operand_strides
from ..heuristics.matmul import K_MAJOR_DOTS, MatmulConfig, MatmulProblem, choose_dot
from .depthwise import build_depthwise, sums_exactly, takes_depthwise
from .gemm import GemmLaunches, build_gemm, chain, epilogue_inputs, leaves
from ....runtime.launch import KernelLaunch, element_span, kernel_name, launch_of, scratch
from .matmul import layout_of, tma_ok
from ....symbolic import top_dims, top_span, varies


def _product(values) -> int:
    total = 1
    for value in values:
        total *= value
    return total


def _merged_rows(sizes: tuple, strides: tuple):
    """The one stride walking rows of `sizes` (outer first) as a flat index, or None."""
    live = [(n, s) for n, s in zip(sizes, strides) if n > 1]
    for (_, outer), (inner_size, inner) in zip(live, live[1:]):
        if outer != inner * inner_size:
            return None
    return live[-1][1] if live else 0


@dataclass(frozen=True)
class ConvPose:
    """One implicit GEMM of a conv node (plain data)."""

    source: object  # the gathered tensor [N, channels * groups, *in]: x (fprop) or dy (dgrad)
    filter_reduce_axis: int  # the filter axis k walks at a tap: 1 (channels, fprop), 0 (filters, dgrad)
    geometry: ConvGeometry
    channels: int  # reduction per tap per group
    filters: int  # GEMM columns per group
    rows: tuple  # output rows per spatial axis
    out_step: tuple  # the output index of row t is out_step * t + out_phase per spatial axis
    out_phase: tuple
    suffix: str = ""
    k_axes: tuple = ()  # taps folded into k: its axes, outer first (-1 the channel); () per tap


def _folded(pose: ConvPose, fold_below: int) -> ConvPose:
    """`pose` with its taps folded into k where heuristics/conv.py fold_taps says so (below
    `fold_below` channels per group)."""
    g = pose.geometry
    if not conv_heuristics.fold_taps(pose.channels, g.taps, fold_below):
        return pose
    axes = conv_heuristics.folded_axes(g.rank, tuple(pose.source.stride))
    return replace(pose, k_axes=axes, suffix=pose.suffix + "_folded")


def _fprop_pose(node, fold_below: int) -> ConvPose:
    x, w = node.inputs
    attrs = node.attrs
    flip = attrs.mode == "convolution"
    filters = tuple(w.dim[2:])
    geometry = ConvGeometry(filters, attrs.stride, attrs.padding, attrs.dilation,
                            tuple(r - 1 if flip else 0 for r in filters), tuple(-1 if flip else 1 for _ in filters))
    out = tuple(node.outputs[0].dim[2:])
    return _folded(ConvPose(x, 1, geometry, x.dim[1] // attrs.groups, w.dim[0] // attrs.groups, out,
                            (1,) * len(out), (0,) * len(out)), fold_below)


def _dgrad_poses(node, fold_below: int) -> list:
    dy, w = node.inputs
    attrs = node.attrs
    filters = tuple(w.dim[2:])
    poses = []
    phases = conv_heuristics.dgrad_phases(tuple(attrs.shape[2:]), filters, attrs.stride, attrs.padding,
                                          attrs.dilation, attrs.mode == "convolution")
    for index, phase in enumerate(phases):
        geometry = ConvGeometry(phase.taps, (1,) * len(filters), phase.padding, phase.dilation, phase.filter_base,
                                phase.filter_step)
        suffix = f"_phase{index}" if len(phases) > 1 else ""
        poses.append(_folded(ConvPose(dy, 0, geometry, w.dim[0] // attrs.groups, w.dim[1], phase.rows,
                                      attrs.stride, phase.phase, suffix), fold_below))
    return poses


POSES = {"conv_fprop": lambda node, fold_below: [_fprop_pose(node, fold_below)], "conv_dgrad": _dgrad_poses}


class ConvBuild(GemmLaunches):
    """Everything about one pose of a conv group that does not depend on the config."""

    def __init__(self, graph, group, pose: ConvPose, target, staged=None):
        self.graph, self.group, self.pose = graph, group, pose
        node = self.node = group.anchor
        # the filter as the kernels read it: the graph's, or its reduction-major copy (StagedFilter)
        self.w, self.out = staged.view if staged is not None else node.inputs[1], node.outputs[0]
        self.read_scratch = (staged.buffer,) if staged is not None else ()
        self.groups = node.attrs.groups
        self.batch_sizes = (self.groups,) if self.groups > 1 else ()
        prologue = set(group.prologue)
        self.prologue = tuple(n for n in group.prologue if n in chain(pose.source, prologue))
        self.source_leaves = leaves(pose.source, set(group.nodes))
        self.epilogue_reads = epilogue_inputs(group)
        exit_outputs = {t.uid for node in group.exits for t in node.outputs}
        self.stored = [t for t in group.outputs if t.producer not in prologue and t.uid not in exit_outputs]
        self.row_sizes = (self.out.dim[0],) + pose.rows
        self.dot_a, self.dot_b, dot, self.precision = self._dot(pose.source, self.w, graph.allow_tf32)
        self.target = target
        self.matmul_path = self._is_matmul()
        self.operands = tuple(self._source_operands() + self._filter_operands() + self._output_operands())
        self.problem = self._problem(dot)
        # configs chosen at the bucket's top (a dynamic batch scales the output rows)
        self.top_problem = replace(self.problem, m=self.problem.m // self.out.dim[0] * top_dims(graph, self.out)[0])
        self.index_64 = any(max(element_span(t), top_span(graph, t)) > INT32_LIMIT
                            for t in list(group.inputs) + list(group.outputs))
        self.name = kernel_name(group) + pose.suffix

    @staticmethod
    def _dot(source, w, allow_tf32: bool):
        for t in (source.data_type, w.data_type):
            if not t.is_floating and t is not dtypes.int8:
                raise UnsupportedError(f"conv of {source.data_type.name} x {w.data_type.name}: no kernel takes "
                                       f"{t.name} operands")
        choice = choose_dot(source.data_type.name, w.data_type.name, source.data_type.triton_type,
                            w.data_type.triton_type, allow_tf32)
        return choice.a_type, choice.b_type, choice.dot, choice.precision

    # --- operands ---------------------------------------------------------------------------------
    def _group_stride(self, per_group: int, stride: int) -> tuple:
        return (per_group * stride,) if self.batch_sizes else ()

    def _source_strides(self, leaf) -> tuple:
        return operand_strides(tuple(self.pose.source.dim), tuple(leaf.dim), tuple(leaf.stride))

    def _is_matmul(self) -> bool:
        """1x1, stride 1, no padding, and every gathered operand walks its pixels as one axis."""
        g = self.pose.geometry
        if any(r != 1 for r in g.filter_sizes) or any(s != 1 for s in g.stride) or any(g.padding):
            return False
        if tuple(self.pose.source.dim[2:]) != self.pose.rows:
            return False
        for leaf in self.source_leaves:
            s = self._source_strides(leaf)
            if _merged_rows(self.row_sizes, (s[0],) + s[2:]) is None:
                return False
        return True

    def _source_operands(self) -> list:
        operands = []
        for leaf in self.source_leaves:
            s = self._source_strides(leaf)
            rows = (s[0],) + s[2:]
            if self.matmul_path:
                rows = (_merged_rows(self.row_sizes, rows),)
            operands.append(GemmOperand(leaf.uid, leaf.data_type, "a", self._group_stride(self.pose.channels, s[1]),
                                        rows, (s[1],)))
        return operands

    def _filter_operands(self) -> list:
        s = operand_strides(tuple(self.w.dim), tuple(self.w.dim), tuple(self.w.stride))
        reduce_axis = self.pose.filter_reduce_axis
        rows = (s[reduce_axis],) if self.matmul_path else (s[reduce_axis],) + s[2:]
        per_group = self.w.dim[0] // self.groups  # the group's filters, whichever axis k walks
        # on the matmul path the one tap walked may sit anywhere in the filter (a dgrad phase)
        tap = sum(b * t for b, t in zip(self.pose.geometry.filter_base, s[2:])) if self.matmul_path else 0
        return [GemmOperand(self.w.uid, self.w.data_type, "b", self._group_stride(per_group, s[0]), rows,
                            (s[1 - reduce_axis],), offset=tap)]

    def _output_operands(self) -> list:
        pose, operands = self.pose, []
        for tensor, is_output in [(t, False) for t in self.epilogue_reads] + [(t, True) for t in self.stored]:
            s = operand_strides(tuple(self.out.dim), tuple(tensor.dim), tuple(tensor.stride))
            spatial = tuple(step * stride for step, stride in zip(pose.out_step, s[2:]))
            offset = sum(phase * stride for phase, stride in zip(pose.out_phase, s[2:]))
            operands.append(GemmOperand(tensor.uid, tensor.data_type, "c", self._group_stride(pose.filters, s[1]),
                                        (s[0],) + spatial, (s[1],), is_output, offset=offset))
        return operands

    def _problem(self, dot: str):
        m = _product(self.row_sizes)
        store_bytes = sum(t.data_type.itemsize for t in self.stored)
        out_bytes = max(1, store_bytes + sum(t.data_type.itemsize for t in self.epilogue_reads
                                             if t.dim[2:] == self.out.dim[2:]))
        a_bytes, b_bytes = self.pose.source.data_type.itemsize, self.w.data_type.itemsize
        epilogue = self.node.op + " " + ",".join(n.op for n in self.group.epilogue)
        if self.matmul_path:
            a_op, b_op = (next(o for o in self.operands if o.side == side) for side in "ab")
            a_layout, b_layout = layout_of(a_op.row_stride, a_op.col_stride), layout_of(b_op.row_stride, b_op.col_stride)
            capability = self.target.capability
            tma = (not self.prologue and not b_op.offset and tma_ok(a_op, a_layout, self.dot_a, capability)
                   and tma_ok(b_op, b_layout, self.dot_b, capability)
                   and (dot not in K_MAJOR_DOTS or (a_layout, b_layout) == ("row", "col")))
            return MatmulProblem(self.groups, m, self.pose.filters, self.pose.channels, dot, a_bytes, b_bytes,
                                 out_bytes, tma, a_layout, b_layout, "conv1x1 " + epilogue, store_bytes)
        g = self.pose.geometry  # the tap shape too: two dgrad phases of one GEMM shape are tuned apart
        layout = ("x" + ",".join(map(str, self.pose.source.stride)) + " w" + ",".join(map(str, self.w.stride))
                  + f" taps{list(g.filter_sizes)} s{list(g.stride)} d{list(g.dilation)} p{list(g.padding)}")
        return conv_heuristics.ConvProblem(self.groups, m, self.pose.filters, self.pose.channels,
                                           self.pose.geometry.taps, dot, a_bytes, b_bytes, out_bytes, layout,
                                           epilogue, bool(self.pose.k_axes))

    def exit_plans(self, epilogue_block) -> list:
        """genstats of an epilogue value: per-channel sum and sum of squares, as column exits
        (one fp32 partial per row tile, folded in tile order: deterministic)."""
        p, pairs = self.problem, []
        written = {t.uid for t in self.group.outputs}  # a statistic nobody reads is not computed
        for node in self.group.exits:
            for output, mode in zip(node.outputs, ("sum", "sq_sum")):
                if output.uid not in written:
                    continue
                s = operand_strides(tuple(self.out.dim), tuple(output.dim), tuple(output.stride))
                operand = GemmOperand(output.uid, output.data_type, "exit", self._group_stride(self.pose.filters, s[1]),
                                      (), (s[1],), is_output=True)
                partial = scratch((p.batch, -(-p.m // epilogue_block[0]), p.n))
                pairs.append((ExitPlan(node, partial.uid, operand, mode, "column"), partial))
        return pairs

    # --- launches for one config ----------------------------------------------------------------
    def _walk_and_loaders(self, config: MatmulConfig) -> tuple:
        source = self.pose.source.uid
        if self.matmul_path:
            if config.variant == "persistent":
                loaders = DescriptorLoader("a", self.problem.a_layout), DescriptorLoader("b", self.problem.b_layout)
            else:
                loaders = (StridedLoader("a", source, self.dot_a, self.prologue),
                           StridedLoader("b", self.w.uid, self.dot_b))
            return (LinearK(self.pose.channels % config.block_k != 0),) + loaders
        geometry, folded = self.pose.geometry, bool(self.pose.k_axes)
        if folded:
            walk = FoldedTapWalk(self.problem.k % config.block_k != 0, self.pose.k_axes)
        else:
            walk = TapWalk(geometry, self.pose.channels, self.pose.channels % config.block_k != 0)
        gather = ActivationGather(geometry, tuple(self.pose.source.dim[2:]), source, self.dot_a, self.prologue,
                                  folded)
        return walk, gather, FilterLoader(geometry, self.dot_b, folded)

    def spec(self, config: MatmulConfig, suffix: str = "", **extra) -> GemmKernelSpec:
        walk, loader_a, loader_b = self._walk_and_loaders(config)
        constexprs = () if self.matmul_path else self.pose.geometry.constexprs()
        if self.pose.k_axes:  # the channel extent k decomposes over, a constant the divisions fold
            constexprs += (("CG", self.pose.channels),)
        return GemmKernelSpec(
            name=self.name + suffix, config=config, problem=self.problem, batch_sizes=self.batch_sizes,
            c_uid=self.out.uid, operands=self.operands, k_walk=walk, loader_a=loader_a, loader_b=loader_b,
            epilogue=tuple(self.group.epilogue), exits=extra.pop("exits", ()), scale_uids=(),
            precision=self.precision, compute=self.graph.compute_data_type.triton_type, index_64=self.index_64,
            description=self.group.summary(), row_sizes=self.row_sizes, extra_constexprs=constexprs,
            varying=frozenset({"m"}) if varies(self.graph, self.out, 0) else frozenset(), **extra)


class WgradBuild(GemmLaunches):
    """wgrad: per group, dw[k, c, taps] = sum over output pixels of dy[n, k, o] times x at the
    tap, o * stride - padding + tap * dilation. Two poses (heuristics/conv.py fold_taps):

      per tap  the taps are batch axes of the GEMM next to the group; columns are the channels;
      folded   few channels per group: the columns are (channel, taps...) in the order
               heuristics/conv.py folded_axes gives, each column gathering x at its own
               tap, so dy is read once per column tile instead of once per tap.

    The reduction over N x pixels is long, so split-K (partials added in order by the combine
    kernel: deterministic) fills the machine."""

    def __init__(self, graph, group, target, fold_below: int = conv_heuristics.FOLD_CHANNELS_BELOW, budget=None):
        self.graph, self.group = graph, group
        node = self.node = group.anchor
        dy, x = node.inputs
        self.dy, self.x, self.out = dy, x, node.outputs[0]
        attrs = node.attrs
        self.groups, filters = attrs.groups, tuple(attrs.shape[2:])
        self.filters, self.channels = attrs.shape[0] // attrs.groups, attrs.shape[1]
        self._pose(filters, fold_below)
        flip = attrs.mode == "convolution"
        self.geometry = ConvGeometry(filters, attrs.stride, attrs.padding, attrs.dilation,
                                     tuple(r - 1 if flip else 0 for r in filters),
                                     tuple(-1 if flip else 1 for _ in filters))
        prologue = set(group.prologue)
        self.prologue = tuple(n for n in group.prologue if n in chain(dy, prologue))
        self.dy_leaves = leaves(dy, set(group.nodes))
        self.epilogue_reads = epilogue_inputs(group)
        self.stored = [t for t in group.outputs if t.producer not in prologue]
        self.exit_operands = []
        self.pixel_sizes = (dy.dim[0],) + tuple(dy.dim[2:])
        self.dot_a, self.dot_b, dot, self.precision = ConvBuild._dot(dy, x, graph.allow_tf32)
        self.target = target
        self.staged = self._staged_operands(dot, budget)
        self.read_scratch = tuple(view.buffer for view in self.staged) if self.staged else ()
        self.operands = tuple(self._dy_operands() + self._x_operands() + self._output_operands())
        self.problem = self._problem(dot)
        # configs chosen at the bucket's top (a dynamic batch scales the reduced pixels)
        self.top_problem = replace(self.problem, k=self.problem.k // dy.dim[0] * top_dims(graph, dy)[0])
        self.index_64 = any(max(element_span(t), top_span(graph, t)) > INT32_LIMIT
                            for t in list(group.inputs) + list(group.outputs))
        self.name = kernel_name(group) + ("_folded" if self.folded else "")

    def _pose(self, filters: tuple, fold_below: int):
        """Where the taps go (heuristics/conv.py): batch axes of the GEMM (tap_axes: the batch
        axis of each spatial axis' tap, -1 for none), or folded into the columns (column_axes and
        col_sizes, outer first)."""
        self.folded = conv_heuristics.fold_taps(self.channels, _product(filters), fold_below)
        self.column_axes = conv_heuristics.folded_axes(len(filters), tuple(self.x.stride)) if self.folded else ()
        self.col_sizes = tuple(self.channels if a < 0 else filters[a] for a in self.column_axes)
        batch_dims = (self.groups,) + ((1,) * len(filters) if self.folded else filters)
        self.batch_axes = tuple(i for i, size in enumerate(batch_dims) if size > 1)
        self.batch_sizes = tuple(batch_dims[i] for i in self.batch_axes)
        position = {axis: i for i, axis in enumerate(self.batch_axes)}
        self.tap_axes = tuple(position.get(axis + 1, -1) for axis in range(len(filters)))

    def _problem(self, dot: str) -> MatmulProblem:
        columns = self.channels * (self.geometry.taps if self.folded else 1)
        out_bytes = max(1, sum(t.data_type.itemsize for t in self.stored))
        g = self.geometry  # folded, the gather's cost depends on where the taps land
        pose = (f"folded taps{list(g.filter_sizes)} s{list(g.stride)} d{list(g.dilation)} "
                f"x{','.join(map(str, self.x.stride))} " if self.folded else "staged " if self.staged else "")
        layouts = ("row", "col") if self.staged else ("strided", "strided")  # staged: both K-major
        return MatmulProblem(_product(self.batch_sizes), self.filters, columns, _product(self.pixel_sizes), dot,
                             self.dy.data_type.itemsize, self.x.data_type.itemsize, out_bytes, False, *layouts,
                             f"conv_wgrad {pose}" + ",".join(n.op for n in self.group.epilogue))

    def schedule(self, problem: MatmulProblem, target, forced=None) -> object:
        """The wgrad schedule of this pose on `target` (heuristics/conv.py); `forced` runs
        whatever the model says."""
        return conv_heuristics.wgrad_schedule(problem, target, self.folded, forced, bool(self.staged))

    def _batch(self, group_stride: int, tap_strides: tuple) -> tuple:
        full = (group_stride,) + tap_strides
        return tuple(full[i] for i in self.batch_axes)

    def _staged_operands(self, dot: str, budget):
        """(dy's StagedGather, x's) where wgrad_stages says so (and the workspace budget allows
        their bytes, which it spends), else ()."""
        if not wgrad_stages(self, dot):
            return ()
        identity = ConvGeometry((1,) * self.geometry.rank, (1,) * self.geometry.rank, (0,) * self.geometry.rank,
                                (1,) * self.geometry.rank, (0,) * self.geometry.rank, (1,) * self.geometry.rank)
        out_sizes = tuple(self.dy.dim[2:])
        line = padded_pixels(_product(self.pixel_sizes))
        nbytes = (self.dy.dim[1] + self.x.dim[1] * self.geometry.taps) * line * self.dy.data_type.itemsize
        if budget is not None:
            if not budget.allows(nbytes):
                return ()
            budget.spend(nbytes)
        name = kernel_name(self.group)
        return (stage_pixel_major(self.group, name + "_dy_pixel_major", self.dy, identity, out_sizes, "dy"),
                stage_pixel_major(self.group, name + "_x_pixel_major", self.x, self.geometry, out_sizes, "x"))

    def _dy_operands(self) -> list:
        if self.staged:  # [filters, pixels] rows of the copy, pixels contiguous
            view, no_taps = self.staged[0], (0,) * self.geometry.rank
            return [GemmOperand(view.buffer.uid, self.dy.data_type, "a", self._batch(self.filters * view.line, no_taps),
                                (view.line,), (1,))]
        operands = []
        for leaf in self.dy_leaves:
            s = operand_strides(tuple(self.dy.dim), tuple(leaf.dim), tuple(leaf.stride))
            no_taps = (0,) * self.geometry.rank
            operands.append(GemmOperand(leaf.uid, leaf.data_type, "a", self._batch(self.filters * s[1], no_taps),
                                        (s[1],), (s[0],) + s[2:]))
        return operands

    def _x_operands(self) -> list:
        if self.staged:  # [taps, channels, pixels] of the copy: per tap [pixels, channels], pixels contiguous
            view, taps = self.staged[1], self.geometry.filter_sizes
            unit = self.x.dim[1] * view.line
            tap_strides = tuple(unit * _product(taps[axis + 1:]) for axis in range(len(taps)))
            return [GemmOperand(view.buffer.uid, self.x.data_type, "b", self._batch(self.channels * view.line, tap_strides),
                                (1,), (view.line,))]
        s = operand_strides(tuple(self.x.dim), tuple(self.x.dim), tuple(self.x.stride))
        no_taps = (0,) * self.geometry.rank
        return [GemmOperand(self.x.uid, self.x.data_type, "b", self._batch(self.channels * s[1], no_taps),
                            (s[0],) + s[2:], (s[1],))]

    def _output_operands(self) -> list:
        """dw and the epilogue's operands: rows the filters; columns the channel (taps in the
        batch), or the folded (channel, taps...) axes each with its own stride."""
        operands = []
        for tensor, is_output in [(t, False) for t in self.epilogue_reads] + [(t, True) for t in self.stored]:
            s = operand_strides(tuple(self.out.dim), tuple(tensor.dim), tuple(tensor.stride))
            if self.folded:
                cols = tuple(s[1] if axis < 0 else s[axis + 2] for axis in self.column_axes)
                batch = self._batch(self.filters * s[0], ())
            else:
                batch, cols = self._batch(self.filters * s[0], s[2:]), (s[1],)
            operands.append(GemmOperand(tensor.uid, tensor.data_type, "c", batch, (s[0],), cols, is_output))
        return operands

    def _gather(self):
        if self.folded:
            return FoldedTapGather(self.geometry, tuple(self.x.dim[2:]), self.column_axes, self.dot_b)
        return PixelGather(self.geometry, tuple(self.x.dim[2:]), self.tap_axes, self.dot_b)

    def spec(self, config: MatmulConfig, suffix: str = "", **extra) -> GemmKernelSpec:
        # a masked pixel walk wherever the batch (and so the pixel count) varies in the bucket
        ragged = self.problem.k % config.block_k != 0 or varies(self.graph, self.dy, 0)
        if self.staged:  # a batched GEMM over the copies: pixels a plain k axis, both operands K-major
            walk, constexprs = LinearK(ragged), ()
            loader_a, loader_b = (StridedLoader(side, view.buffer.uid, dot) for side, view, dot
                                  in zip("ab", self.staged, (self.dot_a, self.dot_b)))
        else:
            walk, constexprs = PixelWalk(ragged, self.geometry.rank, self.pixel_sizes), self.geometry.constexprs()
            loader_a, loader_b = GradientLoader(self.dy.uid, self.dot_a, self.prologue), self._gather()
        return GemmKernelSpec(
            name=self.name + suffix, config=config, problem=self.problem, batch_sizes=self.batch_sizes,
            c_uid=self.out.uid, operands=self.operands, k_walk=walk, loader_a=loader_a, loader_b=loader_b,
            epilogue=tuple(self.group.epilogue), exits=extra.pop("exits", ()), scale_uids=(),
            precision=self.precision, compute=self.graph.compute_data_type.triton_type, index_64=self.index_64,
            description=self.group.summary(), col_sizes=self.col_sizes, extra_constexprs=constexprs, **extra)


def build_conv(graph, group, context) -> list[KernelLaunch]:
    """The launches of a conv group for the context's target: per pose, the model's choice (or
    the options' forced config: conv_config, matmul_config for a pose that is a matmul) or the
    autotuned one, within the workspace budget."""
    node, options = group.anchor, context.options
    # one channel per group: direct kernels (lower/depthwise.py), whose stores do not blend and
    # whose float32 sums are exact for int8 operands over a filter of up to 1024 taps; a blended
    # output or a longer int8 filter takes the GEMM kernels (int32 dots), which serve depthwise
    # convs too
    if takes_depthwise(group) and sums_exactly(node) and not any(t.blend is not None for t in group.outputs):
        launches = build_depthwise(graph, group, context)
        if launches is not None:
            return launches  # else wgrad's partials exceed the workspace limit: the GEMM kernels run
    forced_conv = lambda schedule: lambda problem, target: schedule(problem, target, options.conv_config)
    if node.op == "conv_wgrad":
        build = WgradBuild(graph, group, context.target, options.conv_fold_channels_below, context.budget)
        staging = [view.launch for view in build.staged]
        return staging + build_gemm(build, "conv", forced_conv(build.schedule), context)
    if node.op not in POSES:
        raise UnsupportedError(f"node {node.name!r} ({node.op}): no kernel for {node.op} exists yet; "
                               f"graph.reference() computes it")
    poses = POSES[node.op](node, options.conv_fold_channels_below)
    staged = stage_filter(graph, group, poses, context.target)
    launches = [staged.launch] if staged is not None else []
    for pose in poses:
        build = ConvBuild(graph, group, pose, context.target, staged)
        if build.matmul_path:
            launches += build_gemm(build, "matmul", lambda problem, target: matmul_heuristics.schedule(
                problem, target, options.matmul_config), context)
        else:
            launches += build_gemm(build, "conv", forced_conv(conv_heuristics.schedule), context)
    return launches


# --- 8-bit filters staged reduction-major ---------------------------------------------------------
# wgmma reads 8-bit operands (int8, fp8) K-major from shared memory only: it transposes 16-bit
# types alone (PTX ISA, wgmma.mma_async). A filter tile whose reduced axis is not contiguous (the
# filters, for dgrad of any layout; the channels, for fprop of an NCHW filter) cannot be copied
# to shared memory as wgmma reads it, so Triton loads it into registers every k step, stores it
# transposed to a single shared buffer and waits on each dot: the int8 dgrad of ResNet-50's
# layer1.0.conv2 (sm_90 build of the H200 plan) kept one unpipelined tile load in its loop, 33
# ld.global, 24 st.shared and a wgmma wait of 0 pending per step, and ran 159 TFLOP/s against
# 273 for cuDNN's bf16 (the int8 fprop, whose NHWC filter is K-major, runs 1.5-5x cuDNN's bf16).
# A copy of the filter with the reduced axis contiguous (a kernel over the filter's bytes, a few
# microseconds at ResNet sizes) lets the mainloop pipeline both operands with cp.async (and a
# 1x1 pose take the persistent TMA matmul). H200, bench_conv.py --rows int8_dgrad --quick
# (2026-11-29): 159, 113, 62.7, 63.6 TFLOP/s before, 307, 161, 153, 329 after (layer1.0.conv2,
# layer2.0.conv2, layer3.1.conv1, layer4.1.conv2; cuDNN's bf16 dgrad 284, 271, 143, 371 there).
STAGED_DOTS = ("int8", "fp8")


@dataclass(frozen=True)
class StagedView:
    """The copy as the conv kernels see the filter: the graph filter's dims, the copy's strides."""

    uid: int
    dim: tuple
    stride: tuple
    data_type: object


@dataclass
class StagedFilter:
    buffer: object  # the workspace buffer (runtime/launch.py scratch) holding the copy
    view: StagedView
    launch: KernelLaunch  # the copy, run before the group's GEMM kernels


def stages_filter(graph, node, poses: list, target) -> bool:
    """Whether the group's 8-bit filter is read through a reduction-major copy: planned for a
    GPU (the interpreter has no shared memory to feed: the copy would only cost it time), a pose
    walks the filter tap by tap (a folded pose reads (tap, channel) runs of k, not one axis) and
    the axis it reduces over is not already contiguous; static dims within 32-bit offsets."""
    if target.interpreted:
        return False
    source, w = poses[0].source, node.inputs[1]
    dot = ConvBuild._dot(source, w, graph.allow_tf32)[2]
    reduce_axis = poses[0].filter_reduce_axis
    return (dot in STAGED_DOTS and w.stride[reduce_axis] != 1 and w.dim[reduce_axis] > 1
            and any(not pose.k_axes for pose in poses) and element_span(w) <= INT32_LIMIT
            and not any(varies(graph, w, axis) for axis in range(len(w.dim))))


def stage_filter(graph, group, poses: list, target):
    """The StagedFilter of the group's conv on `target` (stages_filter says when), else None."""
    node = group.anchor
    if not stages_filter(graph, node, poses, target):
        return None
    w, reduce_axis = node.inputs[1], poses[0].filter_reduce_axis
    buffer = scratch(tuple(w.dim), w.data_type.torch_dtype)
    view = StagedView(buffer.uid, tuple(w.dim), staged_filter_strides(tuple(w.dim), reduce_axis), w.data_type)
    axis = "filters" if reduce_axis == 0 else "channels"
    source, grid = render_reduction_major(kernel_name(group) + "_filter_k_major", w, reduce_axis, buffer.uid,
                                          f"filter copied {axis}-contiguous for {group.summary()}")
    launch = launch_of(group, source, grid, 4, f"copy {'x'.join(map(str, w.dim))} grid={list(grid)}",
                       f"8-bit filter copied {axis}-contiguous: wgmma reads int8/fp8 operands K-major only, "
                       f"so the mainloop pipelines it", scratch=[buffer])
    return StagedFilter(buffer, view, launch)


# wgrad reduces over N x output pixels, an axis contiguous in neither dy ([filters, pixels]: the
# filters are, in NHWC) nor x (the channels are): with 8-bit operands Triton moved both tiles
# through registers every k step (ResNet-50 layer4.1.conv2's int8 wgrad, sm_90 build of the H200
# plan: two unpipelined tile loads in the loop, 132 st.shared; layer1.0.conv2's small_m tiles on
# mma.sync: 388 ld.shared and 288 byte permutes), 35-74 TFLOP/s against 178-310 for cuDNN's bf16.
# Staged, dy is copied [filters, pixels] and x gathered [taps, channels, pixels] (the padding
# zero), each pixel line 16-byte aligned (padded_pixels), and the wgrad is a batched GEMM of
# K-major operands: the bytes of x once per tap more in the workspace (58 MB at layer1.0.conv2,
# N=32), spent from the workspace budget (a limit that does not hold them keeps the gathered
# kernel). H200, --rows int8_wgrad --quick (2026-11-29): 35.1, 62.6, 61.0, 74.1 TFLOP/s before,
# 85.0, 151, 106, 245 after (cuDNN's bf16 wgrad 181-333). At layer1.0.conv2 the GEMM alone took
# 46-48 us of the 87 (autotune's timings): the two copies take the rest, the next thing to speed up.
@dataclass
class StagedGather:
    buffer: object  # the workspace buffer [taps, channels, line] (runtime/launch.py scratch)
    line: int  # elements per staged line (padded_pixels)
    launch: KernelLaunch  # the gather, run before the GEMM


def wgrad_stages(build, dot: str) -> bool:
    """Whether a wgrad reads its 8-bit operands through pixel-major copies: planned for a GPU
    (as stages_filter), the per-tap pose (a folded one gathers per column), no prologue on dy,
    static dims, 32-bit offsets."""
    line = padded_pixels(_product(build.pixel_sizes))
    return (dot in STAGED_DOTS and not build.target.interpreted and not build.folded and not build.prologue
            and max(build.dy.dim[1], build.x.dim[1] * build.geometry.taps) * line <= INT32_LIMIT
            and all(element_span(t) <= INT32_LIMIT for t in (build.dy, build.x))
            and not any(varies(build.graph, t, axis) for t in (build.dy, build.x) for axis in range(len(t.dim))))


def stage_pixel_major(group, name: str, source, geometry: ConvGeometry, out_sizes: tuple, role: str) -> StagedGather:
    """The StagedGather of `source` (dy or x) at the taps of `geometry` for the output pixels."""
    line = padded_pixels(source.dim[0] * _product(out_sizes))
    buffer = scratch((geometry.taps, source.dim[1], line), source.data_type.torch_dtype)
    text, grid = render_pixel_major(name, source, geometry, out_sizes, buffer.uid,
                                    f"{role} gathered pixel-major for {group.summary()}")
    launch = launch_of(group, text, grid, 4, f"gather {'x'.join(map(str, buffer.dim))} grid={list(grid)}",
                       f"8-bit {role} gathered pixel-major: wgmma reads int8/fp8 operands K-major only, so the "
                       f"wgrad GEMM pipelines it", scratch=[buffer])
    return StagedGather(buffer, line, launch)
