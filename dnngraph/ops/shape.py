"""Layout family: reshape, transpose, slice, concatenate (logical views and copies)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensor import MAX_EXTENT, MAX_RANK
from ..errors import UnsupportedError
from .base import (OpDef, OutputSpec, backward_rule, canonical_axes, fail, freeze, int_tuple, integer, register,
                   sequence)


@dataclass(frozen=True)
class ReshapeAttrs:
    dim: tuple
    # (output axis, input axis[, multiplier, divisor]) per output axis of a dynamic extent: the
    # output axis is as long as that input axis times multiplier / divisor at every size (a
    # dynamic axis kept whole: (out, in); merged with static axes, [B, s, H] -> [B * s, H]:
    # (0, 1, B, 1); split from such a product: (1, 0, 1, B)). `dim` holds it at the max. Empty
    # for a static reshape.
    from_input: tuple = ()
    written_when_set = ("from_input",)  # a document of a static reshape reads as before

    def __post_init__(self):
        dim = int_tuple("reshape", "dim", self.dim, minimum=1, maximum=MAX_EXTENT)
        pairs = tuple(_from_input_entry(index, entry)
                      for index, entry in enumerate(sequence("reshape", "from_input", self.from_input)))
        outputs = [entry[0] for entry in pairs]
        if len(set(outputs)) != len(outputs) or any(out >= len(dim) for out in outputs):
            fail("reshape", f"from_input names each output axis of {list(dim)} at most once, got {list(pairs)}")
        freeze(self, dim=dim, from_input=pairs)


def _from_input_entry(index: int, entry) -> tuple:
    """One from_input entry checked: (out, in), or (out, in, multiplier, divisor) with both >= 1
    and not both 1 (that is the pair)."""
    what = f"from_input[{index}]"
    if isinstance(entry, (list, tuple)) and len(entry) == 4:
        out, source, multiplier, divisor = int_tuple("reshape", what, entry, 4, minimum=0, maximum=MAX_EXTENT)
        if out > MAX_RANK or source > MAX_RANK or multiplier < 1 or divisor < 1 or multiplier == divisor == 1:
            fail("reshape", f"{what} is (output axis, input axis, multiplier >= 1, divisor >= 1), not both 1, "
                            f"got {list(entry)}")
        return out, source, multiplier, divisor
    return int_tuple("reshape", what, entry, 2, minimum=0, maximum=MAX_RANK)


def reshape_target(attrs, x_dims) -> tuple:
    """The output dims of reshape `attrs` of an input of dims `x_dims`: `attrs.dim`, each axis of
    `from_input` as long as its input axis (times its multiplier, over its divisor)."""
    dim = list(attrs.dim)
    for out, source, *ratio in attrs.from_input:
        if source >= len(x_dims):
            fail("reshape", f"from_input takes axis {source} of an input of rank {len(x_dims)}")
        multiplier, divisor = ratio or (1, 1)
        extent, remainder = divmod(int(x_dims[source]) * multiplier, divisor)
        if remainder or extent < 1:
            fail("reshape", f"output axis {out} is input axis {source} ({x_dims[source]}) times {multiplier} over "
                            f"{divisor}, which is no whole extent")
        dim[out] = extent
    return tuple(dim)


@dataclass(frozen=True)
class TransposeAttrs:
    permutation: tuple

    def __post_init__(self):
        freeze(self, permutation=int_tuple("transpose", "permutation", self.permutation, minimum=0,
                                           maximum=MAX_RANK))


@dataclass(frozen=True)
class SliceAttrs:
    slices: tuple  # ((start, stop, step), ...) per axis, normalized to the input dims

    def __post_init__(self):
        slices = sequence("slice", "slices", self.slices)
        freeze(self, slices=tuple(int_tuple("slice", f"slices[{axis}]", item, 3, minimum=0,
                                            maximum=MAX_EXTENT)
                                  for axis, item in enumerate(slices)))


@dataclass(frozen=True)
class ConcatAttrs:
    axis: int

    def __post_init__(self):
        (axis,) = canonical_axes("concatenate", "axis", (self.axis,))
        freeze(self, axis=axis)


def _numel(dim):
    count = 1
    for size in dim:
        count *= size
    return count


def infer_reshape(inputs, attrs):
    (x,) = inputs
    dim = reshape_target(attrs, x.dim)
    if _numel(dim) != _numel(x.dim):
        fail("reshape", f"cannot reshape {x.name!r} {list(x.dim)} ({_numel(x.dim)} elements) to {list(dim)}")
    return [OutputSpec(dim, type_source=(0,))]


def infer_transpose(inputs, attrs):
    (x,) = inputs
    if sorted(attrs.permutation) != list(range(len(x.dim))):
        fail("transpose", f"permutation {list(attrs.permutation)} is not a permutation of {len(x.dim)} axes")
    return [OutputSpec(tuple(x.dim[a] for a in attrs.permutation), type_source=(0,))]


def infer_slice(inputs, attrs):
    (x,) = inputs
    if len(attrs.slices) != len(x.dim):
        fail("slice", f"{len(attrs.slices)} slices for rank {len(x.dim)}")
    dim = []
    for axis, ((start, stop, step), size) in enumerate(zip(attrs.slices, x.dim)):
        if step < 1 or not 0 <= start < stop <= size:
            fail("slice", f"axis {axis}: slice {start}:{stop}:{step} is empty or outside 0..{size}")
        dim.append(len(range(start, stop, step)))
    return [OutputSpec(tuple(dim), layout_source=0, type_source=(0,))]


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
    return [OutputSpec(tuple(dim), layout_source=0, type_source=tuple(range(len(inputs))))]


# --- views: the same memory seen with other dims and strides (element offsets, no copies) -------
def view_of(node, dims, strides, offset: int):
    """(dims, strides, offset) of a reshape, transpose or slice output over the memory its input
    occupies as (dims, strides, offset), or None where no strides can express it (a reshape that
    merges axes that are not laid out one inside the other)."""
    attrs = node.attrs
    if node.op == "transpose":
        return (tuple(dims[a] for a in attrs.permutation), tuple(strides[a] for a in attrs.permutation), offset)
    if node.op == "slice":
        offset += sum(start * stride for (start, _, _), stride in zip(attrs.slices, strides))
        return (node.outputs[0].dim, tuple(stride * step for (_, _, step), stride in zip(attrs.slices, strides)),
                offset)
    if node.op == "reshape":
        new_dims = tuple(node.outputs[0].dim)
        new_strides = reshape_strides(dims, strides, new_dims)
        return None if new_strides is None else (new_dims, new_strides, offset)
    raise ValueError(f"{node.op} is not a view")


def reshape_strides(dims, strides, new_dims):
    """Strides that show memory laid out as (dims, strides) with dims `new_dims` in row-major
    element order, or None. Axes are taken in chunks that nest (each one's stride is the next
    one's stride times its size); new dims must split and merge within a chunk."""
    kept = [(d, s) for d, s in zip(dims, strides) if d != 1]
    new_strides = [0] * len(new_dims)
    view_axis = len(new_dims) - 1
    if not kept:  # every element count is 1
        return tuple(new_strides)
    chunk_stride, chunk_elements, view_elements = kept[-1][1], 1, 1
    for axis in range(len(kept) - 1, -1, -1):
        chunk_elements *= kept[axis][0]
        if axis == 0 or kept[axis - 1][1] != chunk_elements * chunk_stride:
            while view_axis >= 0 and (view_elements < chunk_elements or new_dims[view_axis] == 1):
                new_strides[view_axis] = view_elements * chunk_stride
                view_elements *= new_dims[view_axis]
                view_axis -= 1
            if view_elements != chunk_elements:
                return None
            if axis > 0:
                chunk_stride, chunk_elements, view_elements = kept[axis - 1][1], 1, 1
    while view_axis >= 0:  # trailing size-1 dims of the view
        if new_dims[view_axis] != 1:
            return None
        view_axis -= 1
    return tuple(new_strides)


def concat_parts(node):
    """(input index, start along the axis) of each input of a concatenate."""
    start, parts = 0, []
    for index, tensor in enumerate(node.inputs):
        parts.append((index, start))
        start += tensor.dim[node.attrs.axis]
    return parts


def normalize_slices(slices, dim) -> tuple:
    """Python slices (or (start, stop[, step]) tuples) as ((start, stop, step), ...)."""
    slices = sequence("slice", "slices", slices)
    if len(slices) != len(dim):
        fail("slice", f"{len(slices)} slices for rank {len(dim)}")
    return tuple(_normalize_slice(axis, item, size) for axis, (item, size) in enumerate(zip(slices, dim)))


def _normalize_slice(axis: int, item, size: int) -> tuple:
    what = f"slices[{axis}]"
    if isinstance(item, slice):
        for bound in (item.start, item.stop, item.step):
            if bound is not None:
                integer("slice", what, bound, -MAX_EXTENT, MAX_EXTENT)
        if item.step is not None and item.step < 1:
            fail("slice", f"{what}: step must be >= 1, got {item.step}")
        return item.indices(size)
    item = sequence("slice", what, item)
    if len(item) not in (2, 3):
        fail("slice", f"{what} must be a slice or (start, stop[, step]), got {list(item)}")
    start, stop, *step = (integer("slice", what, v, -MAX_EXTENT, MAX_EXTENT) for v in item)
    return (start, stop, step[0] if step else 1)


register(OpDef("reshape", "layout", "opaque", ReshapeAttrs, ("x",), ("y",), infer_reshape,
               lambda values, attrs: [values[0].reshape(reshape_target(attrs, values[0].shape))]))
register(OpDef("transpose", "layout", "opaque", TransposeAttrs, ("x",), ("y",), infer_transpose,
               lambda values, attrs: [values[0].permute(attrs.permutation)]))
register(OpDef("slice", "layout", "opaque", SliceAttrs, ("x",), ("y",), infer_slice,
               lambda values, attrs: [values[0][tuple(slice(*s) for s in attrs.slices)]]))
register(OpDef("concatenate", "layout", "opaque", ConcatAttrs, ("tensors",), ("y",), infer_concatenate,
               lambda values, attrs: [torch.cat(values, attrs.axis)], variadic=True))


@backward_rule("transpose")
def _transpose_backward(d, node, grads):
    inverse = [0] * len(node.attrs.permutation)
    for position, axis in enumerate(node.attrs.permutation):
        inverse[axis] = position
    return [d.graph.transpose(grads[0], inverse)]


@backward_rule("reshape")
def _reshape_backward(d, node, grads):
    return [d.graph.reshape(grads[0], list(node.inputs[0].dim))]


@backward_rule("slice")
def _slice_backward(d, node, grads):
    """dy placed back among zeros, one axis at a time: a stepped axis first spreads dy with
    step - 1 zeros after each element, then zeros fill the rows before and after the span."""
    g, grad, x = d.graph, grads[0], node.inputs[0]
    for axis, (start, stop, step) in enumerate(node.attrs.slices):
        size = x.dim[axis]
        if step > 1:
            grad = _spread(d, grad, axis, step)
            span = min(grad.dim[axis], size - start)
            window = [slice(None)] * len(grad.dim)
            window[axis] = slice(0, span)
            grad = g.slice(grad, window) if span < grad.dim[axis] else grad
        end = start + grad.dim[axis]
        before = [_zeros_along(d, grad, axis, start)] if start > 0 else []
        after = [_zeros_along(d, grad, axis, size - end)] if end < size else []
        if before or after:
            grad = g.concatenate(before + [grad] + after, axis)
    return [grad]


def _zeros_along(d, like, axis: int, length: int):
    """Zeros with `like`'s dims but `length` along `axis`."""
    g = d.graph
    copies = -(-length // like.dim[axis])
    source = g.concatenate([like] * copies, axis) if copies > 1 else like
    if source.dim[axis] != length:
        window = [slice(None)] * len(source.dim)
        window[axis] = slice(0, length)
        source = g.slice(source, window)
    return d.zeros(source)


def _spread(d, grad, axis: int, step: int):
    """grad with step - 1 zeros after each element along `axis` (its size times step)."""
    g, dims = d.graph, list(grad.dim)
    column = g.reshape(grad, dims[:axis + 1] + [1] + dims[axis + 1:])
    zeros = d.zeros(g.concatenate([column] * (step - 1), axis + 1))
    spread = g.concatenate([column, zeros], axis + 1)
    return g.reshape(spread, dims[:axis] + [dims[axis] * step] + dims[axis + 1:])


@backward_rule("concatenate")
def _concatenate_backward(d, node, grads):
    axis, grad = node.attrs.axis, grads[0]
    result = []
    for index, start in concat_parts(node):
        window = [slice(None)] * len(grad.dim)
        window[axis] = slice(start, start + node.inputs[index].dim[axis])
        result.append(d.graph.slice(grad, window))
    return result
