"""MoE family: grouped GEMMs of a mixture-of-experts layer, one GEMM per expert over its tokens.

`moe_grouped_matmul(token, weight, first_token_offset)`: token [T, K] (or [1, T, K]) holds the
tokens sorted by expert, weight [E, K, N] one matrix per expert (a K-major weight is a stride
choice: strides (K*N, 1, K)), first_token_offset [E] (or [E, 1, 1]) int32/int64 the first token
row of each expert, as in the cuDNN frontend's routing mode "none". Expert e owns the rows
[off[e], off[e+1]) (the last one [off[E-1], T)); an expert with no rows is empty. The output
[T, N] (the token's rank) is, for those rows, token[rows] @ weight[e].

`moe_grouped_matmul_wgrad(token, dout, first_token_offset)`: the weight gradient, [E, K, N] with
dweight[e] = token[rows of e]^T @ dout[rows of e] (zero for an empty expert).

A gated activation over the output's two column halves (SwiGLU: silu(out[:, :N/2]) * out[:, N/2:],
written with two slices) fuses into the forward kernel (AnchorRule.column_pairs).

Offsets are data, read by the kernels (no host sync): they must start at 0, never decrease and
stay within T. `g.reference` raises ValidationError otherwise, and `execute` raises ExecutionError
before any kernel runs where the bound offsets are on the host (CPU tensors: the interpreter).
On the GPU they are never read back (no sync) and a kernel cannot raise: it clamps every offset
to [0, T] and each expert's end to at least its start, so bad offsets never read or write outside
the tensors, but rows no expert owns are then left unwritten, and rows two experts claim
(decreasing offsets) are written by both, in no set order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dtypes
from ..tensor import contiguous_strides
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, boolean, fail, freeze, register

MOE_TYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)
OFFSET_TYPES = (dtypes.int32, dtypes.int64)


@dataclass(frozen=True)
class MoeGroupedMatmulAttrs:
    allow_tf32: bool = False  # fp32 operands: IEEE math unless the graph opts in

    def __post_init__(self):
        freeze(self, allow_tf32=boolean("moe_grouped_matmul", "allow_tf32", self.allow_tf32))


def token_rows(op: str, role: str, tensor) -> tuple[int, int]:
    """(rows, columns) of a [T, C] or [1, T, C] operand."""
    dims = tuple(tensor.dim)
    if len(dims) == 3 and dims[0] == 1:
        dims = dims[1:]
    if len(dims) != 2:
        fail(op, f"{role} {tensor.name!r} must be [T, C] or [1, T, C], got {list(tensor.dim)}")
    return dims


def expert_count(op: str, offsets) -> int:
    """E, from first_token_offset [E] or [E, 1, 1] (int32 or int64)."""
    if offsets.data_type not in OFFSET_TYPES:
        fail(op, f"first_token_offset {offsets.name!r} must be int32 or int64, got {offsets.data_type.name}")
    dims = tuple(offsets.dim)
    if len(dims) not in (1, 3) or any(size != 1 for size in dims[1:]) or dims[0] < 1:
        fail(op, f"first_token_offset {offsets.name!r} must be [E] or [E, 1, 1] with E >= 1, got {list(dims)}")
    return dims[0]


def _check_floating(op: str, role: str, tensor):
    if tensor.producer is None and tensor.data_type not in MOE_TYPES:
        fail(op, f"{role} {tensor.name!r} is {tensor.data_type.name}; {op} takes "
                 f"{', '.join(t.name for t in MOE_TYPES)}")


def infer(inputs, attrs: MoeGroupedMatmulAttrs):
    token, weight, offsets = inputs
    op = "moe_grouped_matmul"
    _check_floating(op, "token", token)
    _check_floating(op, "weight", weight)
    rows, k = token_rows(op, "token", token)
    if len(weight.dim) != 3:
        fail(op, f"weight {weight.name!r} must be [E, K, N], got {list(weight.dim)}")
    experts, weight_k, n = weight.dim
    if weight_k != k:
        fail(op, f"inner dims differ: token {list(token.dim)} (K={k}), weight {list(weight.dim)} (K={weight_k})")
    if expert_count(op, offsets) != experts:
        fail(op, f"first_token_offset {list(offsets.dim)} must hold one offset per expert ({experts})")
    dim = tuple(token.dim[:-1]) + (n,)
    return [OutputSpec(dim, stride=contiguous_strides(dim))]


def infer_wgrad(inputs, attrs: MoeGroupedMatmulAttrs):
    token, dout, offsets = inputs
    op = "moe_grouped_matmul_wgrad"
    _check_floating(op, "token", token)
    _check_floating(op, "dout", dout)
    rows, k = token_rows(op, "token", token)
    dout_rows, n = token_rows(op, "dout", dout)
    if dout_rows != rows:
        fail(op, f"token {list(token.dim)} and dout {list(dout.dim)} must have the same rows")
    dim = (expert_count(op, offsets), k, n)
    return [OutputSpec(dim, stride=contiguous_strides(dim))]


def expert_ranges(offsets: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """[(start, end)] per expert from host offsets; ValidationError where they are not ordered
    row offsets starting at 0 within [0, rows]."""
    starts = [int(v) for v in offsets.reshape(-1).tolist()]
    if starts[0] != 0:
        fail("moe_grouped_matmul", f"first_token_offset must start at 0, got {starts[0]}")
    ends = starts[1:] + [rows]
    for expert, (start, end) in enumerate(zip(starts, ends)):
        if start > rows:
            fail("moe_grouped_matmul", f"first_token_offset of expert {expert} is {start}, past T={rows}")
        if end < start:
            fail("moe_grouped_matmul", f"first_token_offset decreases at expert {expert + 1}: {start} > {end}")
    return list(zip(starts, ends))


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[-2], tensor.shape[-1])


def reference(values, attrs: MoeGroupedMatmulAttrs):
    token, weight, offsets = values
    rows = _as_rows(token)
    out = torch.zeros(rows.shape[0], weight.shape[-1], dtype=token.dtype, device=token.device)
    for expert, (start, end) in enumerate(expert_ranges(offsets, rows.shape[0])):
        out[start:end] = rows[start:end] @ weight[expert]
    return [out.reshape(tuple(token.shape[:-1]) + (weight.shape[-1],))]


def reference_wgrad(values, attrs: MoeGroupedMatmulAttrs):
    token, dout, offsets = values
    rows, grad_rows = _as_rows(token), _as_rows(dout)
    ranges = expert_ranges(offsets, rows.shape[0])
    dweight = torch.zeros(len(ranges), rows.shape[1], grad_rows.shape[1], dtype=token.dtype, device=token.device)
    for expert, (start, end) in enumerate(ranges):
        dweight[expert] = rows[start:end].transpose(0, 1) @ grad_rows[start:end]
    return [dweight]


# The output's pointwise consumers (an activation, a cast) ride the kernel's store, and so does a
# gated activation over its two column halves (SwiGLU: silu(out[:, :N/2]) * out[:, N/2:]); no
# prologue: the kernels read token rows by the offsets, so a producer would run at scheduled
# positions.
register(OpDef("moe_grouped_matmul", "moe", "anchor", MoeGroupedMatmulAttrs, ("token", "weight", "first_token_offset"),
               ("out",), infer, reference, fusion=AnchorRule((), 0, column_pairs=True)))
register(OpDef("moe_grouped_matmul_wgrad", "moe", "anchor", MoeGroupedMatmulAttrs,
               ("token", "dout", "first_token_offset"), ("dweight",), infer_wgrad, reference_wgrad,
               fusion=AnchorRule((), 0)))


@backward_rule("moe_grouped_matmul")
def _moe_backward(d, node, grads):
    """dtoken = the same grouped GEMM of dout with each expert's weight transposed (a view);
    dweight = the grouped weight gradient; the offsets take none."""
    token, weight, offsets = node.inputs
    g, dout, tf32 = d.graph, grads[0], node.attrs.allow_tf32
    if dout is None:
        return [None, None, None]
    dtoken = dweight = None
    if d.needs(token):
        dtoken = g.moe_grouped_matmul(dout, g.transpose(d.value(weight), [0, 2, 1]), d.value(offsets),
                                      allow_tf32=tf32)
    if d.needs(weight):
        dweight = g.moe_grouped_matmul_wgrad(d.value(token), dout, d.value(offsets), allow_tf32=tf32)
    return [dtoken, dweight, None]


@backward_rule("moe_grouped_matmul_wgrad")
def _moe_wgrad_backward(d, node, grads):
    """dtoken = dout @ ddweight[e]^T per expert; ddout = token @ ddweight[e] per expert."""
    token, dout, offsets = node.inputs
    g, ddweight, tf32 = d.graph, grads[0], node.attrs.allow_tf32
    if ddweight is None:
        return [None, None, None]
    dtoken = g.moe_grouped_matmul(d.value(dout), g.transpose(ddweight, [0, 2, 1]), d.value(offsets),
                                  allow_tf32=tf32) if d.needs(token) else None
    ddout = g.moe_grouped_matmul(d.value(token), ddweight, d.value(offsets), allow_tf32=tf32) \
        if d.needs(dout) else None
    return [dtoken, ddout, None]
