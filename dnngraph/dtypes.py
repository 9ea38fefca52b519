"""Data types: one record per type, mapping names, torch dtypes and Triton types."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ValidationError


@dataclass(frozen=True)
class DataType:
    """A tensor element type as the graph sees it."""

    name: str
    torch_dtype: torch.dtype
    triton_type: str  # the name of the Triton type in generated source
    is_floating: bool
    # elements one torch item holds: 2 for fp4 (torch.float4_e2m1fn_x2 packs two per byte)
    elements_per_item: int = 1

    @property
    def itemsize(self) -> int:
        """Bytes of one torch item (for a packed type, of `elements_per_item` elements)."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def is_bit_packed(self) -> bool:
        """A boolean type stored one bit per element (cuDNN's CUDNN_DATA_BOOLEAN layout): eight
        elements per byte along the packed axis, the first in the least significant bit."""
        return self.name == BIT_PACKED_BOOL

    @property
    def is_boolean(self) -> bool:
        """A predicate type, one byte (bool) or one bit (bool_bit_packed) per element."""
        return self.name in ("bool", BIT_PACKED_BOOL)

    @property
    def is_block_scale_storage(self) -> bool:
        """A block-scale quantization type (fp4 e2m1, e8m0): kernels see its bytes (uint8), and
        only the block-scale ops read or write it."""
        return self.name in BLOCK_SCALE_STORAGE

    def __repr__(self) -> str:
        return f"dg.{self.name}"


float32 = DataType("float32", torch.float32, "tl.float32", True)
float16 = DataType("float16", torch.float16, "tl.float16", True)
bfloat16 = DataType("bfloat16", torch.bfloat16, "tl.bfloat16", True)
float8_e4m3 = DataType("float8_e4m3", torch.float8_e4m3fn, "tl.float8e4nv", True)
float8_e5m2 = DataType("float8_e5m2", torch.float8_e5m2, "tl.float8e5", True)
int32 = DataType("int32", torch.int32, "tl.int32", False)
# int8: quantized operands of matmul and convolution (int32 accumulation) and requantized
# outputs. A conversion to int8 saturates to [-128, 127] and rounds floats to nearest even (NaN
# becomes 0), as cuDNN's int8 outputs do, not torch's truncating, wrapping `.to` (to_int8).
int8 = DataType("int8", torch.int8, "tl.int8", False)
# uint8: quantized activations and image bytes, by the same rule as int8: math on it runs in int32
# (exact; a uint8 value meeting an int8 one promotes to int32, never wraps), and a conversion to
# it saturates to [0, 255], floats rounded to nearest even, NaN and negative values to 0
# (to_uint8). Not a matmul or conv operand: Triton 3.6's tl.dot multiplies int8 by int8 only.
uint8 = DataType("uint8", torch.uint8, "tl.uint8", False)
int64 = DataType("int64", torch.int64, "tl.int64", False)
bool_ = DataType("bool", torch.bool, "tl.int1", False)
# Block-scale quantization types (OCP MX / NVFP4). Kernels address them as bytes: fp4 e2m1 packs
# two elements per byte along the tensor's stride-1 axis, the first in the low nibble (torch's
# float4_e2m1fn_x2); e8m0 is a biased exponent byte, 2^(bits - 127), 0xFF NaN, no zero.
float4_e2m1 = DataType("float4_e2m1", torch.float4_e2m1fn_x2, "tl.uint8", True, elements_per_item=2)
float8_e8m0 = DataType("float8_e8m0", torch.float8_e8m0fnu, "tl.uint8", True)
BLOCK_SCALE_STORAGE = ("float4_e2m1", "float8_e8m0")
# Booleans stored one bit each, as cuDNN stores CUDNN_DATA_BOOLEAN: bit (offset % 8) of byte
# (offset // 8), offset being the element's offset in elements (so bits, here). Bound as uint8
# storage (dtypes.storage_layout); kernels read and write it through the pointwise family only.
BIT_PACKED_BOOL = "bool_bit_packed"
bool_bit_packed = DataType(BIT_PACKED_BOOL, torch.uint8, "tl.uint8", False, elements_per_item=8)

def narrower_than_compute(data_type: DataType) -> bool:
    """A float type narrower than float32, the compute type: a value stored in it is rounded."""
    return data_type.is_floating and data_type.itemsize < float32.itemsize


ALL_TYPES = (float32, float16, bfloat16, float8_e4m3, float8_e5m2, int32, int64, bool_, float4_e2m1, float8_e8m0,
             int8, bool_bit_packed, uint8)
_BY_NAME = {t.name: t for t in ALL_TYPES}
# a uint8 torch tensor is no packed boolean by itself: tensor_like of one is a uint8 tensor
_BY_TORCH = {t.torch_dtype: t for t in ALL_TYPES if not t.is_bit_packed}


INT8_RANGE = (-128, 127)
# the 8-bit integer types, each with the range a conversion to it saturates to
SATURATING_RANGES = {"int8": INT8_RANGE, "uint8": (0, 255)}


def is_saturating(data_type: DataType) -> bool:
    """An 8-bit integer type (int8, uint8): held widened to int32, stored saturated."""
    return data_type.name in SATURATING_RANGES


def to_saturated(value: torch.Tensor, data_type: DataType) -> torch.Tensor:
    """`value` converted to the 8-bit integer `data_type` as kernels store it: saturated to its
    range, floats rounded to nearest even first (torch.round), NaN to 0."""
    low, high = SATURATING_RANGES[data_type.name]
    if value.is_floating_point():
        value = torch.round(torch.nan_to_num(value.to(torch.float64), nan=0.0).clamp(low, high))
    elif value.dtype != torch.bool:
        value = value.clamp(low, high)
    return value.to(data_type.torch_dtype)


def to_int8(value: torch.Tensor) -> torch.Tensor:
    """`value` converted to int8 as kernels store it: saturated to [-128, 127], floats rounded to
    nearest even first (torch.round), NaN to 0."""
    return to_saturated(value, int8)


def to_uint8(value: torch.Tensor) -> torch.Tensor:
    """`value` converted to uint8 as kernels store it: saturated to [0, 255] (negative values and
    -inf to 0, inf to 255), floats rounded to nearest even first, NaN to 0."""
    return to_saturated(value, uint8)


def by_name(name: str) -> DataType:
    """The DataType called `name` ("float32", "bfloat16", ...)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValidationError(f"unknown data type {name!r}; known: {sorted(_BY_NAME)}") from None


def from_torch(dtype: torch.dtype) -> DataType:
    """The DataType of a torch dtype."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValidationError(f"torch dtype {dtype} has no dnngraph data type") from None


def resolve(value) -> DataType:
    """Accept a DataType, a torch dtype or a type name."""
    if isinstance(value, DataType):
        return value
    if isinstance(value, torch.dtype):
        return from_torch(value)
    if isinstance(value, str):
        return by_name(value)
    raise ValidationError(f"{value!r} is not a data type")


def kernel_torch_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype kernels bind a tensor of `data_type` as: its bytes for block-scale types."""
    return torch.uint8 if data_type.is_block_scale_storage else data_type.torch_dtype


def storage_layout(dim, stride, data_type: DataType) -> tuple:
    """(shape, strides) of the torch tensor holding a tensor of logical `dim` and element
    `stride`, in torch items: the logical ones, but for a packed type the packed axis's extent
    divided by the elements per item (rounded up: a bit-packed row may end in a partial byte) and
    the other strides divided (packed_layout_problem says when that is not possible)."""
    dim, stride = tuple(dim), tuple(stride)
    if data_type.elements_per_item == 1:
        return dim, stride
    axis = packed_axis(dim, stride)
    per = data_type.elements_per_item
    shape = tuple(-(-size // per) if a == axis else size for a, size in enumerate(dim))
    strides = tuple(s if a == axis else s // per for a, s in enumerate(stride))
    return shape, strides


def packed_axis(dim, stride) -> int:
    """The axis a packed type packs along: the last one of stride 1 and extent > 1 (the
    innermost), else the last one of stride 1."""
    ones = [a for a, s in enumerate(stride) if s == 1 and dim[a] > 1] or [a for a, s in enumerate(stride) if s == 1]
    return ones[-1] if ones else len(dim) - 1


def packed_layout_problem(dim, stride, data_type: DataType):
    """Why a tensor of `data_type` cannot have this layout (a phrase), or None. Packed fp4 needs
    an axis of stride 1 and even extent to pack along and every other stride even, so that each
    byte holds two elements of one row of that axis."""
    if data_type.elements_per_item == 1:
        return None
    if data_type.is_bit_packed:
        return _bit_packed_layout_problem(dim, stride)
    per = data_type.elements_per_item
    axis = packed_axis(dim, stride)
    if stride[axis] != 1 or dim[axis] % per:
        return (f"{data_type.name} packs {per} elements per byte along an axis of stride 1 and an extent "
                f"divisible by {per}; dims {list(dim)} strides {list(stride)} have none")
    odd = [a for a, (size, s) in enumerate(zip(dim, stride)) if a != axis and size > 1 and s % per]
    if odd:
        return f"{data_type.name} needs the strides off its packed axis {axis} even, got {list(stride)}"
    return None


def _bit_packed_layout_problem(dim, stride):
    """Bit-packed booleans pack along the innermost axis (stride 1, any extent: a row may end in
    a partial byte) and every other axis of extent > 1 steps by whole bytes (a stride that is a
    multiple of 8, or 0): each byte then holds elements of one row only, so the program that owns
    a row segment owns its bytes."""
    axis = packed_axis(dim, stride)
    if dim[axis] > 1 and stride[axis] != 1:
        return (f"{BIT_PACKED_BOOL} packs along an axis of stride 1; dims {list(dim)} strides {list(stride)} "
                f"have none")
    odd = [a for a, (size, s) in enumerate(zip(dim, stride)) if a != axis and size > 1 and s % 8]
    if odd:
        return (f"{BIT_PACKED_BOOL} needs the strides off its packed axis {axis} multiples of 8 (rows "
                f"start on a byte), got {list(stride)}; dg.bit_packed_strides gives dense ones")
    return None
