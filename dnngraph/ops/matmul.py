"""Matmul family: [..., M, K] @ [..., K, N] with broadcast batch dims; output row-major.

fp8 operands carry optional per-tensor scales (one-element float tensors): the result is
(A @ B) * scale_a * scale_b, the dequantization a scaled fp8 GEMM applies after accumulation.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from typing import Optional

import torch

from .. import dtypes
from ..tensor import contiguous_strides
from ..errors import UnsupportedError
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, boolean, broadcast_dims, fail, freeze, register

MATMUL_TYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16, dtypes.float8_e4m3, dtypes.float8_e5m2,
                dtypes.int8)
FP8_TYPES = (dtypes.float8_e4m3, dtypes.float8_e5m2)
# int8 x int8 sums in int32 (as cuDNN and the tensor cores do). One product is at most
# (-128) * (-128) = 2^14, so a reduction of up to (2^31 - 1) // 2^14 = 131071 products never
# overflows; a longer one could, and is refused rather than left to wrap.
INT8_MAX_K = (2**31 - 1) // (128 * 128)


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
    integer = check_int8_operands("matmul", a, b, a.dim[-1])
    for role, operand in (("a", a), ("b", b)):
        if operand.producer is None and operand.data_type not in MATMUL_TYPES:
            fail("matmul", f"{role} {operand.name!r} is {operand.data_type.name}; matmul takes "
                           f"{', '.join(t.name for t in MATMUL_TYPES)}")
    _check_scale("scale_a", scale_a)
    _check_scale("scale_b", scale_b)
    batch = broadcast_dims("matmul", [("a batch", a.dim[:-2]), ("b batch", b.dim[:-2])]) \
        if len(a.dim) > 2 or len(b.dim) > 2 else ()
    dim = tuple(batch) + (a.dim[-2], b.dim[-1])
    if integer and (scale_a is not None or scale_b is not None):
        fail("matmul", "int8 operands take no scale_a / scale_b: scale the int32 result with mul nodes "
                       "(per tensor or per channel), which fuse into the epilogue")
    return [OutputSpec(dim, dtypes.int32 if integer else None, stride=contiguous_strides(dim))]


def check_int8_operands(op: str, a, b, reduction: Optional[int]) -> bool:
    """Whether `op` multiplies int8 by int8 (its result is then the int32 sum); an int8 operand
    with a float one, or a reduction of `reduction` products that could overflow int32, is a
    ValidationError. `reduction` None: no bound is checked, the sum wraps modulo 2^32 (wgrad,
    whose reduction over N x pixels is long; see conv.py). A uint8 operand is an UnsupportedError."""
    _refuse_uint8(op, a, b)
    int8 = [t.data_type is dtypes.int8 for t in (a, b)]
    if not any(int8):
        return False
    if not all(int8):
        fail(op, f"int8 multiplies only int8 (int32 accumulation): {a.name!r} is {a.data_type.name}, "
                 f"{b.name!r} is {b.data_type.name}; cast the other operand to int8 (quantize) or both to a float")
    if reduction is not None and reduction > INT8_MAX_K:
        fail(op, f"int8 reduction of {reduction} products could overflow the int32 accumulator "
                 f"(at most {INT8_MAX_K}: 2^31 / 128^2)")
    return True


def _refuse_uint8(op: str, a, b):
    """uint8 operands are valid quantized data, but no tensor-core kernel takes them: Triton
    3.6's tl.dot multiplies integers only as int8 x int8 (no u8 x u8, no u8 x s8)."""
    for operand in (a, b):
        if operand.data_type is dtypes.uint8:
            raise UnsupportedError(f"{op}: {operand.name!r} is uint8, which no kernel multiplies (Triton 3.6's tl.dot "
                                   f"takes int8 x int8 only); shift it to int8 (x - 128, an int8 zero point) and "
                                   f"add the zero point's term back in the epilogue, or cast both operands to a float")


def exact_integer_product(operation, *operands) -> torch.Tensor:
    """The float64 reference of an int8 product as the kernel's int32 accumulator holds it: the
    integer sum (every partial sum is an integer below 2^53, so float64 adds it exactly in any
    order), as int64."""
    return torch.round(operation(*(t.to(torch.float64) for t in operands))).to(torch.int64)


def wrapped_to_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 `values` as an int32 accumulator holds them: modulo 2^32, in [-2^31, 2^31) (two's
    complement wrap-around, what the tensor cores' and the interpreter's int32 adds do)."""
    return torch.remainder(values + 2**31, 2**32) - 2**31


def reference(values, attrs: MatmulAttrs):
    a, b, scale_a, scale_b = (list(values) + [None, None])[:4]
    if not a.is_floating_point():  # int8 x int8 (the op allows no other integers)
        return [exact_integer_product(torch.matmul, a, b)]
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
