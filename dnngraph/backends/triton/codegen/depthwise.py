"""Render depthwise convolutions as direct kernels (no GEMM): one input channel per group, M
filters per channel (output channel k reads input channel k // M).

  gather  (fprop, dgrad) a tile [BLOCK_R, BLOCK_C] of the output; loops over the filter taps (the
          innermost filter axis unrolled) load the gathered tensor at each tap (zero in the
          padding, the prologue applied at load and zero again there) and add it times the tap's
          filter values:
            fprop  y[n, k, o]  += x[n, k // M, o * STRIDE - PADDING + t * DILATION] * w[k, t']
            dgrad  dx[n, c, i] += dy[n, c * M + m, (i + PADDING - t * DILATION) / STRIDE] * w[c * M + m, t']
                   where the division is exact (other taps do not reach i)
          then the epilogue chain runs on the accumulator and every stored value is written.
  wgrad   a tile [BLOCK_P pixels, BLOCK_T taps, BLOCK_C channels]: a split's pixels are walked in
          steps, dy loaded once a step (its prologue applied) and x at every tap of the tile;
          the sum over the step's pixels goes to the split's partial [TAPS, K], and the combine
          kernel adds the SPLITS partials in order, then runs the epilogue on dw[k, t'].

t' is the filter index of tap t: t, or FILTER - 1 - t in mode="convolution". Geometry is
constexpr, so the unrolled taps fold their offsets. Where the gathered tensor walks the vector
axis and the next one as one memory run at stride 1 (w and c in NHWC, h and w in NCHW), the
columns may merge both: a tap then shifts one contiguous run (heuristics/depthwise.py decides).
Tile axes are "sides": an index vector lives
along one side (or a few) and is broadcast to the tile; an operand's offset sums its strided
coordinates side by side, and its mask joins the validity of exactly those coordinates.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..heuristics.pointwise import pow2_at_least
from .conv import FilterShape
from .emitter import ExpressionEmitter, kind_of, load_conversion
from .grid import FOLDED_PID, folded_program_ids
from .names import NameAllocator
from ...contract import KernelSource
from .pointwise import KernelArgument, kernel_module
from .unrolling import loop_header, unrolled_loops

# identifiers the kernels write themselves; the stems own every `stem_*` name too
FIXED_NAMES = ("pid", FOLDED_PID, "pid_c", "col_tiles", "rows_idx", "cols_idx", "row_mask", "col_mask", "mask", "rest", "acc",
               "value", "grad", "weight", "inside", "chans", "chan_mask", "taps", "tap_mask", "tap_block",
               "split", "chunks", "per_split", "first", "last", "chunk", "pix", "pix_mask", "partial", "offs",
               "channel_in", "m", "rows", "cols", "channels", "pixels", "total", "weight_row", "channel_all",
               "BLOCK_R", "BLOCK_C", "BLOCK_P", "BLOCK_T", "BLOCK", "TAPS", "SPLITS", "MULTIPLIER", "CHANNELS")
FIXED_STEMS = ("idx", "size", "start", "in", "ok", "num", "tap", "t", "r", "o", "out", "FILTER", "STRIDE",
               "PADDING", "DILATION")
ROLE_HINTS = {"src": "src", "x": "x", "w": "w", "read": "c", "out": "y"}


@dataclass(frozen=True)
class Operand:
    """One tensor a depthwise kernel touches, with its strides over its role's logical axes.

    role: "src" (a leaf of the gathered value: x in fprop, dy in dgrad/wgrad, or a prologue
    input), "x" (wgrad's x), "w" (the filter), "read" (an epilogue input), "out" (a stored value).
    """

    uid: int
    data_type: object
    role: str
    strides: tuple
    ident: str = ""


@dataclass(frozen=True)
class DepthwiseSpec(FilterShape):
    """Everything one depthwise kernel renders from (plain data, from lower/depthwise.py)."""

    name: str
    op: str  # conv_fprop | conv_dgrad | conv_wgrad
    body: str  # "gather" | "wgrad" | "combine"
    description: str
    filter_sizes: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    flip: bool  # mode="convolution"
    multiplier: int
    out_dims: tuple  # the tile's logical dims: y, dx or dw
    in_sizes: tuple  # spatial extents the taps land in: x (fprop, wgrad) or dy (dgrad)
    pixel_dims: tuple  # wgrad: dy's (N, output spatial...)
    operands: tuple
    target_uid: int  # the gathered value (the prologue's result)
    out_uid: int  # the anchor's output (the accumulator)
    prologue: tuple
    epilogue: tuple
    compute: str
    index_64: bool
    config: object  # heuristics.depthwise.DepthwiseConfig
    vector_axis: int = 1  # gather: the output axis along the tile's columns
    merged_axis: int = -1  # gather: the axis merged outside it into the columns (-1: none)
    row_axes: tuple = ()  # gather: the others, outermost first
    partial_uid: int = 0  # wgrad: scratch [SPLITS, TAPS, K] fp32
    combine_block: int = 0  # wgrad's combine kernel: elements of dw per program
    fold_grid: bool = False  # wgrad: tap blocks or splits past grid axes y/z, every index from axis x
    fast_math: frozenset = frozenset()  # epilogue outputs of 16-bit math (problems/base.py fast_math_outputs)

    def role(self, role: str) -> list:
        return [op for op in self.operands if op.role == role]


@dataclass(frozen=True)
class Coord:
    """An index vector: its variable, the tile sides it spans, and the mask terms saying where it
    is in range ((text, sides) pairs). Where it is a tile index plus a scalar (an input position
    at stride 1), `base` names the tile index and `shift` the scalar."""

    text: str
    sides: tuple
    valid: tuple = ()
    base: str = ""
    shift: str = ""


def _expand(text: str, sides: tuple, ndim: int) -> str:
    """`text` (spanning `sides`, in order) broadcast to the kernel's ndim-axis tile."""
    if not sides or len(sides) == ndim:
        return text
    if not text.isidentifier():
        text = f"({text})"
    return f"{text}[{', '.join(':' if axis in sides else 'None' for axis in range(ndim))}]"


def _join(terms, ndim: int, operator: str) -> str:
    """Terms (text, sides) joined by `operator`: terms of the same sides first, then broadcast."""
    grouped: dict = {}
    for text, sides in terms:
        grouped.setdefault(tuple(sides), []).append(text)
    parts = []
    for sides, texts in grouped.items():
        text = texts[0] if len(texts) == 1 else f" {operator} ".join(texts)
        parts.append(_expand(text, sides, ndim))
    return f" {operator} ".join(parts)


def _unique(terms) -> list:
    found = []
    for term in terms:
        if term not in found:
            found.append(term)
    return found


class _Writer:
    """The body, names and arguments of one kernel."""

    def __init__(self, spec: DepthwiseSpec, ndim: int):
        self.spec, self.ndim = spec, ndim
        self.names = NameAllocator(FIXED_NAMES + (spec.name,))
        self.names.reserve_stems(*FIXED_STEMS)
        # operands are named by role, never by their tensor's name
        self.operands = tuple(replace(op, ident=self.names.prefix(ROLE_HINTS[op.role])) for op in spec.operands)
        self.lines: list[str] = []
        self.depth = 1
        self.sizes: dict = {}  # runtime size arguments, in order of first use
        self.strides: dict = {}  # (operand ident, axis) -> stride, in order of first use
        self.emitters: list[ExpressionEmitter] = []

    def role(self, role: str) -> list:
        return [op for op in self.operands if op.role == role]

    def __call__(self, *lines: str):
        self.lines.extend("    " * self.depth + line for line in lines)

    def open_static(self, variable: str, count: str, unrolled: bool = True):
        self(loop_header(variable, count, unrolled))
        self.depth += 1

    def open_taps(self, axis: int, unrolled: bool = True):
        """The loop over filter axis `axis`: unrolled for the innermost axis (where `unrolled`:
        within the unrolling budget), a loop for the outer ones, so one filter row's loads are in
        flight at a time (unrolling every tap let the compiler hoist all of them: 255 registers
        and spills at 3x3, ptxas for sm_90)."""
        if axis == self.spec.rank - 1:
            self.open_static(f"t_{axis}", f"FILTER_{axis}", unrolled)
        else:
            self(f"for t_{axis} in range(FILTER_{axis}):")
            self.depth += 1

    def size(self, name: str, value: int) -> str:
        self.sizes.setdefault(name, value)
        return name

    def emitter(self, hint: str) -> ExpressionEmitter:
        emitter = ExpressionEmitter(self.spec.compute, hint=hint, names=self.names, fast_math=self.spec.fast_math)
        self.emitters.append(emitter)
        return emitter

    # --- operand access --------------------------------------------------------------------------
    def stride(self, op: Operand, axis: int) -> str:
        """The argument holding op's stride along `axis` (made an argument of the kernel)."""
        name = f"{op.ident}_stride_{axis}"
        self.strides.setdefault((op.ident, axis), (name, op.strides[axis]))
        return name

    def _merged_terms(self, op: Operand, coords) -> tuple[list, list, set]:
        """Where the tile's columns merge two axes that op walks as one run (the outer stride is
        the inner extent times the inner stride) and op sits at the tile index plus a scalar on
        both: one contiguous term `cols_idx * stride` and the scalar shifts."""
        spec = self.spec
        outer, inner = spec.merged_axis, spec.vector_axis
        if outer < 0 or coords[outer] is None or coords[inner] is None or not op.strides[inner]:
            return [], [], set()
        if op.strides[outer] != spec.out_dims[inner] * op.strides[inner]:
            return [], [], set()
        if (coords[outer].base, coords[inner].base) != (f"idx_{outer}", f"idx_{inner}"):
            return [], [], set()
        offsets = [(f"cols_idx * {self.stride(op, inner)}", (1,))]
        offsets += [(f"{coords[axis].shift} * {self.stride(op, axis)}", ())
                    for axis in (outer, inner) if coords[axis].shift]
        return offsets, list(coords[outer].valid + coords[inner].valid), {outer, inner}

    def _terms(self, op: Operand, coords) -> tuple[list, list]:
        """(offset terms, mask terms) of op at `coords` (one Coord or None per logical axis)."""
        offsets, masks, done = self._merged_terms(op, coords)
        for axis, (coord, stride) in enumerate(zip(coords, op.strides)):
            if coord is None or axis in done:
                continue
            # a broadcast axis (stride 0) adds no offset, but a position out of its range (the
            # padding) is still outside: its mask stays
            masks += coord.valid
            if stride:
                offsets.append((f"{coord.text} * {self.stride(op, axis)}", coord.sides))
        return offsets, _unique(masks)

    def one_element(self) -> str:
        """A one-element tile of the kernel's rank: a load through it is a tile, never 0-d."""
        return f" + tl.zeros({(1,) * self.ndim}, dtype=tl.int32)"

    def load(self, op: Operand, coords, extra_mask=(), convert: Optional[str] = None) -> str:
        """The text of a load of op at `coords`, masked by the coordinates' validity (and
        `extra_mask` terms), converted to `convert` (default: the compute type for floats)."""
        offsets, masks = self._terms(op, coords)
        masks = _unique(list(masks) + list(extra_mask))
        pointer = f"{op.ident}_ptr + {_join(offsets, self.ndim, '+')}" if offsets else \
            f"{op.ident}_ptr{self.one_element()}"
        other = "0.0" if op.data_type.is_floating else "0"
        # masks over sides the pointer spans go into the load; a coordinate along a side it does
        # not span (a broadcast operand's padding) zeroes the loaded value afterwards
        covered = {side for _, sides in offsets for side in sides}
        in_load = [m for m in masks if set(m[1]) <= covered]
        after = [m for m in masks if not set(m[1]) <= covered]
        masked = f", mask={_join(in_load, self.ndim, '&')}, other={other}" if in_load else ""
        if convert is None:
            cast = load_conversion(op.data_type, self.spec.compute)
        else:
            cast = f".to({convert})" if convert else ""
        loaded = f"tl.load({pointer}{masked}){cast}"
        return f"tl.where({_join(after, self.ndim, '&')}, {loaded}, {other})" if after else loaded

    def store(self, op: Operand, coords, value: str, mask: str, full_terms):
        """Store `value` at `coords` over the whole tile (`full_terms` fill sides op skips)."""
        offsets, _ = self._terms(op, coords)
        covered = {side for _, sides in offsets for side in sides}
        offsets += [(text, sides) for text, sides in full_terms if not set(sides) <= covered]
        self(f"tl.store({op.ident}_ptr + {_join(offsets, self.ndim, '+')}, {value}, mask={mask})")

    # --- the gathered value ----------------------------------------------------------------------
    def hoist_constant_leaves(self, coords, emitter: ExpressionEmitter) -> set:
        """Load before the tap loops the prologue inputs that vary with neither the tap nor the
        pixel (a per-channel scale or bias); returns their uids."""
        hoisted = set()
        if not self.spec.prologue:
            return hoisted
        moving = [axis for axis, coord in enumerate(coords) if coord is None]
        for op in self.role("src"):
            if any(op.strides[axis] for axis in moving):
                continue
            self(f"{op.ident}_val = {self.load(op, coords)}")
            emitter.bind(op.uid, f"{op.ident}_val", kind_of(op.data_type))
            hoisted.add(op.uid)
        return hoisted

    def gathered(self, coords, emitter: ExpressionEmitter, hoisted: set, variable: str):
        """`variable` = the gathered value at `coords` in fp32: the leaves loaded, the prologue
        chain applied, zero wherever a coordinate is out of range (the padding stays zero)."""
        inside = _unique([term for coord in coords if coord is not None for term in coord.valid])
        if not self.spec.prologue:
            (op,) = self.role("src")
            _, masks = self._terms(op, coords)
            self(f"{variable} = {self.load(op, coords, convert='tl.float32')}")
            if set(masks) != set(inside):  # a broadcast axis of the source: its padding too
                self(f"{variable} = tl.where({_join(inside, self.ndim, '&')}, {variable}, 0.0)")
            return
        for op in self.role("src"):
            if op.uid in hoisted:
                continue
            self(f"{op.ident}_val = {self.load(op, coords)}")
            emitter.bind(op.uid, f"{op.ident}_val", kind_of(op.data_type))
        start = len(emitter.lines)
        for node in self.spec.prologue:
            emitter.emit(node)
        self(*emitter.lines[start:])
        value = emitter.value(self.spec.target_uid, "f")
        self(f"{variable} = tl.where({_join(inside, self.ndim, '&')}, {value}, 0.0).to(tl.float32)")

    # --- the epilogue ----------------------------------------------------------------------------
    def epilogue(self, coords, mask: str, full_terms):
        """The chain on `acc` (the anchor's output) and the stores of every stored value."""
        emitter = self.emitter("v")
        emitter.bind(self.spec.out_uid, "acc", "f")
        for op in self.role("read"):
            self(f"{op.ident}_val = {self.load(op, coords)}")
            emitter.bind(op.uid, f"{op.ident}_val", kind_of(op.data_type))
        for node in self.spec.epilogue:
            emitter.emit(node)
        self(*emitter.lines)
        for op in self.role("out"):
            self.store(op, coords, emitter.stored(op.uid, op.data_type), mask, full_terms)

    def filter_index(self, axis: int, tap: str) -> str:
        return f"(FILTER_{axis} - 1 - {tap})" if self.spec.flip else tap

    def geometry_constexprs(self) -> list:
        spec, result = self.spec, []
        for axis in range(spec.rank):
            result += [KernelArgument("constexpr", f"FILTER_{axis}", spec.filter_sizes[axis]),
                       KernelArgument("constexpr", f"STRIDE_{axis}", spec.stride[axis]),
                       KernelArgument("constexpr", f"PADDING_{axis}", spec.padding[axis]),
                       KernelArgument("constexpr", f"DILATION_{axis}", spec.dilation[axis])]
        return result + [KernelArgument("constexpr", "MULTIPLIER", spec.multiplier)]


def _program_id(spec, axis: int = 0) -> str:
    return f"tl.program_id({axis})" + (".to(tl.int64)" if spec.index_64 else "")


# --- fprop and dgrad -------------------------------------------------------------------------------
def _tile(w: _Writer) -> list:
    """Rows and columns of the output tile; returns a Coord per output axis."""
    spec = w.spec
    dims = spec.out_dims
    vector, merged = spec.vector_axis, spec.merged_axis
    w.size("rows", _product(dims[axis] for axis in spec.row_axes))
    w.size("cols", dims[vector] * (dims[merged] if merged >= 0 else 1))
    w(f"pid = {_program_id(spec)}",
      "col_tiles = tl.cdiv(cols, BLOCK_C)",
      "rows_idx = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)",
      "cols_idx = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)",
      "row_mask = rows_idx < rows",
      "col_mask = cols_idx < cols",
      "mask = row_mask[:, None] & col_mask[None, :]")
    if merged >= 0:  # columns run over (merged axis, vector axis), the vector axis inner
        inner = w.size(f"size_{vector}", dims[vector])
        w(f"idx_{vector} = cols_idx % {inner}", f"idx_{merged} = cols_idx // {inner}")
    else:
        w(f"idx_{vector} = cols_idx")
    w("rest = rows_idx")
    for axis in reversed(spec.row_axes[1:]):
        w(f"idx_{axis} = rest % {w.size(f'size_{axis}', dims[axis])}", f"rest = rest // size_{axis}")
    w(f"idx_{spec.row_axes[0]} = rest")
    row, col = Coord("", (0,), (("row_mask", (0,)),)), Coord("", (1,), (("col_mask", (1,)),))
    return [replace(col if axis in (vector, merged) else row, text=f"idx_{axis}", base=f"idx_{axis}")
            for axis in range(len(dims))]


def _spatial(coord: Coord, text: str, ok: str, shift: str = "") -> Coord:
    """A coordinate computed from `coord` (same sides), valid where `coord` is and `ok` holds;
    with `shift`, it is `coord` plus that scalar."""
    return Coord(text, coord.sides, coord.valid + ((ok, coord.sides),), coord.base if shift else "", shift)


def _filter_coords(w: _Writer, channel: Coord, taps) -> list:
    """Coordinates of the filter [K, 1, *taps] at filter channel `channel` and constexpr taps."""
    return [channel, None] + [Coord(w.filter_index(axis, tap), ()) for axis, tap in enumerate(taps)]


def _gathers_filter_rows(w: _Writer) -> bool:
    """Merged columns along the channel axis read the filter at channel = column % C: a strided
    gather whose layout the compiler gives the accumulator, converting every tap's tile through
    shared memory. Such kernels load each tap's filter row for all channels and tl.gather it by
    the columns' channel, which keeps the tile's layout."""
    (filter_op,) = w.role("w")
    return w.spec.merged_axis >= 0 and w.spec.vector_axis == 1 and bool(filter_op.strides[0])


def _accumulate(w: _Writer, weight_channel: Coord, reaches: str = ""):
    """acc += value * the tap's weight; with `reaches`, only where that mask holds: dgrad's taps
    that reach no dy element add nothing (a masked 0 times an inf weight would add NaN)."""
    (filter_op,) = w.role("w")
    taps = [f"t_{axis}" for axis in range(w.spec.rank)]
    product = "value * weight"
    if not _gathers_filter_rows(w):
        w(f"weight = {w.load(filter_op, _filter_coords(w, weight_channel, taps), convert='tl.float32')}",
          f"acc += tl.where({reaches}, {product}, 0.0)" if reaches else f"acc += {product}")
        return
    terms = [f"channel_all * {w.stride(filter_op, 0)}"]
    terms += [f"{w.filter_index(axis, tap)} * {w.stride(filter_op, axis + 2)}"
              for axis, tap in enumerate(taps) if filter_op.strides[axis + 2]]
    w(f"weight_row = tl.load({filter_op.ident}_ptr + {' + '.join(terms)}, mask=channel_all < size_1, "
      f"other=0.0).to(tl.float32)",
      f"weight = tl.gather(weight_row, {weight_channel.text}{'.to(tl.int32)' if w.spec.index_64 else ''}, "
      f"0)[None, :]",
      f"acc += tl.where({reaches}, {product}, 0.0)" if reaches else f"acc += {product}")


def _fprop(w: _Writer, tile: list):
    spec = w.spec
    channel = tile[1]
    if spec.multiplier > 1:  # output channel k reads input channel k // M
        w("channel_in = idx_1 // MULTIPLIER")
        channel = replace(channel, text="channel_in", base="")
    for axis in range(spec.rank):
        w(f"start_{axis} = idx_{axis + 2} * STRIDE_{axis} - PADDING_{axis}")
    w("acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)")
    if _gathers_filter_rows(w):
        w("channel_all = tl.arange(0, CHANNELS)")
    emitter = w.emitter("p")
    hoisted = w.hoist_constant_leaves([tile[0], channel] + [None] * spec.rank, emitter)
    coords = [tile[0], channel]
    (inner_unrolled,) = unrolled_loops(spec.filter_sizes[-1:])  # a long 1-D filter is a runtime loop
    for axis in range(spec.rank):
        w.open_taps(axis, inner_unrolled)
        w(f"in_{axis} = start_{axis} + t_{axis} * DILATION_{axis}",
          f"ok_{axis} = (in_{axis} >= 0) & (in_{axis} < {w.size(f'in_size_{axis}', spec.in_sizes[axis])})")
        shift = f"(t_{axis} * DILATION_{axis} - PADDING_{axis})" if spec.stride[axis] == 1 else ""
        coords.append(_spatial(tile[axis + 2], f"in_{axis}", f"ok_{axis}", shift))
    w.gathered(coords, emitter, hoisted, "value")
    _accumulate(w, tile[1])
    w.depth -= spec.rank


def _dgrad(w: _Writer, tile: list):
    spec = w.spec
    w("acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)")
    if _gathers_filter_rows(w):
        w("channel_all = tl.arange(0, CHANNELS)")
    channel = tile[1]
    opened = 0
    # the unrolled loops (the filters of a channel around its innermost taps) within one budget
    *multiplier_unrolled, inner_unrolled = unrolled_loops(
        ([spec.multiplier] if spec.multiplier > 1 else []) + list(spec.filter_sizes[-1:]))
    if spec.multiplier > 1:  # dx of channel c sums the M filters c * M + m
        w.open_static("m", "MULTIPLIER", multiplier_unrolled[0])
        w("channel_in = idx_1 * MULTIPLIER + m")
        channel, opened = replace(channel, text="channel_in", base=""), 1
    emitter = w.emitter("p")
    hoisted = w.hoist_constant_leaves([tile[0], channel] + [None] * spec.rank, emitter)
    coords = [tile[0], channel]
    for axis in range(spec.rank):
        w.open_taps(axis, inner_unrolled)
        out_size = w.size(f"in_size_{axis}", spec.in_sizes[axis])
        w(f"num_{axis} = idx_{axis + 2} + PADDING_{axis} - t_{axis} * DILATION_{axis}")
        if spec.stride[axis] == 1:
            w(f"in_{axis} = num_{axis}", f"ok_{axis} = (num_{axis} >= 0) & (num_{axis} < {out_size})")
        else:  # only taps whose offset is a multiple of the stride reach this dx element
            w(f"in_{axis} = num_{axis} // STRIDE_{axis}",
              f"ok_{axis} = (num_{axis} >= 0) & (num_{axis} % STRIDE_{axis} == 0) & (in_{axis} < {out_size})")
        shift = f"(PADDING_{axis} - t_{axis} * DILATION_{axis})" if spec.stride[axis] == 1 else ""
        coords.append(_spatial(tile[axis + 2], f"in_{axis}", f"ok_{axis}", shift))
    w.gathered(coords, emitter, hoisted, "value")
    reaches = [(f"ok_{axis}", coords[axis + 2].sides) for axis in range(spec.rank)]
    _accumulate(w, channel, _join(reaches, w.ndim, "&"))
    w.depth -= spec.rank + opened


def _gather_body(w: _Writer):
    tile = _tile(w)
    (_fprop if w.spec.op == "conv_fprop" else _dgrad)(w, tile)
    w.epilogue(tile, "mask", [("rows_idx * 0", (0,)), ("cols_idx * 0", (1,))])


def _gather_constexprs(w: _Writer) -> list:
    cfg = w.spec.config
    result = w.geometry_constexprs() + [KernelArgument("constexpr", "BLOCK_R", cfg.block_rows),
                                        KernelArgument("constexpr", "BLOCK_C", cfg.block_cols)]
    if _gathers_filter_rows(w):  # the filter row of every channel, a power of two
        result.append(KernelArgument("constexpr", "CHANNELS", pow2_at_least(w.spec.out_dims[1])))
    return result


# --- wgrad ------------------------------------------------------------------------------------------
def _wgrad_body(w: _Writer):
    """Sides: 0 pixels, 1 taps, 2 channels."""
    spec = w.spec
    rank = spec.rank
    w.size("channels", spec.out_dims[0])
    w.size("pixels", _product(spec.pixel_dims))
    if spec.fold_grid:  # channel tiles fastest, as on the plain grid's axis x
        w(*folded_program_ids(("pid_c", "tap_block", "split"), ("tl.cdiv(channels, BLOCK_C)", "tl.cdiv(TAPS, BLOCK_T)"),
                              ".to(tl.int64)" if spec.index_64 else ""))
    else:
        w(f"pid_c = {_program_id(spec, 0)}", "tap_block = tl.program_id(1)", f"split = {_program_id(spec, 2)}")
    w("chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)", "chan_mask = chans < channels",
      "taps = tap_block * BLOCK_T + tl.arange(0, BLOCK_T)", "tap_mask = taps < TAPS", "tap_rest = taps")
    for axis in range(rank - 1, 0, -1):  # the filter index of each tap of the tile
        w(f"r_{axis} = tap_rest % FILTER_{axis}", f"tap_rest = tap_rest // FILTER_{axis}")
    w("r_0 = tap_rest")
    for axis in range(rank):  # the tap whose input position it reads
        w(f"tap_{axis} = {w.filter_index(axis, f'r_{axis}')}")
    channel = Coord("chans", (2,), (("chan_mask", (2,)),))
    x_channel = channel
    if spec.multiplier > 1:
        w("channel_in = chans // MULTIPLIER")
        x_channel = replace(channel, text="channel_in", base="")
    w("chunks = tl.cdiv(pixels, BLOCK_P)", "per_split = tl.cdiv(chunks, SPLITS)", "first = split * per_split",
      "last = tl.minimum(first + per_split, chunks)")
    emitter = w.emitter("p")
    hoisted = w.hoist_constant_leaves([None, channel] + [None] * rank, emitter)
    w("acc = tl.zeros((BLOCK_P, BLOCK_T, BLOCK_C), dtype=tl.float32)", "for chunk in range(first, last):")
    w.depth += 1
    w("pix = chunk * BLOCK_P + tl.arange(0, BLOCK_P)", "pix_mask = pix < pixels", "rest = pix")
    for axis in range(rank, 0, -1):
        w(f"o_{axis - 1} = rest % {w.size(f'out_size_{axis - 1}', spec.pixel_dims[axis])}",
          f"rest = rest // out_size_{axis - 1}")
    w("idx_0 = rest")
    pixel_valid = (("pix_mask", (0,)),)
    batch = Coord("idx_0", (0,), pixel_valid)
    outputs = [Coord(f"o_{axis}", (0,), pixel_valid) for axis in range(rank)]
    w.gathered([batch, channel] + outputs, emitter, hoisted, "grad")
    inputs = []
    for axis in range(rank):
        w(f"in_{axis} = o_{axis}[:, None] * STRIDE_{axis} - PADDING_{axis} + tap_{axis}[None, :] * DILATION_{axis}",
          f"ok_{axis} = (in_{axis} >= 0) & (in_{axis} < {w.size(f'in_size_{axis}', spec.in_sizes[axis])})")
        inputs.append(Coord(f"in_{axis}", (0, 1), pixel_valid + (("tap_mask", (1,)), (f"ok_{axis}", (0, 1)))))
    (x_op,) = w.role("x")
    w(f"value = {w.load(x_op, [batch, x_channel] + inputs, convert='tl.float32')}", "acc += grad * value")
    w.depth -= 1
    w("partial = tl.sum(acc, axis=0)",
      "tl.store(partial_ptr + (split * TAPS + taps[:, None]) * channels + chans[None, :], partial, "
      "mask=tap_mask[:, None] & chan_mask[None, :])")


def _wgrad_constexprs(w: _Writer) -> list:
    cfg = w.spec.config
    return w.geometry_constexprs() + [
        KernelArgument("constexpr", "TAPS", w.spec.taps), KernelArgument("constexpr", "SPLITS", cfg.splits),
        KernelArgument("constexpr", "BLOCK_P", cfg.block_rows), KernelArgument("constexpr", "BLOCK_T", cfg.block_taps),
        KernelArgument("constexpr", "BLOCK_C", cfg.block_cols)]


def _combine_body(w: _Writer):
    """One lane per element of dw: the splits' partials added in order, then the epilogue."""
    spec = w.spec
    rank = spec.rank
    w.size("channels", spec.out_dims[0])
    w.size("total", spec.out_dims[0] * spec.taps)
    w(f"offs = {_program_id(spec)} * BLOCK + tl.arange(0, BLOCK)", "mask = offs < total",
      "idx_0 = offs // TAPS", "rest = offs % TAPS", "r_all = rest")
    for axis in range(rank - 1, 0, -1):
        w(f"r_{axis} = rest % FILTER_{axis}", f"rest = rest // FILTER_{axis}")
    w("r_0 = rest", "acc = tl.zeros((BLOCK,), dtype=tl.float32)", "for split in range(SPLITS):")
    w("    acc += tl.load(partial_ptr + (split * TAPS + r_all) * channels + idx_0, mask=mask, other=0.0)")
    valid = (("mask", (0,)),)
    coords = [Coord("idx_0", (0,), valid), None] + [Coord(f"r_{axis}", (0,), valid) for axis in range(rank)]
    w.epilogue(coords, "mask", [("offs * 0", (0,))])


def _combine_constexprs(w: _Writer) -> list:
    spec = w.spec
    return [KernelArgument("constexpr", f"FILTER_{axis}", spec.filter_sizes[axis]) for axis in range(spec.rank)] + [
        KernelArgument("constexpr", "TAPS", spec.taps), KernelArgument("constexpr", "SPLITS", spec.config.splits),
        KernelArgument("constexpr", "BLOCK", spec.combine_block)]


BODIES = {"gather": (2, _gather_body, _gather_constexprs), "wgrad": (3, _wgrad_body, _wgrad_constexprs),
          "combine": (1, _combine_body, _combine_constexprs)}


def _product(values) -> int:
    total = 1
    for value in values:
        total *= value
    return total


def _operands_of(w: _Writer) -> list:
    """The operands the body reads or writes: the main wgrad kernel writes its partials only,
    the combine kernel reads partials and runs the epilogue."""
    body = w.spec.body
    if body == "wgrad":
        return [op for op in w.operands if op.role in ("src", "x")]
    if body == "combine":
        return [op for op in w.operands if op.role in ("read", "out")]
    return list(w.operands)


def render(spec: DepthwiseSpec):
    """The KernelSource (name, source, arguments) of one depthwise kernel."""
    ndim, body, constexprs = BODIES[spec.body]
    w = _Writer(spec, ndim)
    body(w)
    operands = _operands_of(w)
    args = [KernelArgument("tensor", f"{op.ident}_ptr", op.uid) for op in operands]
    if spec.body in ("wgrad", "combine"):
        args.append(KernelArgument("tensor", "partial_ptr", spec.partial_uid))
    args += [KernelArgument("int", name, value) for name, value in w.sizes.items()]
    for op in operands:
        args += [KernelArgument("int", name, stride) for (ident, _), (name, stride) in w.strides.items()
                 if ident == op.ident]
    args += [KernelArgument("int", name, value) for e in w.emitters for name, value in e.scalars]
    args += constexprs(w)
    module_globals = [g for e in w.emitters for g in e.globals]
    return KernelSource(spec.name, kernel_module(spec.description, module_globals, spec.name, args,
                                                 "\n".join(w.lines) + "\n"), args)
