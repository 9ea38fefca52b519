"""A quick check that the tensors of a binding set still are what execute() checked.

Plan.execute keys a checked binding set on a stamp of every field its checks read of every
binding (address, dtype, shape, strides, device, negative bit, types): about 0.5 us of Python per
tensor, most of an execute's own time. torch's TensorGuards (torch._C._dynamo.guards, the check
torch.compile's guards run on tensors) compares a list of tensors with what it was made from in
one C call: the exact Python type, the dispatch keys, dtype, device, requires_grad, sizes and
strides (given here as the tensors' own, so none is left dynamic). Addresses and negative bits are
read beside it: the guard does not hold addresses, and it compares dispatch keys through the
thread's local include and exclude sets, which could hide a negative bit the thread excludes or
includes. So a set the quick check passes differs in no field the stamp reads; one it refuses
only costs the full stamp (a thread in inference mode computes other keys than the one that made
the guard, and so is refused).

TensorGuards is torch's private API: it is used only after a self-test, once per process, shows
that it refuses each change the binding checks care about, and not at all where torch lacks it or
it fails the test (guard_of then returns None and execute keys on the stamp alone).
"""
from __future__ import annotations

import operator
import threading
from typing import Optional

import torch

_data_ptr = operator.methodcaller("data_ptr")
_USABLE: list = []  # [bool] once the self-test ran
_USABLE_LOCK = threading.Lock()


class _Subclass(torch.Tensor):
    """A tensor subclass, for the self-test (the exact Python type is part of a binding)."""


def _made(values):
    """torch's TensorGuards over `values`, every size and stride static."""
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*values, dynamic_dims_sizes=[list(v.shape) for v in values],
                        dynamic_dims_strides=[list(v.stride()) for v in values])


def _refuses_every_change() -> bool:
    """Whether this torch's TensorGuards accepts a tensor like the one it was made from and refuses
    one of another dtype (over the same memory or not), shape, strides, device, Python type, or
    with the negative bit."""
    base = torch.randn(4, 6)
    guard = _made([base])
    if not guard.check(base) or not guard.check(torch.randn(4, 6)):
        return False
    others = [base.double(), base.view(torch.int32), base.t().contiguous().t(), base.reshape(6, 4),
              base[:3], base.as_strided((4, 6), (1, 4)), base._neg_view(), base.as_subclass(_Subclass),
              torch.empty(4, 6, device="meta"), torch.randn(4, 6).requires_grad_()]
    return not any(guard.check(other) for other in others)


def usable() -> bool:
    """Whether the quick check is on in this process (the self-test runs on first use)."""
    if not _USABLE:
        with _USABLE_LOCK:
            if not _USABLE:
                try:
                    _USABLE.append(_refuses_every_change())
                except Exception:  # no TensorGuards, or one of another signature
                    _USABLE.append(False)
    return _USABLE[0]


def guard_of(keys: tuple, values: tuple) -> Optional[tuple]:
    """(keys, guard, addresses) of a checked binding set of plain (not negated) tensors, for
    still_bound; None where the quick check is off or the guard cannot be made. Only for sets of
    exact torch.Tensor values: a subclass may answer its Python attributes (device, dtype, ...)
    otherwise than the C++ tensor the guard reads, and the stamp reads the Python ones."""
    if not usable() or any(value.__class__ is not torch.Tensor for value in values):
        return None
    try:
        return keys, _made(values), tuple(map(_data_ptr, values))
    except Exception:  # a tensor the guard cannot describe: the stamp alone
        return None


def still_bound(quick: tuple, bindings: dict) -> bool:
    """Whether `bindings` holds the very keys of guard_of's set, in order, bound to tensors with
    its addresses and, per the guard, its types, dtypes, shapes, strides and devices, none
    negated. A plain loop: map() over operator.methodcaller costs more per tensor than the
    method calls themselves. A value that is no tensor raises (the caller's full checks say so)."""
    keys, guard, addresses = quick
    if len(bindings) != len(keys):
        return False
    index = 0
    for key, value in bindings.items():
        if key is not keys[index] or value.data_ptr() != addresses[index] or value.is_neg():
            return False
        index += 1
    return guard.check(*bindings.values())
