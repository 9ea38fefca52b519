"""Gather geometry: gather and scatter_add along one axis."""
from __future__ import annotations

from dataclasses import dataclass

from .base import problem


@dataclass(frozen=True)
class GatherGeometry:
    op: str  # "gather" | "scatter_add"
    dims: tuple  # the indexed tensor's: gather's x, scatter_add's y
    index_dims: tuple
    axis: int


def gather_problem(graph, group):
    node = group.anchor
    index = node.inputs[1]
    x = node.inputs[0] if node.op == "gather" else node.outputs[0]
    geometry = GatherGeometry(node.op, tuple(int(d) for d in x.dim), tuple(int(d) for d in index.dim),
                              int(node.attrs.axis) % max(1, len(x.dim)))
    return problem(graph, group, geometry)
