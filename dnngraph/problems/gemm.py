"""GEMM geometry: batch, M, N, K and the operands' layouts."""
from __future__ import annotations

from dataclasses import dataclass

from .base import problem, product


@dataclass(frozen=True)
class GemmGeometry:
    """C[batch, M, N] = A[batch, M, K] @ B[batch, K, N]. Layouts: "row" (the last axis is
    contiguous: K for A, N for B), "col" (the other matrix axis is), else "strided"."""

    batch: int
    m: int
    n: int
    k: int
    a_layout: str
    b_layout: str
    batch_dims: tuple = ()
    scaled: bool = False  # scale_a / scale_b operands (fp8)
    allow_tf32: bool = False  # fp32 operands may take TF32 math


def layout(tensor) -> str:
    if len(tensor.dim) < 2:
        return "row"
    rows, cols = tensor.stride[-2], tensor.stride[-1]
    if cols == 1 or tensor.dim[-1] == 1:
        return "row"
    if rows == 1 or tensor.dim[-2] == 1:
        return "col"
    return "strided"


def matmul_problem(graph, group):
    node = group.anchor
    a, b, scale_a, scale_b = node.inputs
    c = node.outputs[0]
    batch_dims = tuple(int(d) for d in c.dim[:-2])
    geometry = GemmGeometry(product(batch_dims), int(c.dim[-2]), int(c.dim[-1]), int(a.dim[-1]),
                            layout(a), layout(b), batch_dims, scale_a is not None or scale_b is not None,
                            bool(node.attrs.allow_tf32))
    return problem(graph, group, geometry)
