"""Depthwise convolution: which convs the direct kernels take, and their tile configs.

Routing. A conv whose groups each hold one input channel (groups == C of x in fprop and wgrad,
of dx in dgrad) and at most MAX_MULTIPLIER filters runs on direct kernels: on the implicit GEMM
such a conv has a reduction of `taps` values padded to a 16-wide k step per tap and at most a
few GEMM columns, so tensor cores idle on padding (about 2% of cuDNN on the H100).

Two models, one per kernel shape:

  gather (fprop, dgrad)  a tile [BLOCK_R, BLOCK_C] of the output (y, or dx): columns walk the
        axis where the gathered tensor (x, or dy) has its smallest stride (channels in NHWC, so
        loads vectorize along C; the last spatial axis in NCHW), rows decompose the others; or,
        merged, the columns run over that axis and the next as one memory run (w and c in NHWC
        at stride 1), so a row segment is long whatever C is. Each tap is one masked tile load
        (L1 hits after the first tap) and one multiply-add an element.
  wgrad  a tile [BLOCK_P pixels, BLOCK_T taps, BLOCK_C channels] accumulated over a split's
        range of pixels (n, output position); each split stores its partial sums and a combine
        kernel adds the SPLITS partials in order (bitwise reproducible), then runs the epilogue.

Each model is a roofline over DRAM traffic (the group's tensors once) and L1 traffic (every tap
load, charged in 128-byte lines), at the share of bandwidth the resident programs' loads in
flight can draw: residency comes from registers, fitted to ptxas for sm_90. The bandwidth figures
are assumptions not yet timed: benchmarks/sweep_depthwise.py times the tile grid on a GPU against
cuDNN and prints the model's rank of each config, the data to calibrate them with.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ....target import Target
from .pointwise import pow2_at_least
from ....runtime.tuning_cache import record_choice, record_field, record_int

# Filters per channel the direct kernels take. Depthwise layers in use have 1 (MobileNet,
# EfficientNet, ConvNeXt) or 2; dgrad unrolls the multiplier's filters inside the taps (M x taps
# loads of dy per dx tile), so past 4 the unrolled body grows long for a rare case.
MAX_MULTIPLIER = 4

# --- assumptions of both models (H100 SXM; not yet timed, see the module docstring) ---------------
# L1 returns one 128-byte line a clock per SM (a warp's load costs the lines it touches), at about
# 1.75 GHz under load.
L1_BYTES_PER_SM = 128 * 1.75e9
SECTOR_BYTES = 32
LINE_BYTES = 128
MAX_PROGRAMS_PER_SM = 32
# Bandwidth needs bytes in flight (Little's law): an SM's share of DRAM bandwidth times the loaded
# latency, assumed 1 us, about 23 KB an SM on the H100. Fewer resident loads draw a share.
DRAM_LATENCY = 1.0e-6
# Fixed cost of a launch: the first loads' latency and the last programs' drain (assumed).
RAMP_OVERHEAD = 2.0e-6

# --- gather tiles (fprop, dgrad) -----------------------------------------------------------------
# Elements per tile; warps give each thread 8 or 16 of them (one or two 16-byte bf16 vectors).
# The grid of tiles the model ranks; which one runs is the model's choice (not yet timed).
GATHER_TILE_ELEMENTS = (512, 1024, 2048, 4096)
GATHER_ELEMENTS_PER_THREAD = 16
# Registers a thread holds: the unrolled innermost filter axis keeps its loads in flight together,
# so they grow with values a thread x taps of that axis. A least-squares fit to ptxas -v for sm_90
# (Triton 3.6; tests/sm90_compile.py) over 90 tiles of the three benchmark layers (fprop, dgrad;
# plain and merged), within 24 registers: 3x3 at 4, 8, 16 values a thread 40, 52-59, 86-105;
# 7x7 at 4, 8, 16: 67-76, 84-101, 140-182.
GATHER_REGISTER_BASE = 36
GATHER_REGISTERS_PER_VALUE = 1.14
MIN_BLOCK_COLS = 8  # 16 bytes of bf16 along the vector axis: one vectorized load a row segment
MAX_BLOCK_COLS = 128
MAX_MERGED_COLS = 512  # merged columns: one run of the gathered tensor, 1 KB of bf16
# Merged columns along channels read each tap's filter row of every channel (then gather it by
# column): past this many channels that row outweighs the tile.
MAX_MERGED_CHANNELS = 1024

# --- wgrad tiles ---------------------------------------------------------------------------------
WGRAD_BLOCK_PIXELS = (16, 32, 64, 128)
WGRAD_BLOCK_TAPS = (1, 2, 4, 8, 16)
WGRAD_MAX_ELEMENTS = 8192  # accumulator [P, T, C] in fp32: 32 registers a thread at 8 warps
WGRAD_ELEMENTS_PER_THREAD = 32
# Registers: the accumulator and one x tile, fp32 (ptxas sm_90 over 10 tiles of the benchmark
# layers at 32 values a thread: 95-116 registers).
WGRAD_REGISTER_BASE = 22
WGRAD_REGISTERS_PER_VALUE = 2.5
# Programs the splits aim for: a few waves of resident programs, so the last wave's tail is short
# while partials stay a small fraction of the traffic.
WGRAD_TARGET_PROGRAMS_PER_SM = 4
# Pixels a split covers at least: below this a program's setup and partial store outweigh its
# loads (and tiny problems stay one split).
WGRAD_MIN_SPLIT_PIXELS = 512
# The combine kernel: one element of dw per lane, the splits added in order.
COMBINE_BLOCK = 256
COMBINE_WARPS = 4


def routes(channels_per_group: int, filters_per_group: int) -> bool:
    """Does a conv with these groups run on the depthwise kernels?"""
    return channels_per_group == 1 and 1 <= filters_per_group <= MAX_MULTIPLIER


@dataclass(frozen=True)
class DepthwiseConfig:
    kernel: str  # "gather" (fprop, dgrad) | "wgrad"
    block_rows: int  # gather: output positions; wgrad: pixels per step
    block_cols: int  # gather: the vector axis; wgrad: channels
    num_warps: int
    block_taps: int = 1  # wgrad: filter taps per program
    splits: int = 1  # wgrad: pixel ranges summed apart, then combined in order
    merge: bool = False  # gather: columns run over the vector axis and the next one (one memory run)
    estimate_us: float = 0.0

    @property
    def text(self) -> str:
        if self.kernel == "wgrad":
            return (f"wgrad {self.block_rows}x{self.block_taps}x{self.block_cols} warps={self.num_warps} "
                    f"SPLITS={self.splits}")
        merged = " merged" if self.merge else ""
        return f"gather {self.block_rows}x{self.block_cols} warps={self.num_warps}{merged}"

    def to_record(self) -> dict:
        return {"kernel": self.kernel, "block_rows": self.block_rows, "block_cols": self.block_cols,
                "num_warps": self.num_warps, "block_taps": self.block_taps, "splits": self.splits,
                "merge": self.merge}

    @staticmethod
    def from_record(record: dict) -> "DepthwiseConfig":
        """The config a tuning-cache record holds; ValueError for anything out of range."""
        block = lambda name, high: record_int(record, name, 1, high, power_of_two=True)
        return DepthwiseConfig(record_choice(record, "kernel", ("gather", "wgrad")), block("block_rows", 4096),
                               block("block_cols", 4096), block("num_warps", 8), block("block_taps", 64),
                               record_int(record, "splits", 1, 1 << 20),
                               record_field(record, "merge", bool, False))


@dataclass(frozen=True)
class GatherProblem:
    """What the gather model knows of one fprop or dgrad (plain data; the tuning key)."""

    op: str
    rows: int  # output positions along the tile's row axes
    cols: int  # along its vector axis
    taps: int
    loads_per_tap: int  # 1 in fprop, the multiplier in dgrad (dx sums the filters of a channel)
    item_bytes: int  # of the gathered tensor
    run_step: float  # elements of the gathered tensor one step along the vector axis moves
                     # (1 contiguous; a conv stride; 1/M for channels shared by M filters)
    contiguous: bool  # the vector axis has stride 1 in the gathered tensor
    traffic: int  # bytes of every tensor the group reads or writes, once
    merged_cols: int = 0  # columns when the next axis merges in (0: it cannot; see lower/depthwise.py)
    inner_taps: int = 1  # taps of the innermost filter axis: the unrolled loop
    epilogue: str = ""

    def signature(self) -> str:
        return (f"{self.op} r{self.rows} c{self.cols} m{self.merged_cols} t{self.taps} l{self.loads_per_tap} "
                f"b{self.item_bytes} s{self.run_step:g} {'contiguous' if self.contiguous else 'strided'} "
                f"{self.epilogue}").strip()


@dataclass(frozen=True)
class WgradProblem:
    pixels: int  # N x output positions: the reduction
    channels: int  # K, filters
    taps: int
    item_bytes: int
    channels_contiguous: bool  # dy and x have channel stride 1 (NHWC): loads vectorize along C
    traffic: int
    epilogue: str = ""

    def signature(self) -> str:
        return (f"conv_wgrad p{self.pixels} c{self.channels} t{self.taps} b{self.item_bytes} "
                f"{'nhwc' if self.channels_contiguous else 'strided'} {self.epilogue}").strip()


@dataclass(frozen=True)
class DepthwiseSchedule:
    problem: object
    ranked: tuple
    config: DepthwiseConfig
    reason: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _run_cost(elements: float, item_bytes: int) -> float:
    """Bytes of L1 throughput a warp spends on a run of `elements` contiguous values: one 128-byte
    line a wavefront, a run starting at a random sector touching 1 + (bytes - 32) / 128 lines."""
    run = max(SECTOR_BYTES, elements * item_bytes)
    return (1 + (run - SECTOR_BYTES) / LINE_BYTES) * LINE_BYTES


def programs_per_sm(registers: float, num_warps: int, target: Target) -> int:
    """Resident programs an SM of `target` holds: by threads, by registers (allocated 8 at a
    time), at most 32."""
    allocated = min(255, _cdiv(int(registers + 0.5), 8) * 8)
    by_registers = target.registers // (allocated * 32 * num_warps)
    return max(1, min(MAX_PROGRAMS_PER_SM, target.threads_per_sm // (32 * num_warps), by_registers))


def _roofline(dram_bytes: float, l1_bytes: float, programs: int, per_sm: int, inflight: float,
              target: Target) -> float:
    """Seconds on `target`: the slower of DRAM and L1, at the share of bandwidth the resident programs' loads
    in flight (`inflight` bytes a program) can draw, stretched by the last wave's unfilled slots,
    plus a fixed ramp."""
    slots = target.sms * per_sm
    resident = min(programs, slots)
    needed = target.bandwidth / target.sms * DRAM_LATENCY
    share = min(1.0, resident * inflight / target.sms / needed)
    quantization = _cdiv(programs, slots) * slots / programs
    busy = max(dram_bytes / target.bandwidth, l1_bytes / (target.sms * L1_BYTES_PER_SM))
    return busy / share * quantization + RAMP_OVERHEAD


# --- gather --------------------------------------------------------------------------------------
def _layouts(problem: GatherProblem) -> list:
    """(merge, rows, cols) of the tile spaces a gather can walk."""
    spaces = [(False, problem.rows, problem.cols)]
    if problem.merged_cols:
        spaces.append((True, problem.rows * problem.cols // problem.merged_cols, problem.merged_cols))
    return spaces


def gather_candidates(problem: GatherProblem) -> list[DepthwiseConfig]:
    found = {}
    for merge, rows, cols in _layouts(problem):
        cap = min(pow2_at_least(cols), MAX_BLOCK_COLS if not merge else MAX_MERGED_COLS)
        widths = sorted({cap} | {w for w in (8, 16, 32, 64, 128, 256, 512) if MIN_BLOCK_COLS <= w <= cap})
        rows_cap = pow2_at_least(rows)
        for block_cols in widths:
            for tile in GATHER_TILE_ELEMENTS:
                block_rows = max(1, min(rows_cap, tile // block_cols))
                elements = block_rows * block_cols
                warps = max(1, min(8, elements // (32 * GATHER_ELEMENTS_PER_THREAD)))
                for num_warps in {warps, min(8, 2 * warps)}:
                    if num_warps * 32 <= elements or num_warps == 1:
                        config = DepthwiseConfig("gather", block_rows, block_cols, num_warps, merge=merge)
                        found.setdefault(config.text, config)
    return list(found.values())


def gather_estimate(config: DepthwiseConfig, problem: GatherProblem, target: Target) -> float:
    rows, cols = problem.rows, problem.cols
    step, contiguous = problem.run_step, problem.contiguous
    if config.merge:  # one run along the merged columns (stride 1, one filter per channel)
        rows, cols, step, contiguous = rows * cols // problem.merged_cols, problem.merged_cols, 1.0, True
    row_tiles, col_tiles = _cdiv(rows, config.block_rows), _cdiv(cols, config.block_cols)
    programs = row_tiles * col_tiles
    if contiguous:  # a row segment of BLOCK_C outputs reads a run of the gathered tensor
        per_segment = _run_cost(config.block_cols * step, problem.item_bytes)
    else:  # every element its own line
        per_segment = config.block_cols * LINE_BYTES
    l1 = problem.taps * problem.loads_per_tap * row_tiles * config.block_rows * col_tiles * per_segment
    in_flight = config.block_rows * config.block_cols * problem.inner_taps  # values of one unrolled row
    registers = GATHER_REGISTER_BASE + GATHER_REGISTERS_PER_VALUE * in_flight / (32 * config.num_warps)
    per_sm = programs_per_sm(registers, config.num_warps, target)
    return _roofline(problem.traffic, l1, programs, per_sm, in_flight * problem.item_bytes, target)


# --- wgrad ---------------------------------------------------------------------------------------
def wgrad_splits(problem: WgradProblem, block_pixels: int, block_taps: int, block_cols: int,
                 target: Target) -> int:
    """Pixel ranges that bring the grid to WGRAD_TARGET_PROGRAMS_PER_SM programs an SM of `target`."""
    tiles = _cdiv(problem.channels, block_cols) * _cdiv(problem.taps, block_taps)
    most = max(1, problem.pixels // max(block_pixels, WGRAD_MIN_SPLIT_PIXELS))
    return max(1, min(most, _cdiv(target.sms * WGRAD_TARGET_PROGRAMS_PER_SM, tiles)))


def wgrad_candidates(problem: WgradProblem, target: Target) -> list[DepthwiseConfig]:
    channel_cap = min(pow2_at_least(problem.channels), MAX_BLOCK_COLS)
    widths = sorted({channel_cap} | {w for w in (8, 16, 32, 64) if w <= channel_cap})
    tap_cap = pow2_at_least(problem.taps)
    found = {}
    for block_cols in widths:
        for block_taps in (t for t in WGRAD_BLOCK_TAPS if t <= tap_cap):
            for block_pixels in WGRAD_BLOCK_PIXELS:
                elements = block_pixels * block_taps * block_cols
                if elements > WGRAD_MAX_ELEMENTS or elements < 32:
                    continue
                warps = max(1, min(8, elements // (32 * WGRAD_ELEMENTS_PER_THREAD)))
                splits = wgrad_splits(problem, block_pixels, block_taps, block_cols, target)
                config = DepthwiseConfig("wgrad", block_pixels, block_cols, warps, block_taps, splits)
                found.setdefault(config.text, config)
    return list(found.values())


def wgrad_estimate(config: DepthwiseConfig, problem: WgradProblem, target: Target) -> float:
    channel_tiles = _cdiv(problem.channels, config.block_cols)
    tap_blocks = _cdiv(problem.taps, config.block_taps)
    chunks = _cdiv(problem.pixels, config.block_rows)
    programs = channel_tiles * tap_blocks * config.splits
    if problem.channels_contiguous:
        per_row = _run_cost(config.block_cols, problem.item_bytes)
    else:  # consecutive pixels are contiguous: each channel a run of BLOCK_P
        per_row = config.block_cols * _run_cost(config.block_rows, problem.item_bytes) / config.block_rows
    steps = chunks * channel_tiles * tap_blocks
    l1 = steps * config.block_rows * per_row * (1 + config.block_taps)  # dy once, x at every tap
    padded_taps = tap_blocks * config.block_taps
    partials = 2 * 4 * config.splits * padded_taps * channel_tiles * config.block_cols
    dram = problem.traffic + partials + (tap_blocks - 1) * problem.traffic / 2  # dy again per tap block
    values = config.block_rows * config.block_taps * config.block_cols
    registers = WGRAD_REGISTER_BASE + WGRAD_REGISTERS_PER_VALUE * values / (32 * config.num_warps)
    per_sm = programs_per_sm(registers, config.num_warps, target)
    in_flight = (values + config.block_rows * config.block_cols) * problem.item_bytes  # x and dy of a step
    return _roofline(dram, l1, programs, per_sm, in_flight, target)


# --- schedules -----------------------------------------------------------------------------------
def _ranked(configs, estimate, problem, target) -> list[DepthwiseConfig]:
    timed = [replace(c, estimate_us=estimate(c, problem, target) * 1e6) for c in configs]
    # ties: the larger tile (neighbouring taps share more of their loads in L1), then more warps
    timed.sort(key=lambda c: (round(c.estimate_us, 2), -c.block_rows * c.block_cols * c.block_taps, -c.num_warps))
    return timed


def schedule(problem, target: Target, forced: Optional[DepthwiseConfig] = None) -> DepthwiseSchedule:
    """The model's choice on `target` for a GatherProblem or WgradProblem, with the ranked list;
    `forced` runs whatever the model says where it is a config of this problem's kernel."""
    if isinstance(problem, WgradProblem):
        ranked = _ranked(wgrad_candidates(problem, target), wgrad_estimate, problem, target)
    else:
        ranked = _ranked(gather_candidates(problem), gather_estimate, problem, target)
    best = ranked[0]
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us for {problem.traffic} bytes "
              f"(~{problem.traffic / max(best.estimate_us, 1e-3) / 1e6:.2f} TB/s) over {problem.taps} taps; "
              f"depthwise (one channel per group) runs direct, not as an implicit GEMM")
    if forced is not None and forced.kernel == best.kernel:
        ranked.insert(0, forced)
        reason = f"forced by BuildOptions.depthwise_config over the {best.text} of " + reason
        best = forced
    return DepthwiseSchedule(problem, tuple(ranked), best, reason)
