"""The one place generated source converts a value to a stored (or cast-to) data type.

Every store of an output or intermediate and every `cast` op renders through `converted_to`, so a
value lands in memory as torch's `Tensor.to` would put it there, on the GPU as in the
interpreter (whose conversions interpreter_casts.py makes torch's own):

* integers convert to narrow floats through float32, as torch does (int64 -> bf16 rounds twice;
  the second rounding on the bits, which the GPU compiler cannot fold into the first);
* fp16 and bf16 are Triton's round-to-nearest-even conversions from float32, which on the GPU
  are IEEE (overflow to inf) like torch's;
* fp8: Triton on sm_90 converts with satfinite (e5m2: 1e6 -> 57344; NaN loses its sign), so the
  result is corrected to torch's overflow, infinity and NaN encodings. Those encodings are read
  from the running torch (`float8_rule`), which has changed them between releases (e4m3fn past
  464 was NaN, then saturates to 448), so kernels agree with the torch they run beside.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy
import torch

from .... import dtypes


@dataclass(frozen=True)
class Float8Rule:
    """How torch encodes what does not round to a finite fp8 value: magnitudes at or above
    `first_overflow` (a float32) become `overflow_bits`, infinities `infinity_bits`, NaN
    `nan_bits`; the sign bit is the input's in every case."""

    first_overflow: float
    overflow_bits: int
    infinity_bits: int
    nan_bits: int


def _fp8_bits(values, data_type) -> list:
    return torch.tensor(values, dtype=torch.float32).to(data_type.torch_dtype).view(torch.uint8).tolist()


@functools.lru_cache(maxsize=None)
def float8_rule(data_type) -> Float8Rule:
    """Torch's encodings of overflow, infinity and NaN for fp8 `data_type`, read from torch."""
    largest = float(torch.finfo(data_type.torch_dtype).max)
    below = _fp8_bits([largest], data_type)[0] - 1  # the code just below the largest finite value
    step = largest - float(torch.tensor([below], dtype=torch.uint8).view(data_type.torch_dtype).float())
    halfway = largest + step / 2  # the first value that may round past the largest
    halfway_bits, largest_bits = _fp8_bits([halfway, largest], data_type)
    first = halfway if halfway_bits != largest_bits else float(
        numpy.nextafter(numpy.float32(halfway), numpy.float32(math.inf), dtype=numpy.float32))
    overflow, infinity, nan = _fp8_bits([first, math.inf, math.nan], data_type)
    return Float8Rule(first, overflow, infinity, nan)


def converted_to(text: str, kind: str, data_type) -> str:
    """Source converting `text`, a value of kind "f" (compute float), "b", "i" or "l", to
    `data_type` as torch's `.to` does (floats to integers truncate toward zero), but int8 as
    cuDNN's int8 outputs (saturated, floats rounded to nearest even: dtypes.to_saturated), uint8
    alike."""
    if data_type.is_boolean:  # a bit-packed store packs the predicate itself (library.store_bit_runs, store_lone_bits)
        return f"({text}).to(tl.int1)" if kind == "b" else f"(({text}) != 0)"
    if data_type is dtypes.int8:  # saturating, floats rounded to nearest even (dtypes.to_int8)
        return {"f": f"tm.float_to_int8({text})", "b": f"({text}).to(tl.int8)"}.get(kind, f"tm.saturate_int8({text})")
    if data_type is dtypes.uint8:  # as int8, to [0, 255] (dtypes.to_uint8)
        return {"f": f"tm.float_to_uint8({text})", "b": f"({text}).to(tl.uint8)"}.get(kind, f"tm.saturate_uint8({text})")
    if not data_type.is_floating:
        return f"({text}).to({data_type.triton_type})"
    if kind in ("i", "l") and data_type is dtypes.bfloat16:
        return f"tm.int_to_bfloat16({text})"
    wide = f"({text}).to(tl.float32)"
    if data_type is dtypes.float32:
        return wide
    if data_type.itemsize == 2:
        return f"{wide}.to({data_type.triton_type})"
    rule = float8_rule(data_type)
    return (f"tm.to_float8({wide}, {data_type.triton_type}, {rule.first_overflow!r}, "
            f"{rule.overflow_bits}, {rule.infinity_bits}, {rule.nan_bits})")
