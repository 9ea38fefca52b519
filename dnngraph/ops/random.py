"""Counter-based random numbers (Philox 4x32-10), the definition dropout kernels must match.

Element i of a tensor draws from counter (offset + i) split into (lo, hi, 0, 0) under the key
(seed lo, seed hi); the first output word's top 24 bits give a uniform float in [0, 1).
"""
from __future__ import annotations

import torch

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    # a * b needs 64 unsigned bits, more than int64 holds: multiply by 16-bit halves of b
    b_lo, b_hi = b & 0xFFFF, b >> 16
    low = a * b_lo
    high = a * b_hi + (low >> 16)
    hi_word = high >> 16
    lo_word = ((high & 0xFFFF) << 16 | (low & 0xFFFF)) & MASK32
    return hi_word & MASK32, lo_word


def philox_uniform(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) (float64) for int64 counters, per the module docstring."""
    counters = counters.to(torch.int64)
    c0, c1 = counters & MASK32, (counters >> 32) & MASK32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = int(seed) & MASK32, (int(seed) >> 32) & MASK32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & MASK32, (k1 + PHILOX_KEY_B) & MASK32
    return (c0 >> 8).to(torch.float64) * (1.0 / (1 << 24))


def keep_mask(seed: int, offset: int, shape, p: float, device=None) -> torch.Tensor:
    """The dropout keep-mask of a tensor of logical `shape` (row-major element order)."""
    numel = 1
    for size in shape:
        numel *= size
    counters = torch.arange(numel, dtype=torch.int64, device=device) + int(offset)
    return (philox_uniform(seed, counters) >= p).reshape(tuple(shape))
