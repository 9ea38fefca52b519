"""Render convolutions as implicit GEMMs: the conv family's k walk and loaders for the shared
GEMM mainloop (codegen/gemm.py).

fprop is C[m, n] = sum_k A[m, k] B[k, n] per group with m = (n, o_1..o_d) the output pixels,
n the group's filters and k = (filter tap, channel):

  TapWalk          k steps walk the filter taps (outer) and BLOCK_K channels of the group (inner):
                   per step one scalar tap decomposition, `ks` the channels, `mask_k` their end
                   (a small channel count is padded in the loader, never in memory)
  ActivationGather A tiles gathered from the activation: rows decompose into (n, o_1..o_d) once
                   per tile, the input coordinate of a tap is o * STRIDE - PADDING + tap * DILATION,
                   out-of-range coordinates load zero (padding), and a pointwise prologue (a
                   batchnorm's scale-bias-relu) runs at load, zero again where the padding is
  FilterLoader     B tiles [channels, filters] of the filter at one tap, read at an affine filter
                   index (back to front in mode="convolution" and in dgrad)

With few channels per group the taps fold into k (FoldedTapWalk): K = taps x channels is walked
in plain BLOCK_K steps, each k decoded into its own tap (tap_<axis>, a [BLOCK_K] vector) and
channel (`chan`), in the order heuristics/conv.py folded_axes gives (channels innermost for an
NHWC activation); ActivationGather and FilterLoader then take the tap along k (`folded`), the
padding mask [BLOCK_M, BLOCK_K].

wgrad reduces over output pixels instead (PixelWalk, GradientLoader for dy): its B tiles gather
x at one tap per program (PixelGather, the taps a batch axis) or, with few channels per group, at
one tap per column (FoldedTapGather: columns decompose into (channel, taps...), as dw's do).

Geometry (taps, stride, padding, dilation) is constexpr: the compiler folds the divisions.
Operands of side "a" have row strides (n, input spatial axes...) and column stride (channel);
the filter (side "b") has row strides (channel, filter spatial axes...) and column stride
(filter); the group is the GEMM's batch axis.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from .emitter import SCALAR_AS_TILE, load_conversion
from .gemm import (LinearK, Loader, batch_offset, col_lines, converted, decompose_lines, prologue_tile, row_lines,
                   stride_name)
from ...contract import KernelSource
from .pointwise import KernelArgument, kernel_module


class FilterShape:
    """rank and taps of anything holding `filter_sizes` (conv geometry, depthwise specs)."""

    @property
    def rank(self) -> int:
        return len(self.filter_sizes)

    @property
    def taps(self) -> int:
        return math.prod(self.filter_sizes)


@dataclass(frozen=True)
class ConvGeometry(FilterShape):
    """Filter taps and their placement per spatial axis (plain data, from the plan)."""

    filter_sizes: tuple  # taps walked per spatial axis (0: a dgrad phase no tap reaches)
    stride: tuple
    padding: tuple  # may be negative where a phase of a strided dgrad starts inside the input
    dilation: tuple
    filter_base: tuple  # the filter index of tap t is filter_base + filter_step * t per axis:
    filter_step: tuple  # (0, 1) in fprop, (R - 1, -1) flipped, (r0 + (J-1) q, -q) in a dgrad phase

    def constexprs(self) -> tuple:
        values = [("TAPS", self.taps)]
        for axis in range(self.rank):
            values += [(f"FILTER_{axis}", max(1, self.filter_sizes[axis])), (f"STRIDE_{axis}", self.stride[axis]),
                       (f"PADDING_{axis}", self.padding[axis]), (f"DILATION_{axis}", self.dilation[axis]),
                       (f"FILTER_BASE_{axis}", self.filter_base[axis]), (f"FILTER_STEP_{axis}", self.filter_step[axis])]
        return tuple(values)

    def filter_index(self, axis: int, tap: str = "") -> str:
        """The filter index along `axis` of tap `tap` (default: the step's, tap_<axis>)."""
        tap = tap or f"tap_{axis}"
        if (self.filter_base[axis], self.filter_step[axis]) == (0, 1):
            return tap
        return f"(FILTER_BASE_{axis} + FILTER_STEP_{axis} * {tap})"


@dataclass(frozen=True)
class TapWalk:
    """k steps over (tap, channel block): k_tiles = TAPS * cdiv(CG, BLOCK_K)."""

    geometry: ConvGeometry
    channels: int  # channels per group (the reduction length at one tap)
    ragged: bool  # channels % BLOCK_K != 0
    names = ("c_tiles", "CG", "TAPS")
    stems = ("tap", "FILTER", "STRIDE", "PADDING", "DILATION")
    sizes = ("CG",)

    @property
    def size_values(self) -> dict:
        return {"CG": self.channels}

    def arguments(self) -> list:
        return []

    def count(self, spec, w):
        w("c_tiles = tl.cdiv(CG, BLOCK_K)", "k_tiles = TAPS * c_tiles")

    def step(self, spec, w):
        w("tap = kt // c_tiles", "ks = (kt - tap * c_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)")
        if self.ragged:
            w("mask_k = ks < CG")
        last = self.geometry.rank - 1
        if last == 0:
            w("tap_0 = tap")
            return
        w("tap_rest = tap")
        for axis in range(last, 0, -1):
            w(f"tap_{axis} = tap_rest % FILTER_{axis}", f"tap_rest = tap_rest // FILTER_{axis}")
        w("tap_0 = tap_rest")


@dataclass(frozen=True)
class FoldedTapWalk(LinearK):
    """k steps of BLOCK_K over K = taps x channels of the group folded together: per step `ks`
    decomposes (constexpr extents) into a tap per spatial axis and a channel for every k."""

    axes: tuple = ()  # the folded axes, outer first: -1 the channel, a the tap along spatial axis a
    names = ("CG", "TAPS", "chan")
    stems = ("tap", "FILTER", "STRIDE", "PADDING", "DILATION")

    def step(self, spec, w):
        super().step(spec, w)
        # k past K (a ragged last step) decodes to a tap past the filter: mask_k covers it
        decompose_lines(w, "ks", ["chan" if role < 0 else f"tap_{role}" for role in self.axes],
                        ["CG" if role < 0 else f"FILTER_{role}" for role in self.axes])


def _input_sizes(sizes: tuple) -> list:
    """The activation's spatial extents, which the padding masks compare against."""
    return [KernelArgument("int", f"in_size_{axis}", size) for axis, size in enumerate(sizes)]


def _k_mask(spec, side: str) -> str:
    if not spec.k_walk.ragged:
        return ""
    return "mask_k[None, :]" if side == "a" else "mask_k[:, None]"


def _and(*masks: str) -> str:
    return " & ".join(m for m in masks if m)


@dataclass(frozen=True)
class ActivationGather(Loader):
    """A [BLOCK_M, BLOCK_K]: output pixel rows x channels of one tap, gathered with zero padding
    (`folded`: x (tap, channel) of each k, FoldedTapWalk's)."""

    geometry: ConvGeometry
    input_sizes: tuple  # spatial extents of the activation
    target_uid: int  # the tensor the conv reads (the prologue's result)
    dot_type: str
    prologue: tuple = ()
    folded: bool = False
    reads_rows = True
    stems = ("in", "valid", "base")

    def tile_setup(self, spec, w):
        row_lines(spec, w, "offs_m % M")  # wrapped: loads need no row mask, stores mask the tail
        for axis in range(self.geometry.rank):
            w(f"in_{axis} = row_{axis + 1} * STRIDE_{axis} - PADDING_{axis}")
        for op in spec.side("a"):
            terms = [f"row_0 * {stride_name(op, 'r', 0)}"] if op.row_strides[0] else []
            terms += [f"in_{axis} * {stride_name(op, 'r', axis + 1)}"
                      for axis in range(self.geometry.rank) if op.row_strides[axis + 1]]
            if terms:
                w(f"base_{op.ident} = " + " + ".join(terms))

    def _spans_rows(self, op) -> bool:
        return any(op.row_strides)

    def _offset(self, op, full: bool = False) -> str:
        """op's offsets over the tile; broadcast axes (stride 0) are skipped unless `full` (the
        operand fed to tl.dot needs the whole [BLOCK_M, BLOCK_K] even where every stride is 0)."""
        terms = [t for t in [batch_offset(op)] if t]
        tap = [f"tap_{axis} * DILATION_{axis} * {stride_name(op, 'r', axis + 1)}"
               for axis in range(self.geometry.rank) if op.row_strides[axis + 1]]
        rows = [f"base_{op.ident}"] if self._spans_rows(op) else []
        if self.folded:  # the tap moves along k: its reach joins the channel's in the column part
            channel = [f"chan * {stride_name(op, 'c', 0)}"] if op.col_strides[0] else []
            cols = "(" + " + ".join(tap + channel) + ")[None, :]" if tap + channel else ""
        else:
            rows += tap if rows else []
            cols = f"ks[None, :] * {stride_name(op, 'c', 0)}" if op.col_strides[0] else ""
        if rows:
            terms.append("(" + " + ".join(rows) + ")[:, None]")
        elif full:
            terms.append("row_0[:, None] * 0")
        if cols:
            terms.append(cols)
        elif full:
            terms.append("ks[None, :] * 0")
        return " + ".join(terms) or "0"

    def _valid(self, w) -> str:
        """Write valid_a (the tap inside the activation) and return its mask over the tile."""
        checks = []
        for axis in range(self.geometry.rank):
            reach = f"tap_{axis} * DILATION_{axis}"
            w(f"in_tap_{axis} = in_{axis}[:, None] + ({reach})[None, :]" if self.folded
              else f"in_tap_{axis} = in_{axis} + {reach}")
            checks.append(f"(in_tap_{axis} >= 0) & (in_tap_{axis} < in_size_{axis})")
        w("valid_a = " + " & ".join(checks))
        return "valid_a" if self.folded else "valid_a[:, None]"

    def step(self, spec, w):
        valid = self._valid(w)
        k_mask = _k_mask(spec, "a")
        inside = _and(valid, k_mask)
        if not self.prologue:
            (op,) = spec.side("a")
            convert = converted(op, self.dot_type)
            w(f"tile_a = tl.load({op.ident}_ptr + {self._offset(op, full=True)}, mask={inside}, other=0.0){convert}")
            return
        loads = []
        for op in spec.side("a"):
            mask = _and(valid if self._spans_rows(op) else "", k_mask if op.col_strides[0] else "")
            other = "0.0" if op.data_type.is_floating else "0"
            masked = f", mask={mask}, other={other}" if mask else SCALAR_AS_TILE  # a [1, 1] tile, not 0-d
            cast = load_conversion(op.data_type, spec.compute)
            loads.append((op, f"tl.load({op.ident}_ptr + {self._offset(op)}{masked}){cast}"))
        # the padding and the channels past the group are zero after the prologue too
        prologue_tile(spec, w, "a", loads, self.prologue, self.target_uid, inside, self.dot_type)

    def arguments(self, spec) -> list:
        return _input_sizes(self.input_sizes)


@dataclass(frozen=True)
class FilterLoader(Loader):
    """B [BLOCK_K, BLOCK_N]: channels x filters of the group at the step's tap (`folded`: the
    (tap, channel) of each k; the weight read as [taps x channels, filters] through its strides)."""

    geometry: ConvGeometry
    dot_type: str
    folded: bool = False
    reads_rows = False

    def tile_setup(self, spec, w):
        w("cols_b = offs_n % N")

    def step(self, spec, w):
        (op,) = spec.side("b")
        terms = [t for t in [batch_offset(op)] if t]
        tap = []
        for axis in range(self.geometry.rank):
            if op.row_strides[axis + 1]:
                tap.append(f"{self.geometry.filter_index(axis)} * {stride_name(op, 'r', axis + 1)}")
        if self.folded:
            channel = [f"chan * {stride_name(op, 'r', 0)}"] if op.row_strides[0] else []
            terms.append("(" + " + ".join(tap + channel or ["ks * 0"]) + ")[:, None]")
        else:
            terms += tap
            terms.append(f"ks[:, None] * {stride_name(op, 'r', 0)}" if op.row_strides[0] else "ks[:, None] * 0")
        terms.append(f"cols_b[None, :] * {stride_name(op, 'c', 0)}" if op.col_strides[0] else "cols_b[None, :] * 0")
        k_mask = _k_mask(spec, "b")
        masked = f", mask={k_mask}, other=0.0" if k_mask else ""
        convert = converted(op, self.dot_type)
        w(f"tile_b = tl.load({op.ident}_ptr + {' + '.join(terms)}{masked}){convert}")



# --- wgrad: the reduction runs over output pixels ---------------------------------------------------
@dataclass(frozen=True)
class PixelWalk(LinearK):
    """k steps of BLOCK_K output pixels (n, o_1..o_d), decomposed per step (wgrad)."""

    rank: int = 1
    pixel_sizes: tuple = ()  # (N, O_1, ..., O_d)
    stems = ("pix",)

    def step(self, spec, w):
        super().step(spec, w)
        w("pix_rest = ks % K" if self.ragged else "pix_rest = ks")  # wrapped: loads stay in range
        for axis in range(self.rank, 0, -1):
            w(f"pix_{axis} = pix_rest % pix_size_{axis}", f"pix_rest = pix_rest // pix_size_{axis}")
        w("pix_0 = pix_rest")

    def arguments(self) -> list:
        return [KernelArgument("int", f"pix_size_{axis}", size) for axis, size in enumerate(self.pixel_sizes) if axis]


def _pixel_terms(op, include_spatial: bool) -> list:
    """Offset terms of op over the step's pixels: n, and the output pixel when `include_spatial`."""
    terms = [f"pix_0 * {stride_name(op, 'c' if op.side == 'a' else 'r', 0)}"] if (
        op.col_strides if op.side == "a" else op.row_strides)[0] else []
    if include_spatial:
        strides = op.col_strides if op.side == "a" else op.row_strides
        axis_name = "c" if op.side == "a" else "r"
        terms += [f"pix_{i} * {stride_name(op, axis_name, i)}" for i in range(1, len(strides)) if strides[i]]
    return terms


@dataclass(frozen=True)
class GradientLoader(Loader):
    """A [BLOCK_M, BLOCK_K] of wgrad: filters x output pixels of dy (dy's pixels are the
    columns here), with a pointwise prologue on dy applied at load."""

    target_uid: int
    dot_type: str
    prologue: tuple = ()
    reads_rows = False

    def tile_setup(self, spec, w):
        w("rows_a = offs_m % M")

    def _offset(self, op) -> str:
        terms = [t for t in [batch_offset(op)] if t]
        if op.row_strides[0]:
            terms.append(f"rows_a[:, None] * {stride_name(op, 'r', 0)}")
        pixels = _pixel_terms(op, include_spatial=True)
        if pixels:
            terms.append("(" + " + ".join(pixels) + ")[None, :]")
        return " + ".join(terms) or "0"

    def step(self, spec, w):
        k_mask = _k_mask(spec, "a")
        if not self.prologue:
            (op,) = spec.side("a")
            masked = f", mask={k_mask}, other=0.0" if k_mask else ""
            full = "" if op.row_strides[0] else " + rows_a[:, None] * 0"
            convert = converted(op, self.dot_type)
            w(f"tile_a = tl.load({op.ident}_ptr + {self._offset(op)}{full}{masked}){convert}")
            return
        loads = []
        for op in spec.side("a"):
            spans_pixels = any(op.col_strides)
            masked = f", mask={k_mask}, other=0.0" if k_mask and spans_pixels else ""
            one = "" if (spans_pixels or op.row_strides[0]) else SCALAR_AS_TILE
            cast = load_conversion(op.data_type, spec.compute)
            loads.append((op, f"tl.load({op.ident}_ptr + {self._offset(op)}{one}{masked}){cast}"))
        # pixels past the end are zero whatever the prologue maps zero to
        prologue_tile(spec, w, "a", loads, self.prologue, self.target_uid, k_mask, self.dot_type)



@dataclass(frozen=True)
class PixelGather(Loader):
    """B [BLOCK_K, BLOCK_N] of wgrad: output pixels x channels of x at the program's filter tap
    (from the batch index), zero where the tap lands in the padding."""

    geometry: ConvGeometry  # filter_sizes, stride, padding, dilation; filter_base/step: the flip
    input_sizes: tuple
    tap_axes: tuple  # per spatial axis, the batch axis holding its tap (-1: a filter of size 1)
    dot_type: str
    reads_rows = False
    stems = ("in", "valid")

    def tile_setup(self, spec, w):
        w("cols_b = offs_n % N")
        for axis, batch_axis in enumerate(self.tap_axes):
            tap = f"bidx_{batch_axis}" if batch_axis >= 0 else "0"
            w(f"tap_{axis} = {self.geometry.filter_index(axis, tap)}")

    def step(self, spec, w):
        (op,) = spec.side("b")
        checks = []
        for axis in range(self.geometry.rank):
            w(f"in_tap_{axis} = pix_{axis + 1} * STRIDE_{axis} - PADDING_{axis} + tap_{axis} * DILATION_{axis}")
            checks.append(f"(in_tap_{axis} >= 0) & (in_tap_{axis} < in_size_{axis})")
        w("valid_b = " + " & ".join(checks))
        terms = [t for t in [batch_offset(op)] if t]
        pixels = [f"pix_0 * {stride_name(op, 'r', 0)}"] if op.row_strides[0] else []
        pixels += [f"in_tap_{i} * {stride_name(op, 'r', i + 1)}" for i in range(self.geometry.rank) if op.row_strides[i + 1]]
        terms.append("(" + " + ".join(pixels) + ")[:, None]" if pixels else "ks[:, None] * 0")
        terms.append(f"cols_b[None, :] * {stride_name(op, 'c', 0)}" if op.col_strides[0] else "cols_b[None, :] * 0")
        mask = _and("valid_b[:, None]", _k_mask(spec, "b"))
        convert = converted(op, self.dot_type)
        w(f"tile_b = tl.load({op.ident}_ptr + {' + '.join(terms)}, mask={mask}, other=0.0){convert}")

    def arguments(self, spec) -> list:
        return _input_sizes(self.input_sizes)


@dataclass(frozen=True)
class FoldedTapGather(Loader):
    """B [BLOCK_K, BLOCK_N] of a wgrad with its filter taps folded into the columns: output pixels
    x columns (channel, taps...) of x, each column at its own tap, zero where the tap lands in the
    padding. The address splits into a pixel part [BLOCK_K] and a column part [BLOCK_N] (the
    column's channel and its tap's dilated reach), set up once per tile."""

    geometry: ConvGeometry  # filter_sizes, stride, padding, dilation; filter_base/step: the flip
    input_sizes: tuple
    column_axes: tuple  # per output column axis, outer first: -1 the channel, a the tap along axis a
    dot_type: str
    reads_cols = True
    stems = ("in", "valid", "tap", "gather")

    def _column_index(self, role: int) -> str:
        return f"col_{self.column_axes.index(role)}"

    def tile_setup(self, spec, w):
        (op,) = spec.side("b")
        col_lines(spec, w, "offs_n % N")  # wrapped: loads stay in range, stores mask the tail
        terms = [f"{self._column_index(-1)} * {stride_name(op, 'c', 0)}"] if op.col_strides[0] else []
        for axis in range(self.geometry.rank):
            w(f"tap_{axis} = {self.geometry.filter_index(axis, self._column_index(axis))} * DILATION_{axis}")
            if op.row_strides[axis + 1]:
                terms.append(f"tap_{axis} * {stride_name(op, 'r', axis + 1)}")
        w("gather_cols = " + (" + ".join(terms) if terms else "offs_n * 0"))

    def step(self, spec, w):
        (op,) = spec.side("b")
        checks, pixels = [], [f"pix_0 * {stride_name(op, 'r', 0)}"] if op.row_strides[0] else []
        for axis in range(self.geometry.rank):
            w(f"in_{axis} = pix_{axis + 1} * STRIDE_{axis} - PADDING_{axis}",
              f"in_tap_{axis} = in_{axis}[:, None] + tap_{axis}[None, :]")
            checks.append(f"(in_tap_{axis} >= 0) & (in_tap_{axis} < in_size_{axis})")
            if op.row_strides[axis + 1]:
                pixels.append(f"in_{axis} * {stride_name(op, 'r', axis + 1)}")
        w("valid_b = " + " & ".join(checks), "gather_pixels = " + (" + ".join(pixels) if pixels else "ks * 0"))
        terms = [t for t in [batch_offset(op)] if t] + ["gather_pixels[:, None] + gather_cols[None, :]"]
        mask = _and("valid_b", _k_mask(spec, "b"))
        convert = converted(op, self.dot_type)
        w(f"tile_b = tl.load({op.ident}_ptr + {' + '.join(terms)}, mask={mask}, other=0.0){convert}")

    def arguments(self, spec) -> list:
        return _input_sizes(self.input_sizes)


# --- a filter staged reduction-major (8-bit dots: wgmma reads both operands K-major) ------------
STAGE_BLOCK = (64, 64)  # (lines, reduced values) a reduction_major_copy program moves
STAGE_TAP_AXES = 3  # filter taps the copy decomposes (1D to 3D convs)


def staged_filter_strides(dim: tuple, reduce_axis: int) -> tuple:
    """The strides of a filter [filters, channels, taps...] copied reduction-major: the reduced
    axis (`reduce_axis`: 1 the channels, fprop; 0 the filters, dgrad) contiguous, then the other of
    the two, then the taps, outer first."""
    reduced, columns = dim[reduce_axis], dim[1 - reduce_axis]
    tap_strides, unit = [], reduced * columns
    for size in reversed(dim[2:]):
        tap_strides.insert(0, unit)
        unit *= size
    pair = (1, reduced) if reduce_axis == 0 else (reduced, 1)
    return pair + tuple(tap_strides)


def render_reduction_major(kernel_name: str, source, reduce_axis: int, copy_uid: int, description: str) -> tuple:
    """(KernelSource, grid) of the kernel copying the filter `source` (a graph tensor) to the
    contiguous buffer `copy_uid` in staged_filter_strides' order, with lib.reduction_major_copy."""
    dim, stride = tuple(source.dim), tuple(source.stride)
    taps = dim[2:]
    pad = STAGE_TAP_AXES - len(taps)
    tap_sizes, tap_strides = (1,) * pad + taps, (0,) * pad + stride[2:]
    reduced, columns = dim[reduce_axis], dim[1 - reduce_axis]
    lines = columns * math.prod(taps)
    args = [KernelArgument("tensor", "src_ptr", source.uid), KernelArgument("tensor", "dst_ptr", copy_uid)]
    values = (("REDUCED", reduced), ("COLUMNS", columns), ("LINES", lines), ("src_reduced", stride[reduce_axis]),
              ("src_column", stride[1 - reduce_axis]), ("src_tap_0", tap_strides[0]), ("src_tap_1", tap_strides[1]),
              ("src_tap_2", tap_strides[2]), ("tap_size_1", tap_sizes[1]), ("tap_size_2", tap_sizes[2]))
    args += [KernelArgument("int", name, int(value)) for name, value in values]
    call = [a.name for a in args] + [f"BLOCK_L={STAGE_BLOCK[0]}", f"BLOCK_R={STAGE_BLOCK[1]}"]
    body = "    lib.reduction_major_copy(" + ", ".join(call) + ")\n"
    text = kernel_module(description, [], kernel_name, args, body, libraries=("lib",))
    grid = (-(-lines // STAGE_BLOCK[0]), -(-reduced // STAGE_BLOCK[1]))
    return KernelSource(kernel_name, text, tuple(args)), grid


# --- wgrad's operands staged pixel-major (8-bit dots) ----------------------------------------------
GATHER_BLOCK = (64, 64)  # (channels, pixels) a pixel_major_gather program moves
PIXEL_ALIGN = 16  # elements: each staged line starts 16-byte aligned for cp.async (8-bit types)


def padded_pixels(pixels: int) -> int:
    """The length of a staged line of `pixels` values (PIXEL_ALIGN-aligned; the tail is never read)."""
    return -(-pixels // PIXEL_ALIGN) * PIXEL_ALIGN


def render_pixel_major(kernel_name: str, source, geometry: ConvGeometry, out_sizes: tuple, copy_uid: int,
                       description: str) -> tuple:
    """(KernelSource, grid) of the kernel gathering `source` ([N, C, *in], a graph tensor) into the
    contiguous buffer `copy_uid` ([taps, C, padded_pixels(N x out)]) with lib.pixel_major_gather:
    at every filter tap of `geometry` (one tap, stride 1 and no padding copies dy as it is)."""
    dim, stride = tuple(source.dim), tuple(source.stride)
    pad = STAGE_TAP_AXES - geometry.rank
    front = lambda values, fill: (fill,) * pad + tuple(values)
    pixels = dim[0] * math.prod(out_sizes)
    outs, ins, taps = front(out_sizes, 1), front(dim[2:], 1), front(geometry.filter_sizes, 1)
    spatial = front(stride[2:], 0)
    args = [KernelArgument("tensor", "src_ptr", source.uid), KernelArgument("tensor", "dst_ptr", copy_uid)]
    values = [("CHANNELS", dim[1]), ("PIXELS", pixels), ("PIXELS_PAD", padded_pixels(pixels)), ("src_n", stride[0]),
              ("src_c", stride[1])] + [(f"src_s{a}", spatial[a]) for a in range(STAGE_TAP_AXES)]
    values += [(f"out_{a}", outs[a]) for a in range(STAGE_TAP_AXES)] + [(f"in_{a}", ins[a]) for a in range(STAGE_TAP_AXES)]
    values += [("taps_1", taps[1]), ("taps_2", taps[2])]
    args += [KernelArgument("int", name, int(value)) for name, value in values]
    constexprs = []
    for name, field, fill in (("STRIDE", geometry.stride, 1), ("PADDING", geometry.padding, 0),
                              ("DILATION", geometry.dilation, 1), ("FILTER_BASE", geometry.filter_base, 0),
                              ("FILTER_STEP", geometry.filter_step, 1)):
        constexprs += [f"{name}_{a}={int(v)}" for a, v in enumerate(front(field, fill))]
    constexprs += [f"BLOCK_C={GATHER_BLOCK[0]}", f"BLOCK_P={GATHER_BLOCK[1]}"]
    body = "    lib.pixel_major_gather(" + ", ".join([a.name for a in args] + constexprs) + ")\n"
    text = kernel_module(description, [], kernel_name, args, body, libraries=("lib",))
    grid = (-(-pixels // GATHER_BLOCK[1]), -(-dim[1] // GATHER_BLOCK[0]), math.prod(geometry.filter_sizes))
    return KernelSource(kernel_name, text, tuple(args)), grid
