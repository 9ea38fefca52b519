"""Matmul family: [..., M, K] @ [..., K, N] with broadcast batch dims; output row-major.

fp8 operands carry optional per-tensor scales (one-element float tensors): the result is
(A @ B) * scale_a * scale_b, the dequantization a scaled fp8 GEMM applies after accumulation.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from .. import dtypes
from ..tensor import contiguous_strides
from ..errors import UnsupportedError
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, boolean, broadcast_dims, fail, freeze, register

MATMUL_TYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16, dtypes.float8_e4m3, dtypes.float8_e5m2)
FP8_TYPES = (dtypes.float8_e4m3, dtypes.float8_e5m2)


@dataclass(frozen=True)
class MatmulAttrs:
    allow_tf32: bool = False  # fp32 inputs: IEEE math unless the graph opts in

    def __post_init__(self):
        freeze(self, allow_tf32=boolean("matmul", "allow_tf32", self.allow_tf32))


def _check_scale(name: str, scale):
    if scale is None:
        return
    count = 1
    for size in scale.dim:
        count *= size
    if count != 1:
        fail("matmul", f"{name} must hold one value (a per-tensor scale), got dims {list(scale.dim)}")
    if not scale.data_type.is_floating:
        fail("matmul", f"{name} must be floating point, got {scale.data_type.name}")


def infer(inputs, attrs: MatmulAttrs):
    a, b, scale_a, scale_b = (list(inputs) + [None, None])[:4]
    if len(a.dim) < 2 or len(b.dim) < 2:
        fail("matmul", f"operands need rank >= 2: a {list(a.dim)}, b {list(b.dim)}")
    if a.dim[-1] != b.dim[-2]:
        fail("matmul", f"inner dims differ: a {list(a.dim)} (K={a.dim[-1]}) @ b {list(b.dim)} (K={b.dim[-2]})")
    for role, operand in (("a", a), ("b", b)):
        if operand.producer is None and operand.data_type not in MATMUL_TYPES:
            fail("matmul", f"{role} {operand.name!r} is {operand.data_type.name}; matmul takes "
                           f"{', '.join(t.name for t in MATMUL_TYPES)}")
    _check_scale("scale_a", scale_a)
    _check_scale("scale_b", scale_b)
    batch = broadcast_dims("matmul", [("a batch", a.dim[:-2]), ("b batch", b.dim[:-2])]) \
        if len(a.dim) > 2 or len(b.dim) > 2 else ()
    dim = tuple(batch) + (a.dim[-2], b.dim[-1])
    return [OutputSpec(dim, stride=contiguous_strides(dim))]


def reference(values, attrs: MatmulAttrs):
    a, b, scale_a, scale_b = (list(values) + [None, None])[:4]
    result = torch.matmul(a, b)
    for scale in (scale_a, scale_b):
        if scale is not None:
            result = result * scale.reshape(())
    return [result]


register(OpDef("matmul", "matmul", "anchor", MatmulAttrs, ("a", "b", "scale_a", "scale_b"), ("c",), infer,
               reference, optional=("scale_a", "scale_b"),
               # row amax (fp8 scaling) or row sums of the epilogue value, folded across N tiles
               fusion=AnchorRule((0, 1), 0, frozenset({"sum", "mean", "max", "min", "amax", "norm1", "norm2"}))))


def _transposed(g, value):
    """The last two axes swapped (a view: no kernel)."""
    order = list(range(len(value.dim)))
    order[-2:] = order[-1], order[-2]
    return g.transpose(value, order)


@backward_rule("matmul")
def _matmul_backward(d, node, grads):
    """dA = dC B^T, dB = A^T dC (batch axes the forward broadcast are summed by the caller)."""
    if any(t is not None for t in node.inputs[2:]):
        raise UnsupportedError("matmul: no gradient through fp8 scales")
    g, dc, tf32 = d.graph, grads[0], node.attrs.allow_tf32
    a, b = node.inputs[:2]
    da = g.matmul(dc, _transposed(g, d.value(b)), allow_tf32=tf32) if d.needs(a) else None
    db = None
    if d.needs(b) and len(b.dim) == 2 and len(a.dim) > 2:
        # a weight shared by every batch (x @ w): one GEMM over the batch folded into K, not a
        # batched GEMM and a sum over the batch
        rows = math.prod(a.dim[:-1])
        folded_a = g.reshape(d.value(a), [rows, a.dim[-1]])
        folded_dc = g.reshape(dc, [rows, dc.dim[-1]])
        db = g.matmul(_transposed(g, folded_a), folded_dc, allow_tf32=tf32)
    elif d.needs(b):
        db = g.matmul(_transposed(g, d.value(a)), dc, allow_tf32=tf32)
    return [da, db, None, None]
