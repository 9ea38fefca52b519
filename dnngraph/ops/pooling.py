"""Pooling family: max / average (padding counted or not), 1D/2D/3D, and its backward.

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

import torch
import torch.nn.functional as F

from .. import dtypes
from ..tensor import MAX_EXTENT
from .base import OpDef, OutputSpec, backward_rule, boolean, choice, fail, freeze, int_tuple, register

MODES = ("max", "avg_include_pad", "avg_exclude_pad")


@dataclass(frozen=True)
class PoolingAttrs:
    mode: str
    window: tuple
    stride: tuple
    padding: tuple
    return_indices: bool = False  # max pooling: also torch's argmax indices (int64)

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


def output_spatial(op, x_dim, attrs: PoolingAttrs) -> tuple[int, ...]:
    """Pooled spatial sizes; fails when the window is larger than the padded input."""
    spatial = x_dim[2:]
    if len(spatial) != len(attrs.window):
        fail(op, f"x {list(x_dim)} has {len(spatial)} spatial dims, window {list(attrs.window)}")
    sizes = []
    for size, w, s, p in zip(spatial, attrs.window, attrs.stride, attrs.padding):
        if size + 2 * p < w:
            fail(op, f"window {list(attrs.window)} is larger than the padded input {list(spatial)}")
        sizes.append((size + 2 * p - w) // s + 1)
    return tuple(sizes)


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
        return fn(x, attrs.window, attrs.stride, attrs.padding)
    # zero-pad explicitly: torch's 3D average pooling rejects inputs smaller than the window
    # even where the padding makes the window fit
    fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[spatial - 1]
    pads = [p for pad in reversed(attrs.padding) for p in (pad, pad)]
    window_sums = fn(F.pad(x, pads), attrs.window, attrs.stride) * math.prod(attrs.window)
    if attrs.mode == "avg_include_pad":
        return window_sums / math.prod(attrs.window)
    ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    counts = fn(F.pad(ones, pads), attrs.window, attrs.stride) * math.prod(attrs.window)
    return window_sums / counts


def reference_forward(values, attrs):
    if not attrs.return_indices:
        return [pool(values[0], attrs), None]
    fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[len(attrs.window) - 1]
    return list(fn(values[0], attrs.window, attrs.stride, attrs.padding, return_indices=True))


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
               infer_forward, reference_forward))
register(OpDef("pooling_backward", "pooling", "anchor", PoolingAttrs, ("dy", "x", "indices"), ("dx",),
               infer_backward, reference_backward, optional=("indices",)))


@backward_rule("pooling")
def _pooling_backward(d, node, grads):
    if grads[0] is None:  # the indices have no gradient
        return [None]
    attrs = dataclasses.replace(node.attrs, return_indices=False)
    return [d.graph._add_op("pooling_backward", [grads[0], d.value(node.inputs[0]), None], attrs)[0]]
