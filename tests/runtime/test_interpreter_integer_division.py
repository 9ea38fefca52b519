"""Triton's interpreter divides integers as the GPU does: `//` truncates toward zero and `%`
takes the dividend's sign (C's rule, PTX's div.s32 and rem.s32), not Python's floor. The CPU
tests stand for the GPU's integer index math (window starts, coordinates decomposed by `//` and
`%`, which can meet a negative value) only while this holds."""
import torch
import triton
import triton.language as tl

from dnngraph.runtime.interpreter import run_interpreted


@triton.jit
def _divide(dividend_ptr, divisor_ptr, quotient_ptr, remainder_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    dividend = tl.load(dividend_ptr + offsets)
    divisor = tl.load(divisor_ptr + offsets)
    tl.store(quotient_ptr + offsets, dividend // divisor)
    tl.store(remainder_ptr + offsets, dividend % divisor)


def test_negative_integers_divide_toward_zero_as_on_the_gpu():
    for dtype in (torch.int32, torch.int64):
        dividend = torch.tensor([-7, -6, -1, 0, 5, 7, -7, 7], dtype=dtype)
        divisor = torch.tensor([2, 4, 3, 3, -2, -3, -2, 2], dtype=dtype)
        quotient, remainder = torch.full_like(dividend, 99), torch.full_like(dividend, 99)
        run_interpreted(_divide, (1,), [dividend, divisor, quotient, remainder, 8])
        assert torch.equal(quotient, torch.div(dividend, divisor, rounding_mode="trunc")), quotient
        assert torch.equal(remainder, torch.fmod(dividend, divisor)), remainder
