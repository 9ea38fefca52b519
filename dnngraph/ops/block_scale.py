"""Block-scale quantization family (cuDNN frontend names): block_scale_quantize and
block_scale_dequantize, the MXFP8 / MXFP4 (OCP MX, e8m0 scales) and NVFP4 (e4m3 scales) formats.

`block_scale_quantize(x, block_size, axis, transpose=False)` -> (y, scale): x is cut along
`axis` into blocks of `block_size` consecutive elements (the extent must be a multiple: a partial
last block is refused, as the frontend's reference does); scale has x's dims with that axis
divided by block_size. As in the frontend, the formats are the outputs' data types (set them
with set_data_type; the defaults follow the block size: 32 -> y float8_e4m3 and scale
float8_e8m0 (MXFP8), 16 -> y float4_e2m1 and scale float8_e4m3 (NVFP4)). y may be float8_e4m3,
float8_e5m2 or float4_e2m1; scale float8_e8m0 or float8_e4m3. Per block, with amax the largest
|x| and vmax the largest finite value of y's type (448, 57344, 6), computed in float32:

* e8m0 scale (the frontend's quantize_round_up, `scale_rounding="up"`, the default): the
  smallest power of two 2^k with 2^k * vmax >= amax, k clamped to [-127, 127] (an all-zero block
  gets 2^-127, code 0x00); no element saturates. `scale_rounding="floor"` takes the OCP MX
  spec's k = floor(log2 amax) - emax (emax: the exponent of vmax: 8, 15, 2), one step finer,
  whose largest elements may clamp to vmax. Elements: x * 2^-k (exact).
* e4m3 scale (NVFP4): s = amax / vmax rounded to float32, stored as e4m3 (round to nearest
  even, torch's encoding); the elements are quantized with the float32 s as the frontend does:
  x * (1 / s), the reciprocal and the product each rounded to float32. Where s is below
  float32's smallest normal (2^-126: its e4m3 code is 0 anyway) the elements are x * 0.
* the element value is clamped to [-vmax, vmax] and rounded to nearest, ties to even (fp8: as
  torch converts; fp4 e2m1: to 0, 0.5, 1, 1.5, 2, 3, 4, 6, its sign bit x's sign bit).
* a block holding NaN or +-inf has a NaN scale (e8m0 0xFF, e4m3 NaN) and its elements stored
  as +0: dequantized, the whole block is NaN.

fp4 e2m1 has no NaN or infinity; it is packed two elements per byte along the tensor's stride-1
axis, the first in the low nibble (torch.float4_e2m1fn_x2). There is no global (per-tensor)
scale: the frontend's op takes none; multiply by one with a pointwise op.

`block_scale_dequantize(x, scale, block_size)` -> y = x * scale, scale broadcast over its block
(block_size: one int per axis of x as the frontend takes it, [1, 32] for rows of 32; an int
means the last axis), computed in float32 and stored in y's type.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import dtypes
from ..errors import UnsupportedError, ValidationError
from .base import AnchorRule, OpDef, OutputSpec, boolean, choice, fail, freeze, int_tuple, integer, register

ELEMENT_TYPES = (dtypes.float8_e4m3, dtypes.float8_e5m2, dtypes.float4_e2m1)
SCALE_TYPES = (dtypes.float8_e8m0, dtypes.float8_e4m3)
BLOCK_SIZES = (16, 32)
SCALE_ROUNDINGS = ("up", "floor")
DEFAULT_TYPES = {32: (dtypes.float8_e4m3, dtypes.float8_e8m0), 16: (dtypes.float4_e2m1, dtypes.float8_e4m3)}
E8M0_BIAS, E8M0_NAN = 127, 0xFF
E8M0_LOWEST = -127  # the smallest exponent e8m0 holds (code 0)
SMALLEST_NORMAL = 2.0 ** -126  # float32's
# fp4 e2m1: the magnitude of each code 0..7 (bit 3 is the sign)
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between consecutive codes: a magnitude past one takes the next code; at a tie
# (equal) it goes up only where the next code is the even one (round to nearest even)
FP4_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def largest(data_type) -> float:
    """vmax: the largest finite value of element type `data_type`."""
    if data_type is dtypes.float4_e2m1:
        return FP4_MAGNITUDES[-1]
    return float(torch.finfo(data_type.torch_dtype).max)


@dataclass(frozen=True)
class BlockScaleQuantizeAttrs:
    """block_size consecutive elements along `axis` (canonical: >= 0) share one scale."""

    block_size: int
    axis: int
    transpose: bool = False
    scale_rounding: str = "up"  # e8m0 scales: "up" (the frontend's) or "floor" (the OCP MX spec's)

    def __post_init__(self):
        op = "block_scale_quantize"
        size = integer(op, "block_size", self.block_size, minimum=1)
        if size not in BLOCK_SIZES:
            fail(op, f"block_size must be one of {list(BLOCK_SIZES)} (MXFP8/MXFP4: 32, NVFP4: 16), got {size}")
        freeze(self, block_size=size, axis=integer(op, "axis", self.axis, minimum=0),
               transpose=boolean(op, "transpose", self.transpose),
               scale_rounding=choice(op, "scale_rounding", self.scale_rounding, SCALE_ROUNDINGS))
        if self.transpose:
            # a layout, which dnngraph states as strides: Graph.block_scale_quantize(transpose=True)
            # sets y's and scale's strides and records transpose=False
            fail(op, "transpose=True is a layout: Graph.block_scale_quantize sets it as y's and scale's strides")


@dataclass(frozen=True)
class BlockScaleDequantizeAttrs:
    """block_size: elements per scale along each axis of x (one axis above 1)."""

    block_size: tuple

    def __post_init__(self):
        op = "block_scale_dequantize"
        sizes = int_tuple(op, "block_size", self.block_size, minimum=1)
        if sum(1 for s in sizes if s > 1) != 1:
            fail(op, f"block_size needs exactly one axis with blocks (above 1), got {list(sizes)}")
        if max(sizes) not in BLOCK_SIZES:
            fail(op, f"blocks of {max(sizes)} elements: block_size takes {list(BLOCK_SIZES)} on its block axis")
        freeze(self, block_size=sizes)

    @property
    def axis(self) -> int:
        return next(a for a, s in enumerate(self.block_size) if s > 1)

    @property
    def size(self) -> int:
        return self.block_size[self.axis]


def infer_quantize(inputs, attrs: BlockScaleQuantizeAttrs):
    (x,) = inputs
    op = "block_scale_quantize"
    if not x.data_type.is_floating or x.data_type.is_block_scale_storage:
        fail(op, f"x must be float32, float16 or bfloat16 (or fp8), got {x.data_type.name}")
    if attrs.axis >= len(x.dim):
        fail(op, f"axis {attrs.axis} out of range for x of dims {list(x.dim)}")
    extent = x.dim[attrs.axis]
    if extent % attrs.block_size:
        fail(op, f"x's axis {attrs.axis} ({extent}) is not a multiple of block_size {attrs.block_size}: "
                 f"a partial last block is refused (pad x)")
    y_type, scale_type = DEFAULT_TYPES[attrs.block_size]
    scale_dim = tuple(d // attrs.block_size if a == attrs.axis else d for a, d in enumerate(x.dim))
    return [OutputSpec(tuple(x.dim), data_type=y_type, layout_source=0),
            OutputSpec(scale_dim, data_type=scale_type, layout_source=0)]


def infer_dequantize(inputs, attrs: BlockScaleDequantizeAttrs):
    x, scale = inputs
    op = "block_scale_dequantize"
    check_types(op, x.data_type, scale.data_type)
    if len(attrs.block_size) != len(x.dim) or len(scale.dim) != len(x.dim):
        fail(op, f"block_size {list(attrs.block_size)}, x {list(x.dim)} and scale {list(scale.dim)} need one rank")
    for axis, (size, blocks, block) in enumerate(zip(x.dim, scale.dim, attrs.block_size)):
        if blocks * block != size:
            fail(op, f"axis {axis}: scale has {blocks} blocks of {block}, x has {size} elements")
    return [OutputSpec(tuple(x.dim), layout_source=0)]


def check_types(op: str, y_type, scale_type):
    """ValidationError unless (y_type, scale_type) is a block-scale format this family runs."""
    if y_type not in ELEMENT_TYPES:
        fail(op, f"the quantized tensor must be {', '.join(t.name for t in ELEMENT_TYPES)}, got {y_type.name}")
    if scale_type not in SCALE_TYPES:
        fail(op, f"the scale must be {', '.join(t.name for t in SCALE_TYPES)}, got {scale_type.name}")


def check_rounding(op: str, attrs: BlockScaleQuantizeAttrs, scale_type):
    """ValidationError where scale_rounding asks for a power-of-two rule of an e4m3 scale."""
    if attrs.scale_rounding != "up" and scale_type is not dtypes.float8_e8m0:
        fail(op, f"scale_rounding={attrs.scale_rounding!r} applies to float8_e8m0 scales; "
                 f"{scale_type.name} scales are amax / vmax")


# --- the float64 reference (bit-exact with the kernels) -------------------------------------------
def float32_quotient(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """float32 `numerator` / `denominator` correctly rounded on any device. (torch's CUDA division
    by a CPU scalar, a Python number or a 0-dim CPU tensor, multiplies by the scalar's float32
    reciprocal instead (ATen's div_true_kernel_cuda): one ulp off for some quotients, so the
    rules computed on a GPU would disagree with the kernels' correctly rounded amax / vmax.)"""
    return numerator / torch.full_like(numerator, denominator)


def e8m0_exponents(amax: torch.Tensor, vmax: float, rounding: str = "up") -> torch.Tensor:
    """k per block, in [-127, 127] (exact: frexp): "up", the smallest 2^k with 2^k * vmax >=
    amax; "floor", floor(log2 amax) - floor(log2 vmax)."""
    mantissa, exponent = torch.frexp(amax.to(torch.float64))
    vmax_mantissa, vmax_exponent = math.frexp(vmax)
    k = exponent - vmax_exponent
    if rounding == "up":
        k = k + (mantissa > vmax_mantissa).to(exponent.dtype)
    return torch.where(amax > 0, k, E8M0_LOWEST).clamp(E8M0_LOWEST, 127)


def round_fp4(values: torch.Tensor) -> torch.Tensor:
    """float32 values in [-6, 6] rounded to e2m1 (nearest, ties to even), sign bit kept."""
    magnitude = values.abs()
    code = torch.zeros_like(magnitude, dtype=torch.int64)
    for boundary, tie_up in FP4_BOUNDARIES:
        code += (magnitude >= boundary if tie_up else magnitude > boundary).to(torch.int64)
    rounded = torch.tensor(FP4_MAGNITUDES, dtype=torch.float64)[code]
    return torch.where(torch.signbit(values), -rounded, rounded)


def quantized_blocks(blocks: torch.Tensor, y_type, scale_type, rounding: str = "up") -> tuple:
    """(element values, scale values) in float64 of float32 `blocks` [..., nblocks, block]."""
    vmax = largest(y_type)
    finite = torch.isfinite(blocks).all(-1)
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(-1)
    if scale_type is dtypes.float8_e8m0:
        k = e8m0_exponents(amax, vmax, rounding)
        scale = torch.pow(2.0, k.to(torch.float64))
        normalized = (blocks.to(torch.float64) * torch.pow(2.0, -k.to(torch.float64)).unsqueeze(-1)).to(torch.float32)
    else:
        fp32_scale = float32_quotient(amax, vmax)
        scale = fp32_scale.to(scale_type.torch_dtype).to(torch.float64)
        normal = fp32_scale >= SMALLEST_NORMAL  # below it 1 / s may overflow: the block goes to zeros
        inverse = torch.where(normal, 1.0 / torch.where(normal, fp32_scale, 1.0), 0.0).to(torch.float32)
        normalized = blocks * inverse.unsqueeze(-1)
    normalized = normalized.clamp(-vmax, vmax)
    if y_type is dtypes.float4_e2m1:
        elements = round_fp4(normalized)
    else:
        elements = normalized.to(y_type.torch_dtype).to(torch.float64)
    elements = torch.where(finite.unsqueeze(-1), elements, 0.0)
    scale = torch.where(finite, scale, math.nan)
    return elements, scale


def quantize_reference(x: torch.Tensor, attrs: BlockScaleQuantizeAttrs, y_type, scale_type) -> tuple:
    """(y, scale) in float64, as the kernels store them."""
    moved = x.to(torch.float32).movedim(attrs.axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // attrs.block_size, attrs.block_size)
    elements, scale = quantized_blocks(blocks, y_type, scale_type, attrs.scale_rounding)
    return elements.reshape(moved.shape).movedim(-1, attrs.axis), scale.movedim(-1, attrs.axis)


def reference_quantize(values, attrs, output_types=None):
    y_type, scale_type = output_types or DEFAULT_TYPES[attrs.block_size]
    check_types("block_scale_quantize", y_type, scale_type)
    check_rounding("block_scale_quantize", attrs, scale_type)
    return list(quantize_reference(values[0], attrs, y_type, scale_type))


def reference_dequantize(values, attrs: BlockScaleDequantizeAttrs):
    x, scale = values
    return [x * scale.repeat_interleave(attrs.size, dim=attrs.axis)]


# --- fp4 storage helpers (tests, users building operands) -------------------------------------------
def fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (uint8 0..15) of each value, which must be one e2m1 holds (sign bit kept)."""
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=torch.float64)
    wide = values.to(torch.float64)
    matches = wide.abs().unsqueeze(-1) == magnitudes
    if not bool(matches.any(-1).all()):
        raise ValidationError("fp4_codes: a value is not an e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives)")
    code = matches.to(torch.int64).argmax(-1)
    return (code + 8 * torch.signbit(wide).to(torch.int64)).to(torch.uint8)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """e2m1 `values` [..., K] (K even) packed along the last axis: float4_e2m1fn_x2 [..., K / 2],
    the even element in the low nibble."""
    codes = fp4_codes(values)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous().view(dtypes.float4_e2m1.torch_dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """float64 values [..., 2K] of packed e2m1 [..., K] (float4_e2m1fn_x2 or uint8)."""
    codes = packed.view(torch.uint8).to(torch.int64)
    pairs = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=torch.float64)[pairs & 7]
    return torch.where(pairs >= 8, -magnitudes, magnitudes)


def unpack_storage(value: torch.Tensor, dim, stride) -> torch.Tensor:
    """float64 logical values of a bound packed fp4 tensor of logical `dim` and `stride`."""
    axis = dtypes.packed_axis(dim, stride)
    unpacked = unpack_fp4(value.movedim(axis, -1))
    return unpacked.movedim(-1, axis)


register(OpDef("block_scale_quantize", "block_scale", "anchor", BlockScaleQuantizeAttrs, ("x",), ("y", "scale"),
               infer_quantize, reference_quantize, typed_reference=True,
               # pointwise producers of x run at load (a global scale, an activation)
               fusion=AnchorRule((0,), None)))
# a dequantization feeding a matmul's A or B joins the matmul's group instead (fusion/partition.py)
register(OpDef("block_scale_dequantize", "block_scale", "anchor", BlockScaleDequantizeAttrs, ("x", "scale"), ("y",),
               infer_dequantize, reference_dequantize, fusion=AnchorRule((), None)))


def refuse_elsewhere(group) -> None:
    """UnsupportedError where a kernel group other than a block-scale op's reads or writes a
    block-scale type (its bytes mean nothing to another family's loads and stores), and
    ValidationError where a packed fp4 tensor's layout cannot pack."""
    for tensor in list(group.inputs) + list(group.outputs):
        data_type = tensor.data_type
        if not data_type.is_block_scale_storage:
            continue
        problem = dtypes.packed_layout_problem(tensor.dim, tensor.stride, data_type)
        if problem is not None:
            raise ValidationError(f"tensor {tensor.name!r}: {problem}")
        readers = [n for n in group.nodes if tensor in n.inputs or tensor in n.outputs]
        if any(n.opdef.family != "block_scale" for n in readers) or not readers:
            anchor = group.anchor
            what = "a fused group" if anchor is None else f"node {anchor.name!r} ({anchor.op})"
            raise UnsupportedError(f"{what} reads or writes {tensor.name!r} of {data_type.name}: only "
                                   f"block_scale_quantize and block_scale_dequantize take block-scale types")
