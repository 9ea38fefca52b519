"""Gather family: values of a table picked along one axis by an integer index tensor, and the
scatter-add that is its gradient.

`gather(x, index, axis)`: x and index have one rank; y[..., i, ...] = x[..., index[..., i, ...], ...]
with i on `axis`. On the other axes x and index broadcast (numpy style: equal, or one of them
1), so one op is torch's gather (index of y's dims), index_select (an index of size 1 on every
axis but `axis`) and an embedding lookup (table [V, D], ids [N, 1] on axis 0).

Ids are checked by the kernel, never trusted: an id outside [0, x.dim[axis]) reads nothing and
gives NaN (floating tables) or 0 (integers; False for bool). torch raises on such ids (on CPU;
its CUDA kernels assert); a compiled kernel cannot raise, so the value says it instead, and the
float64 reference gives the same. Negative ids are out of range here: torch's indexing that
wraps them (x[ids]) is converted with the wrap written as pointwise ops before the gather.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import dtypes
from ..tensor import MAX_RANK
from ..tensor import MAX_EXTENT
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, fail, freeze, integer, register

INDEX_TYPES = (dtypes.int32, dtypes.int64)


@dataclass(frozen=True)
class GatherAttrs:
    axis: int

    def __post_init__(self):
        freeze(self, axis=integer("gather", "axis", self.axis, minimum=0, maximum=MAX_RANK - 1))


def gathered_dims(op: str, x_dim, index_dim, axis: int) -> tuple:
    """y's dims: the index's along `axis`, x and index broadcast along the others."""
    if len(x_dim) != len(index_dim):
        fail(op, f"x {list(x_dim)} and index {list(index_dim)} must have one rank")
    if axis >= len(x_dim):
        fail(op, f"axis {axis} out of range for rank {len(x_dim)}")
    dims = []
    for position, (size, picks) in enumerate(zip(x_dim, index_dim)):
        if position == axis:
            dims.append(picks)
        elif size == picks or 1 in (size, picks):
            dims.append(max(size, picks))
        else:
            fail(op, f"x {list(x_dim)} and index {list(index_dim)} do not broadcast on axis {position}")
    return tuple(dims)


def infer(inputs, attrs: GatherAttrs):
    x, index = inputs
    if index.data_type not in INDEX_TYPES:
        fail("gather", f"index must be int32 or int64, got {index.data_type.name}")
    dims = gathered_dims("gather", x.dim, index.dim, attrs.axis)
    # a floating table follows the graph's types; integers and bools stay what they are
    imposed = None if x.data_type.is_floating else x.data_type
    layout = 1 if tuple(index.dim) == dims else (0 if tuple(x.dim) == dims else None)
    return [OutputSpec(dims, imposed, layout_source=layout)]


def out_of_range_value(x: torch.Tensor):
    """What an id outside the table gives: NaN for floats, 0 (False) otherwise."""
    return math.nan if x.is_floating_point() else 0


def reference(values, attrs: GatherAttrs):
    x, index = values
    axis = attrs.axis
    dims = gathered_dims("gather", tuple(x.shape), tuple(index.shape), axis)
    ids = index.long().expand(dims)
    valid = (ids >= 0) & (ids < x.shape[axis])
    table = x.expand(dims[:axis] + (x.shape[axis],) + dims[axis + 1:])
    picked = torch.gather(table, axis, ids.clamp(0, x.shape[axis] - 1))
    return [torch.where(valid, picked, torch.full((), out_of_range_value(x), dtype=x.dtype))]


# a gather's loads follow its ids: no prologue (it would run at gathered positions); its pointwise
# consumers (an embedding's scale, a position add) ride the store
register(OpDef("gather", "gather", "anchor", GatherAttrs, ("x", "index"), ("y",), infer, reference,
               fusion=AnchorRule((), 0)))


# --- scatter_add: the gather's gradient --------------------------------------------------------
@dataclass(frozen=True)
class ScatterAddAttrs:
    axis: int
    size: int  # y's extent along `axis` (the gathered table's)

    def __post_init__(self):
        freeze(self, axis=integer("scatter_add", "axis", self.axis, minimum=0, maximum=MAX_RANK - 1),
               size=integer("scatter_add", "size", self.size, minimum=1, maximum=MAX_EXTENT))


def infer_scatter(inputs, attrs: ScatterAddAttrs):
    src, index = inputs
    if index.data_type not in INDEX_TYPES:
        fail("scatter_add", f"index must be int32 or int64, got {index.data_type.name}")
    if attrs.axis >= len(src.dim):
        fail("scatter_add", f"axis {attrs.axis} out of range for rank {len(src.dim)}")
    if len(index.dim) != len(src.dim) or index.dim[attrs.axis] != src.dim[attrs.axis]:
        fail("scatter_add", f"index {list(index.dim)} must have src {list(src.dim)}'s rank and its extent "
                            f"along axis {attrs.axis}")
    dims = list(gathered_dims("scatter_add", src.dim, index.dim, attrs.axis))
    if tuple(dims) != tuple(src.dim):
        fail("scatter_add", f"index {list(index.dim)} must broadcast to src {list(src.dim)}")
    dims[attrs.axis] = attrs.size
    if not src.data_type.is_floating:
        fail("scatter_add", f"src must be floating, got {src.data_type.name}")
    return [OutputSpec(tuple(dims), layout_source=0 if tuple(dims) == tuple(src.dim) else None)]


def reference_scatter(values, attrs: ScatterAddAttrs):
    src, index = values
    axis = attrs.axis
    ids = index.long().expand(src.shape)
    valid = (ids >= 0) & (ids < attrs.size)  # an id outside y adds nothing
    dims = list(src.shape)
    dims[axis] = attrs.size
    y = torch.zeros(dims, dtype=src.dtype, device=src.device)
    return [y.scatter_add_(axis, ids.clamp(0, attrs.size - 1), torch.where(valid, src, torch.zeros((), dtype=src.dtype)))]


register(OpDef("scatter_add", "gather", "anchor", ScatterAddAttrs, ("src", "index"), ("y",),
               infer_scatter, reference_scatter))


@backward_rule("gather")
def _gather_backward(d, node, grads):
    """dx: dy added at the element each id names; summed over the axes where x broadcast (the
    derivation does that); the ids take no gradient."""
    x, index = node.inputs
    if grads[0] is None or not d.needs(x):
        return [None, None]
    attrs = ScatterAddAttrs(node.attrs.axis, x.dim[node.attrs.axis])
    return [d.graph._add_op("scatter_add", [grads[0], d.value(index)], attrs)[0], None]


@backward_rule("scatter_add")
def _scatter_add_backward(d, node, grads):
    """dsrc: the gradient of y read back where each id sent its value (0 for ids outside y)."""
    src, index = node.inputs
    if grads[0] is None or not d.needs(src):
        return [None, None]
    picked = d.graph.gather(grads[0], d.value(index), node.attrs.axis)
    # an id outside y added nothing: its gradient is 0, not the gather's NaN
    ids = d.value(index)
    inside = d.graph.logical_and(d.graph.cmp_ge(ids, 0), d.graph.cmp_lt(ids, node.attrs.size))
    return [d.graph.where(inside, picked, 0.0), None]
