"""Pooling geometry: N, C, spatial sizes in and out, window, stride, padding, mode."""
from __future__ import annotations

from dataclasses import dataclass

from .base import as_tuple, problem


@dataclass(frozen=True)
class PoolingGeometry:
    """direction: "forward" | "backward"; x [N, C, *input], y [N, C, *output]."""

    direction: str
    mode: str
    n: int
    c: int
    input_spatial: tuple
    output_spatial: tuple
    window: tuple
    stride: tuple
    padding: tuple
    ceil_mode: bool


def pooling_problem(graph, group):
    node = group.anchor
    attrs = node.attrs
    if node.op == "pooling":
        direction, x, y = "forward", node.inputs[0], node.outputs[0]
    else:  # pooling_backward(dy, ..., x?) -> dx: dx has x's dims, dy y's
        direction, y, x = "backward", node.inputs[0], node.outputs[0]
    geometry = PoolingGeometry(direction, attrs.mode, int(x.dim[0]), int(x.dim[1]), tuple(int(d) for d in x.dim[2:]),
                               tuple(int(d) for d in y.dim[2:]), as_tuple(attrs.window), as_tuple(attrs.stride),
                               as_tuple(attrs.padding), bool(attrs.ceil_mode))
    return problem(graph, group, geometry)
