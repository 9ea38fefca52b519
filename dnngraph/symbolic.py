"""Dynamic extents: a named symbol with a range (`dg.dynamic("tokens", 1, 8192)`) in a tensor's
dims, as the cuDNN frontend's dynamic-shape mode has a graph built once run many sizes.

A graph holds every tensor at concrete dims: a dynamic axis at its largest size (the
representative), so every shape rule runs as it does for a static graph. Which axes are dynamic
is tracked beside the dims (`Tensor.dynamic_dim`): per axis its extent, a symbol `s` (a
`Dynamic`) or a constant multiple of one (`Multiple`: `2 * s`, a dynamic axis merged with static
ones by a reshape, [B, s, H] -> [B * s, H], or joined with itself). An op's output axis carries
`c * s` when the op's shape rule, run again with `s` at other sizes (one below the max, and the
min, where a rule fails or broadcasts), moves that axis to exactly c times that size, as at the
max (`propagate`). Anything else (an axis that becomes s + 4, ceil(s / 2), a reshape with literal
sizes, two symbols forced equal or multiplied, a rule that fails at the min) is refused with a
typed error at the op call: it cannot be symbolic yet. A graph at given sizes is checked against
these dims (Graph.specialised), so no size runs a graph the probes misjudged. An input's dynamic
axis is one symbol (coefficient 1): its size is what a bound tensor's axis says.

Layer 1 (IR): imports only the base layer and tensor.py.
"""
from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass
from typing import Sequence

from .errors import UnsupportedError, ValidationError
from .tensor import MAX_EXTENT, dense_strides, stride_order


@dataclass(frozen=True)
class Dynamic:
    """A dynamic extent: the symbol `name`, any size from `min` to `max` (both included).
    The same name in several tensors ties their extents (q's and o's sequence length)."""

    name: str
    min: int
    max: int

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValidationError(f"dynamic: a symbol's name is an identifier, got {self.name!r}")
        for bound in (self.min, self.max):
            if not isinstance(bound, numbers.Integral) or isinstance(bound, bool):
                raise ValidationError(f"dynamic {self.name!r}: bounds are integers, got {bound!r}")
        if not 1 <= self.min <= self.max <= MAX_EXTENT:
            raise ValidationError(f"dynamic {self.name!r}: needs 1 <= min <= max <= 2**48, "
                                  f"got min {self.min}, max {self.max}")

    @property
    def probes(self) -> tuple:
        """The other sizes in range shape propagation runs the rules at (see module doc): the
        one below the max (a generic size) and the min (where a rule clamps, or an axis of
        extent 1 broadcasts)."""
        return tuple(sorted({size for size in (self.max - 1, self.min) if self.min <= size < self.max}))

    @property
    def symbol(self) -> "Dynamic":
        """The symbol of this extent (itself: an extent of coefficient 1; see Multiple)."""
        return self

    @property
    def coefficient(self) -> int:
        return 1

    def extent(self, size: int) -> int:
        """This axis's extent where the symbol is `size`."""
        return size

    def __mul__(self, factor):
        return scaled(self, _factor(self, factor))

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"dynamic({self.name!r}, {self.min}, {self.max})"


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _factor(extent, factor) -> int:
    """`factor` checked as what a dynamic extent may be multiplied by: an integer >= 1."""
    if isinstance(factor, (Dynamic, Multiple)):
        raise UnsupportedError(f"{extent!r} * {factor!r}: a product of two symbols cannot be dynamic yet (an "
                               f"extent is a constant multiple of one symbol)")
    if not _is_count(factor):
        raise ValidationError(f"{extent!r} * {factor!r}: a dynamic extent is multiplied by an integer >= 1")
    return int(factor)


@dataclass(frozen=True)
class Multiple:
    """A dynamic extent `coefficient * symbol` (coefficient >= 2): the axis of a reshape that
    merges a dynamic axis with static ones ([B, seq, H] -> [B * seq, H] with B static), or of a
    concatenation of a dynamic axis with itself. Written `2 * seq` in a reshape's dim. It has no
    `name`, `min` or `max` of its own: a reader of a dynamic axis asks for its `symbol` and
    evaluates `extent(size)`."""

    symbol: Dynamic
    coefficient: int

    def __post_init__(self):
        if not isinstance(self.symbol, Dynamic):
            raise ValidationError(f"a dynamic multiple is of a dg.dynamic symbol, got {self.symbol!r}")
        if not _is_count(self.coefficient) or self.coefficient < 2:
            raise ValidationError(f"a multiple of {self.symbol!r} has an integer coefficient >= 2, "
                                  f"got {self.coefficient!r}")
        if self.coefficient * self.symbol.max > MAX_EXTENT:
            raise ValidationError(f"{self.coefficient} * {self.symbol!r} reaches past 2**48 at its max")

    def extent(self, size: int) -> int:
        """This axis's extent where the symbol is `size`."""
        return self.coefficient * size

    def __mul__(self, factor):
        return scaled(self.symbol, self.coefficient * _factor(self, factor))

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"{self.coefficient} * {self.symbol!r}"


def scaled(symbol: Dynamic, coefficient: int):
    """The extent `coefficient * symbol`: the symbol itself for coefficient 1, else a Multiple."""
    return symbol if coefficient == 1 else Multiple(symbol, coefficient)


def is_extent(value) -> bool:
    """Is `value` a dynamic extent (a Dynamic or a Multiple of one)?"""
    return isinstance(value, (Dynamic, Multiple))


def extent_at(entry, sizes: dict) -> int:
    """The extent of a dynamic axis `entry` (Dynamic or Multiple) at `sizes` (symbol name -> size)."""
    return entry.extent(sizes[entry.symbol.name])


def dynamic(name: str, min: int, max: int) -> Dynamic:  # noqa: A002  (the frontend's words)
    """A dynamic extent for a tensor's dims: `g.tensor(dim=[dg.dynamic("tokens", 1, 8192), 4096])`."""
    return Dynamic(name, int(min) if isinstance(min, numbers.Integral) and not isinstance(min, bool) else min,
                   int(max) if isinstance(max, numbers.Integral) and not isinstance(max, bool) else max)


def split_dims(dim, what: str) -> tuple:
    """(concrete dims, symbols per axis or None): a Dynamic entry stands at its max. An input's
    dynamic axis is one symbol (its size is what a bound tensor's axis says): a Multiple is
    refused."""
    if not isinstance(dim, (list, tuple)) or not any(is_extent(d) for d in dim):
        return dim, None
    multiples = [d for d in dim if isinstance(d, Multiple)]
    if multiples:
        raise UnsupportedError(f"{what}: an input's dynamic axis is one symbol, got {multiples[0]!r} in dims "
                               f"{list(dim)}; declare the symbol's axis and reshape to the product")
    concrete = [d.max if isinstance(d, Dynamic) else d for d in dim]
    return concrete, tuple(d if isinstance(d, Dynamic) else None for d in dim)


def check_dense(dims: Sequence[int], strides: Sequence[int], what: str) -> None:
    """A dynamic tensor is densely packed in some axis order (contiguous, NHWC, transposed): its
    strides at any size are the dense strides of that order. Broadcast or padded layouts have no
    meaning that carries over to other sizes yet."""
    if tuple(strides) != dense_strides(dims, stride_order(dims, strides)):
        raise UnsupportedError(f"{what}: a tensor with dynamic dims must be densely packed (stride None, or "
                               f"a permutation of dense strides), got strides {list(strides)} for "
                               f"dims {list(dims)}")


def resized(dims: Sequence[int], strides: Sequence[int], symbols, sizes: dict) -> tuple:
    """(dims, strides) of a dense layout with each dynamic axis (`symbols`: its Dynamic or Multiple)
    at its extent where each symbol is `sizes[symbol name]`, packed in the same axis order."""
    new_dims = tuple(extent_at(s, sizes) if s is not None else d for d, s in zip(dims, symbols))
    return new_dims, dense_strides(new_dims, stride_order(dims, strides))


def symbols_of(tensors) -> dict:
    """name -> Dynamic of every symbol in `tensors`' dims."""
    found = {}
    for tensor in tensors:
        for entry in tensor.dynamic_dim_symbols or ():
            if entry is not None:
                found[entry.symbol.name] = entry.symbol
    return found


def check_sizes(graph, sizes) -> None:
    """`sizes` names each symbol of `graph` once, at an integer size in its range."""
    symbols = symbols_of(graph.inputs())
    if not isinstance(sizes, dict) or set(sizes) != set(symbols):
        raise ValidationError(f"graph {graph.name!r}: sizes are a dict of every symbol ({sorted(symbols)}) to "
                              f"its size, got {sizes!r}")
    for name, size in sizes.items():
        symbol = symbols[name]
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or not symbol.min <= size <= symbol.max:
            raise ValidationError(f"graph {graph.name!r}: symbol {name!r} takes an integer in "
                                  f"[{symbol.min}, {symbol.max}], got {size!r}")


def _moved(tensor, symbol: Dynamic, size: int):
    """A copy of `tensor` (for a shape rule only) with `symbol`'s axes at `size`."""
    symbols = tensor.dynamic_dim_symbols
    if not symbols or all(s is None or s.symbol.name != symbol.name for s in symbols):
        return tensor
    sizes = {s.symbol.name: (size if s.symbol.name == symbol.name else s.symbol.max) for s in symbols if s is not None}
    moved = copy.copy(tensor)
    moved._dim, moved._stride = resized(tensor.dim, tensor.stride, symbols, sizes)
    return moved


def propagate(op: str, infer, inputs: list, attrs, specs: list) -> list:
    """Per output spec (None where absent) its dynamic extents per axis, or None when it has no
    dynamic axis: each symbol of the inputs moved alone to each of its probe sizes, the shape rule
    `infer` run again; an axis that is c times the probe size at every probe, as it is c times the
    max, carries `c * symbol` (scaled), one that stays put at every probe is static.
    UnsupportedError for a result the rule refuses at a probe, or an axis that moves any other way
    (s + 4, ceil(s / 2), min(s, 3), a product of two symbols)."""
    symbols = symbols_of(t for t in inputs if t is not None)
    found: list[list] = [[None] * len(spec.dim) if spec is not None else None for spec in specs]
    for symbol in symbols.values():
        # per output and axis: how it moved at each probe (0: static, c: c times the symbol)
        moves = [None if spec is None else [set() for _ in spec.dim] for spec in specs]
        for size in symbol.probes:
            moved = _inferred_at(op, infer, inputs, attrs, symbol, size)
            for index, (spec, other) in enumerate(zip(specs, moved)):
                if spec is None:
                    continue
                for axis, (extent, moved_extent) in enumerate(zip(spec.dim, other.dim)):
                    moves[index][axis].add(_coefficient_of_move(op, index, axis, extent, moved_extent, symbol, size))
        for index, axes in enumerate(moves):
            for axis, coefficients in enumerate(axes or ()):
                what = f"{op}: output {index} axis {axis} ({specs[index].dim[axis]})"
                if len(coefficients) > 1:
                    raise UnsupportedError(f"{what} follows {symbol!r} at some sizes only; this cannot be dynamic yet")
                (coefficient,) = coefficients or {0}
                if coefficient and found[index][axis] is not None:
                    raise UnsupportedError(f"{what} follows both {found[index][axis]!r} and {symbol!r}; this cannot "
                                           f"be dynamic yet")
                if coefficient:
                    found[index][axis] = scaled(symbol, coefficient)
    return [None if axes is None or all(s is None for s in axes) else tuple(axes) for axes in found]


def _inferred_at(op: str, infer, inputs: list, attrs, symbol: Dynamic, size: int) -> list:
    """The output specs of the rule with `symbol` alone at `size`; UnsupportedError if it refuses."""
    try:
        return infer([None if t is None else _moved(t, symbol, size) for t in inputs], attrs)
    except ValidationError as error:
        raise UnsupportedError(f"{op}: its shape rule holds at {symbol.name} = {symbol.max} but not at {size}, "
                               f"inside the range of {symbol!r} ({error}); this cannot be dynamic yet") from None


def _coefficient_of_move(op: str, index: int, axis: int, extent: int, moved_extent: int, symbol: Dynamic,
                         size: int) -> int:
    """0 where the axis stays put, c where it is c times the symbol's size at `size` as it is c
    times the max at the max (`extent`): a constant multiple of the symbol."""
    if extent == moved_extent:
        return 0
    coefficient, remainder = divmod(extent, symbol.max)
    if remainder == 0 and coefficient >= 1 and moved_extent == coefficient * size:
        return coefficient
    raise UnsupportedError(f"{op}: output {index} axis {axis} ({extent}) follows {symbol!r} in a way other than "
                           f"a constant multiple of it ({moved_extent} at {symbol.name} = {size}, {extent} at "
                           f"{symbol.max}); this cannot be dynamic yet")


def bucket_of(size: int, symbol: Dynamic) -> int:
    """The bucket `size` falls in, named by its upper bound: the next power of two, never past
    the symbol's max. Sizes of one bucket share their kernels' sources (sizes are runtime
    arguments of the kernels); it is the unit compiles are counted in."""
    return min(1 << max(size - 1, 0).bit_length(), symbol.max)


def bucket_range(size: int, symbol: Dynamic) -> tuple:
    """(smallest, largest) size of the bucket `size` falls in (see bucket_of), within the range."""
    top = bucket_of(size, symbol)
    return max(symbol.min, (1 << max(size - 1, 0).bit_length()) // 2 + 1), top


@dataclass(frozen=True)
class BucketExtents:
    """What a graph specialised at sizes of one bucket knows of the bucket (Graph.bucket): per
    tensor whose dims vary in it, its dims and dense strides at the bucket's top (an axis of
    `c * symbol` at c times the symbol's top), and the axes
    that vary. Every config decision that reads a dynamic extent reads it at the top (so every
    size of a bucket launches the same kernels with the same configs: one compile per bucket),
    and a fact baked into a kernel's source (an alignment hint, a ragged-K mask) holds only
    where it holds at every size of the bucket; the kernels run the exact sizes (runtime
    arguments, masks and grids)."""

    tensors: tuple  # (name, dims at the top, strides at the top, axes that vary), by name

    @staticmethod
    def of(graph, sizes: dict) -> "BucketExtents":
        """The bucket of `sizes` (symbol name -> size) in dynamic `graph`."""
        symbols = symbols_of(graph.inputs())
        ranges = {name: bucket_range(size, symbols[name]) for name, size in sizes.items()}
        found = []
        for tensor in sorted(graph.tensors, key=lambda t: t.name):
            axes = tensor.dynamic_dim_symbols or ()
            varying = tuple(axis for axis, s in enumerate(axes)
                            if s is not None and ranges[s.symbol.name][0] < ranges[s.symbol.name][1])
            if varying:
                tops = {s.symbol.name: ranges[s.symbol.name][1] for s in axes if s is not None}
                dims, strides = resized(tensor.dim, tensor.stride, axes, tops)
                found.append((tensor.name, tuple(dims), tuple(strides), varying))
        return BucketExtents(tuple(found))

    def _entry(self, tensor):
        return next((entry for entry in self.tensors if entry[0] == tensor.name), None)

    def top(self, tensor) -> tuple:
        """(dims, strides) of `tensor` at the bucket's top."""
        entry = self._entry(tensor)
        return (tuple(tensor.dim), tuple(tensor.stride)) if entry is None else (entry[1], entry[2])

    def varies(self, tensor, axis: int) -> bool:
        """Does `tensor`'s `axis` take other sizes in the bucket?"""
        entry = self._entry(tensor)
        return entry is not None and axis % len(tensor.dim) in entry[3]


def top_dims(graph, tensor) -> tuple:
    """`tensor`'s dims as configs are chosen at: at its bucket's top where `graph` was
    specialised at sizes of a bucket (Graph.bucket), else its own."""
    bucket = getattr(graph, "bucket", None)
    return tuple(tensor.dim) if bucket is None else bucket.top(tensor)[0]


def top_strides(graph, tensor) -> tuple:
    """`tensor`'s strides at its bucket's top (see top_dims)."""
    bucket = getattr(graph, "bucket", None)
    return tuple(tensor.stride) if bucket is None else bucket.top(tensor)[1]


def top_span(graph, tensor) -> int:
    """Elements from `tensor`'s first to its last at the bucket's top (its own for a static
    graph): a kernel whose offsets need int64 there takes them at every size of the bucket."""
    bucket = getattr(graph, "bucket", None)
    dims, strides = (tuple(tensor.dim), tuple(tensor.stride)) if bucket is None else bucket.top(tensor)
    return sum((size - 1) * stride for size, stride in zip(dims, strides)) + 1


def varies(graph, tensor, axis: int) -> bool:
    """Does `tensor`'s `axis` take other sizes in the bucket `graph` was specialised at? (False
    for a static graph.)"""
    bucket = getattr(graph, "bucket", None)
    return bucket is not None and bucket.varies(tensor, axis)


def strides_vary(graph, tensor) -> bool:
    """Do `tensor`'s strides take other values in the bucket `graph` was specialised at (a
    varying axis inside another of its axes: a column-major matrix's pitch is its row count)?
    Alignment a kernel's choice depends on (TMA pitches) then holds at some sizes only."""
    bucket = getattr(graph, "bucket", None)
    if bucket is None:
        return False
    dims, strides = bucket.top(tensor)
    varying = [axis for axis in range(len(dims)) if bucket.varies(tensor, axis)]
    return any(dims[outer] > 1 and strides[outer] > strides[axis] for axis in varying for outer in range(len(dims)))
