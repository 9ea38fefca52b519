"""Build the launches of a convolution group: pose the implicit GEMM, choose a config, render.

A group is a conv node with a pointwise prologue on its activation (a previous batchnorm's
scale-bias-relu, applied at load) and a pointwise epilogue chain (bias, activations, residual,
scale, cast; values inside the chain stored as extra outputs). Per group of the convolution,
fprop is a GEMM over rows (n, output pixel), columns (filters) and k (tap, channel); the group
index is the GEMM's batch axis, so every operand carries its group offset as a batch stride.
A 1x1 stride-1 unpadded conv whose activation pixels merge into one row axis is a matmul and
takes the matmul loaders and schedule (TMA included).
"""
from __future__ import annotations

from ..codegen.conv import ActivationGather, ConvGeometry, FilterLoader, TapWalk
from ..codegen.gemm import GemmKernelSpec, GemmOperand
from ..codegen.matmul import DescriptorLoader, LinearK, StridedLoader
from ..errors import UnsupportedError
from ..heuristics import conv as conv_heuristics
from ..heuristics import device_model
from ..heuristics import matmul as matmul_heuristics
from ..heuristics.layout import INT32_LIMIT, operand_strides
from ..heuristics.matmul import MatmulConfig, MatmulProblem, choose_dot
from .gemm import GemmLaunches, build_gemm, chain, epilogue_inputs, leaves
from .launch import KernelLaunch, element_span, kernel_name
from .matmul import _layout, _tma_ok


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


class ConvBuild(GemmLaunches):
    """Everything about one conv fprop group that does not depend on the config."""

    def __init__(self, graph, group, index, device=None):
        self.graph, self.group, self.index = graph, group, index
        node = self.node = group.anchor
        if node.op != "conv_fprop":
            raise UnsupportedError(f"node {node.name!r} ({node.op}): no kernel for {node.op} exists yet; "
                                   f"graph.reference() computes it")
        x, w = node.inputs
        y = node.outputs[0]
        self.x, self.w, self.y = x, w, y
        attrs = node.attrs
        self.groups = attrs.groups
        self.channels = x.dim[1] // attrs.groups
        self.filters = w.dim[0] // attrs.groups
        self.input_sizes, self.output_sizes = tuple(x.dim[2:]), tuple(y.dim[2:])
        self.geometry = ConvGeometry(tuple(w.dim[2:]), attrs.stride, attrs.padding, attrs.dilation,
                                     attrs.mode == "convolution")
        self.batch_sizes = (attrs.groups,) if attrs.groups > 1 else ()
        prologue = set(group.prologue)
        self.prologue = tuple(n for n in group.prologue if n in chain(x, prologue))
        members = set(group.nodes)
        self.x_leaves = leaves(x, members)
        self.epilogue_reads = epilogue_inputs(group)
        self.stored = [t for t in group.outputs if t.producer not in prologue]
        self.exit_operands = []
        self.row_sizes = (x.dim[0],) + self.output_sizes
        self.dot_a, self.dot_b, dot, self.precision = self._dot(x, w, graph.allow_tf32)
        self.device = device_model(device)
        self.matmul_path = self._is_matmul(attrs)
        self.operands = tuple(self._activation_operands() + self._filter_operands() + self._output_operands())
        self.problem = self._problem(dot)
        self.index_64 = any(element_span(t) > INT32_LIMIT for t in list(group.inputs) + list(group.outputs))
        self.name = kernel_name(group, index)

    @staticmethod
    def _dot(x, w, allow_tf32: bool):
        for t in (x.data_type, w.data_type):
            if not t.is_floating:
                raise UnsupportedError(f"conv of {x.data_type.name} x {w.data_type.name}: no kernel takes "
                                       f"{t.name} operands")
        choice = choose_dot(x.data_type.name, w.data_type.name, x.data_type.triton_type, w.data_type.triton_type,
                            allow_tf32)
        return choice.a_type, choice.b_type, choice.dot, choice.precision

    # --- operands ---------------------------------------------------------------------------------
    def _group_stride(self, per_group: int, stride: int) -> tuple:
        return (per_group * stride,) if self.batch_sizes else ()

    def _is_matmul(self, attrs) -> bool:
        """1x1, stride 1, no padding, and every activation operand walks its pixels as one axis."""
        if any(r != 1 for r in self.w.dim[2:]) or any(s != 1 for s in attrs.stride) or any(attrs.padding):
            return False
        for leaf in self.x_leaves:
            strides = operand_strides(tuple(self.x.dim), tuple(leaf.dim), tuple(leaf.stride))
            if _merged_rows(self.row_sizes, (strides[0],) + strides[2:]) is None:
                return False
        return True

    def _activation_operands(self) -> list:
        operands = []
        for leaf in self.x_leaves:
            s = operand_strides(tuple(self.x.dim), tuple(leaf.dim), tuple(leaf.stride))
            rows = (s[0],) + s[2:]
            if self.matmul_path:
                rows = (_merged_rows(self.row_sizes, rows),)
            operands.append(GemmOperand(leaf.uid, leaf.data_type, "a", self._group_stride(self.channels, s[1]),
                                        rows, (s[1],)))
        return operands

    def _filter_operands(self) -> list:
        s = operand_strides(tuple(self.w.dim), tuple(self.w.dim), tuple(self.w.stride))
        rows = (s[1],) if self.matmul_path else (s[1],) + s[2:]
        return [GemmOperand(self.w.uid, self.w.data_type, "b", self._group_stride(self.filters, s[0]), rows, (s[0],))]

    def _output_operands(self) -> list:
        operands = []
        for tensor, is_output in [(t, False) for t in self.epilogue_reads] + [(t, True) for t in self.stored]:
            s = operand_strides(tuple(self.y.dim), tuple(tensor.dim), tuple(tensor.stride))
            operands.append(GemmOperand(tensor.uid, tensor.data_type, "c", self._group_stride(self.filters, s[1]),
                                        (s[0],) + s[2:], (s[1],), is_output))
        return operands

    def _problem(self, dot: str):
        m = _product(self.row_sizes)
        out_bytes = max(1, sum(t.data_type.itemsize for t in self.stored)
                        + sum(t.data_type.itemsize for t in self.epilogue_reads if t.dim[2:] == self.y.dim[2:]))
        a_bytes, b_bytes = self.x.data_type.itemsize, self.w.data_type.itemsize
        epilogue = ",".join(n.op for n in self.group.epilogue)
        if self.matmul_path:
            a_op, b_op = (next(o for o in self.operands if o.side == side) for side in "ab")
            a_layout, b_layout = _layout(a_op.row_stride, a_op.col_stride), _layout(b_op.row_stride, b_op.col_stride)
            capability = self.device.capability
            tma = (not self.prologue and _tma_ok(a_op, a_layout, self.dot_a, capability)
                   and _tma_ok(b_op, b_layout, self.dot_b, capability)
                   and (dot not in ("fp8", "tf32") or (a_layout, b_layout) == ("row", "col")))
            return MatmulProblem(self.groups, m, self.filters, self.channels, dot, a_bytes, b_bytes, out_bytes, tma,
                                 a_layout, b_layout, "conv1x1 " + epilogue)
        layout = "x" + ",".join(map(str, self.x.stride)) + " w" + ",".join(map(str, self.w.stride))
        return conv_heuristics.ConvProblem(self.groups, m, self.filters, self.channels, self.geometry.taps, dot,
                                           a_bytes, b_bytes, out_bytes, layout, epilogue)

    # --- launches for one config ----------------------------------------------------------------
    def _walk_and_loaders(self, config: MatmulConfig) -> tuple:
        if self.matmul_path:
            if config.variant == "persistent":
                loaders = DescriptorLoader("a", self.problem.a_layout), DescriptorLoader("b", self.problem.b_layout)
            else:
                loaders = (StridedLoader("a", self.x.uid, self.dot_a, self.prologue),
                           StridedLoader("b", self.w.uid, self.dot_b))
            return (LinearK(self.channels % config.block_k != 0),) + loaders
        walk = TapWalk(self.geometry, self.channels, self.channels % config.block_k != 0)
        gather = ActivationGather(self.geometry, self.input_sizes, self.x.uid, self.dot_a, self.prologue)
        return walk, gather, FilterLoader(self.geometry, self.dot_b)

    def spec(self, config: MatmulConfig, suffix: str = "", **extra) -> GemmKernelSpec:
        walk, loader_a, loader_b = self._walk_and_loaders(config)
        constexprs = () if self.matmul_path else self.geometry.constexprs()
        return GemmKernelSpec(
            name=self.name + suffix, config=config, problem=self.problem, batch_sizes=self.batch_sizes,
            c_uid=self.y.uid, operands=self.operands, k_walk=walk, loader_a=loader_a, loader_b=loader_b,
            epilogue=tuple(self.group.epilogue), exits=extra.pop("exits", ()), scale_uids=(),
            precision=self.precision, compute=self.graph.compute_data_type.triton_type, index_64=self.index_64,
            description=self.group.describe(), row_sizes=self.row_sizes, extra_constexprs=constexprs, **extra)


def build_conv(graph, group, index, tuner=None, device=None) -> list[KernelLaunch]:
    """The launches of a conv group for `device` (default: the current one): model choice, or
    the autotuned one with `tuner`."""
    build = ConvBuild(graph, group, index, device)
    if build.matmul_path:
        return build_gemm(build, "matmul", matmul_heuristics.schedule, tuner, device)
    return build_gemm(build, "conv", conv_heuristics.schedule, tuner, device)
