"""Convolution geometry: N, C, K, spatial sizes, filter, stride, padding, dilation, groups and
the direction."""
from __future__ import annotations

from dataclasses import dataclass

from .base import as_tuple, problem

DIRECTIONS = {"conv_fprop": "fprop", "conv_dgrad": "dgrad", "conv_wgrad": "wgrad"}


@dataclass(frozen=True)
class ConvGeometry:
    """x [N, C, *input], w [K, C / groups, *filter], y [N, K, *output] whatever the direction
    (fprop computes y, dgrad x from dy, wgrad w from dy and x)."""

    direction: str
    n: int
    c: int
    k: int
    input_spatial: tuple
    output_spatial: tuple
    filter: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int


def conv_problem(graph, group):
    node = group.anchor
    direction = DIRECTIONS[node.op]
    if direction == "fprop":
        (x, w), y = node.inputs[:2], node.outputs[0]
    elif direction == "dgrad":
        (y, w), x = node.inputs[:2], node.outputs[0]
    else:
        (y, x), w = node.inputs[:2], node.outputs[0]
    attrs = node.attrs
    geometry = ConvGeometry(direction, int(x.dim[0]), int(x.dim[1]), int(w.dim[0]),
                            tuple(int(d) for d in x.dim[2:]), tuple(int(d) for d in y.dim[2:]),
                            tuple(int(d) for d in w.dim[2:]), as_tuple(attrs.stride), as_tuple(attrs.padding),
                            as_tuple(attrs.dilation), int(attrs.groups))
    return problem(graph, group, geometry)
