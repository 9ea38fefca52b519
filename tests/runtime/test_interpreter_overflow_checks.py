"""Triton's interpreter redoes every integer add, sub and mul in int64 to check for overflow, then
drops the assert that would read the check (no debug): dnngraph turns that dead work off, and the
kernels compute what they computed with it (int32 wraps as on the GPU)."""
import pytest
import torch
import triton
import triton.language as tl
from triton.language import semantic

from dnngraph.runtime.interpreter import interpreting, run_interpreted

pytestmark = pytest.mark.skipif(not interpreting(), reason="kernels run through the interpreter in this process")


@triton.jit
def _index_math(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offsets)
    b = tl.load(b_ptr + offsets)
    tl.store(out_ptr + offsets, a * b + a - b)


def _run(a, b):
    out = torch.full_like(a, 99)
    run_interpreted(_index_math, (1,), [a, b, out, a.numel()])
    return out


def test_integer_math_runs_no_overflow_check(monkeypatch):
    """The check ends in a device_assert (dropped without debug): the kernel, which asserts
    nothing itself, reaches none."""
    asserts = []
    original = semantic.TritonSemantic.device_assert

    def counted(self, cond, msg, mask):
        asserts.append(msg)
        return original(self, cond, msg, mask)

    monkeypatch.setattr(semantic.TritonSemantic, "device_assert", counted)
    a = torch.tensor([3, -7, 11, 0, 5, 1, -2, 9], dtype=torch.int32)
    b = torch.tensor([2, 4, -3, 8, 5, 1, 6, -1], dtype=torch.int32)
    assert torch.equal(_run(a, b), a * b + a - b)
    assert asserts == []


def test_int32_overflow_wraps_as_on_the_gpu():
    a = torch.tensor([2**30, 2**31 - 1, -(2**31), 46341], dtype=torch.int32)
    b = torch.tensor([4, 2, 3, 46341], dtype=torch.int32)
    want = ((a.long() * b.long() + a.long() - b.long() + 2**31) % 2**32 - 2**31).int()
    assert torch.equal(_run(a, b), want)
