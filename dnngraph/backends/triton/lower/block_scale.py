"""Build the launch of a block-scale group (block_scale_quantize, block_scale_dequantize)."""
from __future__ import annotations

from .... import dtypes
from ....errors import UnsupportedError
from ....ops.block_scale import check_rounding, check_types
from ....runtime.launch import element_span, kernel_name, launch_of
from ..heuristics.layout import INT32_LIMIT
from ..codegen.block_scale import render
from ..heuristics.block_scale import fitted, rank


def _operands(node):
    """(high-precision tensor, quantized elements, scales, the op's result, block axis)."""
    if node.op == "block_scale_quantize":
        (x,), (y, scale) = node.inputs, node.outputs
        return x, y, scale, y, node.attrs.axis
    (x, scale), (y,) = node.inputs, node.outputs
    return y, x, scale, y, node.attrs.axis


def _check(node):
    _, quantized, scale, output, axis = _operands(node)
    where = f"node {node.name!r} ({node.op})"
    check_types(where, quantized.data_type, scale.data_type)
    if node.op == "block_scale_quantize":
        check_rounding(where, node.attrs, scale.data_type)
    if node.op == "block_scale_dequantize" and (not output.data_type.is_floating
                                                or output.data_type.is_block_scale_storage):
        raise UnsupportedError(f"{where}: y must be float32, float16, bfloat16 or fp8, got {output.data_type.name}")
    if quantized.data_type is dtypes.float4_e2m1 and dtypes.packed_axis(quantized.dim, quantized.stride) != axis:
        raise UnsupportedError(f"{where}: fp4 {quantized.name!r} must be packed along the block axis {axis} "
                               f"(stride 1 there), got strides {list(quantized.stride)}")


def _bytes_per_element(node) -> float:
    """Bytes moved per element of x: x read, the quantized elements and the scales written (or
    the reverse for dequantize)."""
    x, quantized, scale, _, _ = _operands(node)
    block = node.attrs.block_size if node.op == "block_scale_quantize" else node.attrs.size
    elements = lambda t: t.data_type.itemsize / t.data_type.elements_per_item
    return elements(x) + elements(quantized) + scale.data_type.itemsize / block


def schedule(node, blocks: int, block: int, context):
    """(config, why): BuildOptions.block_scale_config where set (fitted to the problem), else
    the model's first for the build's target."""
    forced = context.options.block_scale_config
    if forced is not None:
        return fitted(forced, blocks), "config forced by BuildOptions.block_scale_config"
    ranked = rank(blocks, block, _bytes_per_element(node), context.target)
    return ranked[0], f"model's first of {len(ranked)} (heuristics/block_scale.py)"


def build_block_scale(graph, group, context):
    """One kernel: each program quantizes (or dequantizes) BLOCK_G blocks."""
    node = group.anchor
    _check(node)
    scale = _operands(node)[2]
    block = node.attrs.block_size if node.op == "block_scale_quantize" else node.attrs.size
    blocks = 1
    for size in scale.dim:
        blocks *= size
    config, why = schedule(node, blocks, block, context)
    # offsets past int32 (or a block index whose elements are) take 64-bit index math
    index_64 = any(element_span(t) > INT32_LIMIT or t.numel > INT32_LIMIT
                   for t in list(group.inputs) + list(group.outputs))
    source = render(kernel_name(group), group, config, group.summary(), index_64)
    programs = max(1, -(-blocks // config.block_g))
    reason = (f"{blocks} blocks of {block} elements, {config.block_g} per program ({programs} programs): "
              f"one pass over x, {config.run} whole blocks per thread (amax, scales and fp4 pairs in "
              f"registers); {why}")
    return launch_of(group, source, programs, config.num_warps, config.text(), reason)
