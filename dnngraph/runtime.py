"""Where kernels run: CUDA when torch sees a GPU, else Triton's interpreter on CPU tensors.

The interpreter is chosen before any kernel is defined (Triton reads TRITON_INTERPRET when a
function is decorated), so on a CPU-only machine nothing needs to be set by the user.
"""
from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


# Triton reads the variable when kernels are decorated: its value at import is the one that counts
# (and execute() need not read the environment on every call)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when generated kernels run through Triton's interpreter."""
    return _INTERPRETING


def _widen_bfloat16_dots():
    """Triton 3.6's interpreter keeps bf16 values as their uint16 bit patterns and its tl.dot
    multiplies those integers (o came out near 1e9). bf16 widens to float32 exactly (the bits
    shifted up by 16), so the interpreter's dot gets float32 operands instead; kernels on a GPU
    are untouched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "dnngraph_widens_bf16", False):
        return
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.asarray(handle.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot.dnngraph_widens_bf16 = True
    builder.create_dot = create_dot


if interpreting():
    _widen_bfloat16_dots()
