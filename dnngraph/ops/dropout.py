"""Dropout: y = x * keep / (1 - p), keep drawn by the counter-based generator of ops/random.py.

The same (seed, offset) regenerates the same mask, so backward recomputes it instead of
storing it; the mask is an output only when asked for (return_mask=True).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dtypes
from .base import OpDef, OutputSpec, fail, register
from .random import keep_mask


@dataclass(frozen=True)
class DropoutAttrs:
    p: float
    seed: int
    offset: int = 0
    return_mask: bool = False

    def __post_init__(self):
        if not 0.0 <= self.p < 1.0:
            fail("dropout", f"p must be in [0, 1), got {self.p}")
        if not 0 <= self.seed < 2**64 or not 0 <= self.offset < 2**63:
            fail("dropout", "seed and offset must be non-negative 64-bit integers")


def infer(inputs, attrs: DropoutAttrs):
    (x,) = inputs
    mask = OutputSpec(x.dim, dtypes.bool_, layout_source=0) if attrs.return_mask else None
    return [OutputSpec(x.dim, layout_source=0), mask]


def reference(values, attrs: DropoutAttrs):
    (x,) = values
    keep = keep_mask(attrs.seed, attrs.offset, x.shape, attrs.p, device=x.device)
    y = torch.where(keep, x / (1.0 - attrs.p), torch.zeros_like(x))
    return [y, keep if attrs.return_mask else None]


register(OpDef("dropout", "dropout", "anchor", DropoutAttrs, ("x",), ("y", "mask"), infer, reference))
