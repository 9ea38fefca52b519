"""Matmul family: [..., M, K] @ [..., K, N] with broadcast batch dims; output row-major."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensor import contiguous_strides
from .base import OpDef, OutputSpec, broadcast_dims, fail, register


@dataclass(frozen=True)
class MatmulAttrs:
    allow_tf32: bool = False  # fp32 inputs: IEEE math unless the graph opts in


def infer(inputs, attrs: MatmulAttrs):
    a, b = inputs
    if len(a.dim) < 2 or len(b.dim) < 2:
        fail("matmul", f"operands need rank >= 2: a {list(a.dim)}, b {list(b.dim)}")
    if a.dim[-1] != b.dim[-2]:
        fail("matmul", f"inner dims differ: a {list(a.dim)} (K={a.dim[-1]}) @ b {list(b.dim)} (K={b.dim[-2]})")
    batch = broadcast_dims("matmul", [("a batch", a.dim[:-2]), ("b batch", b.dim[:-2])]) \
        if len(a.dim) > 2 or len(b.dim) > 2 else ()
    dim = tuple(batch) + (a.dim[-2], b.dim[-1])
    return [OutputSpec(dim, stride=contiguous_strides(dim))]


def reference(values, attrs: MatmulAttrs):
    a, b = values
    return [torch.matmul(a, b)]


register(OpDef("matmul", "matmul", "anchor", MatmulAttrs, ("a", "b"), ("c",), infer, reference))
