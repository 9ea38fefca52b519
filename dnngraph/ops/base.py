"""The op registry: each family registers, per op, its attributes, shape rule and reference."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy

from ..errors import ValidationError

from ..tensor import INT64_MAX, MAX_EXTENT, MAX_RANK


@dataclass(frozen=True)
class OutputSpec:
    """What an op's shape rule says of one output."""

    dim: tuple[int, ...]
    data_type: Any = None  # a DataType the op imposes (bool for comparisons), or None
    stride: Optional[tuple[int, ...]] = None  # a layout the op imposes (matmul), or None
    layout_source: Optional[int] = None  # index of the input whose stride order to follow
    # indices of the inputs whose type a virtual output keeps (views; a concatenate's parts) while
    # they agree on one
    type_source: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class AnchorRule:
    """What an anchor op's kernel absorbs in fusion (fusion/partition.py applies it)."""

    prologue_inputs: tuple[int, ...]  # input positions whose pointwise producers fuse in
    epilogue_output: Optional[int]  # output whose pointwise consumers fuse in (None: none)
    exit_modes: frozenset = frozenset()  # reductions over the last axis that ride the epilogue
    stats_exit: bool = False  # genstats (per-channel sum, sum of squares) of an epilogue value rides it
    # pointwise consumers of the other outputs (a norm's statistics, per-channel parameter
    # gradients) ride the epilogue too: a row kernel computes those per row and stores them there
    side_epilogues: bool = False
    # the epilogue output's two column halves, taken by two slices of the last axis ([0, N/2) and
    # [N/2, N): a gated activation's gate and up, SwiGLU), ride as a pair: the kernel computes both
    # halves of each column tile and its epilogue sees them side by side
    column_pairs: bool = False


@dataclass(frozen=True)
class OpDef:
    """One op of the catalog.

    infer(inputs, attrs) -> list[OutputSpec | None] (None: optional output absent)
    reference(values, attrs) -> list[torch.Tensor | None] on float64-capable torch tensors
    """

    name: str
    family: str  # kernel family that runs it: "pointwise", "matmul", "conv", ...
    role: str  # fusion role: "pointwise" (fusible), "anchor" or "opaque"
    attrs_type: type
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    infer: Callable
    reference: Callable
    variadic: bool = False  # inputs are a list (concatenate)
    optional: tuple[str, ...] = ()  # inputs that may be None
    fusion: Optional[AnchorRule] = None  # an anchor's: what its kernel absorbs (None: nothing)
    # the reference also takes its outputs' data types (a third argument): an op whose math
    # depends on the types it stores (block-scale quantization, whose format they are)
    typed_reference: bool = False


REGISTRY: dict[str, OpDef] = {}

# op name -> backward rule. A rule(d, node, grads) gets the derivation `d` (autodiff.py: d.graph
# is the backward graph, d.value(t) a forward tensor's value there, d.operand(node, i) an
# operand's value or constant), the forward node and the gradient of each of its outputs (a
# backward-graph tensor or None), and returns the gradient of each input (or None: none flows).
# A gradient may have the input's dims or any dims that broadcast to them: the derivation sums
# or expands it.
BACKWARD_RULES: dict[str, Callable] = {}


def backward_rule(*names: str):
    """Register the decorated function as the backward rule of ops `names`."""
    def register_rule(rule):
        for name in names:
            BACKWARD_RULES[name] = rule
        return rule
    return register_rule


def register(op: OpDef) -> OpDef:
    """Add an op to the catalog (names are unique)."""
    if op.name in REGISTRY:
        raise RuntimeError(f"op {op.name!r} registered twice")
    REGISTRY[op.name] = op
    return op


def lookup(name: str) -> OpDef:
    """The catalog entry of op `name`."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValidationError(f"unknown op {name!r}") from None


# --- helpers the shape rules share --------------------------------------------------------------
def fail(op: str, message: str):
    raise ValidationError(f"{op}: {message}")


def broadcast_dims(op: str, named_dims: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """Numpy-style broadcast of several dims (aligned on the right)."""
    rank = max(len(d) for _, d in named_dims)
    result = [1] * rank
    for name, dims in named_dims:
        padded = (1,) * (rank - len(dims)) + tuple(dims)
        for axis, size in enumerate(padded):
            if size == result[axis] or size == 1:
                continue
            if result[axis] == 1:
                result[axis] = size
            else:
                shapes = ", ".join(f"{n} {list(d)}" for n, d in named_dims)
                fail(op, f"cannot broadcast {shapes} (axis {axis}: {result[axis]} vs {size})")
    return tuple(result)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, numpy.bool_))


def integer(op: str, what: str, value, minimum: Optional[int] = None, maximum: int = INT64_MAX) -> int:
    """`value` as a Python int (bools and floats are not integers), within the bounds."""
    if not _is_integer(value):
        fail(op, f"{what} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        fail(op, f"{what} must be >= {minimum}, got {value}")
    if value > maximum:
        fail(op, f"{what} must be <= {maximum}, got {value}")
    return value


def real(op: str, what: str, value, finite: bool = True) -> float:
    """`value` as a Python float: an int or a float, never a bool or a string."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, numpy.bool_)):
        fail(op, f"{what} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:
        fail(op, f"{what} is too large for a float: {value!r}")
    if finite and not math.isfinite(value):
        fail(op, f"{what} must be finite, got {value}")
    return value


def boolean(op: str, what: str, value) -> bool:
    """`value` as a Python bool: True or False only (no truthy strings or numbers)."""
    if not isinstance(value, (bool, numpy.bool_)):
        fail(op, f"{what} must be True or False, got {value!r}")
    return bool(value)


def choice(op: str, what: str, value, options: Sequence[str]) -> str:
    """`value` when it is one of the names in `options`."""
    if not isinstance(value, str) or value not in options:
        fail(op, f"{what} must be one of {', '.join(options)}; got {value!r}")
    return value


def sequence(op: str, what: str, values) -> tuple:
    """A list or tuple as a tuple (strings, dicts, sets and scalars are not sequences here)."""
    if not isinstance(values, (list, tuple)):
        fail(op, f"{what} must be a list, got {values!r}")
    return tuple(values)


def normalize_axes(op: str, axes, rank: int) -> tuple[int, ...]:
    """Axes as sorted non-negative ints; negative axes count from the end."""
    raw = (axes,) if _is_integer(axes) else sequence(op, "axes", axes)
    normalized = []
    for axis in raw:
        axis = integer(op, "axis", axis, maximum=rank)
        if not -rank <= axis < rank:
            fail(op, f"axis {axis} out of range for rank {rank}")
        normalized.append(axis % rank)
    if len(set(normalized)) != len(normalized):
        fail(op, f"repeated axis in {list(raw)}")
    return tuple(sorted(normalized))


def canonical_axes(op: str, what: str, axes) -> tuple[int, ...]:
    """Axes in the canonical form normalize_axes gives: distinct non-negative ints, ascending.

    Attributes hold axes this way; the Graph methods normalize user input (negative axes,
    any order) with the rank in hand, so a document with axes [-1] or [1, 1] is rejected here
    instead of meaning something the method call could not have produced.
    """
    axes = tuple(integer(op, what, a, minimum=0, maximum=MAX_RANK) for a in sequence(op, what, axes))
    if list(axes) != sorted(set(axes)):
        fail(op, f"{what} must be distinct and ascending (canonical form), got {list(axes)}")
    return axes


def int_tuple(op: str, what: str, values, length: Optional[int] = None, minimum: Optional[int] = None,
              maximum: int = INT64_MAX):
    """A tuple of ints, validated for length and bounds."""
    result = tuple(integer(op, f"{what} value", v, minimum, maximum) for v in sequence(op, what, values))
    if length is not None and len(result) != length:
        fail(op, f"{what} needs {length} values, got {list(result)}")
    return result


def per_axis(op: str, what: str, values, spatial: int, default: int, minimum: int) -> tuple:
    """One int per spatial axis: None gives the default, an int applies to every axis."""
    if values is None:
        return (default,) * spatial
    if _is_integer(values):
        values = (values,) * spatial
    return int_tuple(op, what, values, spatial, minimum, maximum=MAX_EXTENT)


def freeze(attrs, **values):
    """Store normalized field values on a frozen attrs dataclass (from its __post_init__)."""
    for name, value in values.items():
        object.__setattr__(attrs, name, value)


def attrs_to_dict(attrs) -> dict:
    """Attributes as a plain dict (tuples stay tuples)."""
    return {f.name: getattr(attrs, f.name) for f in dataclasses.fields(attrs)}
