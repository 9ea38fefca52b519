"""Configs for pooling kernels: a [BLOCK_R, BLOCK_C] tile ranked by a bandwidth + wave model.

The tile covers the pooled output (forward) or dx (backward; with a stride above 1, blocks of
dx a stride in size: owned_block). Its columns walk the axis with
the smallest stride in x (channels for NHWC, width for NCHW) so every window load is a run of
contiguous elements; its rows decompose into the other logical axes, outermost first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ....target import Target
from .layout import INT32_LIMIT
from ..codegen.unrolling import UNROLLED_BODIES_MAX
from .pointwise import pow2_at_least

# Columns per tile: 128 bf16 channels are 256 bytes, two 16-byte vectors per row segment.
# Wider rows buy nothing once a row segment is a few full cache lines.
MAX_BLOCK_COLS = 128
# Elements per program. Every window position is one unrolled load of the whole tile, so a
# 3x3 window keeps 9 tile loads in flight: 4096 elements at 8 warps is 9 x 16 values a thread.
TILE_ELEMENTS = (512, 1024, 2048, 4096)
# Values a thread holds per tile load, at most: the unrolled window keeps several tile loads
# live at once (9 for 3x3), and more than 16 values each pushes registers past 128 a thread.
# The cap where no tile was measured (LRN's windows, a backward gathering per dx element);
# the measured kinds have theirs below.
ELEMENTS_PER_THREAD = 16
# The same cap for a per-element max backward given the forward's indices. Model assumption,
# not yet measured: each covering window (up to 4 for 3x3 stride 2) is one int64 and one dy tile load,
# all live at once; int64 values take two registers, so 8 values a thread keeps the indices near
# 64 registers, as 16 bf16-widened values of 4 window loads would be.
INDEXED_ELEMENTS_PER_THREAD = 8
# Owned-block backward (see owned_block): dx positions one tile position owns, at most. Each is
# one accumulator and, per covering window, one compare and select; 3x3x3 stride 2 (8) and 2D
# stride 3 (9) stay within it, a stride past the window (mostly gaps) may not.
OWNED_POSITIONS_MAX = 16
# Measured tiles (H200, 2026-11-29, `cd benchmarks && python sweep_pooling.py --budget 95`, 3x3
# stride 2 bf16 at ResNet's stem; BENCHMARKS.md "Pooling"). The wave model ranks these tiles
# within a few percent of each other, and the measurement then tells them apart, by as much
# as 2x: each kind of kernel gets the elements a thread holds per tile load and the tile size
# that measured best, and the model's near-ties go to that tile.
# Forward: 8x64 w2 70.8 us NCHW (64x64 w8: 146), 32.3 us NHWC (64x64 w8: 35.1; best 16x64 w4 32.2).
FORWARD_ELEMENTS_PER_THREAD, FORWARD_TILE_ELEMENTS = 8, 512
# Owned-block backward recomputing the argmax (each covering window's x loads in registers),
# values shared by the owned positions' accumulators (4 each at 2x2):
# 8x64 w4 613 us NCHW (16x64 w8: 1158), 302.8 us NHWC (16x64 w8: 303.9).
RECOMPUTE_VALUES_PER_THREAD, RECOMPUTE_TILE_ELEMENTS = 16, 512
# Owned-block backward of dy alone (averages, or routed by the forward's indices; 16 values
# an accumulator at 2x2): one dy load per covering window, which neighbouring blocks of a
# larger tile likely share through L1. 32x64 w4:
# 105.3 us indexed NHWC (8x64 w8: 117.8), 37.2 us average NHWC (16x64 w8: 40.2, best 64x64 w8 36.4).
GATHER_VALUES_PER_THREAD, GATHER_TILE_ELEMENTS = 64, 2048
# Model estimates within this share of the fastest are ties (the model's wave term moves by a
# wave's fixed cost between these tiles, which the sweep did not see).
MODEL_TIE = 0.10
# Largest stride along the vector axis a forward reads as row segments (row_segment_stride): a
# segment is stride x BLOCK_C elements a row, split in log2(stride) steps.
MAX_SEGMENT_STRIDE = 8
MAX_WARPS = 8
# Hopper keeps at most 32 resident blocks per SM, whatever their size.
MAX_PROGRAMS_PER_SM = 32
# Assumed (not yet measured for pooling): a streaming kernel reaches full DRAM bandwidth with
# about half the SM's warps resident; fewer warps in flight get a proportional share.
SATURATING_WARPS_PER_SM = 32
# Fixed cost of one wave of programs (assumed too): the first loads' DRAM latency, which
# nothing hides at a wave's edge. It breaks ties toward fewer, larger programs.
WAVE_OVERHEAD = 1.0e-6

AXIS_NAMES = {3: ("n", "c", "w"), 4: ("n", "c", "h", "w"), 5: ("n", "c", "d", "h", "w")}


@dataclass(frozen=True)
class PoolingConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    estimate_us: float  # model time


class TiledWindows:
    """The tile a windowed kernel's schedule lays out (pooling's, LRN's): `tile_dims` flattened
    into rows (`row_axes`) and columns (`vector_axis`), in blocks of `config`'s rows and columns;
    the subclass (a dataclass) holds those fields and x_dims, index_64."""

    @property
    def cols(self) -> int:
        return self.tile_dims[self.vector_axis]

    @property
    def rows(self) -> int:
        count = 1
        for axis in self.row_axes:
            count *= self.tile_dims[axis]
        return count

    @property
    def programs(self) -> int:
        return -(-self.rows // self.config.block_rows) * -(-self.cols // self.config.block_cols)

    def tile_text(self) -> str:
        names = AXIS_NAMES[len(self.x_dims)]
        return (f"BLOCK_R={self.config.block_rows} BLOCK_C={self.config.block_cols} "
                f"num_warps={self.config.num_warps} grid={self.programs} "
                f"vector={names[self.vector_axis]} rows={''.join(names[a] for a in self.row_axes)}"
                + (" int64-index" if self.index_64 else ""))


@dataclass(frozen=True)
class PoolingSchedule(TiledWindows):
    """Everything codegen needs to write one pooling kernel: problem, tile layout, config."""

    backward: bool
    mode: str
    window: tuple
    stride: tuple
    padding: tuple
    x_dims: tuple  # the windowed tensor, [N, C, *spatial]
    y_dims: tuple  # the pooled tensor
    vector_axis: int  # logical axis the tile columns walk
    row_axes: tuple  # the other logical axes, outermost first; they decompose the row index
    index_64: bool  # some offset may pass 2^31: index math in int64
    indexed: bool  # a max backward reading the forward's indices instead of recomputing the argmax
    read_uids: frozenset  # the group inputs the kernel loads (x left out where nothing reads it)
    config: PoolingConfig
    candidates: int
    reason: str
    ceil_mode: bool = False  # windows may run past the padded input (averages count what is in it)
    divisor: Optional[int] = None  # an average's fixed divisor (torch's divisor_override)
    # backward only: per spatial axis, the dx positions one tile position owns (the stride), or
    # () where each tile position is one dx element (see owned_block)
    owned: tuple = ()
    # the stride along the vector axis where each window row is read as contiguous segments split
    # into its taps (row_segment_stride: a forward, a shared-argmax backward's neighbourhood), 0
    # where each tap is its own load
    segment_stride: int = 0
    # owned-block backward recomputing the argmax: the spatial axis along which neighbouring tile
    # positions' windows are exchanged in registers (shared_argmax_axis), -1 where each block
    # recomputes every covering window
    argmax_shift_axis: int = -1

    @property
    def tile_dims(self) -> tuple:
        if not self.backward:
            return self.y_dims
        if self.owned:
            return tuple(self.x_dims[:2]) + owner_dims(self.x_dims[2:], self.stride, self.padding)
        return self.x_dims

    @property
    def config_text(self) -> str:
        owned = f" owned={'x'.join(map(str, self.owned))}" if self.owned else ""
        segments = f" row-segments/{self.segment_stride}" if self.segment_stride else ""
        shared = f" argmax=shared/{AXIS_NAMES[len(self.x_dims)][self.argmax_shift_axis]}" \
            if self.argmax_shift_axis >= 0 else ""
        return self.tile_text() + (" argmax=indices" if self.indexed else "") + owned + segments + shared


def owner_dims(spatial: tuple, stride: tuple, padding: tuple) -> tuple:
    """Per spatial axis, the owned blocks of a backward: block o owns dx positions
    [o * stride - padding % stride, (o + 1) * stride - padding % stride), so blocks 0 ..
    (size - 1 + padding % stride) // stride cover the axis, the first starting less than a
    stride before it: no block lies wholly in the padding (a stride-1 axis padded by 3 would
    add 3 rows of programs with nothing to write)."""
    return tuple((size - 1 + p % s) // s + 1 for size, s, p in zip(spatial, stride, padding))


def owned_block(stride: tuple, window: tuple = ()) -> tuple:
    """The owned block of a backward with these strides, or () to gather per dx element.

    A gather per dx element visits each covering window once per element it covers: prod(window)
    times over for a recomputed argmax, cover^d times for dy and indices (36 x loads and 4 dy
    loads per dx element for 3x3 stride 2). A tile position owning a stride-sized block of dx
    visits the same cover^d windows once for all prod(stride) positions of its block. Stride 1
    owns one position (nothing to share); large strides would unroll too many accumulators; a
    window of more than 2^31 elements would overflow the owned blocks' int32 tap numbers (the
    gather compares coordinates).
    """
    positions = 1
    for s in stride:
        positions *= s
    if _numel(window) > INT32_LIMIT:
        return ()
    return tuple(stride) if 1 < positions <= OWNED_POSITIONS_MAX else ()


def row_segment_stride(vector_axis: int, stride: tuple) -> int:
    """The stride s along the vector axis where a forward reads each window row as contiguous
    segments of s * BLOCK_C elements, one per s-aligned group of taps, and splits each into its
    s taps in registers (0: each tap its own load).

    NCHW's vector axis is a spatial one (width): a tap load at stride s puts lanes s elements
    apart, so no load is a vector and each window row costs a scalar load per tap and element
    (11-22% of copy on the H200). A segment is a run of contiguous elements (vector loads), and
    one segment serves the s taps that share its offset. The split needs s a power of two (tile
    shapes are); stride 1 taps are contiguous already, and a channel vector axis (NHWC) is
    contiguous whatever the stride.
    """
    if vector_axis < 2:
        return 0
    s = stride[vector_axis - 2]
    return s if 2 <= s <= MAX_SEGMENT_STRIDE and s & (s - 1) == 0 else 0


def shared_argmax_axis(owned: tuple, window: tuple, stride: tuple, vector_axis: int, row_axes: tuple) -> int:
    """The spatial axis along which an owned-block backward recomputing the argmax passes each
    window's argmax to the neighbouring tile positions it also covers (-1: every block
    recomputes each covering window, prod(cover) x prod(window) x loads a block).

    The tile's neighbour along that axis is the next column (a spatial vector axis: NCHW's
    width) or the next row (the innermost row axis: NHWC's width), so the argmax of the
    block's own windows, computed once, reaches the blocks before it through a tl.gather;
    along the other spatial axes the covering windows are found in one pass over their joint
    neighbourhood, each x element loaded once a block. Tile positions whose neighbour lies
    outside the program recompute theirs (their loads masked to them). The neighbourhood pass
    unrolls, so it must fit the unroll budget (else -1).
    """
    if not owned:
        return -1
    axis = vector_axis if vector_axis >= 2 else row_axes[-1]
    if axis < 2:
        return -1
    loads = 1
    for a, (k, s) in enumerate(zip(window, stride)):
        cover = -(-k // s)
        loads *= k if a + 2 == axis else (cover - 1) * s + k
    return axis if loads <= UNROLLED_BODIES_MAX else -1


def segments_and_shared_argmax(backward: bool, attrs, indexed: bool, owned: tuple, vector_axis: int,
                               row_axes: tuple) -> tuple[int, int]:
    """(segment_stride, argmax_shift_axis) of a schedule: a forward reads row segments along a
    strided vector axis; a max backward recomputing the argmax shares it along its shift axis,
    and reads that axis as row segments where it is the vector axis (NCHW's width)."""
    stride = tuple(attrs.stride)
    if not backward:
        return row_segment_stride(vector_axis, stride), -1
    shift = shared_argmax_axis(owned, tuple(attrs.window), stride, vector_axis, row_axes) \
        if attrs.mode == "max" and not indexed else -1
    return (row_segment_stride(vector_axis, stride) if shift == vector_axis else 0), shift


def candidates(rows: int, cols: int, elements_per_thread: int = ELEMENTS_PER_THREAD) -> list[tuple[int, int, int]]:
    """(block_rows, block_cols, num_warps) triples worth ranking for a rows x cols tile space;
    tiles that would put more than `elements_per_thread` values of one load on a thread of
    MAX_WARPS warps are left out (the smallest tile always stays)."""
    block_cols = min(pow2_at_least(cols), MAX_BLOCK_COLS)
    rows_cap = pow2_at_least(rows)
    result = set()
    for tile in TILE_ELEMENTS:
        block_rows = max(1, min(rows_cap, tile // block_cols))
        elements = block_rows * block_cols
        if result and elements > MAX_WARPS * 32 * elements_per_thread:
            continue
        # the fewest warps that keep a tile load within elements_per_thread, and twice as many
        # (shorter per-thread load queues, more warps to hide latency)
        warps = max(1, min(MAX_WARPS, elements // (32 * elements_per_thread)))
        result.add((block_rows, block_cols, warps))
        if 2 * warps * 32 <= elements:  # every thread still holds an element
            result.add((block_rows, block_cols, min(MAX_WARPS, 2 * warps)))
    return sorted(result)


def _wave_time(programs: int, num_warps: int, program_bytes: float, target: Target) -> float:
    """Seconds for one wave: its bytes at the bandwidth its warps can draw, plus a fixed cost."""
    share = min(1.0, programs * num_warps / (target.sms * SATURATING_WARPS_PER_SM))
    return programs * program_bytes / (target.bandwidth * share) + WAVE_OVERHEAD


def estimate(rows: int, cols: int, block_rows: int, block_cols: int, num_warps: int,
             bytes_per_element: float, target: Target) -> float:
    """Model time in seconds on `target`: full waves of resident programs, then the partial last wave,
    each moving its padded tiles' bytes."""
    programs = -(-rows // block_rows) * -(-cols // block_cols)
    program_bytes = block_rows * block_cols * bytes_per_element
    per_sm = min(MAX_PROGRAMS_PER_SM, max(1, target.threads_per_sm // (32 * num_warps)))
    resident = target.sms * per_sm
    full_waves, last_wave = divmod(programs, resident)
    time = full_waves * _wave_time(resident, num_warps, program_bytes, target)
    return time + (_wave_time(last_wave, num_warps, program_bytes, target) if last_wave else 0.0)


def rank(rows: int, cols: int, bytes_per_element: float, target: Target,
         elements_per_thread: int = ELEMENTS_PER_THREAD,
         preferred_elements: Optional[int] = None) -> list[PoolingConfig]:
    """Candidate configs, best first. Without `preferred_elements`: by model time, ties to the
    larger tile, whose neighbouring windows share more of their loads through L1. With it: the
    configs within MODEL_TIE of the fastest estimate first, the tile nearest that many elements
    (a measured best), then the fewer warps (each thread holding the whole budget, as the
    measured tiles did), then by model time."""
    configs = [PoolingConfig(r, c, w, 1e6 * estimate(rows, cols, r, c, w, bytes_per_element, target))
               for r, c, w in candidates(rows, cols, elements_per_thread)]
    if preferred_elements is None:
        return sorted(configs, key=lambda cfg: (cfg.estimate_us, -cfg.block_rows * cfg.block_cols,
                                                -cfg.num_warps))
    fastest = min(cfg.estimate_us for cfg in configs)

    def preference(cfg):
        tied = cfg.estimate_us <= fastest * (1 + MODEL_TIE)
        distance = abs(math.log2(cfg.block_rows * cfg.block_cols / preferred_elements))
        return (not tied, distance if tied else 0.0, cfg.num_warps if tied else 0, cfg.estimate_us)

    return sorted(configs, key=preference)


def tile_budget(backward: bool, owned: tuple, mode: str, indexed: bool) -> tuple[int, Optional[int]]:
    """(values a thread holds per tile load, at most; the measured best tile's elements, or None
    where nothing was measured) of a pooling kernel. An owned-block backward holds one
    accumulator per owned position: its budget per thread is shared among them."""
    if not backward:
        return FORWARD_ELEMENTS_PER_THREAD, FORWARD_TILE_ELEMENTS
    if owned and mode == "max" and not indexed:
        return max(2, RECOMPUTE_VALUES_PER_THREAD // _numel(owned)), RECOMPUTE_TILE_ELEMENTS
    if owned:
        return max(2, GATHER_VALUES_PER_THREAD // _numel(owned)), GATHER_TILE_ELEMENTS
    # a gather per dx element: not measured since the owned blocks replaced it at stride 2
    return (INDEXED_ELEMENTS_PER_THREAD if indexed else ELEMENTS_PER_THREAD), None


def tile_axes(tile_dims: tuple, x_stride: tuple) -> tuple[int, tuple]:
    """(vector axis, row axes outermost first), ordered by the strides of x.

    The vector axis is the smallest-stride axis of size > 1 (NHWC: channels, NCHW: width);
    rows follow the remaining strides, largest first, so consecutive rows are close in memory.
    """
    rank_ = len(tile_dims)
    sized = [a for a in range(rank_) if tile_dims[a] > 1] or [rank_ - 1]
    vector_axis = min(sized, key=lambda a: (x_stride[a], -a))
    rows = sorted((a for a in range(rank_) if a != vector_axis), key=lambda a: (-x_stride[a], a))
    return vector_axis, tuple(rows)


def _span(tensor) -> int:
    return sum((size - 1) * stride for size, stride in zip(tensor.dim, tensor.stride)) + 1


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


def moved_tensors(group, x, window_reads_x: bool) -> list:
    """The tensors a pooling kernel moves: x only where its window loop loads it or a fused node
    reads it (a ReLU backward's mask)."""
    others = [node for node in group.nodes if node is not group.anchor]
    anchor_reads = group.anchor.input_tensors()[:1]  # dy (pooling_backward) may be x itself
    read = window_reads_x or any(t.uid == x.uid for node in others for t in node.input_tensors()) or any(
        t.uid == x.uid for t in anchor_reads)
    return [t for t in group.inputs if read or t.uid != x.uid] + list(group.outputs)


def schedule(group, target: Target) -> PoolingSchedule:
    """Tile layout and best-ranked config on `target` of a pooling or pooling_backward group."""
    anchor = group.anchor
    backward = anchor.op == "pooling_backward"
    x = anchor.inputs[1] if backward else anchor.inputs[0]
    y_dims = tuple(anchor.inputs[0].dim) if backward else tuple(anchor.outputs[0].dim)
    attrs = anchor.attrs
    indexed = backward and anchor.inputs[2] is not None
    owned = owned_block(tuple(attrs.stride), tuple(attrs.window)) if backward else ()
    tile_dims = y_dims
    if backward:
        tile_dims = tuple(x.dim[:2]) + (owner_dims(tuple(x.dim[2:]), attrs.stride, attrs.padding) if owned
                                        else tuple(x.dim[2:]))
    vector_axis, row_axes = tile_axes(tile_dims, tuple(x.stride))
    tensors = list(group.inputs) + list(group.outputs)
    index_64 = max(max(_span(t) for t in tensors), _numel(x.dim)) > INT32_LIMIT
    # only the indexed path leaves x out so far; the average backward's ranking stays as measured
    moved = moved_tensors(group, x, not indexed)
    traffic = sum(_numel(t.dim) * t.data_type.itemsize for t in moved)
    tile_elements = _numel(tile_dims)
    cols = tile_dims[vector_axis]
    rows = tile_elements // cols
    per_thread, preferred = tile_budget(backward, owned, attrs.mode, indexed)
    ranked = rank(rows, cols, traffic / max(tile_elements, 1), target, per_thread, preferred)
    best = ranked[0]
    names = AXIS_NAMES[len(tile_dims)]
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us at "
              f"{target.bandwidth / 1e12:.1f} TB/s for {traffic} bytes over {rows}x{cols} "
              f"({'dx blocks' if owned else 'dx' if backward else 'y'} positions x {names[vector_axis]}); vector axis "
              f"{names[vector_axis]} has the smallest stride of x ({x.stride[vector_axis]})"
              + ("; the forward's indices route dy (no argmax recompute)" if indexed else "")
              + (f"; each position owns a {'x'.join(map(str, owned))} block of dx (covering windows visited once a block)"
                 if owned else ""))
    return PoolingSchedule(backward, attrs.mode, tuple(attrs.window), tuple(attrs.stride),
                           tuple(attrs.padding), tuple(x.dim), y_dims, vector_axis, row_axes,
                           index_64, indexed, frozenset(t.uid for t in moved) & {t.uid for t in group.inputs}, best,
                           len(ranked), reason, attrs.ceil_mode, attrs.divisor, owned,
                           *segments_and_shared_argmax(backward, attrs, indexed, owned, vector_axis, row_axes))
