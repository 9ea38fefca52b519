"""Reduction family: sum mean max min amax prod norm1 norm2 over any axes, rank kept."""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from .base import AnchorRule, OpDef, OutputSpec, backward_rule, canonical_axes, choice, fail, freeze, register

MODES = ("sum", "mean", "max", "min", "amax", "prod", "norm1", "norm2")


@dataclass(frozen=True)
class ReductionAttrs:
    mode: str
    axes: tuple

    def __post_init__(self):
        axes = canonical_axes("reduction", "axes", self.axes)
        if not axes:
            fail("reduction", "needs at least one axis")
        freeze(self, mode=choice("reduction", "mode", self.mode, MODES), axes=axes)


def infer(inputs, attrs: ReductionAttrs):
    (x,) = inputs
    if any(not 0 <= a < len(x.dim) for a in attrs.axes):
        fail("reduction", f"axes {list(attrs.axes)} out of range for {x.name!r} of rank {len(x.dim)}")
    dim = tuple(1 if axis in attrs.axes else size for axis, size in enumerate(x.dim))
    return [OutputSpec(dim, layout_source=0)]


_REDUCE = {
    "sum": lambda x, axes: x.sum(axes, keepdim=True),
    "mean": lambda x, axes: x.mean(axes, keepdim=True),
    "max": lambda x, axes: x.amax(axes, keepdim=True),
    "min": lambda x, axes: x.amin(axes, keepdim=True),
    "amax": lambda x, axes: x.abs().amax(axes, keepdim=True),
    "prod": lambda x, axes: _prod(x, axes),
    "norm1": lambda x, axes: x.abs().sum(axes, keepdim=True),
    "norm2": lambda x, axes: x.square().sum(axes, keepdim=True).sqrt(),
}


def _prod(x: torch.Tensor, axes) -> torch.Tensor:
    for axis in axes:
        x = x.prod(axis, keepdim=True)
    return x


def reference(values, attrs: ReductionAttrs):
    (x,) = values
    return [_REDUCE[attrs.mode](x.to(torch.float64) if x.dtype == torch.bool else x, attrs.axes)]


register(OpDef("reduction", "reduction", "anchor", ReductionAttrs, ("x",), ("y",), infer, reference,
               fusion=AnchorRule((0,), 0)))


@backward_rule("reduction")
def _reduction_backward(d, node, grads):
    """dx of each mode; dy (reduced axes of size 1) broadcasts back over x. Ties of max, min and
    amax share dy evenly; prod divides by x (0 in x gives NaN there); norm2 of zeros is 0. x and
    y are read only by the modes that use them (reading one keeps it in the forward)."""
    g, dy, mode, axes = d.graph, grads[0], node.attrs.mode, list(node.attrs.axes)
    x, y = (lambda: d.value(node.inputs[0])), (lambda: d.value(node.outputs[0]))
    if mode == "sum":
        return [dy]
    if mode == "mean":
        return [g.div(dy, float(math.prod(node.inputs[0].dim[a] for a in axes)))]
    if mode in ("max", "min", "amax"):
        value = x()
        seen = g.abs(value) if mode == "amax" else value
        # the extreme found again from the values compared: the forward's y may be stored in a
        # narrower type (an fp16 output), which no element of x equals
        extreme = g.reduction(seen, "min" if mode == "min" else "max", axes)
        hit = g.cmp_eq(seen, extreme)
        ties = g.reduction(g.cast(hit, "float32"), "sum", axes)
        share = g.where(hit, g.div(dy, ties), 0.0)
        return [g.where(g.cmp_lt(value, 0.0), g.neg(share), share) if mode == "amax" else share]
    if mode == "prod":
        return [g.div(g.mul(dy, y()), x())]
    if mode == "norm1":
        value = x()
        return [g.where(g.cmp_gt(value, 0.0), dy, g.where(g.cmp_lt(value, 0.0), g.neg(dy), 0.0))]
    norm = y()
    return [g.where(g.cmp_eq(norm, 0.0), 0.0, g.div(g.mul(dy, x()), norm))]  # norm2
