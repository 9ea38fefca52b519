"""Configs for windowed normalization kernels (LRN, divisive normalization): halo tiles.

Each program owns a box of positions along the windowed axes (LRN: a chunk of channels; divisive
normalization: a block of H x W, or D x H x W) times a block of the other axes, and loads x (and
dy, means) once over that box widened by the halo its window sums need: the window itself
forward, twice the window backward (the scale of every centre whose window holds an owned
element). The window side of the tile flattens the windowed axes' blocks; the batch side
flattens the other axes. Whichever side holds x's smallest-stride axis becomes the tile's
columns, so loads are runs of contiguous elements. The halo is re-read by the neighbouring
program (an L2 hit), never re-loaded within one.

Configs are plain data ranked by a model: bytes moved (widened by halo re-reads and short
contiguous runs) over the target's bandwidth, against lanes computed (owned or not) times the
window's shift operations. Model assumption, not measured: the lead's H200 run calibrates it.

The tiles then run one a program, or persistent (`choose_form`): a grid the SMs hold at once
walks them in a loop whose loads Triton pipelines as cp.async copies, where those copies are
possible (`async_copyable`) and each program has tiles enough to fill the pipeline.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ....errors import UnsupportedError
from ....target import Target
from .layout import INT32_LIMIT, merged_stride, operand_strides
from .matmul import LOAD_LATENCY
from .pointwise import pow2_at_least
from .pooling import AXIS_NAMES

# Tile elements (window side x batch side) one program may hold: about eight tiles are live in a
# backward (x, its square, two partial sums, S, S^-beta, dy, the covering term), so 4096
# elements at 8 warps is 16 values a thread per tile, 128 registers in all.
MAX_TILE_ELEMENTS = 4096
# Smallest tile worth a program (fewer elements leave the SM idle between a program's loads).
MIN_TILE_ELEMENTS = 256
MAX_WARPS = 8
# Elements a thread holds per tile (the warp count follows from the tile size).
ELEMENTS_PER_THREAD = 8
# DRAM moves whole 32-byte sectors: a contiguous run shorter than a sector wastes the rest.
SECTOR_BYTES = 32
# Model: lane operations an SM retires per second per clock-normalised SM (128 lanes at ~1.8 GHz),
# and the operations one tile lane costs besides its shifts (loads, squares, exp2/log2, store).
LANE_OPS_PER_SM_SECOND = 128 * 1.8e9
BASE_OPS_PER_LANE = 12
# A shift is a tl.gather along one windowed axis (codegen gathers a view of the tile with an axis
# per windowed axis), which Triton 3.6 keeps within a warp (its "efficient" layout puts the 32
# lanes along the gathered axis, the warps along the others) and lowers to one shuffle and select
# per source register a thread holds along that axis for every value: block / 32 shuffles a
# value (sm_90 PTX of a gather along a flattened 64x64 window side: 65536 shuffles, 255 registers
# and spills; 128 lanes: 4 a value), so the model charges a shift per 32 lanes of its axis: a
# shuffle and a select each (the H200's LCN 3x3 NHWC forward, 8 shuffles a shift then, ran at
# 51 us, which bounds the cost at about 2.5 operations a shuffle).
OPS_PER_SHIFT = 2
LANES_PER_WARP = 32
# Values of one tile a thread may hold: past this, the eight live tiles of a backward spill.
MAX_ELEMENTS_PER_THREAD = 2 * ELEMENTS_PER_THREAD
# A forward window of at most this many positions may instead load x once per window offset
# (neighbours' lanes: L1 and L2 hits), owning its whole tile (no halo lanes, no shuffles). The
# H200 (2026-11-29) ran LRN's size 4 and 5 forwards so at 16-40% of copy against 22-32% for the
# halo tiles (which lost lanes to halos of a 32-128 channel block), and the 3x3 LCN's nine loads
# at 28% against its halo tile's 34%: the model's operation counts do not separate those, so
# the window's size does. An L1 hit costs about a load and an add.
LOADS_MAX_POINTS = 8
OPS_PER_LOAD = 2
# Schedules. "tile": one program a tile, which loads its tile and then computes with nothing in
# flight; the next loads wait for another resident program (the H200's 23-56% of copy forward,
# 14-29% backward). "persistent": a grid of the programs the SMs hold at once, each walking tiles
# pid, pid + grid, ... in a pipelined tl.range loop: Triton 3.6's pipeliner
# turns the loop's loads into cp.async copies to shared memory issued stages - 1 tiles ahead
# (sm_90a TTGIR of the bench's persistent kernels, bf16 and fp32: no tt.load left synchronous in
# the loop, no spills, 46-230 registers). Against a register prefetch (the next tile's tl.load
# issued before this tile's math and carried across the iteration, derived by hand from the same
# generated kernels and compiled alike, one tile ahead at most): backward registers 64 -> 143,
# 111 -> 176, 128 -> 164, 147 -> 178 bf16 and 219 -> 255 fp32, forward within -29..+8, SASS
# instructions within 10% either way, no spills in either; the pipelined loop keeps the registers
# and may run more than one tile ahead, for 24-82 KB of shared memory a program. Model
# assumption until the H200 run calibrates it: persistence pays once every program walks
# PERSISTENT_MIN_TILES tiles (the pipeline's fill, one tile's loads exposed, amortized over them,
# and the last wave's imbalance at most one tile in that many); fewer tiles keep one tile a program.
PERSISTENT_MIN_TILES = 4
# Measured on the H200 (2026-11-29, `cd benchmarks && python bench_lrn.py --dtypes bf16
# --no-compile-anchor`, both forms side by side): the persistent loop ran slower than one tile a
# program on 17 of the 20 bf16 kernels (e.g. LRN NCHW wide forward 43% of copy against 55%, the 3x3
# LCN NHWC forward 20% against 35%) and gained 2-4 points on the other 3; so the model keeps one
# tile a program, and the persistent form runs only where a build forces it (lrn_schedule,
# lrn_programs) until its loop is made to pay.
PERSISTENT_BY_MODEL = False
# Stages: at least two (one tile ahead), more while the resident programs' loads in flight fall
# short of an SM's share of DRAM bandwidth times the load latency (Little's law: 4.8 TB/s / 132
# SMs x 1 us, about 36 KB an SM), as far as shared memory holds their buffers.
MIN_STAGES, MAX_STAGES = 2, 4
# cp.async copies 4, 8 or 16 bytes a thread from an address aligned to that size: a bf16 tile
# whose runs the compiler cannot prove start on an even element stays a synchronous tt.load in the
# loop (sm_90a TTGIR: NCHW LRN over 55 x 55, channel stride 3025; the 3x3 LCN over 56 x 56, H
# stride 56 and an owned box of 30 after a halo of 1), and a loop without its loads in flight only
# costs occupancy (the 3x3 NCHW LCN forward: 209 registers against the tile form's 78). Triton's
# launcher marks an int argument divisible by 16 when it is; any other stride is unknown.
ASYNC_COPY_BYTES = 4
KNOWN_DIVISIBILITY = 16
# Live tiles a thread holds (registers per value of its share of a tile) and the registers
# besides (indices, masks, addresses): the model of a program's registers that bounds how many
# programs an SM holds at once (forward: x, its square, a partial sum, S, S^-beta; backward: dy
# and the covering term besides, the partial sums dead by then). sm_90a SASS of the persistent
# kernels at the bench's bf16 sizes, 4096-lane tiles on 8 warps: forward 46-106 registers (the
# model: 112), backward 64-147 (the model: 128). A model above the compiler's count halves the
# grid; one below only queues a program behind another on its SM.
LIVE_TILES = {False: 5, True: 6}
BASE_REGISTERS = 32
MAX_REGISTERS = 255
MAX_PROGRAMS_PER_SM = 8
SCHEDULES = ("tile", "persistent")


@dataclass(frozen=True)
class LrnConfig:
    """Block per windowed axis (powers of two, halo included), batch-side block, warps, and how
    the window sums are made."""

    window_blocks: tuple
    batch_block: int
    num_warps: int
    estimate_us: float
    window_by: str = "gather"  # "gather": shifted register copies of a halo tile; "loads": a load per offset


@dataclass(frozen=True)
class LrnSchedule:
    """What codegen needs to write one kernel."""

    backward: bool
    axes: tuple  # the windowed logical axes, outermost (largest stride) first
    batch_axes: tuple  # the other logical axes, outermost first
    inner_axes: tuple  # the trailing batch axes every operand walks as one axis (batch_runs)
    reach: tuple  # per windowed axis, (positions loaded before, after) an owned one
    window_on_cols: bool  # the window side is the tile's columns (it holds x's smallest-stride axis)
    x_dims: tuple
    index_64: bool
    read_uids: frozenset
    config: LrnConfig
    candidates: int
    reason: str
    persistent: bool = False  # programs walk tiles in a pipelined loop of `stages`
    grid: int = 0  # programs launched in the persistent form (0: one a tile)
    stages: int = 1

    @property
    def owned(self) -> tuple:
        """Positions each program owns (stores) along each windowed axis."""
        return tuple(block - before - after for block, (before, after) in zip(self.config.window_blocks, self.reach))

    @property
    def window_tiles(self) -> tuple:
        return tuple(-(-self.x_dims[a] // own) for a, own in zip(self.axes, self.owned))

    @property
    def batch(self) -> int:
        return _numel(self.x_dims[a] for a in self.batch_axes)

    @property
    def inner(self) -> int:
        """Positions of the merged inner batch axis, which a program's batch block tiles."""
        return _numel(self.x_dims[a] for a in self.inner_axes)

    @property
    def inner_tiles(self) -> int:
        return -(-self.inner // self.config.batch_block)

    @property
    def tiles(self) -> int:
        return _numel(self.window_tiles) * (self.batch // self.inner) * self.inner_tiles

    @property
    def programs(self) -> int:
        """Programs launched: one a tile, or the persistent grid."""
        return self.grid if self.persistent else self.tiles

    @property
    def config_text(self) -> str:
        names = AXIS_NAMES[len(self.x_dims)]
        blocks = "x".join(f"{names[a]}{b}" for a, b in zip(self.axes, self.config.window_blocks))
        return (f"window={blocks} owned={'x'.join(map(str, self.owned))} "
                f"tiles={'x'.join(map(str, self.window_tiles))} "
                f"batch={''.join(names[a] for a in self.batch_axes if a not in self.inner_axes)}"
                f"[{''.join(names[a] for a in self.inner_axes)}]{self.config.batch_block} "
                f"cols={'window' if self.window_on_cols else 'batch'} sums={self.config.window_by} "
                f"num_warps={self.config.num_warps} "
                f"grid={self.programs}" + (f" persistent={self.tiles}/{self.grid} stages={self.stages}"
                                           if self.persistent else " schedule=tile") +
                (" int64-index" if self.index_64 else ""))


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


@dataclass(frozen=True)
class BoxPlan:
    """How to sum a tile over offsets lo..hi along one axis with shifted copies.

    doublings: the sign (+1 or -1) of each doubling: power 2k = power k + power k shifted by
    sign * k. pieces: (power exponent, shift) terms adding up to the box, each a shift of a power.
    """

    lo: int
    hi: int
    doublings: tuple
    pieces: tuple

    @property
    def gathers(self) -> int:
        return len(self.doublings) + sum(1 for _, shift in self.pieces if shift)

    def intervals(self) -> list:
        """The offsets [a, b] each power 2^i covers (unshifted)."""
        spans = [(0, 0)]
        for level, sign in enumerate(self.doublings):
            a, b = spans[-1]
            k = 1 << level
            spans.append((a, b + k) if sign > 0 else (a - k, b))
        return spans


def _binary_pieces(start: int, length: int, spans) -> list:
    """Pieces covering [start, start + length) with powers (largest first), as (exponent, shift)."""
    pieces = []
    for exponent in reversed(range(len(spans))):
        if length & (1 << exponent):
            pieces.append((exponent, start - spans[exponent][0]))
            start += 1 << exponent
    return pieces


def box_plan(lo: int, hi: int) -> BoxPlan:
    """The plan with the fewest shifts summing offsets lo..hi (lo <= 0 <= hi... or any lo <= hi):
    every doubling sign pattern is tried (log2 of the window levels, a few hundred at most)."""
    length = hi - lo + 1
    levels = length.bit_length() - 1
    best = None
    for signs in itertools.product((1, -1), repeat=levels):
        plan = BoxPlan(lo, hi, signs, ())
        spans = plan.intervals()
        a, b = spans[-1]
        if lo <= a and b <= hi:  # the largest power in place, the rest either side
            pieces = [(levels, 0)] + _binary_pieces(lo, a - lo, spans) + _binary_pieces(b + 1, hi - b, spans)
        else:
            pieces = _binary_pieces(lo, length, spans)
        plan = BoxPlan(lo, hi, signs, tuple(pieces))
        if best is None or plan.gathers < best.gathers:
            best = plan
    return best


def window_reach(size: int, backward: bool) -> tuple:
    """(before, after): positions a program loads around the ones it owns along a windowed axis.
    Forward: the window. Backward: the window of every centre whose window holds an owned
    position (centres from `after` before to `before` after it), so twice the window."""
    before, after = size // 2, (size - 1) // 2
    return (before + after, before + after) if backward else (before, after)


def shift_count(size: int) -> int:
    """Shifts (gathers) of one axis's box sum: box_plan's doublings plus pieces."""
    return box_plan(-(size // 2), (size - 1) // 2).gathers


def _block_choices(extent: int, halo: int) -> list:
    """Powers of two from the smallest that owns a position past the halo to the one holding
    the whole extent with its halo."""
    smallest, largest = pow2_at_least(halo + 1), pow2_at_least(extent + halo)
    choices, block = [], smallest
    while block <= max(smallest, largest):
        choices.append(block)
        block *= 2
    return choices


def loaded_positions(extent: int, block: int, owned: int, before: int) -> int:
    """Positions along one windowed axis that the programs load in all (halos overlap their
    neighbours'; positions outside x are masked, so they move no bytes). Only the tiles at
    either end are clipped, so only they are visited."""
    tiles = -(-extent // owned)
    total, tile = tiles * block, 0
    while tile < tiles and tile * owned - before < 0:  # clipped before position 0
        total -= before - tile * owned
        tile += 1
    tile = tiles - 1
    while tile >= 0 and tile * owned - before + block > extent:  # clipped past the end
        total -= tile * owned - before + block - extent
        tile -= 1
    return total


def _contiguous_run(window_on_cols: bool, owned, axes, inner: int, x, batch_block) -> int:
    """Elements a tile row reads contiguously along x's smallest-stride axis (on the batch side,
    the merged inner batch axes, `inner` positions)."""
    if window_on_cols:
        return min(owned[-1], x.dim[axes[-1]])
    return min(batch_block, inner)


def shuffles_per_shift(block: int) -> int:
    """Shuffles a warp-local tl.gather along an axis of `block` lanes takes per value."""
    return max(1, block // LANES_PER_WARP)


def tile_warps(blocks: tuple, batch_block: int) -> int:
    """Warps of a tile: about ELEMENTS_PER_THREAD values a thread, and no more than each
    gather's layout can place once it puts a warp's lanes along the gathered windowed axis
    (codegen gathers a view with an axis per windowed axis): a warp past them would hold a
    replica of the tile."""
    tile = _numel(blocks) * batch_block
    wanted = pow2_at_least(tile // (LANES_PER_WARP * ELEMENTS_PER_THREAD) or 1)
    room = min(max(1, tile // block * min(block, LANES_PER_WARP) // LANES_PER_WARP) for block in blocks)
    return max(1, min(MAX_WARPS, wanted, room))


def gather_operations(blocks: tuple, shifts_per_axis: int) -> int:
    """Lane operations of a tile's shifted copies per value: each windowed axis's shifts, a
    shuffle and a select per register a thread holds along that axis."""
    return sum(OPS_PER_SHIFT * shifts_per_axis * shuffles_per_shift(block) for block in blocks)


def _estimate(traffic: float, lanes: int, window_ops: int, run_bytes: int, target: Target) -> tuple:
    """Model seconds (DRAM bytes, a run shorter than a sector moving the whole sector, against
    lane operations over every SM, whichever is longer) and their sum, which breaks ties between
    tiles equal on the longer one toward the one lighter on the other."""
    efficiency = min(1.0, run_bytes / SECTOR_BYTES)
    memory = traffic / efficiency / target.bandwidth
    compute = lanes * (BASE_OPS_PER_LANE + window_ops) / (LANE_OPS_PER_SM_SECOND * target.sms)
    return max(memory, compute), memory + compute


@dataclass(frozen=True)
class _Layout:
    """What ranking needs of a group besides the target: x, the axes, the window's cost."""

    x: object
    axes: tuple
    batch_axes: tuple
    inner_axes: tuple
    reach: tuple
    window_on_cols: bool
    backward: bool
    read: int  # bytes of the group's inputs, each read once
    traffic: int  # and of its outputs
    shifts: int  # shifted copies a tile's window sums take (as many along each windowed axis)
    size: int = 1  # the window's positions along each windowed axis


def inner_batch_axes(tensors, x_dims: tuple, batch_axes: tuple) -> tuple:
    """The longest run of trailing batch axes that every tensor walks as one axis (merged_stride).
    A program's batch block tiles that run alone, so its index is an arange from a multiple of
    the block, whose contiguity Triton can prove (a flat index split by div and mod over axes
    whose extents are no multiple of 16 loses it: scalar loads down a column, 7% of copy for NCHW
    LRN on the H200), and the rest of the batch axes are one value per program."""
    for start in range(len(batch_axes)):
        run = batch_axes[start:]
        sizes = tuple(x_dims[a] for a in run)
        strides = [operand_strides(x_dims, t.dim, t.stride) for t in tensors]
        if all(merged_stride(sizes, tuple(s[a] for a in run)) is not None for s in strides):
            return run
    return ()


def _layout(group, window_axes_: tuple) -> _Layout:
    anchor = group.anchor
    backward = anchor.op.endswith("_backward")
    x = anchor.inputs[1] if backward else anchor.inputs[0]
    size, rank = anchor.attrs.size, len(x.dim)
    by_stride = lambda axes: tuple(sorted(axes, key=lambda a: (-x.stride[a], a)))  # outermost first
    axes = by_stride(window_axes_)
    batch_axes = by_stride(a for a in range(rank) if a not in window_axes_)
    read = sum(_numel(t.dim) * t.data_type.itemsize for t in group.inputs)
    tensors = list(group.inputs) + list(group.outputs)
    return _Layout(x, axes, batch_axes, inner_batch_axes(tensors, tuple(x.dim), batch_axes),
                   tuple(window_reach(size, backward) for _ in axes),
                   column_axis(x) in axes, backward, read,
                   read + sum(_numel(t.dim) * t.data_type.itemsize for t in group.outputs),
                   shift_count(size) * len(axes) * (2 if backward else 1), size)


def _candidates(layout: _Layout) -> list:
    """(how the window sums are made, reach per windowed axis, window operations per lane, None
    where they follow the blocks) of
    each way the group may take: shifted register copies over a halo tile, and for a forward
    window of at most LOADS_MAX_POINTS positions a load of x per window offset (no halo)."""
    found = [("gather", layout.reach, None)]  # gather_operations, per block
    points = _numel(sum(r) + 1 for r in layout.reach)
    if not layout.backward and points <= LOADS_MAX_POINTS:
        found.append(("loads", tuple((0, 0) for _ in layout.reach), OPS_PER_LOAD * points))
    return found


def _ranked(layout: _Layout, target: Target, max_tile: int) -> list:
    """Every config within `max_tile` elements, best first by the model: those whose tiles a
    thread holds without spilling first."""
    x, axes = layout.x, layout.axes
    inner = _numel(x.dim[a] for a in layout.inner_axes)
    outer = _numel(x.dim[a] for a in layout.batch_axes) // inner
    ranked = []
    for window_by, reach, window_ops in _candidates(layout):
        halo = sum(reach[0])
        for blocks in itertools.product(*[_block_choices(x.dim[a], halo) for a in axes]):
            window = _numel(blocks)
            if window > max_tile:
                continue
            owned = tuple(b - halo for b in blocks)
            window_lanes = _numel(-(-x.dim[a] // own) * b for a, own, b in zip(axes, owned, blocks))
            # halo positions inside x are read again by the neighbouring program
            reread = _numel(loaded_positions(x.dim[a], b, own, before) / x.dim[a]
                            for a, b, own, (before, _) in zip(axes, blocks, owned, reach))
            lane_ops = window_ops if window_ops is not None else gather_operations(blocks, layout.shifts // len(axes))
            batch_block = 1
            while window * batch_block <= max_tile:
                tile = window * batch_block
                warps = tile_warps(blocks, batch_block)
                # a last resort only (a 3-D 5x5x5 backward's smallest halo tile is 16^3 lanes)
                spills = tile > max(MIN_TILE_ELEMENTS, LANES_PER_WARP * warps * MAX_ELEMENTS_PER_THREAD)
                lanes = window_lanes * outer * -(-inner // batch_block) * batch_block
                run = _contiguous_run(layout.window_on_cols, owned, axes, inner, x, batch_block)
                seconds = _estimate(layout.traffic + layout.read * (reread - 1), lanes, lane_ops,
                                    run * x.data_type.itemsize, target)
                small = tile < MIN_TILE_ELEMENTS and batch_block < inner
                config = LrnConfig(blocks, batch_block, warps, seconds[0] * 1e6, window_by)
                # ties go to longer contiguous runs (whole lines), then to larger tiles
                ranked.append(((spills, small) + seconds + (-run, -tile), config))
                if batch_block >= inner:
                    break
                batch_block *= 2
    ranked.sort(key=lambda item: item[0])
    return [config for _, config in ranked]


def program_registers(config: LrnConfig, backward: bool) -> int:
    """Model registers a thread of one program takes (allocated 8 at a time): its share of each
    live tile, and the indices and masks besides."""
    per_thread = -(-_numel(config.window_blocks) * config.batch_block // (LANES_PER_WARP * config.num_warps))
    return min(MAX_REGISTERS, -(-(BASE_REGISTERS + LIVE_TILES[backward] * per_thread) // 8) * 8)


def pipeline_shared_bytes(config: LrnConfig, operand_bytes: int, stages: int) -> int:
    """Shared memory a persistent program's pipelined loads take: a tile buffer per loaded
    operand for each stage ahead (Triton 3.6 allocates stages - 1 of them per load)."""
    return (stages - 1) * _numel(config.window_blocks) * config.batch_block * operand_bytes


def pipeline_depth(config: LrnConfig, backward: bool, operand_bytes: int, target: Target) -> tuple:
    """(stages, programs one SM of `target` holds at once): residents by threads, the model's
    registers and the stages' shared memory; the fewest stages whose loads in flight cover the
    SM's bandwidth-latency product, or the deepest that shared memory holds."""
    threads = LANES_PER_WARP * config.num_warps
    by_threads = target.threads_per_sm // threads
    by_registers = target.registers // (program_registers(config, backward) * threads)
    fits = max(1, min(MAX_PROGRAMS_PER_SM, by_threads, by_registers))
    wanted = target.bandwidth / target.sms * LOAD_LATENCY
    best = (MIN_STAGES, 1)
    for stages in range(MIN_STAGES, MAX_STAGES + 1):
        per_program = pipeline_shared_bytes(config, operand_bytes, stages)
        resident = min(fits, target.shared_memory // per_program)
        if resident < 1:
            break
        best = (stages, resident)
        if resident * per_program >= wanted:
            break
    return best


def column_axis(x) -> int:
    """x's smallest-stride axis of more than one position (the tile's columns hold it)."""
    sized = [a for a in range(len(x.dim)) if x.dim[a] > 1] or [len(x.dim) - 1]
    return min(sized, key=lambda a: (x.stride[a], -a))


def async_copyable(group, layout: "_Layout", config: LrnConfig, reach: tuple) -> bool:
    """Whether every tile load can become a cp.async copy: each operand's runs along the
    columns contiguous and starting on an ASYNC_COPY_BYTES boundary the compiler can prove
    (every other axis's stride a known multiple of 16, the column index's start a multiple)."""
    x, column = layout.x, column_axis(layout.x)
    merged_away = set(layout.inner_axes) - {([a for a in layout.inner_axes if x.dim[a] > 1] or layout.inner_axes)[-1]}
    if layout.window_on_cols:  # the innermost windowed axis: tile * owned - before + lane (+ offsets)
        before = reach[-1][0]
        starts = [config.window_blocks[-1] - before - reach[-1][1], before]
        if config.window_by == "loads":
            starts += range(-(layout.size // 2), (layout.size - 1) // 2 + 1)
    else:  # a block of the merged inner batch axes
        starts = [config.batch_block]
    for tensor in group.inputs:
        need = max(1, ASYNC_COPY_BYTES // tensor.data_type.itemsize)
        if need == 1:
            continue
        strides = operand_strides(tuple(x.dim), tensor.dim, tensor.stride)
        others = [s for a, s in enumerate(strides) if a != column and a not in merged_away and s]
        if strides[column] != 1 or any(s % KNOWN_DIVISIBILITY for s in others) or any(v % need for v in starts):
            return False
    return True


@dataclass(frozen=True)
class FormChoice:
    """The schedule's form: persistent or not, its grid, and why."""

    persistent: bool
    grid: int
    reason: str


def choose_form(tiles: int, depth: tuple, copyable: bool, target: Target, form=None, programs=None) -> FormChoice:
    """One tile a program, or a persistent grid of every program the SMs hold at once
    (`depth`: stages, programs an SM), by the model (loads that become cp.async copies, and
    PERSISTENT_MIN_TILES tiles a program) unless `form` ("tile" | "persistent") or a grid of
    `programs` is forced (BuildOptions.lrn_schedule, lrn_programs)."""
    stages, resident = depth
    slots = target.sms * resident
    grid = min(tiles, programs or slots)
    forced = form is not None or programs is not None
    if form == "tile":
        return FormChoice(False, 0, "one tile a program (forced)")
    if not forced and not PERSISTENT_BY_MODEL:
        return FormChoice(False, 0, "one tile a program (the persistent loop measured slower on the H200: "
                                    "heuristics/lrn.py PERSISTENT_BY_MODEL)")
    if not forced and not copyable:
        return FormChoice(False, 0, "one tile a program (loads the compiler cannot prove aligned for cp.async: "
                                    "nothing would be in flight)")
    if not forced and tiles < PERSISTENT_MIN_TILES * slots:
        return FormChoice(False, 0, f"one tile a program ({tiles} tiles are fewer than {PERSISTENT_MIN_TILES} a "
                                    f"program over {slots} resident, {resident} an SM: a loop's pipeline would "
                                    f"not fill)")
    why = "forced" if forced else f"{tiles} tiles, at least {PERSISTENT_MIN_TILES} a program, loads cp.async-aligned"
    return FormChoice(True, grid, f"persistent: {grid} programs ({resident} an SM) walk {tiles} tiles in a "
                                  f"{stages}-stage tl.range, the next tiles' loads in flight during this one's "
                                  f"math ({why})")


def schedule(group, target: Target, window_axes_: tuple, max_tile: int = MAX_TILE_ELEMENTS, form=None,
             programs=None) -> LrnSchedule:
    """Tile layout and the best-ranked config on `target` of a windowed normalization group,
    whose tiles hold at most `max_tile` elements (BuildOptions.lrn_tile_elements), in the form
    choose_form picks (`form` and `programs` force it: BuildOptions.lrn_schedule, lrn_programs)."""
    anchor, layout = group.anchor, _layout(group, window_axes_)
    x, axes, reach = layout.x, layout.axes, layout.reach
    names = AXIS_NAMES[len(x.dim)]
    ranked = _ranked(layout, target, max_tile)
    if not ranked:
        raise UnsupportedError(f"node {anchor.name!r} ({anchor.op}): a window of size {anchor.attrs.size} over "
                               f"{''.join(names[a] for a in axes)} needs a tile of more than {max_tile} "
                               f"elements with its halo of {sum(reach[0])} positions an axis: too large")
    best = ranked[0]
    reach = dict((by, r) for by, r, _ in _candidates(layout))[best.window_by]
    tensors = list(group.inputs) + list(group.outputs)
    span = max(sum((d - 1) * s for d, s in zip(t.dim, t.stride)) + 1 for t in tensors)
    index_64 = max(span, _numel(x.dim)) + max_tile > INT32_LIMIT
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us at {target.bandwidth / 1e12:.1f} TB/s "
              f"for {layout.traffic} bytes; halo {reach[0][0]} before and {reach[0][1]} after the owned box "
              f"along {''.join(names[a] for a in axes)}, " +
              (f"x loaded once per program, {layout.shifts} shifted copies (tl.gather) for its window sums"
               if best.window_by == "gather" else "x loaded once per window offset for its window sums"))
    tiled = LrnSchedule(anchor.op.endswith("_backward"), axes, layout.batch_axes, layout.inner_axes, reach,
                        layout.window_on_cols,
                        tuple(x.dim), index_64, frozenset(t.uid for t in group.inputs), best, len(ranked), reason)
    # a load per window offset stages each offset's tile
    loads = layout.size ** len(axes) if best.window_by == "loads" else 1
    operand_bytes = loads * sum(t.data_type.itemsize for t in group.inputs)
    depth = pipeline_depth(best, layout.backward, operand_bytes, target)
    choice = choose_form(tiled.tiles, depth, async_copyable(group, layout, best, reach), target, form, programs)
    return replace(tiled, persistent=choice.persistent, grid=choice.grid,
                   stages=depth[0] if choice.persistent else 1, reason=f"{reason}; {choice.reason}")
