"""Render a MoE group as one Triton kernel: a grouped GEMM (or its weight gradient) and its
pointwise epilogue.

Forward (`moe_grouped_matmul`): one program per (row tile slot, N tile), GROUP_M slots walking
their N tiles together (`lib.tile_of`: the weight's tiles shared in L2). The experts' row ranges,
read from first_token_offset on the device, are cut into BLOCK_M tiles numbered in expert order
(`lib.expert_tile`); a slot past the last tile has no rows and does nothing. The grid has
cdiv(T, BLOCK_M) + E slots, enough for every expert's partial last tile, so no host sync, no
per-expert launch and no padded copy. Rows past the expert's end are masked on load and store.

Weight gradient (`moe_grouped_matmul_wgrad`): one program per (expert, K tile, N tile), summing
token[rows]^T @ dout[rows] over the expert's rows BLOCK_M at a time in order: deterministic, no
atomics; an empty expert stores zeros.

Epilogue operands load at the output's coordinates with their own (broadcast) strides.

Column pairs (the group's `column_pairs`: the output read only as its two column halves, a gated
activation such as SwiGLU): each program computes both halves of its N tile (columns n and
n + N/2 of the weight, two accumulators over the same token tile), and the epilogue sees them
side by side; the whole output is never stored.
"""
from __future__ import annotations

from ..heuristics.layout import operand_strides
from .emitter import ExpressionEmitter, masked_epilogue
from .names import NameAllocator
from ...contract import KernelSource
from .pointwise import KernelArgument, kernel_module

INDENT = "    "
FIXED_NAMES = ("pid", "slot", "pid_n", "pid_k", "tiles_n", "tiles_k", "expert", "first_row", "end_row", "start",
               "end", "rows", "cols", "ks", "row_mask", "col_mask", "k_mask", "acc", "k0", "r0", "a_tile",
               "b_tile", "acc_pair", "mask", "tile_zero", "ROWS", "K", "N", "EXPERTS", "SLOTS", "GROUP_M",
               "BLOCK_M", "BLOCK_N", "BLOCK_K")


class _MoeWriter:
    """The body of one grouped GEMM kernel; one method per part of it."""

    def __init__(self, kernel_name, config, group, compute_type, dot):
        self.config, self.group, self.anchor, self.dot = config, group, group.anchor, dot
        self.forward = self.anchor.op == "moe_grouped_matmul"
        self.compute = compute_type.triton_type
        self.names = NameAllocator(FIXED_NAMES + (kernel_name,))
        self.emitter = ExpressionEmitter(self.compute, names=self.names)
        self.out = self.anchor.outputs[0]
        self.pair = [node.outputs[0] for node in group.column_pairs] if group.column_pairs else None
        # the tile's space: the output's, or one column half's where the halves ride as a pair
        self.out_dims = tuple((self.pair[0] if self.pair else self.out).dim)
        # the index variable of each output axis: rows x cols, or expert x ks x cols
        self.axis_index = (("rows", "cols") if len(self.out_dims) == 2 else (None, "rows", "cols")) \
            if self.forward else ("expert", "ks", "cols")
        first, second, offsets = self.anchor.inputs
        hints = [(first, "token"), (second, "weight" if self.forward else "dout"), (offsets, "offsets")]
        hints += [(t, "x") for t in group.inputs] + [(t, "out") for t in group.outputs]
        anchor_uids = {t.uid for t in (first, second, offsets)}
        self.operands = {}  # uid -> (identifier, the anchor's strides: every axis, or None)
        self.tile_strides = {}  # uid -> strides over the output's axes (0 where it broadcasts)
        for tensor, hint in hints:
            if tensor.uid not in self.operands:
                self.operands[tensor.uid] = (self.names.prefix(hint),
                                             tuple(tensor.stride) if tensor.uid in anchor_uids else None)
        for tensor in list(group.inputs) + list(group.outputs):
            if tensor.uid not in anchor_uids or self._in_epilogue(tensor):
                self.tile_strides[tensor.uid] = operand_strides(self.out_dims, tensor.dim, tensor.stride)
        self.body: list[str] = []

    def _in_epilogue(self, tensor) -> bool:
        return any(tensor.uid == t.uid for node in self.group.epilogue for t in node.input_tensors())

    def line(self, text: str, depth: int = 1):
        self.body.append(INDENT * depth + text)

    def _ids(self, position):
        return self.operands[self.anchor.inputs[position].uid][0]

    def _row_col(self, position):
        """(row stride, column stride) argument names of a [T, C] / [1, T, C] operand."""
        identifier, strides = self.operands[self.anchor.inputs[position].uid]
        rank = len(strides)
        return f"{identifier}_stride_{rank - 2}", f"{identifier}_stride_{rank - 1}"

    def _dot(self, a, b, acc="acc"):
        precision = f", input_precision=\"{self.dot.precision}\"" if self.dot.precision else ""
        return f"{acc} = tl.dot({a}.to({self.dot.a_type}), {b}.to({self.dot.b_type}), {acc}{precision})"

    def grouped_forward(self):
        token, offsets = self._ids(0), self._ids(2)
        weight = self._ids(1)
        token_row, token_col = self._row_col(0)
        self.line("pid = tl.program_id(0)")
        self.line("tiles_n = tl.cdiv(N, BLOCK_N)")
        self.line("slot, pid_n = lib.tile_of(pid, SLOTS, tiles_n, GROUP_M)  # GROUP_M slots share weight tiles")
        self.line("slot = slot.to(tl.int64)")
        self.line(f"expert, first_row, end_row = lib.expert_tile(slot, {offsets}_ptr, {offsets}_stride_0, EXPERTS, "
                  f"ROWS, BLOCK_M)")
        self.line("if first_row < end_row:  # a slot past the last tile has no rows")
        self.line("rows = first_row + tl.arange(0, BLOCK_M)", 2)
        self.line("row_mask = rows < end_row", 2)
        self.line("cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)", 2)
        self.line("col_mask = cols < N", 2)
        self.line("acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)", 2)
        if self.pair:
            self.line("acc_pair = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)", 2)
        self.line("for k0 in range(0, K, BLOCK_K):", 2)
        self.line("ks = k0 + tl.arange(0, BLOCK_K)", 3)
        self.line("k_mask = ks < K", 3)
        self.line(f"a_tile = tl.load({token}_ptr + rows[:, None] * {token_row} + ks[None, :] * {token_col}, "
                  f"mask=row_mask[:, None] & k_mask[None, :], other=0)", 3)
        self.line(f"b_tile = tl.load({weight}_ptr + expert * {weight}_stride_0 + ks[:, None] * {weight}_stride_1 "
                  f"+ cols[None, :] * {weight}_stride_2, mask=k_mask[:, None] & col_mask[None, :], other=0)", 3)
        self.line(self._dot("a_tile", "b_tile"), 3)
        if self.pair:  # the second half's columns: N further along the weight
            self.line(f"b_tile = tl.load({weight}_ptr + expert * {weight}_stride_0 + ks[:, None] * {weight}_stride_1 "
                      f"+ (cols + N)[None, :] * {weight}_stride_2, mask=k_mask[:, None] & col_mask[None, :], "
                      f"other=0)", 3)
            self.line(self._dot("a_tile", "b_tile", "acc_pair"), 3)
        self.line("mask = row_mask[:, None] & col_mask[None, :]", 2)
        if self.pair:
            self.emitter.bind(self.pair[0].uid, "acc", "f")
            self.emitter.bind(self.pair[1].uid, "acc_pair", "f")
        else:
            self.emitter.bind(self.out.uid, "acc", "f")
        self.epilogue_and_stores(2)

    def grouped_wgrad(self):
        token, dout, offsets = self._ids(0), self._ids(1), self._ids(2)
        token_row, token_col = self._row_col(0)
        dout_row, dout_col = self._row_col(1)
        self.line("pid = tl.program_id(0)")
        self.line("tiles_n = tl.cdiv(N, BLOCK_N)")
        self.line("tiles_k = tl.cdiv(K, BLOCK_K)")
        self.line("expert = (pid // (tiles_k * tiles_n)).to(tl.int64)")
        self.line("pid_k = (pid // tiles_n) % tiles_k")
        self.line("pid_n = pid % tiles_n")
        self.line(f"start, end = lib.expert_rows({offsets}_ptr, {offsets}_stride_0, expert, EXPERTS, ROWS)")
        self.line("ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)")
        self.line("k_mask = ks < K")
        self.line("cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        self.line("col_mask = cols < N")
        self.line("acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)")
        self.line("for r0 in range(start, end, BLOCK_M):  # in order: the same sum on every run")
        self.line("rows = r0 + tl.arange(0, BLOCK_M)", 2)
        self.line("row_mask = rows < end", 2)
        self.line(f"a_tile = tl.load({token}_ptr + rows[None, :] * {token_row} + ks[:, None] * {token_col}, "
                  f"mask=k_mask[:, None] & row_mask[None, :], other=0)", 2)
        self.line(f"b_tile = tl.load({dout}_ptr + rows[:, None] * {dout_row} + cols[None, :] * {dout_col}, "
                  f"mask=row_mask[:, None] & col_mask[None, :], other=0)", 2)
        self.line(self._dot("a_tile", "b_tile"), 2)
        self.line("mask = k_mask[:, None] & col_mask[None, :]")
        self.emitter.bind(self.out.uid, "acc", "f")
        self.epilogue_and_stores(1)

    def offset(self, uid) -> str:
        """Operand `uid`'s element offsets over the output tile (broadcast axes left out)."""
        identifier, strides = self.operands[uid][0], self.tile_strides[uid]
        terms = []
        for axis, stride in enumerate(strides):
            index = self.axis_index[axis]
            if not stride or index is None:
                continue
            shaped = {"rows": "rows[:, None]", "ks": "ks[:, None]", "cols": "cols[None, :]"}.get(index, index)
            terms.append(f"{shaped} * {identifier}_tile_stride_{axis}")
        return " + ".join(["tile_zero"] + terms)

    def epilogue_and_stores(self, depth):
        first = "BLOCK_M" if self.forward else "BLOCK_K"
        self.line(f"tile_zero = tl.zeros([{first}, BLOCK_N], dtype=tl.int64)", depth)
        made = {self.out.uid} | {t.uid for n in self.group.nodes for t in n.output_tensors()}
        for text in masked_epilogue(self.emitter, self.group.epilogue, made, self.operands, self.offset,
                                    self.group.outputs):
            self.line(text, depth)

    def arguments(self, geometry) -> list:
        args = [KernelArgument("tensor", f"{identifier}_ptr", uid) for uid, (identifier, _) in self.operands.items()]
        for uid, (identifier, strides) in self.operands.items():
            args += [KernelArgument("int", f"{identifier}_stride_{axis}", stride)
                     for axis, stride in enumerate(strides or ())]
            args += [KernelArgument("int", f"{identifier}_tile_stride_{axis}", stride)
                     for axis, stride in enumerate(self.tile_strides.get(uid, ())) if stride]
        columns = geometry.n // 2 if self.pair else geometry.n  # a pair's tiles span one half
        args += [KernelArgument("int", "ROWS", geometry.rows), KernelArgument("int", "K", geometry.k),
                 KernelArgument("int", "N", columns), KernelArgument("int", "EXPERTS", geometry.experts)]
        if self.forward:
            args += [KernelArgument("int", "SLOTS", -(-geometry.rows // self.config.block_m) + geometry.experts),
                     KernelArgument("constexpr", "GROUP_M", self.config.group_m)]
        args += [KernelArgument("constexpr", "BLOCK_M", self.config.block_m),
                 KernelArgument("constexpr", "BLOCK_N", self.config.block_n),
                 KernelArgument("constexpr", "BLOCK_K", self.config.block_k)]
        return args


def render(kernel_name: str, config, group, geometry, compute_type, dot, description: str):
    """The KernelSource of the kernel running a MoE group under `config` (a MoeConfig), its dots
    as `dot` (a DotChoice) says."""
    writer = _MoeWriter(kernel_name, config, group, compute_type, dot)
    if writer.forward:
        writer.grouped_forward()
    else:
        writer.grouped_wgrad()
    args = writer.arguments(geometry)
    return KernelSource(kernel_name, kernel_module(description, writer.emitter.globals, kernel_name, args,
                                                   "\n".join(writer.body) + "\n", libraries=("lib",)), args)
