"""Float conversions in Triton 3.6's interpreter, made bit-exact with torch's `Tensor.to`.

Triton 3.6's interpreter converts fp32 -> bf16 by truncation (0.99999 became 0.99609375), and
fp32 -> fp8 without rounding into the exponent, saturation or subnormals (e4m3: 500 became 256,
1e-3 became 0); int -> bf16 and int -> fp8 took the integer value as the bit pattern. Every
conversion with a float on either side reaches the interpreter's builder through
`cast_impl` (fp_trunc, fp_ext, si/ui_to_fp, fp_to_si/ui), `create_fp_to_fp` (fp8 and explicit
rounding modes) or the module function `_convert_float` (fp8 operands of tl.dot). `install()`
routes all three through torch's own conversion of the numpy buffers, so what a CPU tensor's
kernel stores is what torch's `.to` gives, by construction. Conversions between integer types
and non-default rounding modes keep Triton's own code.

The interpreter is reached by name, so `install()` refuses (UnsupportedError) unless the
Triton is 3.6.0 and the names it replaces are there.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import UnsupportedError

TRITON_VERSION = "3.6.0"
_REPLACED = ("cast_impl", "create_fp_to_fp")
_MARK = "dnngraph_torch_conversion"


@functools.lru_cache(maxsize=None)
def _torch_types():
    """Triton scalar type -> (torch dtype of the value, torch dtype of the numpy buffer)."""
    import triton.language as tl

    same = {tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
            tl.int64: torch.int64, tl.int32: torch.int32, tl.int16: torch.int16, tl.int8: torch.int8,
            tl.int1: torch.bool}
    types = {triton_type: (dtype, dtype) for triton_type, dtype in same.items()}
    # the interpreter holds bf16 as uint16 and fp8 as uint8 bit patterns
    types[tl.bfloat16] = (torch.bfloat16, torch.uint16)
    types[tl.float8e4nv] = (torch.float8_e4m3fn, torch.uint8)
    types[tl.float8e5] = (torch.float8_e5m2, torch.uint8)
    return types


def torch_convert(data: np.ndarray, source, target) -> np.ndarray:
    """The numpy buffer of `data` (held as Triton type `source`) converted to `target` by torch."""
    types = _torch_types()
    source_value, source_buffer = types[source]
    target_value, target_buffer = types[target]
    array = np.ascontiguousarray(data)
    if not array.flags.writeable:  # torch.from_numpy warns on a read-only buffer
        array = array.copy()
    shape = array.shape
    values = torch.from_numpy(array.reshape(-1)).view(source_buffer).view(source_value)
    converted = values.to(target_value).view(target_buffer)
    return converted.numpy().reshape(shape)


def _converts_by_torch(data, source, target) -> bool:
    """A conversion torch defines: both types known, a float on at least one side, and the
    buffer holding what its type says (the interpreter keeps bool data under a float type
    after some broadcasts; Triton's own code converts those by value, as before)."""
    types = _torch_types()
    return (source in types and target in types and source != target
            and (source.is_floating() or target.is_floating())
            and np.asarray(data).dtype == _numpy_buffer(types[source][1]))


def _numpy_buffer(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _check_triton(interpreter) -> None:
    import triton

    if triton.__version__ != TRITON_VERSION:
        raise UnsupportedError(f"dnngraph's interpreter conversions are written against Triton "
                               f"{TRITON_VERSION}'s interpreter; this is Triton {triton.__version__}")
    builder = interpreter.InterpreterBuilder
    missing = [name for name in _REPLACED if not callable(getattr(builder, name, None))]
    if missing or not callable(getattr(interpreter, "_convert_float", None)):
        raise UnsupportedError(f"Triton {triton.__version__}'s interpreter lacks "
                               f"{missing or ['_convert_float']}: cannot install exact conversions")


def install() -> None:
    """Route the interpreter's float conversions through torch (idempotent)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, _MARK, False):
        return
    _check_triton(interpreter)
    original_cast, original_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    original_convert = interpreter._convert_float
    rtne = interpreter._ir.ROUNDING_MODE.RTNE

    def cast_impl(self, src, dst_type):
        source, target = src.dtype.scalar, dst_type.scalar
        if not _converts_by_torch(src.data, source, target):
            return original_cast(self, src, dst_type)
        return interpreter.TensorHandle(torch_convert(src.data, source, target), target)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        source, target = src.dtype.scalar, dst_type.scalar
        if rounding_mode not in (None, rtne) or not _converts_by_torch(src.data, source, target):
            return original_fp_to_fp(self, src, dst_type, rounding_mode)
        return interpreter.TensorHandle(torch_convert(src.data, source, target), target)

    def convert_float(data, source, target, rounding_mode):
        # callers .view() the result as the target's numpy type: hand back the same buffer kind
        if rounding_mode not in (None, rtne) or not _converts_by_torch(data, source, target):
            return original_convert(data, source, target, rounding_mode)
        return torch_convert(data, source, target)

    for function in (cast_impl, create_fp_to_fp, convert_float):
        setattr(function, _MARK, True)
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    interpreter._convert_float = convert_float
