"""Windowed normalization geometry (LRN, divisive normalization): x's dims, the window, the constants."""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.lrn import window_axes, window_count
from .base import problem


@dataclass(frozen=True)
class LrnGeometry:
    """direction: "forward" | "backward"; the window runs over `axes` of x [N, C, *spatial]."""

    direction: str
    op: str  # the forward op: "lrn" | "divisive_normalization"
    dims: tuple
    axes: tuple
    size: int
    count: int  # elements of a whole window (alpha is divided by it)
    alpha: float
    beta: float
    k: float
    centred: bool  # a means input is subtracted first


def lrn_problem(graph, group):
    node = group.anchor
    backward = node.op.endswith("_backward")
    op = node.op[:-len("_backward")] if backward else node.op
    x = node.inputs[1] if backward else node.inputs[0]
    means = node.inputs[2 if backward else 1] if op == "divisive_normalization" else None
    rank, attrs = len(x.dim), node.attrs
    geometry = LrnGeometry("backward" if backward else "forward", op, tuple(int(d) for d in x.dim),
                           window_axes(op, rank), attrs.size, window_count(op, rank, attrs), attrs.alpha,
                           attrs.beta, attrs.k, means is not None)
    return problem(graph, group, geometry)
