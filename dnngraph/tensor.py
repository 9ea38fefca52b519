"""Tensor handles: logical dims, physical strides, a data type, and who produces them."""
from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Optional, Sequence

import numpy

from . import dtypes
from .errors import UnsupportedError, ValidationError

INT64_MAX = 2**63 - 1
# Element counts, spans and strides stay far inside int64 (2**48) so that index math in the
# kernels (an index times a stride, plus a tile offset, in int64) can never overflow.
MAX_EXTENT = 2**48
MAX_RANK = 16

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
    """Axes from outermost to innermost by stride.

    Broadcast axes (stride 0) and size-1 axes say nothing about the layout: they keep their
    logical positions and only the other axes are ordered by stride (ties keep the logical
    order), so an expanded input does not turn its op's output around.
    """
    free = [axis for axis in range(len(dim)) if stride[axis] == 0 or dim[axis] == 1]
    placed = sorted((axis for axis in range(len(dim)) if axis not in free),
                    key=lambda axis: (-stride[axis], axis))
    order, ranked = [], iter(placed)
    for axis in range(len(dim)):
        order.append(axis if axis in free else next(ranked))
    return tuple(order)


def dense_strides(dim: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Densely packed strides of `dim` with axes laid out in `order` (outermost first)."""
    strides = [0] * len(dim)
    running = 1
    for axis in reversed(order):
        strides[axis] = running
        running *= max(int(dim[axis]), 1)
    return tuple(strides)


def bit_packed_strides(dim, stride) -> tuple:
    """The dense strides of a bit-packed tensor in the stride order of `stride`: as
    dense_strides, but each row of the innermost axis starts on a byte (its extent rounded up to
    8), so that a row's last partial byte belongs to that row alone."""
    order = stride_order(dim, stride)
    inner = next((a for a in reversed(order) if dim[a] > 1), order[-1])
    padded = [(-(-size // 8) * 8 if a == inner else size) for a, size in enumerate(dim)]
    return dense_strides(padded, order)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, numpy.bool_))


def _int_list(values, what: str, kind: str) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not all(_is_int(v) for v in values):
        raise ValidationError(f"{what}: {kind} must be a list of integers, got {values!r}")
    return tuple(int(v) for v in values)


def check_dims(dim, what: str) -> tuple[int, ...]:
    """Validate a dims list: 1 to MAX_RANK positive ints, at most MAX_EXTENT elements in all."""
    dims = _int_list(dim, what, "dims")
    if not 1 <= len(dims) <= MAX_RANK:
        raise ValidationError(f"{what}: needs 1 to {MAX_RANK} dims, got {list(dims)} "
                              f"(declare a scalar as [1])")
    if any(d <= 0 for d in dims):
        raise ValidationError(f"{what}: dims must be positive integers, got {list(dims)}")
    if math.prod(dims) > MAX_EXTENT:
        raise ValidationError(f"{what}: dims {list(dims)} hold more than 2**48 elements; element "
                              f"counts must stay well inside int64 index math")
    return dims


def span(dim: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from the first to one past the last element a layout addresses."""
    return sum((size - 1) * step for size, step in zip(dim, stride)) + 1


def check_strides(stride, dims: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Validate strides against dims: same rank, non-negative ints, a span inside int64 math."""
    strides = _int_list(stride, what, "strides")
    if len(strides) != len(dims):
        raise ValidationError(f"{what}: {len(strides)} strides for {len(dims)} dims {list(dims)}")
    if any(s < 0 for s in strides):
        raise ValidationError(f"{what}: strides must be non-negative, got {list(strides)}")
    if any(s > MAX_EXTENT for s in strides) or span(dims, strides) > MAX_EXTENT:
        raise ValidationError(f"{what}: strides {list(strides)} span more than 2**48 elements; "
                              f"spans must stay well inside int64 index math")
    return strides


def overlaps(dim: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of the layout share an address.

    Axes of size > 1 taken from the smallest stride up: each stride must reach past everything
    the axes inside it span, else two index tuples meet.
    """
    axes = sorted((stride[a], dim[a]) for a in range(len(dim)) if dim[a] > 1)
    extent = 1
    for step, size in axes:
        if step < extent:
            return True
        extent += (size - 1) * step
    return False


def _blend_factor(value, what: str, graph):
    """A blend factor: a finite real number as a float, or a one-element floating graph input of
    `graph` (read by the kernel at each execute: a new value needs no new build)."""
    if isinstance(value, Tensor):
        if value.graph is not graph or graph._tensors.get(value.uid) is not value:
            raise ValidationError(f"{what}: tensor {value.name!r} belongs to another graph")
        problem = blend_factor_problem(value)
        if problem is not None:
            raise ValidationError(f"{what}: {problem}")
        return value
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Real):
        raise ValidationError(f"{what} must be a finite real number or a one-element tensor, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValidationError(f"{what} must be finite, got {value!r}")
    return value


def blend_factor_problem(factor: "Tensor") -> Optional[str]:
    """Why graph tensor `factor` cannot hold a blend factor (a phrase), or None: it must be a
    one-element input of float32, float16, bfloat16 or fp8. Block-scale types (fp4, e8m0) are
    floating, but kernels see their bytes, not their values. Checked by set_blend and again at
    build (the type may change after)."""
    if factor.producer is not None or factor.numel != 1 or not factor.data_type.is_floating \
            or factor.data_type.is_block_scale_storage:
        return f"a tensor factor is a one-element graph input of float32, float16, bfloat16 or fp8, got {factor!r}"
    return None


def plain_blend(blend) -> Optional[tuple]:
    """(alpha, beta) with each tensor factor as ("tensor", uid): what problems and kernels carry
    (plain data, the same for every copy of the graph)."""
    if blend is None:
        return None
    return tuple(("tensor", f.uid) if isinstance(f, Tensor) else f for f in blend)


def blend_factor_uids(tensors) -> set:
    """uids of the one-element tensors the blended stores of `tensors` read alpha or beta from
    (read by the kernel storing them, though no node takes them as an input)."""
    return {f.uid for t in tensors for f in (t.blend or ()) if isinstance(f, Tensor)}


def check_not_overlapping(tensor: "Tensor"):
    """Outputs are written: reject a layout whose elements share memory."""
    if overlaps(tensor.dim, tensor.stride):
        raise ValidationError(f"output {tensor.name!r} of dims {list(tensor.dim)} has overlapping "
                              f"strides {list(tensor.stride)}: elements would share memory")


class Tensor:
    """A value in a graph: an input the user binds, or the output of an op.

    Setters return the tensor so calls chain: `y.set_output(True).set_name("y")`.
    """

    def __init__(self, graph: "Graph", uid: int, name: str, dim, stride, data_type,
                 producer: Optional["Node"] = None, fixed_data_type=None, type_source=None):
        self._graph = graph
        self.uid = uid
        self._name = name
        self._dim = dim
        self._stride = stride
        self._data_type = data_type  # set explicitly (inputs, set_data_type)
        self._fixed_data_type = fixed_data_type  # imposed by the op (comparisons, casts)
        self._type_source = type_source or ()  # a virtual view keeps the type of what it views
        self._inferred_stride = None  # a build made this virtual tensor a view: its own strides
        self.producer = producer
        self._is_output = False
        self._ragged_offset: Optional["Tensor"] = None  # sdpa's packed (THD) sequences: dnngraph/ragged.py
        self._blend: Optional[tuple] = None  # (alpha, beta): stored as alpha * result + beta * prior
        self._is_pass_by_value = False  # a host scalar bound at execute (Graph.execute stages it)
        self._dynamic: Optional[tuple] = None  # per axis its symbolic.Dynamic or Multiple, or None (symbolic.py)

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
    def own_stride(self) -> tuple[int, ...]:
        """The tensor's own strides: inferred or set, never the view strides a build lent it
        (what serialization and copies of the graph carry)."""
        return self._stride if self._inferred_stride is None else self._inferred_stride

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
        """Explicit type, else the op's, else (layout ops) the viewed tensor's type but io type
        for an output of floats, else io type for outputs and intermediate type inside."""
        if self._data_type is not None:
            return self._data_type
        if self._fixed_data_type is not None:
            return self._fixed_data_type
        types = {t.data_type for t in self._type_source}
        source = types.pop() if len(types) == 1 else None  # parts of several types: as any op's
        if source is not None and not (self._is_output and source.is_floating):
            return source  # a view keeps its values' type (an output of floats takes the io type)
        if self._is_output or self.producer is None:
            return self._graph.io_data_type
        return self._graph.intermediate_data_type

    @property
    def dynamic_dim_symbols(self) -> Optional[tuple]:
        """Per axis its dynamic extent (a dg.dynamic symbol, or a dg.Multiple of one: `2 * seq`) or
        None; None for a static tensor."""
        return self._dynamic

    @property
    def dynamic_dim(self) -> tuple:
        """The dims with each dynamic extent as its symbol or multiple of one (the dims hold its
        largest size)."""
        if self._dynamic is None:
            return self._dim
        return tuple(d if s is None else s for d, s in zip(self._dim, self._dynamic))

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

    @property
    def is_pass_by_value(self) -> bool:
        """True for a one-element input whose value comes from the host at execute (a Python
        number or a CPU tensor), as the cuDNN frontend's is_pass_by_value."""
        return self._is_pass_by_value

    def get_is_pass_by_value(self):
        return self._is_pass_by_value

    @property
    def ragged_offset(self) -> Optional["Tensor"]:
        """The [B + 1, 1, 1, 1] int tensor of element offsets where each sequence starts, or None."""
        return self._ragged_offset

    def get_ragged_offset(self):
        return self._ragged_offset

    @property
    def blend(self) -> Optional[tuple]:
        """(alpha, beta) when the output is stored as `alpha * result + beta * prior` (its bound
        memory's content before the execute), None for a plain store."""
        return self._blend

    def get_blend(self):
        return self._blend

    # --- setters (chainable) ------------------------------------------------------------------
    def set_output(self, is_output: bool = True) -> "Tensor":
        """Mark the tensor as a graph output: the user binds it and the plan writes it."""
        if not isinstance(is_output, (bool, numpy.bool_)):
            raise ValidationError(f"set_output of {self._name!r}: needs True or False, got {is_output!r}")
        if is_output and self.producer is None:
            raise ValidationError(
                f"tensor {self._name!r} is a graph input and cannot also be an output")
        if is_output:
            self.restore_strides()  # an output has its own memory, laid out as inferred
            check_not_overlapping(self)
        self._graph._invalidate()
        self._is_output = bool(is_output)
        return self

    def set_name(self, name: str) -> "Tensor":
        """Rename the tensor; names are unique in a graph."""
        self._graph._rename_tensor(self, name)
        return self

    def set_data_type(self, data_type) -> "Tensor":
        """Set the stored data type (for op outputs: the type written to memory). A tensor made
        bit-packed (dg.bool_bit_packed) whose strides are the dense ones of their order takes the
        bit-packed dense strides (rows start on a byte: bit_packed_strides)."""
        data_type = dtypes.resolve(data_type)
        self._graph._invalidate()
        self._data_type = data_type
        if data_type.is_bit_packed and self._inferred_stride is None and \
                self._stride == dense_strides(self._dim, stride_order(self._dim, self._stride)):
            self._stride = bit_packed_strides(self._dim, self._stride)
        return self

    def set_stride(self, stride) -> "Tensor":
        """Override the physical strides (logical dims stay)."""
        stride = check_strides(stride, self._dim, f"tensor {self._name!r}")
        if self._dynamic is not None and stride != dense_strides(self._dim, stride_order(self._dim, stride)):
            # every size is built densely packed in this axis order (symbolic.check_dense)
            raise UnsupportedError(f"tensor {self._name!r} has dynamic dims: its strides must be densely packed "
                                   f"(a permutation of dense strides), got {list(stride)} for dims {list(self._dim)}")
        if self._is_output and overlaps(self._dim, stride):
            raise ValidationError(f"output {self._name!r} of dims {list(self._dim)} cannot take "
                                  f"overlapping strides {list(stride)}: elements would share memory")
        self._graph._invalidate()
        self._stride, self._inferred_stride = stride, None
        return self

    def set_blend(self, alpha=1.0, beta=0.0) -> "Tensor":
        """Store this output as `alpha * result + beta * prior` (cuDNN's classic blending, e.g.
        gradient accumulation `dW += ...` with beta=1): the kernel writing it reads the bound
        memory in its store. beta == 0 never reads the prior (NaN there does not propagate);
        alpha=1, beta=0 is a plain store. alpha and beta are finite Python numbers (kernel
        literals) or one-element floating graph inputs (device scalars the kernel reads at each
        execute, or pass-by-value host scalars: one build for every value, as the frontend's)."""
        alpha = _blend_factor(alpha, f"set_blend of {self._name!r}: alpha", self._graph)
        beta = _blend_factor(beta, f"set_blend of {self._name!r}: beta", self._graph)
        self._graph._invalidate()
        plain = not any(isinstance(f, Tensor) for f in (alpha, beta)) and (alpha, beta) == (1.0, 0.0)
        self._blend = None if plain else (alpha, beta)
        return self

    def set_is_pass_by_value(self, value: bool = True) -> "Tensor":
        """Mark a one-element graph input as passed by value: execute and reference take a Python
        number (or a CPU tensor) for it."""
        if not isinstance(value, (bool, numpy.bool_)):
            raise ValidationError(f"set_is_pass_by_value of {self._name!r}: needs True or False, got {value!r}")
        if value and self.producer is not None:
            raise ValidationError(f"tensor {self._name!r} is an op output: only graph inputs are passed by value")
        if value and self.numel != 1:
            raise ValidationError(f"tensor {self._name!r} of dims {list(self._dim)} holds {self.numel} elements: "
                                  f"a value passed by value holds one")
        self._graph._invalidate()
        self._is_pass_by_value = bool(value)
        return self

    def set_ragged_offset(self, offset: Optional["Tensor"]) -> "Tensor":
        """Make this [B, H, S_max, D] sdpa operand ragged (THD): its sequences lie packed in one
        buffer, sequence b from element offset[b] (dnngraph/ragged.py), `offset` an int32 or
        int64 [B + 1, 1, 1, 1] graph input; None makes it dense again. The sdpa ops reading or
        writing this tensor take the offset (and need the seq_len of its axis)."""
        what = f"set_ragged_offset of {self._name!r}"
        if offset is not None:
            if not isinstance(offset, Tensor) or offset.graph is not self._graph:
                raise ValidationError(f"{what}: needs a Tensor of graph {self._graph.name!r} or None, "
                                      f"got {offset!r}")
            if len(self._dim) != 4:
                raise ValidationError(f"{what}: a ragged tensor is [B, H, S, D], got dims {list(self._dim)}")
            if offset.producer is not None:
                raise ValidationError(f"{what}: the offset {offset.name!r} must be a graph input")
            if offset.data_type not in (dtypes.int32, dtypes.int64):
                raise ValidationError(f"{what}: the offset must be int32 or int64, got {offset.data_type.name}")
            wanted = (self._dim[0] + 1, 1, 1, 1)
            if tuple(offset.dim) != wanted:
                raise ValidationError(f"{what}: the offset must be {list(wanted)} (one start per sequence "
                                      f"and the end), got {list(offset.dim)}")
        self._graph._set_ragged_offset(self, offset)
        return self

    # --- build-internal -------------------------------------------------------------------------
    def view_strides(self, stride) -> None:
        """A build made this virtual tensor a view of other memory: kernels use these strides
        until the next build (or set_output) restores the tensor's own."""
        if self._inferred_stride is None:
            self._inferred_stride = self._stride
        self._stride = tuple(stride)

    def restore_strides(self) -> None:
        """Undo view_strides."""
        if self._inferred_stride is not None:
            self._stride, self._inferred_stride = self._inferred_stride, None

    def __repr__(self) -> str:
        kind = "input" if self.producer is None else ("output" if self._is_output else "virtual")
        return (f"Tensor({self._name!r}, dim={list(self._dim)}, stride={list(self._stride)}, "
                f"{self.data_type.name}, {kind})")
