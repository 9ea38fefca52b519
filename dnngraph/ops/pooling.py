"""Pooling family: max / average (padding counted or not), 1D/2D/3D, and its backward.

As torch's pooling: `ceil_mode` rounds the output size up (a last, partial window that starts
inside the input or its left padding); an average's divisor counts the window's elements inside
the padded input (avg_include_pad) or inside the input (avg_exclude_pad), unless `divisor`
(torch's divisor_override) is given.

Max pooling can also give torch's indices (`return_indices=True`): per output element the
int64 flat index, within its input plane, of the window's first maximum in scan order; a NaN
takes the index from any number and from an earlier NaN (so the last NaN wins); a window with
nothing above -inf keeps its first in-range element. The max backward recomputes that argmax
from x, or, given those indices (int64, dy's dims), routes each dy to the element its index names
when that element lies in its window (torch's max_pool*_with_indices_backward for such indices).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import dtypes
from ..tensor import MAX_EXTENT
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, boolean, choice, fail, freeze, int_tuple, integer, register

MODES = ("max", "avg_include_pad", "avg_exclude_pad")


@dataclass(frozen=True)
class PoolingAttrs:
    mode: str
    window: tuple
    stride: tuple
    padding: tuple
    return_indices: bool = False  # max pooling: also torch's argmax indices (int64)
    # torch's ceil_mode: the output size rounds up, adding a last window that runs past the
    # padded input where it starts inside the input or its left padding
    ceil_mode: bool = False
    # average pooling: every window's sum divided by this (torch's divisor_override), not a count
    divisor: Optional[int] = None

    def __post_init__(self):
        op = "pooling"
        window = int_tuple(op, "window", self.window, minimum=1, maximum=MAX_EXTENT)
        spatial = len(window)
        if not 1 <= spatial <= 3:
            fail(op, f"window must have 1 to 3 values, got {list(window)}")
        padding = int_tuple(op, "padding", self.padding, spatial, minimum=0, maximum=MAX_EXTENT)
        if any(2 * p > w for p, w in zip(padding, window)):
            fail(op, f"padding {list(padding)} must be at most half the window {list(window)}")
        freeze(self, mode=choice(op, "mode", self.mode, MODES), window=window, padding=padding,
               stride=int_tuple(op, "stride", self.stride, spatial, minimum=1, maximum=MAX_EXTENT),
               return_indices=boolean(op, "return_indices", self.return_indices))
        if self.return_indices and self.mode != "max":
            fail(op, f"return_indices needs mode 'max', got {self.mode!r}")
        freeze(self, ceil_mode=boolean(op, "ceil_mode", self.ceil_mode))
        if self.divisor is not None:
            if self.mode == "max":
                fail(op, "divisor is an average pooling's; mode is 'max'")
            divisor = integer(op, "divisor", self.divisor, minimum=-MAX_EXTENT, maximum=MAX_EXTENT)
            if divisor == 0:  # torch refuses a zero divisor_override too
                fail(op, "divisor must not be zero")
            freeze(self, divisor=divisor)


def output_spatial(op, x_dim, attrs: PoolingAttrs) -> tuple[int, ...]:
    """Pooled spatial sizes; fails when the window is larger than the padded input."""
    spatial = x_dim[2:]
    if len(spatial) != len(attrs.window):
        fail(op, f"x {list(x_dim)} has {len(spatial)} spatial dims, window {list(attrs.window)}")
    sizes = []
    for size, w, s, p in zip(spatial, attrs.window, attrs.stride, attrs.padding):
        if size + 2 * p < w:
            fail(op, f"window {list(attrs.window)} is larger than the padded input {list(spatial)}")
        sizes.append(pooled_size(size, w, s, p, attrs.ceil_mode))
    return tuple(sizes)


def pooled_size(size: int, window: int, stride: int, padding: int, ceil_mode: bool) -> int:
    """Windows along one axis, torch's rule: rounded up in ceil mode, where the last window
    must start inside the input or its left padding (else it is dropped)."""
    if not ceil_mode:
        return (size + 2 * padding - window) // stride + 1
    count = -(-(size + 2 * padding - window) // stride) + 1
    if (count - 1) * stride >= size + padding:
        count -= 1
    return count


def overhang(size: int, window: int, stride: int, padding: int, pooled: int) -> int:
    """How far the last of `pooled` windows runs past the padded input (ceil mode), else 0."""
    return max(0, (pooled - 1) * stride + window - (size + 2 * padding))


def infer_forward(inputs, attrs):
    (x,) = inputs
    dims = tuple(x.dim[:2]) + output_spatial("pooling", x.dim, attrs)
    indices = OutputSpec(dims, dtypes.int64, layout_source=0) if attrs.return_indices else None
    return [OutputSpec(dims, layout_source=0), indices]


def infer_backward(inputs, attrs):
    dy, x, indices = inputs
    if attrs.return_indices:
        fail("pooling_backward", "return_indices is an attribute of the forward only")
    expected = tuple(x.dim[:2]) + output_spatial("pooling_backward", x.dim, attrs)
    if tuple(dy.dim) != expected:
        fail("pooling_backward", f"dy must be {list(expected)}, got {list(dy.dim)}")
    if indices is not None:
        check_indices(attrs, dy, indices)
    return [OutputSpec(x.dim, layout_source=1)]


def check_indices(attrs, dy, indices):
    """The max backward's indices: int64 with dy's dims, for mode 'max' only."""
    if attrs.mode != "max":
        fail("pooling_backward", f"indices route max pooling's gradient; mode is {attrs.mode!r}")
    if indices.data_type is not dtypes.int64:
        fail("pooling_backward", f"indices must be int64, got {indices.data_type.name}")
    if tuple(indices.dim) != tuple(dy.dim):
        fail("pooling_backward", f"indices must have dy's dims {list(dy.dim)}, got {list(indices.dim)}")


def pool(x: torch.Tensor, attrs: PoolingAttrs) -> torch.Tensor:
    """Reference pooling in torch."""
    spatial = len(attrs.window)
    if attrs.mode == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[spatial - 1]
        return fn(x, attrs.window, attrs.stride, attrs.padding, ceil_mode=attrs.ceil_mode)
    # zero-pad explicitly (the padding, then what a ceil-mode last window runs past it) and pool
    # without padding: torch's 3D average pooling rejects inputs smaller than the window even
    # where the padding makes the window fit
    fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[spatial - 1]
    sizes = tuple(x.shape[2:])
    pooled = output_spatial("pooling", tuple(x.shape), attrs)
    extra = [overhang(*geometry) for geometry in zip(sizes, attrs.window, attrs.stride, attrs.padding, pooled)]

    def window_sums(values, pads):
        flat = [p for pair in reversed(pads) for p in pair]  # F.pad lists the last axis first
        return fn(F.pad(values, flat), attrs.window, attrs.stride) * math.prod(attrs.window)

    sums = window_sums(x, [(p, p + e) for p, e in zip(attrs.padding, extra)])
    if attrs.divisor is not None:
        return sums / attrs.divisor
    if attrs.mode == "avg_include_pad":  # the window's part inside the padded input
        ones = torch.ones((1, 1) + tuple(s + 2 * p for s, p in zip(sizes, attrs.padding)), dtype=x.dtype,
                          device=x.device)
        return sums / window_sums(ones, [(0, e) for e in extra])
    ones = torch.ones((1, 1) + sizes, dtype=x.dtype, device=x.device)
    return sums / window_sums(ones, [(p, p + e) for p, e in zip(attrs.padding, extra)])


def reference_forward(values, attrs):
    if not attrs.return_indices:
        return [pool(values[0], attrs), None]
    fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[len(attrs.window) - 1]
    return list(fn(values[0], attrs.window, attrs.stride, attrs.padding, ceil_mode=attrs.ceil_mode,
                   return_indices=True))


def in_window(indices: torch.Tensor, attrs, in_spatial) -> torch.Tensor:
    """Does each pooled position's index name an element of its own window?"""
    plane = math.prod(in_spatial)
    inside = (indices >= 0) & (indices < plane)
    inner = plane
    for axis, (size, w, s, p) in enumerate(zip(in_spatial, attrs.window, attrs.stride, attrs.padding)):
        inner //= size
        coordinate = indices // inner % size
        shape = [1] * indices.dim()
        shape[2 + axis] = indices.shape[2 + axis]
        start = torch.arange(indices.shape[2 + axis], device=indices.device).view(shape) * s - p
        inside &= (coordinate >= start) & (coordinate < start + w)
    return inside


def route_by_indices(dy: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, attrs) -> torch.Tensor:
    """dx: each dy added at the element its index names, where that element is in its window."""
    inside = in_window(indices, attrs, tuple(x.shape[2:]))
    grads = torch.where(inside, dy, torch.zeros((), dtype=dy.dtype)).flatten(2)
    targets = torch.where(inside, indices, 0).flatten(2)
    dx = torch.zeros(tuple(x.shape[:2]) + (math.prod(x.shape[2:]),), dtype=dy.dtype, device=dy.device)
    return dx.scatter_add_(2, targets, grads).view(x.shape)


def reference_backward(values, attrs):
    dy, x, indices = values
    if indices is not None:
        return [route_by_indices(dy, x, indices, attrs)]
    with torch.enable_grad():
        leaf = x.detach().clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(pool(leaf, attrs), leaf, dy)
    return [dx]


register(OpDef("pooling", "pooling", "anchor", PoolingAttrs, ("x",), ("y", "indices"),
               infer_forward, reference_forward, fusion=AnchorRule((0,), 0)))
register(OpDef("pooling_backward", "pooling", "anchor", PoolingAttrs, ("dy", "x", "indices"), ("dx",),
               infer_backward, reference_backward, optional=("indices",), fusion=AnchorRule((0,), 0)))


@backward_rule("pooling")
def _pooling_backward(d, node, grads):
    if grads[0] is None:  # the indices have no gradient
        return [None]
    attrs = dataclasses.replace(node.attrs, return_indices=False)
    return [d.graph._add_op("pooling_backward", [grads[0], d.value(node.inputs[0]), None], attrs)[0]]
