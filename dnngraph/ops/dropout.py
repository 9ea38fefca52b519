"""Dropout: y = x * keep / (1 - p), keep drawn by the counter-based generator of ops/random.py.

The same (seed, offset) regenerates the same mask, so backward recomputes it instead of
storing it: dropout(dy, p, seed, offset) is the gradient. The mask is an output only when asked
for (return_mask=True). Dropout runs in pointwise kernels, which know each element's logical
row-major index (its counter is offset + that index); no anchor kernel absorbs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import dtypes
from .base import OpDef, OutputSpec, boolean, fail, freeze, integer, real, register
from .random import keep_mask


@dataclass(frozen=True)
class DropoutAttrs:
    p: float
    seed: int
    offset: int = 0
    return_mask: bool = False

    def __post_init__(self):
        p = real("dropout", "p", self.p)
        if not 0.0 <= p < 1.0:
            fail("dropout", f"p must be in [0, 1), got {p}")
        freeze(self, p=p, seed=integer("dropout", "seed", self.seed, 0, 2**64 - 1),
               offset=integer("dropout", "offset", self.offset, 0, 2**63 - 1),
               return_mask=boolean("dropout", "return_mask", self.return_mask))


def keep_threshold(p: float) -> int:
    """The integer k0 with: uniform >= p exactly when the uniform's 24-bit numerator k >= k0."""
    # uniform = k * 2^-24, and p * 2^24 is exact in float64 (a power-of-two scaling), so the
    # comparison needs no float rounding in the kernel: keep = (bits >> 8) >= ceil(p * 2^24)
    return math.ceil(p * (1 << 24))


def infer(inputs, attrs: DropoutAttrs):
    (x,) = inputs
    mask = OutputSpec(x.dim, dtypes.bool_, layout_source=0) if attrs.return_mask else None
    return [OutputSpec(x.dim, layout_source=0), mask]


def reference(values, attrs: DropoutAttrs):
    (x,) = values
    keep = keep_mask(attrs.seed, attrs.offset, x.shape, attrs.p, device=x.device)
    y = torch.where(keep, x / (1.0 - attrs.p), torch.zeros_like(x))
    return [y, keep if attrs.return_mask else None]


register(OpDef("dropout", "pointwise", "pointwise", DropoutAttrs, ("x",), ("y", "mask"), infer, reference))
