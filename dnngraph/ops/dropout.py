"""Dropout: y = x * keep / (1 - p), keep drawn by the counter-based generator of ops/random.py.

The same (seed, offset) regenerates the same mask, so backward recomputes it instead of
storing it: dropout(dy, p, seed, offset) is the gradient. seed and offset are Python ints (kept
in the attributes) or int64 graph tensors of one element (inputs; the attribute is None), so one
built graph serves every training step; a seed tensor holds the seed's 64 bits as int64. The mask is an output only when asked
for (return_mask=True). Dropout runs in pointwise kernels, which know each element's logical
row-major index (its counter is offset + that index); no anchor kernel absorbs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import dtypes
from ..errors import UnsupportedError
from .base import OpDef, OutputSpec, backward_rule, boolean, fail, freeze, integer, real, register
from .random import keep_mask


@dataclass(frozen=True)
class DropoutAttrs:
    p: float
    seed: Optional[int]  # None: the seed input tensor holds it
    offset: Optional[int] = 0  # None: the offset input tensor holds it
    return_mask: bool = False

    def __post_init__(self):
        p = real("dropout", "p", self.p)
        if not 0.0 <= p < 1.0:
            fail("dropout", f"p must be in [0, 1), got {p}")
        seed = None if self.seed is None else integer("dropout", "seed", self.seed, 0, 2**64 - 1)
        offset = None if self.offset is None else integer("dropout", "offset", self.offset, 0, 2**63 - 1)
        freeze(self, p=p, seed=seed, offset=offset,
               return_mask=boolean("dropout", "return_mask", self.return_mask))


def check_random_inputs(op: str, seed_attr, offset_attr, seed, offset):
    """A seed or offset comes from exactly one place: its attribute (an int) or its input (an
    int64 tensor of one element)."""
    for name, attr, tensor in (("seed", seed_attr, seed), ("offset", offset_attr, offset)):
        if (attr is None) == (tensor is None):
            fail(op, f"{name} must be an int or an int64 tensor of one element, not both or neither")
        if tensor is not None:
            if tensor.data_type is not dtypes.int64 or any(d != 1 for d in tensor.dim):
                fail(op, f"{name} tensor must be int64 with one element, got {tensor.data_type.name} "
                         f"{list(tensor.dim)}")


def random_values(seed_attr, offset_attr, seed, offset) -> tuple:
    """(seed, offset) as ints, from the attributes or the one-element tensors' values (a seed's
    int64 bits read as unsigned)."""
    seed_value = seed_attr if seed is None else int(seed.reshape(-1)[0].item()) & (2**64 - 1)
    offset_value = offset_attr if offset is None else int(offset.reshape(-1)[0].item())
    return seed_value, offset_value


def keep_threshold(p: float) -> int:
    """The integer k0 with: uniform >= p exactly when the uniform's 24-bit numerator k >= k0."""
    # uniform = k * 2^-24, and p * 2^24 is exact in float64 (a power-of-two scaling), so the
    # comparison needs no float rounding in the kernel: keep = (bits >> 8) >= ceil(p * 2^24)
    return math.ceil(p * (1 << 24))


def infer(inputs, attrs: DropoutAttrs):
    x, seed, offset = inputs
    check_random_inputs("dropout", attrs.seed, attrs.offset, seed, offset)
    mask = OutputSpec(x.dim, dtypes.bool_, layout_source=0) if attrs.return_mask else None
    return [OutputSpec(x.dim, layout_source=0), mask]


def reference(values, attrs: DropoutAttrs):
    x, seed, offset = values
    seed, offset = random_values(attrs.seed, attrs.offset, seed, offset)
    keep = keep_mask(seed, offset, x.shape, attrs.p, device=x.device)
    y = torch.where(keep, x / (1.0 - attrs.p), torch.zeros_like(x))
    return [y, keep if attrs.return_mask else None]


register(OpDef("dropout", "pointwise", "pointwise", DropoutAttrs, ("x", "seed", "offset"), ("y", "mask"), infer,
               reference, optional=("seed", "offset")))


@backward_rule("dropout")
def _dropout_backward(d, node, grads):
    """The same mask again: dropout of dy with the forward's seed and offset."""
    if len(grads) > 1 and grads[1] is not None:
        raise UnsupportedError("dropout: no gradient through the mask")
    seed, offset = (None if t is None else d.value(t) for t in node.inputs[1:])
    attrs = DropoutAttrs(node.attrs.p, node.attrs.seed, node.attrs.offset)
    return [d.graph._add_op("dropout", [grads[0], seed, offset], attrs)[0], None, None]
