"""Block-scale quantization geometry: the blocks (count, size, axis) and the formats."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .base import problem


@dataclass(frozen=True)
class BlockScaleGeometry:
    op: str  # "block_scale_quantize" | "block_scale_dequantize"
    dims: tuple  # x's
    axis: int
    block_size: int
    blocks: int  # scales: one per block
    element_type: str  # the quantized tensor's data type name
    scale_type: str


def block_scale_problem(graph, group):
    node = group.anchor
    if node.op == "block_scale_quantize":
        (x,), (quantized, scale) = node.inputs, node.outputs
        axis, size = node.attrs.axis, node.attrs.block_size
    else:
        (quantized, scale), x = node.inputs, node.inputs[0]
        axis, size = node.attrs.axis, node.attrs.size
    geometry = BlockScaleGeometry(node.op, tuple(int(d) for d in x.dim), axis, size, math.prod(scale.dim),
                                  quantized.data_type.name, scale.data_type.name)
    return problem(graph, group, geometry)
