"""Softmax family: softmax / log-softmax along one axis, and its backward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AnchorRule, OpDef, OutputSpec, backward_rule, boolean, canonical_axes, fail, freeze, register


@dataclass(frozen=True)
class SoftmaxAttrs:
    axis: int
    log: bool = False

    def __post_init__(self):
        (axis,) = canonical_axes("softmax", "axis", (self.axis,))
        freeze(self, axis=axis, log=boolean("softmax", "log", self.log))


def _check_axis(op, x, attrs):
    if not 0 <= attrs.axis < len(x.dim):
        fail(op, f"axis {attrs.axis} out of range for {x.name!r} of rank {len(x.dim)}")


def infer_forward(inputs, attrs: SoftmaxAttrs):
    (x,) = inputs
    _check_axis("softmax", x, attrs)
    return [OutputSpec(x.dim, layout_source=0)]


def infer_backward(inputs, attrs: SoftmaxAttrs):
    dy, y = inputs
    _check_axis("softmax_backward", y, attrs)
    if dy.dim != y.dim:
        fail("softmax_backward", f"dy {list(dy.dim)} and y {list(y.dim)} differ")
    return [OutputSpec(y.dim, layout_source=0)]


def reference_forward(values, attrs: SoftmaxAttrs):
    (x,) = values
    fn = torch.log_softmax if attrs.log else torch.softmax
    return [fn(x, attrs.axis)]


def reference_backward(values, attrs: SoftmaxAttrs):
    dy, y = values
    if attrs.log:  # y = log softmax(x): dx = dy - softmax(x) * sum(dy)
        return [dy - y.exp() * dy.sum(attrs.axis, keepdim=True)]
    return [y * (dy - (dy * y).sum(attrs.axis, keepdim=True))]


register(OpDef("softmax", "softmax", "anchor", SoftmaxAttrs, ("x",), ("y",),
               infer_forward, reference_forward, fusion=AnchorRule((0,), 0)))
register(OpDef("softmax_backward", "softmax", "anchor", SoftmaxAttrs, ("dy", "y"), ("dx",),
               infer_backward, reference_backward, fusion=AnchorRule((0,), 0)))


@backward_rule("softmax")
def _softmax_backward(d, node, grads):
    """dx from dy and the saved y (softmax_backward, log or not)."""
    return [d.graph._add_op("softmax_backward", [grads[0], d.value(node.outputs[0])], node.attrs)[0]]
