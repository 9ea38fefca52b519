"""What kinds of torch tensors a plan can bind: every entry point (execute, as_function and its
autograd backward and custom ops, the torch.compile backend through as_function) asks here.

Kernels read and write a tensor's memory as raw strided elements, so a tensor whose values are
not that memory cannot be bound as it is:

  * a lazily negated view (torch's negative bit: `z.conj().imag`) holds the negation of its
    memory. As an input it is resolved (its memory span copied with the negation applied, the
    strides kept), which is what torch ops do; as an output it is refused, since writing a result
    into it in place has no meaning for a kernel that stores raw values;
  * a conjugate view (complex: not a dnngraph dtype anyway), sparse (COO, CSR, CSC, BSR, BSC),
    mkldnn and nested (strided or jagged) tensors are refused with an ExecutionError naming the
    binding; so are tensors without an addressable storage (Plan._check), and meta tensors by
    the device check (kernels run on CUDA devices and, interpreted, on CPU tensors).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import ExecutionError


def unbindable(value: torch.Tensor) -> Optional[str]:
    """Why `value` cannot be bound (as a phrase), or None when its memory is its values (a
    lazily negated view aside: see resolved_input)."""
    if value.is_nested:
        return "a nested tensor"
    if value.layout != torch.strided:
        return f"a tensor of layout {value.layout} (dnngraph binds strided tensors)"
    if value.is_conj():
        return "a conjugate view (call resolve_conj() first)"
    return None


def check_bindable(value: torch.Tensor, what: str, is_output: bool) -> None:
    """Raise ExecutionError when `value` cannot be bound as `what` (an input or, when
    `is_output`, an output written in place)."""
    reason = unbindable(value)
    if reason is None and is_output and value.is_neg():
        reason = ("a lazily negated view (torch's negative bit): a result written into it would "
                  "read back negated")
    if reason is not None:
        raise ExecutionError(f"{what} is {reason}")


def resolved_input(value: torch.Tensor) -> torch.Tensor:
    """An input as kernels must read it: a lazily negated view is replaced by a tensor of the
    same shape and strides over a copy of its memory span, negation applied (a broadcast or
    otherwise overlapping layout keeps its layout); any other tensor as it is."""
    if not value.is_neg():
        return value
    if value.numel() == 0:
        return value.resolve_neg()
    span = sum((size - 1) * stride for size, stride in zip(value.shape, value.stride())) + 1
    memory = value.as_strided((span,), (1,), value.storage_offset()).resolve_neg()
    return memory.as_strided(value.shape, value.stride(), 0)
