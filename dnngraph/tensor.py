"""Tensor handles: logical dims, physical strides, a data type, and who produces them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from . import dtypes
from .errors import ValidationError

if TYPE_CHECKING:  # pragma: no cover
    from .graph import Graph, Node


def contiguous_strides(dim: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a dense tensor of logical dims `dim`."""
    strides, running = [], 1
    for size in reversed(dim):
        strides.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(strides))


def stride_order(dim: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Axes from outermost to innermost; ties (size-1 axes) keep the logical order."""
    return tuple(sorted(range(len(dim)), key=lambda axis: (-stride[axis], axis)))


def dense_strides(dim: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Densely packed strides of `dim` with axes laid out in `order` (outermost first)."""
    strides = [0] * len(dim)
    running = 1
    for axis in reversed(order):
        strides[axis] = running
        running *= max(int(dim[axis]), 1)
    return tuple(strides)


def check_dims(dim, what: str) -> tuple[int, ...]:
    """Validate a dims list: a non-empty sequence of positive ints."""
    try:
        dims = tuple(int(d) for d in dim)
    except (TypeError, ValueError):
        raise ValidationError(f"{what}: dims must be a list of integers, got {dim!r}") from None
    if any(d <= 0 for d in dims) or any(int(d) != d for d in dim):
        raise ValidationError(f"{what}: dims must be positive integers, got {list(dim)}")
    return dims


def check_strides(stride, dims: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Validate strides against dims: same rank, non-negative ints."""
    try:
        strides = tuple(int(s) for s in stride)
    except (TypeError, ValueError):
        raise ValidationError(f"{what}: strides must be a list of integers, got {stride!r}") from None
    if len(strides) != len(dims):
        raise ValidationError(f"{what}: {len(strides)} strides for {len(dims)} dims {list(dims)}")
    if any(s < 0 for s in strides):
        raise ValidationError(f"{what}: strides must be non-negative, got {list(strides)}")
    return strides


class Tensor:
    """A value in a graph: an input the user binds, or the output of an op.

    Setters return the tensor so calls chain: `y.set_output(True).set_name("y")`.
    """

    def __init__(self, graph: "Graph", uid: int, name: str, dim, stride, data_type,
                 producer: Optional["Node"] = None, fixed_data_type=None):
        self._graph = graph
        self.uid = uid
        self._name = name
        self._dim = dim
        self._stride = stride
        self._data_type = data_type  # set explicitly (inputs, set_data_type)
        self._fixed_data_type = fixed_data_type  # imposed by the op (comparisons, casts)
        self.producer = producer
        self._is_output = False

    # --- queries -------------------------------------------------------------------------------
    @property
    def graph(self) -> "Graph":
        return self._graph

    @property
    def name(self) -> str:
        return self._name

    @property
    def dim(self) -> tuple[int, ...]:
        return self._dim

    @property
    def stride(self) -> tuple[int, ...]:
        return self._stride

    @property
    def is_virtual(self) -> bool:
        """True for op outputs the user did not mark as outputs: they live inside kernels."""
        return self.producer is not None and not self._is_output

    @property
    def is_output(self) -> bool:
        return self._is_output

    @property
    def is_input(self) -> bool:
        return self.producer is None

    @property
    def data_type(self) -> dtypes.DataType:
        """Explicit type, else the op's, else io type for outputs and intermediate type inside."""
        if self._data_type is not None:
            return self._data_type
        if self._fixed_data_type is not None:
            return self._fixed_data_type
        if self._is_output or self.producer is None:
            return self._graph.io_data_type
        return self._graph.intermediate_data_type

    @property
    def numel(self) -> int:
        count = 1
        for size in self._dim:
            count *= size
        return count

    def get_dim(self):
        return list(self._dim)

    def get_stride(self):
        return list(self._stride)

    def get_data_type(self):
        return self.data_type

    def get_name(self):
        return self._name

    def get_is_output(self):
        return self._is_output

    # --- setters (chainable) ------------------------------------------------------------------
    def set_output(self, is_output: bool = True) -> "Tensor":
        """Mark the tensor as a graph output: the user binds it and the plan writes it."""
        if is_output and self.producer is None:
            raise ValidationError(
                f"tensor {self._name!r} is a graph input and cannot also be an output")
        self._graph._invalidate()
        self._is_output = bool(is_output)
        return self

    def set_name(self, name: str) -> "Tensor":
        """Rename the tensor; names are unique in a graph."""
        self._graph._rename_tensor(self, name)
        return self

    def set_data_type(self, data_type) -> "Tensor":
        """Set the stored data type (for op outputs: the type written to memory)."""
        self._graph._invalidate()
        self._data_type = dtypes.resolve(data_type)
        return self

    def set_stride(self, stride) -> "Tensor":
        """Override the physical strides (logical dims stay)."""
        self._graph._invalidate()
        self._stride = check_strides(stride, self._dim, f"tensor {self._name!r}")
        return self

    def __repr__(self) -> str:
        kind = "input" if self.producer is None else ("output" if self._is_output else "virtual")
        return (f"Tensor({self._name!r}, dim={list(self._dim)}, stride={list(self._stride)}, "
                f"{self.data_type.name}, {kind})")
