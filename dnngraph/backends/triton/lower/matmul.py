"""Build the launches of a matmul group: pose the problem, choose a config, render, bind.

A group is a matmul node with pointwise prologues on A and B, a pointwise epilogue chain and
row-reduction exits. The problem (sizes, dot type, layouts, TMA legality) is plain data for the
heuristics; autotuning times whole launch lists of candidate configs on scratch tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .... import dtypes
from ..codegen.block_scaled import BlockScaledLoader
from ..codegen.gemm import GemmKernelSpec, GemmOperand, LinearK
from ..codegen.matmul import DescriptorLoader, StridedLoader
from ....errors import UnsupportedError
from ..heuristics.layout import INT32_LIMIT, merged_stride, operand_strides
from ..heuristics.matmul import K_MAJOR_DOTS, MatmulConfig, MatmulProblem, choose_dot, schedule
from .gemm import TMA_ALIGNMENT, GemmLaunches, build_gemm, chain, epilogue_inputs, leaves
from ....runtime.launch import KernelLaunch, element_span, kernel_name
from ....symbolic import strides_vary, top_dims, top_span, varies


def _dot_types(a, b, allow_tf32: bool):
    """(dot type of A, of B, model name, input precision) for the matmul's input types: the
    precision rule lives in heuristics.matmul.choose_dot."""
    for t in (a.data_type, b.data_type):
        if not t.is_floating and t is not dtypes.int8:
            raise UnsupportedError(f"matmul of {a.data_type.name} x {b.data_type.name}: no kernel takes "
                                   f"{t.name} operands")
    choice = choose_dot(a.data_type.name, b.data_type.name, a.data_type.triton_type, b.data_type.triton_type,
                        allow_tf32)
    return choice.a_type, choice.b_type, choice.dot, choice.precision


def _product(sizes) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def layout_of(row_stride: int, col_stride: int) -> str:
    if col_stride == 1:
        return "row"
    if row_stride == 1:
        return "col"
    return "strided"


def tma_ok(operand: GemmOperand, layout: str, dot_type: str, cuda_capability) -> bool:
    """A descriptor needs unit stride on one axis, 16-byte pitches and a matching type (an
    operand converted at load, as in a mixed-type dot, takes the pointer-load kernels)."""
    if layout == "strided" or operand.data_type.triton_type != dot_type:
        return False
    if cuda_capability is not None and cuda_capability < (9, 0):
        return False
    itemsize = operand.data_type.itemsize
    pitch = operand.row_stride if layout == "row" else operand.col_stride
    pitches = [pitch] + [s for s in operand.batch_strides if s]
    # a size-1 matrix axis has stride 0 here: nothing for a descriptor to walk
    return pitch > 0 and all(p * itemsize % TMA_ALIGNMENT == 0 for p in pitches)


class MatmulBuild(GemmLaunches):
    """Everything about one matmul group that does not depend on the config."""

    def __init__(self, graph, group, target):
        self.graph, self.group = graph, group
        node = self.node = group.anchor
        a, b, scale_a, scale_b = node.inputs
        c = node.outputs[0]
        self.a, self.b, self.c = a, b, c
        self.scales = [s for s in (scale_a, scale_b) if s is not None]
        batch_dims = tuple(c.dim[:-2])
        self.batch_axes = tuple(i for i, size in enumerate(batch_dims) if size > 1)
        self.batch_sizes = tuple(batch_dims[i] for i in self.batch_axes)
        m, n, k = c.dim[-2], c.dim[-1], a.dim[-1]
        members = set(group.nodes)
        # block_scale_dequantize producing A or B: run by that side's loader (block-scaled GEMM)
        self.dequantized = {side: t.producer for side, t in (("a", a), ("b", b))
                            if t.producer in group.prologue and t.producer.op == "block_scale_dequantize"}
        prologue = set(group.prologue) - set(self.dequantized.values())
        self.prologue_a = tuple(x for x in group.prologue if x in chain(a, prologue))
        self.prologue_b = tuple(x for x in group.prologue if x in chain(b, prologue))
        exit_outputs = {x.outputs[0].uid for x in group.exits}
        epilogue_reads = epilogue_inputs(group)
        # prologue values that are outputs are written by a pointwise kernel run first
        stored_values = [t for t in group.outputs if t.uid not in exit_outputs and t.producer not in prologue]
        exit_values = [x.outputs[0] for x in group.exits]
        # a dequantized side reads its quantized elements there (and its scales, below)
        side_a = [self.dequantized["a"].inputs[0]] if "a" in self.dequantized else leaves(a, members)
        side_b = [self.dequantized["b"].inputs[0]] if "b" in self.dequantized else leaves(b, members)
        sides = [("a", side_a, batch_dims + (m, k), False),
                 ("b", side_b, batch_dims + (k, n), False),
                 *block_scale_sides(self.dequantized, batch_dims, m, n, k),
                 ("c", epilogue_reads, tuple(c.dim), False), ("c", stored_values, tuple(c.dim), True),
                 ("exit", exit_values, tuple(c.dim[:-1]) + (1,), True)]
        # (axes, sizes) of the batches folded into one GEMM of batch x M rows, or None
        self.folded = (self.batch_axes, self.batch_sizes) if self._batches_fold(sides, m) else None
        if self.folded:
            m *= _product(self.batch_sizes)
            self.batch_axes, self.batch_sizes = (), ()
        operands, self.exit_operands = [], []
        for side, tensors, domain, is_output in sides:
            self._add(self.exit_operands if side == "exit" else operands, side, tensors, domain, is_output)
        self._add(operands, "scalar", self.scales, ())
        self.operands = tuple(operands)
        self.dot_a, self.dot_b, dot, self.precision = _dot_types(*self._dot_operand_types(a, b),
                                                                 node.attrs.allow_tf32)
        (a_op,) = [o for o in operands if o.side == "a"] if not (self.prologue_a or "a" in self.dequantized) \
            else [None]
        (b_op,) = [o for o in operands if o.side == "b"] if not (self.prologue_b or "b" in self.dequantized) \
            else [None]
        capability = target.capability  # the device the launches are for, not the current one
        a_layout = layout_of(a_op.row_stride, a_op.col_stride) if a_op else "strided"
        b_layout = layout_of(b_op.row_stride, b_op.col_stride) if b_op else "strided"
        tma = (a_op is not None and b_op is not None and tma_ok(a_op, a_layout, self.dot_a, capability)
               and tma_ok(b_op, b_layout, self.dot_b, capability))
        if dot in K_MAJOR_DOTS and (a_layout, b_layout) != ("row", "col"):
            tma = False  # fp8, int8 and tf32 wgmma read both operands K-major from shared memory
        epilogue_text = ",".join(x.op for x in group.epilogue + group.exits)
        store_bytes = sum(t.data_type.itemsize for t in stored_values)
        out_bytes = max(1, store_bytes + sum(t.data_type.itemsize for t in epilogue_reads
                                             if tuple(t.dim[-2:]) == tuple(c.dim[-2:])))
        self.problem = MatmulProblem(_product(self.batch_sizes), m, n, k, dot, a.data_type.itemsize if a_op else 4,
                                     b.data_type.itemsize if b_op else 4, out_bytes, tma,
                                     a_layout, b_layout, epilogue_text, store_bytes)
        self.index_64 = any(max(element_span(t), top_span(graph, t)) > INT32_LIMIT
                            for t in list(group.inputs) + list(group.outputs))
        self.top_problem = self._at_bucket_top(graph)
        self.varying = self._varying_extents(graph)
        self.target = target
        self.name = kernel_name(group)

    def _at_bucket_top(self, graph) -> MatmulProblem:
        """The problem with its extents at the top of the bucket the graph was specialised at
        (symbolic.BucketExtents; the problem itself for a static graph): configs are chosen
        there, the same for every size of the bucket."""
        c_dims, a_dims = top_dims(graph, self.c), top_dims(graph, self.a)
        batch_axes = self.folded[0] if self.folded else self.batch_axes
        batch = _product(c_dims[i] for i in batch_axes)
        # descriptors only where their pitches are legal at every size of the bucket
        tma = self.problem.tma and not any(strides_vary(graph, t) for t in (self.a, self.b))
        if self.folded:
            return replace(self.problem, m=c_dims[-2] * batch, n=c_dims[-1], k=a_dims[-1], tma=tma)
        return replace(self.problem, batch=batch, m=c_dims[-2], n=c_dims[-1], k=a_dims[-1], tma=tma)

    def _varying_extents(self, graph) -> frozenset:
        """Which of "m", "n", "k" take other sizes in the bucket (none for a static graph)."""
        rows = [-2] + (list(self.folded[0]) if self.folded else [])
        found = {"m": any(varies(graph, self.c, axis) for axis in rows), "n": varies(graph, self.c, -1),
                 "k": varies(graph, self.a, -1)}
        return frozenset(name for name, varying in found.items() if varying)

    def _dot_operand_types(self, a, b) -> tuple:
        """(A, B) as the dot sees their types: a dequantized side feeds it bfloat16 (exact)."""
        def typed(side, tensor):
            return _AsType(tensor, dtypes.bfloat16) if side in self.dequantized else tensor
        return typed("a", a), typed("b", b)

    def _batches_fold(self, sides, m: int) -> bool:
        """Do the batch axes fold into the rows? Where B is shared by every batch (x @ w, a
        weight) and every other operand's batch axes and rows merge into one axis, the batched
        GEMM is one GEMM of batch x M rows: fewer, fuller tiles when M is small."""
        if not self.batch_axes:
            return False
        sizes = self.batch_sizes + (m,)
        for side, tensors, domain, _ in sides:
            for tensor in tensors:
                strides = operand_strides(domain, tuple(tensor.dim), tuple(tensor.stride))
                batch = tuple(strides[i] for i in self.batch_axes)
                if side.startswith("b") and any(batch):
                    return False
                if not side.startswith("b") and merged_stride(sizes, batch + (strides[-2],)) is None:
                    return False
        return True

    def _add(self, operands, side, tensors, domain, is_output=False):
        for tensor in tensors:
            strides = operand_strides(domain, tuple(tensor.dim), tuple(tensor.stride)) if domain else ()
            nb = len(domain) - 2 if len(domain) >= 2 else 0
            batch = tuple(strides[i] for i in self.batch_axes) if nb else ()
            row, col = (strides[-2], strides[-1]) if len(domain) >= 2 else (0, 0)
            if self.folded and nb and not side.startswith("b"):  # the batch axes are part of the rows
                axes, sizes = self.folded
                row = merged_stride(sizes + (domain[-2],), tuple(strides[i] for i in axes) + (row,))
            operands.append(GemmOperand(tensor.uid, tensor.data_type, side, batch, (row,), (col,), is_output))

    # --- launches for one config --------------------------------------------------------------
    def _loaders(self, config: MatmulConfig) -> tuple:
        """The operand loaders of `config`'s variant: descriptors for the persistent kernel."""
        if config.variant == "persistent":
            return DescriptorLoader("a", self.problem.a_layout), DescriptorLoader("b", self.problem.b_layout)
        return tuple(self._block_scaled_loader(side) if side in self.dequantized else
                     StridedLoader(side, target.uid, dot, prologue)
                     for side, target, dot, prologue in (("a", self.a, self.dot_a, self.prologue_a),
                                                         ("b", self.b, self.dot_b, self.prologue_b)))

    def _block_scaled_loader(self, side: str) -> BlockScaledLoader:
        node = self.dequantized[side]
        elements, scales = node.inputs
        return BlockScaledLoader(side, node.attrs.size, elements.data_type, scales.data_type,
                                 self.dot_a if side == "a" else self.dot_b)

    def spec(self, config: MatmulConfig, suffix: str = "", **extra) -> GemmKernelSpec:
        loader_a, loader_b = self._loaders(config)
        return GemmKernelSpec(
            name=self.name + suffix, config=config, problem=self.problem, batch_sizes=self.batch_sizes,
            c_uid=self.c.uid, operands=self.operands,
            k_walk=LinearK(self.problem.k % config.block_k != 0 or "k" in self.varying),
            loader_a=loader_a, loader_b=loader_b, epilogue=tuple(self.group.epilogue),
            exits=extra.pop("exits", ()), scale_uids=tuple(s.uid for s in self.scales),
            precision=self.precision, compute=self.graph.compute_data_type.triton_type,
            index_64=self.index_64, description=self.group.summary(), varying=self.varying, **extra)

@dataclass(frozen=True)
class _AsType:
    """A tensor seen with another data type (a dequantized operand as its loader feeds the dot)."""

    tensor: object
    data_type: object


def block_scale_sides(dequantized: dict, batch_dims: tuple, m: int, n: int, k: int) -> list:
    """(side, tensors, domain, is_output) of the block scales the block-scaled loaders read:
    A's scales over [batch..., M, K / block], B's over [batch..., K / block, N]."""
    sides = []
    for side, node in sorted(dequantized.items()):
        blocks = k // node.attrs.size
        domain = batch_dims + ((m, blocks) if side == "a" else (blocks, n))
        sides.append((f"{side}_scale", [node.inputs[1]], domain, False))
    return sides


def build_matmul(graph, group, context) -> list[KernelLaunch]:
    """The launches of a matmul group for the context's target: the model's choice (or the
    options' forced config), or the autotuned one, within the workspace budget."""
    forced = context.options.matmul_config
    return build_gemm(MatmulBuild(graph, group, context.target), "matmul",
                      lambda problem, target: schedule(problem, target, forced), context)
