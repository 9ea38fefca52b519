"""Build the launches of a depthwise conv group: direct kernels, no implicit GEMM.

lower/conv.py hands a conv group here when takes_depthwise(group) holds: every group of the conv
has one input channel and at most heuristics/depthwise.py's MAX_MULTIPLIER filters. The group
keeps a conv group's fusion: a pointwise prologue on the gathered operand (x in fprop, dy in
dgrad and wgrad) applied at load, and the pointwise epilogue chain with every stored value.

  fprop, dgrad  one gather kernel over the output (y, dx): a launch
  wgrad         the split kernel writes per-split partial sums of dw (workspace scratch), the
                combine kernel adds them in order and runs the epilogue: two launches
"""
from __future__ import annotations

from dataclasses import replace

from ..codegen.depthwise import DepthwiseSpec, Operand, render
from ....problems.base import fast_math_outputs
from .... import dtypes
from ....errors import UnsupportedError
from ..heuristics import depthwise as depthwise_heuristics
from ....runtime.autotune import TuningRecord
from ..heuristics.depthwise import DepthwiseConfig, GatherProblem, WgradProblem
from ..heuristics.layout import INT32_LIMIT, operand_strides
from ..heuristics.pooling import tile_axes
from .gemm import chain, epilogue_inputs, leaves
from ....target import laid_out
from ....runtime.launch import (KernelLaunch, element_span, kernel_name, launch_of, sample_tensors, scratch,
                               time_candidate)


def _product(values) -> int:
    total = 1
    for value in values:
        total *= value
    return total


def _channels_and_filters(node) -> tuple:
    """(input channels, filters) of a conv node, whichever op it is."""
    if node.op == "conv_fprop":
        return node.inputs[0].dim[1], node.inputs[1].dim[0]
    if node.op == "conv_dgrad":
        return node.attrs.shape[1], node.inputs[1].dim[0]
    return node.inputs[1].dim[1], node.attrs.shape[0]


# The direct kernels sum in float32: int8 x int8 products (at most 128^2 = 2^14 in magnitude) over
# up to 2^24 / 2^14 = 1024 taps stay integers float32 holds exactly, so an int8 conv's int32 result
# comes out exact; a longer filter takes the GEMM kernels' int32 accumulator.
INT8_EXACT_TAPS = 2**24 // (128 * 128)


def _int8_products_summed(node) -> int:
    """The most int8 products a direct kernel sums into one result of `node`: fprop's filter
    taps, dgrad's taps of every filter reading the channel (the channel multiplier), wgrad's N x
    output pixels (treated as unbounded: its sums take the int32 GEMM kernels)."""
    taps = _product(node.inputs[1].dim[2:])
    if node.op == "conv_fprop":
        return taps
    if node.op == "conv_dgrad":
        return taps * (node.inputs[1].dim[0] // node.attrs.groups)
    return INT8_EXACT_TAPS + 1


def sums_exactly(node) -> bool:
    """Do the direct kernels' float32 sums give `node`'s result exactly (float operands, or int8
    ones over at most INT8_EXACT_TAPS products)?"""
    types = [t.data_type for t in node.input_tensors()]
    if all(t.is_floating for t in types):
        return True
    return all(t is dtypes.int8 for t in types) and _int8_products_summed(node) <= INT8_EXACT_TAPS


def takes_depthwise(group) -> bool:
    """Does this conv group run on the depthwise kernels?"""
    node = group.anchor
    if node.op not in ("conv_fprop", "conv_dgrad", "conv_wgrad") or group.exits:
        return False
    channels, filters = _channels_and_filters(node)
    groups = node.attrs.groups
    return depthwise_heuristics.routes(channels // groups, filters // groups)


def _bytes(tensor) -> int:
    return _product(tensor.dim) * tensor.data_type.itemsize


class DepthwiseBuild:
    """Everything about a depthwise group that does not depend on the config."""

    def __init__(self, graph, group, target):
        self.graph, self.group = graph, group
        node = self.node = group.anchor
        attrs = node.attrs
        self.op = node.op
        self.source, other = node.inputs  # the gathered operand; the filter, or x in wgrad
        self.out = node.outputs[0]
        for tensor in (self.source, other):
            if not tensor.data_type.is_floating and not sums_exactly(node):
                raise UnsupportedError(f"node {node.name!r} ({node.op}): no depthwise kernel takes "
                                       f"{tensor.data_type.name} operands ({tensor.name!r})")
        w_dim = tuple(attrs.shape) if self.op == "conv_wgrad" else tuple(other.dim)
        self.filter_sizes = w_dim[2:]
        self.multiplier = w_dim[0] // attrs.groups
        # where the taps land: x in fprop and wgrad, dy in dgrad
        self.in_sizes = tuple((other if self.op == "conv_wgrad" else self.source).dim[2:])
        members = set(group.nodes)
        prologue = set(group.prologue)
        self.prologue = tuple(n for n in group.prologue if n in chain(self.source, prologue))
        self.stored = [t for t in group.outputs if t.producer not in prologue]
        self.operands = tuple(self._operands(other, leaves(self.source, members), epilogue_inputs(group)))
        self.index_64 = any(element_span(t) > INT32_LIMIT for t in list(group.inputs) + list(group.outputs))
        self.name = kernel_name(group) + "_depthwise"
        self.target = target
        traffic = sum(_bytes(t) for t in list(group.inputs) + list(group.outputs))
        epilogue = ",".join(n.op for n in group.prologue + group.epilogue)
        self.vector_axis, self.row_axes, self.merge_axis = 1, (), -1  # the gather tile's axes
        if self.op == "conv_wgrad":
            self.problem = WgradProblem(_product((self.source.dim[0],) + tuple(self.source.dim[2:])), w_dim[0],
                                        _product(self.filter_sizes), self.source.data_type.itemsize,
                                        self.source.stride[1] == 1 and other.stride[1] == 1, traffic, epilogue)
        else:
            self.vector_axis, self.row_axes = tile_axes(tuple(self.out.dim), tuple(self.source.stride))
            self.merge_axis = self._merge_axis()
            self.problem = self._gather_problem(traffic, epilogue)

    def _operands(self, other, source_leaves, reads) -> list:
        source_dims, out_dims = tuple(self.source.dim), tuple(self.out.dim)
        strides = lambda domain, t: operand_strides(domain, tuple(t.dim), tuple(t.stride))
        operands = [Operand(t.uid, t.data_type, "src", strides(source_dims, t)) for t in source_leaves]
        operands.append(Operand(other.uid, other.data_type, "x" if self.op == "conv_wgrad" else "w",
                                strides(tuple(other.dim), other)))
        operands += [Operand(t.uid, t.data_type, "read", strides(out_dims, t)) for t in reads]
        operands += [Operand(t.uid, t.data_type, "out", strides(out_dims, t)) for t in self.stored]
        return operands

    def _merge_axis(self) -> int:
        """The row axis next outside the vector axis where the two can merge into the tile's
        columns (-1: none): the gathered tensor walks them as one memory run of the output's
        extent, and along both the input position is the output's plus a constant (stride 1;
        one filter per channel), so a tap shifts the whole run."""
        inner, outer = self.vector_axis, self.row_axes[-1]
        for axis in (inner, outer):
            if axis == 1 and self.multiplier != 1:
                return -1
            if axis >= 2 and self.node.attrs.stride[axis - 2] != 1:
                return -1
        dims, stride = tuple(self.out.dim), tuple(self.source.stride)
        if self.source.dim[inner] != dims[inner] or stride[outer] != dims[inner] * stride[inner]:
            return -1
        if inner == 1 and dims[1] > depthwise_heuristics.MAX_MERGED_CHANNELS:
            return -1
        return outer

    def _merges(self, config: DepthwiseConfig) -> bool:
        return config.merge and self.op != "conv_wgrad" and self.merge_axis >= 0

    def _gather_problem(self, traffic: int, epilogue: str) -> GatherProblem:
        axis, dims = self.vector_axis, tuple(self.out.dim)
        cols = dims[axis]
        dgrad = self.op == "conv_dgrad"
        if axis == 1:  # fprop: M filters share an input channel; dgrad: c reads channels c * M + m
            step = self.multiplier if dgrad else 1.0 / self.multiplier
        elif axis >= 2:
            stride = self.node.attrs.stride[axis - 2]
            step = 1.0 / stride if dgrad else float(stride)
        else:
            step = 1.0
        merged_cols = cols * dims[self.merge_axis] if self.merge_axis >= 0 else 0
        return GatherProblem(self.op, rows=_product(dims) // cols, cols=cols, taps=_product(self.filter_sizes),
                             loads_per_tap=self.multiplier if dgrad else 1,
                             item_bytes=self.source.data_type.itemsize, run_step=step,
                             contiguous=self.source.stride[axis] == 1, traffic=traffic, merged_cols=merged_cols,
                             inner_taps=self.filter_sizes[-1], epilogue=epilogue)

    def spec(self, config: DepthwiseConfig, body: str, suffix: str = "", partial_uid: int = 0,
             fold_grid: bool = False) -> DepthwiseSpec:
        attrs = self.node.attrs
        wgrad = self.op == "conv_wgrad"
        merged = self.merge_axis if self._merges(config) else -1
        row_axes = tuple(a for a in self.row_axes if a != merged)
        return DepthwiseSpec(
            name=self.name + suffix, op=self.op, body=body, description=self.group.summary() + " (depthwise)",
            filter_sizes=tuple(self.filter_sizes), stride=tuple(attrs.stride), padding=tuple(attrs.padding),
            dilation=tuple(attrs.dilation), flip=attrs.mode == "convolution", multiplier=self.multiplier,
            out_dims=tuple(self.out.dim), in_sizes=self.in_sizes,
            pixel_dims=(self.source.dim[0],) + tuple(self.source.dim[2:]) if wgrad else (),
            operands=self.operands, target_uid=self.source.uid, out_uid=self.out.uid, prologue=self.prologue,
            epilogue=tuple(self.group.epilogue), compute=self.graph.compute_data_type.triton_type,
            index_64=self.index_64, config=config, vector_axis=self.vector_axis,
            merged_axis=merged, row_axes=row_axes, partial_uid=partial_uid,
            combine_block=depthwise_heuristics.COMBINE_BLOCK, fold_grid=fold_grid,
            fast_math=fast_math_outputs(self.group))

    def _launch(self, spec, grid, warps, config_text, reason, scratch_buffers=()) -> KernelLaunch:
        return launch_of(self.group, render(spec), grid, warps, config_text, reason, scratch=scratch_buffers)

    def launches(self, config: DepthwiseConfig, reason: str) -> list[KernelLaunch]:
        """The kernels of this group under `config`."""
        if config.merge and not self._merges(config):  # a forced config on a problem that cannot
            config = replace(config, merge=False)
        if self.op != "conv_wgrad":
            p = self.problem
            cols = p.merged_cols if self._merges(config) else p.cols
            programs = -(-(p.rows * p.cols // cols) // config.block_rows) * -(-cols // config.block_cols)
            return [self._launch(self.spec(config, "gather"), (programs,), config.num_warps,
                                 config.text + f" grid={programs}", reason)]
        p = self.problem
        partial = scratch((config.splits, p.taps, p.channels))
        grid = (-(-p.channels // config.block_cols), -(-p.taps // config.block_taps), config.splits)
        fold = not self.target.grid_fits(grid)  # tap blocks or splits past axes y/z: all on axis x
        main = self._launch(self.spec(config, "wgrad", partial_uid=partial.uid, fold_grid=fold),
                            laid_out(grid, fold), config.num_warps,
                            config.text + f" grid={grid[0]}x{grid[1]}x{grid[2]}" + " folded" * fold, reason, [partial])
        elements = p.channels * p.taps
        block = depthwise_heuristics.COMBINE_BLOCK
        combine = self._launch(self.spec(config, "combine", "_combine", partial.uid), (-(-elements // block),),
                               depthwise_heuristics.COMBINE_WARPS, f"combine {config.splits} splits in order",
                               "adds the SPLITS partials in order (deterministic), then the epilogue")
        return [main, combine]


def _partial_bytes(config, problem) -> int:
    """Workspace of a wgrad config's per-split partials (fp32 [SPLITS, taps, channels])."""
    return config.splits * problem.taps * problem.channels * 4 if config.kernel == "wgrad" else 0


def build_depthwise(graph, group, context) -> list[KernelLaunch]:
    """The launches of a depthwise conv group for the context's target: the model's config (or
    the options' forced one), or the autotuned one (recorded under "depthwise" in the tuning
    cache), within the workspace budget; None where wgrad's partials (it always has some) do
    not fit it."""
    tuner, budget = context.tuner, context.budget
    build = DepthwiseBuild(graph, group, context.target)
    sched = depthwise_heuristics.schedule(build.problem, build.target, context.options.depthwise_config)
    ranked = [c for c in sched.ranked if budget is None or budget.allows(_partial_bytes(c, build.problem))]
    if not ranked:  # wgrad's partials do not fit: the caller runs the GEMM kernels, which need none
        return None
    config, record = ranked[0], TuningRecord("model", ranked[0].text)
    if tuner is not None:
        where = context.device
        tensors = sample_tensors(group, where)
        limit = "" if budget is None or budget.limit is None else f" ws{budget.limit}"
        config, record = tuner.choose(
            "depthwise", build.problem.signature() + limit, ranked, DepthwiseConfig.to_record,
            DepthwiseConfig.from_record, lambda c: c.text,
            lambda c: time_candidate(build.launches(c, "autotune candidate"), tensors, where))
    reason = record.describe() or sched.reason
    if budget is not None:
        budget.spend(_partial_bytes(config, build.problem))
        reason += "; " + budget.describe(_partial_bytes(config, build.problem))
    launches = build.launches(config, reason)
    for launch in launches:
        launch.tuning = record
    return launches
