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

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def __repr__(self) -> str:
        return f"dg.{self.name}"


float32 = DataType("float32", torch.float32, "tl.float32", True)
float16 = DataType("float16", torch.float16, "tl.float16", True)
bfloat16 = DataType("bfloat16", torch.bfloat16, "tl.bfloat16", True)
float8_e4m3 = DataType("float8_e4m3", torch.float8_e4m3fn, "tl.float8e4nv", True)
float8_e5m2 = DataType("float8_e5m2", torch.float8_e5m2, "tl.float8e5", True)
int32 = DataType("int32", torch.int32, "tl.int32", False)
int64 = DataType("int64", torch.int64, "tl.int64", False)
bool_ = DataType("bool", torch.bool, "tl.int1", False)

def narrower_than_compute(data_type: DataType) -> bool:
    """A float type narrower than float32, the compute type: a value stored in it is rounded."""
    return data_type.is_floating and data_type.itemsize < float32.itemsize


ALL_TYPES = (float32, float16, bfloat16, float8_e4m3, float8_e5m2, int32, int64, bool_)
_BY_NAME = {t.name: t for t in ALL_TYPES}
_BY_TORCH = {t.torch_dtype: t for t in ALL_TYPES}


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
