"""The op registry: each family registers, per op, its attributes, shape rule and reference."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..errors import ValidationError


@dataclass(frozen=True)
class OutputSpec:
    """What an op's shape rule says of one output."""

    dim: tuple[int, ...]
    data_type: Any = None  # a DataType the op imposes (bool for comparisons), or None
    stride: Optional[tuple[int, ...]] = None  # a layout the op imposes (matmul), or None
    layout_source: Optional[int] = None  # index of the input whose stride order to follow


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


REGISTRY: dict[str, OpDef] = {}


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


def normalize_axes(op: str, axes, rank: int) -> tuple[int, ...]:
    """Axes as sorted non-negative ints; negative axes count from the end."""
    if isinstance(axes, int):
        axes = (axes,)
    try:
        raw = [int(a) for a in axes]
    except (TypeError, ValueError):
        fail(op, f"axes must be integers, got {axes!r}")
    normalized = []
    for axis in raw:
        if not -rank <= axis < rank:
            fail(op, f"axis {axis} out of range for rank {rank}")
        normalized.append(axis % rank)
    if len(set(normalized)) != len(normalized):
        fail(op, f"repeated axis in {list(raw)}")
    return tuple(sorted(normalized))


def int_tuple(op: str, what: str, values, length: Optional[int] = None, minimum: Optional[int] = None):
    """A tuple of ints, validated for length and lower bound."""
    try:
        result = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        fail(op, f"{what} must be a list of integers, got {values!r}")
    if any(int(v) != v for v in values):
        fail(op, f"{what} must be integers, got {list(values)}")
    if length is not None and len(result) != length:
        fail(op, f"{what} needs {length} values, got {list(result)}")
    if minimum is not None and any(v < minimum for v in result):
        fail(op, f"{what} must be >= {minimum}, got {list(result)}")
    return result


def attrs_to_dict(attrs) -> dict:
    """Attributes as a plain dict (tuples stay tuples)."""
    return {f.name: getattr(attrs, f.name) for f in dataclasses.fields(attrs)}
