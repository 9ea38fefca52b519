"""Row geometry: softmax, norms and reductions reduce rows of a tensor; how many rows, how long."""
from __future__ import annotations

from dataclasses import dataclass

from .base import problem, product


@dataclass(frozen=True)
class RowsGeometry:
    """kind: "softmax" | "norm" | "reduction" (the family); op: the anchor's op; dims: the reduced
    tensor's; reduced_axes: the axes a row runs along (row_length elements); rows: the rest."""

    kind: str
    op: str
    dims: tuple
    reduced_axes: tuple
    rows: int
    row_length: int


def _norm_axes(node, rank: int) -> tuple:
    """The axes one norm statistic reduces (cuDNN's conventions, channels on axis 1)."""
    op = node.op.removesuffix("_backward")
    if op in ("layernorm", "rmsnorm", "adalayernorm"):
        return tuple(range(1, rank))
    if op == "instancenorm":
        return tuple(range(2, rank))
    if op == "groupnorm":
        return tuple(range(1, rank))  # per group of channels: rows are (N, groups) below
    return (0,) + tuple(range(2, rank))  # batchnorm, batchnorm_inference, genstats: per channel


def rows_problem(graph, group):
    node = group.anchor
    x = node.inputs[0]
    dims = tuple(int(d) for d in x.dim)
    if group.kind == "softmax":
        axes = (node.attrs.axis % len(dims),)
    elif group.kind == "reduction":
        axes = tuple(node.attrs.axes)
    else:
        axes = _norm_axes(node, len(dims))
    length = product(dims[a] for a in axes)
    rows = product(dims) // max(1, length)
    if group.kind == "norm" and node.op.removesuffix("_backward") == "groupnorm":
        groups = int(getattr(node.attrs, "groups", 1) or 1)
        rows, length = rows * groups, length // groups
    return problem(graph, group, RowsGeometry(group.kind, node.op, dims, axes, rows, length))
