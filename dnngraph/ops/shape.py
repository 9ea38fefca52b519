"""Layout family: reshape, transpose, slice, concatenate (logical views and copies)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import OpDef, OutputSpec, fail, int_tuple, register


@dataclass(frozen=True)
class ReshapeAttrs:
    dim: tuple


@dataclass(frozen=True)
class TransposeAttrs:
    permutation: tuple


@dataclass(frozen=True)
class SliceAttrs:
    slices: tuple  # ((start, stop, step), ...) per axis, normalized to the input dims


@dataclass(frozen=True)
class ConcatAttrs:
    axis: int


def _numel(dim):
    count = 1
    for size in dim:
        count *= size
    return count


def infer_reshape(inputs, attrs):
    (x,) = inputs
    dim = int_tuple("reshape", "dim", attrs.dim, minimum=1)
    if _numel(dim) != _numel(x.dim):
        fail("reshape", f"cannot reshape {x.name!r} {list(x.dim)} ({_numel(x.dim)} elements) to {list(dim)}")
    return [OutputSpec(dim)]


def infer_transpose(inputs, attrs):
    (x,) = inputs
    if sorted(attrs.permutation) != list(range(len(x.dim))):
        fail("transpose", f"permutation {list(attrs.permutation)} is not a permutation of {len(x.dim)} axes")
    return [OutputSpec(tuple(x.dim[a] for a in attrs.permutation))]


def infer_slice(inputs, attrs):
    (x,) = inputs
    if len(attrs.slices) != len(x.dim):
        fail("slice", f"{len(attrs.slices)} slices for rank {len(x.dim)}")
    dim = []
    for axis, ((start, stop, step), size) in enumerate(zip(attrs.slices, x.dim)):
        if step < 1 or not 0 <= start < stop <= size:
            fail("slice", f"axis {axis}: slice {start}:{stop}:{step} is empty or outside 0..{size}")
        dim.append(len(range(start, stop, step)))
    return [OutputSpec(tuple(dim), layout_source=0)]


def infer_concatenate(inputs, attrs):
    if not inputs:
        fail("concatenate", "needs at least one tensor")
    rank = len(inputs[0].dim)
    if not 0 <= attrs.axis < rank:
        fail("concatenate", f"axis {attrs.axis} out of range for rank {rank}")
    for t in inputs[1:]:
        other = [s for a, s in enumerate(t.dim) if a != attrs.axis]
        first = [s for a, s in enumerate(inputs[0].dim) if a != attrs.axis]
        if len(t.dim) != rank or other != first:
            fail("concatenate", f"{t.name!r} {list(t.dim)} does not match {list(inputs[0].dim)} "
                                f"off axis {attrs.axis}")
    dim = list(inputs[0].dim)
    dim[attrs.axis] = sum(t.dim[attrs.axis] for t in inputs)
    return [OutputSpec(tuple(dim), layout_source=0)]


def normalize_slices(slices, dim) -> tuple:
    """Python slices (or (start, stop[, step]) tuples) as ((start, stop, step), ...)."""
    if len(slices) != len(dim):
        fail("slice", f"{len(slices)} slices for rank {len(dim)}")
    normalized = []
    for item, size in zip(slices, dim):
        if isinstance(item, slice):
            normalized.append(item.indices(size))
        else:
            start, stop, *step = item
            normalized.append((int(start), int(stop), int(step[0]) if step else 1))
    return tuple(normalized)


register(OpDef("reshape", "layout", "opaque", ReshapeAttrs, ("x",), ("y",), infer_reshape,
               lambda values, attrs: [values[0].reshape(attrs.dim)]))
register(OpDef("transpose", "layout", "opaque", TransposeAttrs, ("x",), ("y",), infer_transpose,
               lambda values, attrs: [values[0].permute(attrs.permutation)]))
register(OpDef("slice", "layout", "opaque", SliceAttrs, ("x",), ("y",), infer_slice,
               lambda values, attrs: [values[0][tuple(slice(*s) for s in attrs.slices)]]))
register(OpDef("concatenate", "layout", "opaque", ConcatAttrs, ("tensors",), ("y",), infer_concatenate,
               lambda values, attrs: [torch.cat(values, attrs.axis)], variadic=True))
