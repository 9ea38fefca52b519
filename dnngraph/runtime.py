"""Where kernels run: CUDA when torch sees a GPU, else Triton's interpreter on CPU tensors.

The interpreter is chosen before any kernel is defined (Triton reads TRITON_INTERPRET when a
function is decorated), so on a CPU-only machine nothing needs to be set by the user.
"""
from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    """True when generated kernels run through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
