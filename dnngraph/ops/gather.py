"""Gather family: values of a table picked along one axis by an integer index tensor.

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
from .base import OpDef, OutputSpec, fail, freeze, integer, register

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


register(OpDef("gather", "gather", "anchor", GatherAttrs, ("x", "index"), ("y",), infer, reference))
