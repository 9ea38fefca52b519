"""Windowed normalization family: cross-channel LRN and divisive normalization, and their backward.

Both compute, per element i of x [N, C, *spatial] (rank 3 to 5, logical dims; NHWC is a stride
choice),

    c_i = x_i - means_i                      (means: divisive normalization's optional input)
    S_i = k + alpha / count * sum_{w in W(i)} c_w^2
    y_i = c_i / S_i^beta

where the window W(i) runs, along each windowed axis, from `size // 2` before i to
`(size - 1) // 2` after it, and elements outside x count as zeros (torch's zero padding).

- `lrn` (cuDNN's cudnnLRNCrossChannelForward, AlexNet's LRN): the window runs over the channel
  axis only and count = size. These are torch's `F.local_response_norm` semantics exactly,
  even sizes included (libraries differ on where an even window sits around its centre; the
  cuDNN frontend has no LRN graph op, so torch's rule is the one followed here).
- `divisive_normalization` (cuDNN's cudnnDivisiveNormalizationForward, the divisive half of
  local contrast normalization, Jarrett et al. 2009): the window runs over every spatial axis,
  per channel, and count = size ** spatial rank. `means` (optional, broadcastable to x: a local
  mean, e.g. an average pooling of x with stride 1 and padding size // 2) is subtracted first;
  `Graph.local_contrast_normalization` chains the two.

The backward ops give dx from dy and x; they recompute S from x (a window of loads the kernel
makes anyway) instead of reading y or a saved scale:

    dx_m = dy_m / S_m^beta - 2 beta alpha / count * c_m * sum_{i: m in W(i)} dy_i c_i / S_i^(beta + 1)

and a means input gets -dx (c depends on it with sign -1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..tensor import MAX_EXTENT
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, broadcast_dims, fail, freeze, integer, real, register

FORWARD_OPS = ("lrn", "divisive_normalization")
BACKWARD_OPS = {"lrn": "lrn_backward", "divisive_normalization": "divisive_normalization_backward"}
RANKS = (3, 4, 5)  # [N, C, W], [N, C, H, W], [N, C, D, H, W]


@dataclass(frozen=True)
class LrnAttrs:
    """size: window elements per windowed axis; y = c / (k + alpha / count * window sum of c^2)^beta."""

    size: int
    alpha: float = 1e-4
    beta: float = 0.75
    k: float = 1.0

    def __post_init__(self):
        op = "lrn"
        freeze(self, size=integer(op, "size", self.size, minimum=1, maximum=MAX_EXTENT),
               alpha=real(op, "alpha", self.alpha), beta=real(op, "beta", self.beta), k=real(op, "k", self.k))
        # with alpha and k both >= 0 the base S is never negative, so S^beta is real for any beta
        if self.alpha < 0:
            fail(op, f"alpha must be >= 0, got {self.alpha}")
        if self.k < 0:
            fail(op, f"k must be >= 0, got {self.k}")

    @property
    def before(self) -> int:
        """Window elements before the centre along a windowed axis (torch's left padding)."""
        return self.size // 2

    @property
    def after(self) -> int:
        return (self.size - 1) // 2


def window_axes(op: str, rank: int) -> tuple[int, ...]:
    """The axes the window of forward op `op` (or its backward) runs over."""
    return (1,) if op.startswith("lrn") else tuple(range(2, rank))


def window_count(op: str, rank: int, attrs: LrnAttrs) -> int:
    """Elements of a whole window: alpha is divided by it."""
    return attrs.size ** len(window_axes(op, rank))


def _check_x(op: str, x):
    if len(x.dim) not in RANKS:
        fail(op, f"x must have rank 3 to 5 ([N, C, *spatial]), got dims {list(x.dim)}")
    if not x.data_type.is_floating:
        fail(op, f"x must be a floating type, got {x.data_type.name}")


def _check_like_x(op: str, what: str, x, other, exact: bool):
    if not other.data_type.is_floating:
        fail(op, f"{what} must be a floating type, got {other.data_type.name}")
    if exact and tuple(other.dim) != tuple(x.dim):
        fail(op, f"{what} must have x's dims {list(x.dim)}, got {list(other.dim)}")
    if not exact and broadcast_dims(op, [("x", tuple(x.dim)), (what, tuple(other.dim))]) != tuple(x.dim):
        fail(op, f"{what} {list(other.dim)} must broadcast to x's dims {list(x.dim)}")


def infer_forward(op: str):
    def infer(inputs, attrs):
        x, means = inputs[0], inputs[1] if len(inputs) > 1 else None
        _check_x(op, x)
        if means is not None:
            _check_like_x(op, "means", x, means, exact=False)
        return [OutputSpec(tuple(x.dim), layout_source=0)]
    return infer


def infer_backward(op: str):
    def infer(inputs, attrs):
        dy, x, means = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        _check_x(op, x)
        _check_like_x(op, "dy", x, dy, exact=True)
        if means is not None:
            _check_like_x(op, "means", x, means, exact=False)
        return [OutputSpec(tuple(x.dim), layout_source=1)]
    return infer


def window_sums(values: torch.Tensor, axes, attrs: LrnAttrs) -> torch.Tensor:
    """Each element's sum of `values` over its window along `axes`, zeros outside."""
    for axis in axes:
        pads = [0, 0] * (values.dim() - 1 - axis) + [attrs.before, attrs.after]  # F.pad: last axis first
        values = F.pad(values, pads).unfold(axis, attrs.size, 1).sum(-1)
    return values


def normalized(op: str, x: torch.Tensor, means, attrs: LrnAttrs) -> torch.Tensor:
    """Reference y of forward op `op` in torch (differentiable)."""
    centred = x if means is None else x - means
    axes = window_axes(op, x.dim())
    scale = attrs.k + attrs.alpha / window_count(op, x.dim(), attrs) * window_sums(centred * centred, axes, attrs)
    return centred / scale ** attrs.beta


def reference_forward(op: str):
    def reference(values, attrs):
        return [normalized(op, values[0], values[1] if len(values) > 1 else None, attrs)]
    return reference


def reference_backward(op: str):
    def reference(values, attrs):
        dy, x, means = values[0], values[1], values[2] if len(values) > 2 else None
        with torch.enable_grad():
            leaf = x.detach().clone().requires_grad_(True)
            (dx,) = torch.autograd.grad(normalized(op, leaf, means, attrs), leaf, dy)
        return [dx]
    return reference


register(OpDef("lrn", "lrn", "anchor", LrnAttrs, ("x",), ("y",), infer_forward("lrn"),
               reference_forward("lrn"), fusion=AnchorRule((0,), 0)))
register(OpDef("lrn_backward", "lrn", "anchor", LrnAttrs, ("dy", "x"), ("dx",), infer_backward("lrn"),
               reference_backward("lrn"), fusion=AnchorRule((0, 1), 0)))
register(OpDef("divisive_normalization", "lrn", "anchor", LrnAttrs, ("x", "means"), ("y",),
               infer_forward("divisive_normalization"), reference_forward("divisive_normalization"),
               optional=("means",), fusion=AnchorRule((0, 1), 0)))
register(OpDef("divisive_normalization_backward", "lrn", "anchor", LrnAttrs, ("dy", "x", "means"), ("dx",),
               infer_backward("divisive_normalization"), reference_backward("divisive_normalization"),
               optional=("means",), fusion=AnchorRule((0, 1, 2), 0)))


@backward_rule(*FORWARD_OPS)
def _lrn_backward(d, node, grads):
    if grads[0] is None:
        return [None] * len(node.inputs)
    inputs = [grads[0]] + [None if t is None else d.value(t) for t in node.inputs]
    dx = d.graph._add_op(BACKWARD_OPS[node.op], inputs, node.attrs)[0]
    if len(node.inputs) == 1:
        return [dx]
    means = node.inputs[1]
    return [dx, None if means is None else d.graph.neg(dx)]
