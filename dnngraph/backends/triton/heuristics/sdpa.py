"""Configs for the flash-attention forward kernel: query tile, key tile, warps and stages.

One program owns BLOCK_M query rows of one (batch, head) and walks the visible key blocks of
BLOCK_N keys, keeping the running max, the running sum and the output accumulator on chip. The
tile sizes trade the accumulator's registers ([BLOCK_M, Dv] fp32) and the shared memory of the
pipelined K/V tiles (stages x BLOCK_N x (D + Dv) x 2 bytes) against the work per key block.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Optional

from ....errors import UnsupportedError
from ....target import CUDA_GRID_LIMITS, H200, Target, laid_out
from .mma import fitting_warps, has_wgmma
from .pointwise import pow2_at_least

# (head dim at most, BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs on a GPU, first
# for unmasked attention, then for masked (causal, bands). Chosen on the H100 (.dbg sweeps, bf16 /
# fp16, TFLOP/s of the best / of the runner-up), re-timed after the fully visible blocks moved the
# scale into the row max and one multiply-add (.dbg/ws_probe.py): D64 B8 H16 S2048: [128, 64]
# 8 warps 3 stages 409 full ([128, 64] 4 warps 406, [64, 64] 4 warps 377), [64, 64] 4 warps 320
# causal ([128, 64] 4 warps 293); D128 B4 H32 S4096: [128, 128] 8 warps 466-481 full ([128, 64]
# 438), [128, 64] 8 warps 3 stages 424 causal ([128, 128] 409) and 424 GQA 32:8 causal; D256 B2
# H16 S4096: [128, 64] 8 warps 2 stages 485 (3 stages need 256 KiB of shared memory, [64, 64]
# 381, [128, 32] 334). Causal D128 again after the grid interleaved 8 heads' tiles (below),
# through do_bench (L2 flushed between runs; bench_attention.py --rows fwd --only causal, TFLOP/s
# of [128, 64] 8 warps / [64, 64] 4 warps): B4 H32 S4096 439 / 395, B1 H16 S16384 439 / 382, B4
# H32:8 S4096 425 / 391. (Back to back, L2 warm, [64, 64] won B1 H32:8 S4096 by 10%: 284 us
# against 315; a model's other kernels leave L2 cold, as do_bench does.)
GPU_TILES = {False: ((64, 128, 64, 8, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 2)),
             True: ((64, 64, 64, 4, 3), (128, 128, 64, 8, 3), (256, 128, 64, 8, 2))}
# 32-bit inputs hold twice the bytes per tile: one step smaller key tiles. IEEE fp32 dots run on
# the FMA units and want warps more than tiles: B2 H16 S2048 D128 causal on the H100
# (.dbg/fp32_probe.py, TFLOP/s): [64, 32] 8 warps 2 stages 7.8, [64, 32] 4 warps 3.6, [32, 64]
# 4 warps 3.8, [64, 64] 4-8 warps 0.7-1.1. (3xTF32 dots, tf32x3, ran 22.6-25.3 at the same
# error, 4.5e-7; the precision rule says IEEE, so they are not used.)
GPU_TILES_FP32 = ((64, 64, 64, 4, 2), (128, 64, 32, 8, 2), (256, 64, 16, 4, 2))
# The interpreter runs every program on the CPU in numpy: small tiles keep tests quick.
INTERPRETER_TILE = (16, 16, 1, 1)
# Queries per program for short query sequences (decode, Sq <= 16): the tile is never wider
# than the query rows that exist (tl.dot needs 16 rows at least).
MIN_BLOCK_M = 16
# The widest head dim the GPU tables cover: a padded 512-wide q tile and accumulator would not
# fit one block's registers and shared memory (the interpreter runs any width).
MAX_GPU_HEAD_DIM = 256
# Decode (few query rows): one program per K/V head holds every query row of its GROUP query
# heads (GQA packing: K/V read once, tl.dot on GROUP x Sq rows), when they fit one tile.
DECODE_MAX_ROWS = 64
DECODE_MAX_SQ = 16
# Keys per step of a decode program: [64, 128] bf16 K and V tiles, 3 stages in flight (assumed,
# not yet swept); D 256 halves it.
DECODE_TILE = {128: (64, 4, 3), 256: (32, 4, 2)}
# Split the keys when there are fewer decode programs than this many per SM (one wave of one
# program per SM walking 8192 keys each leaves the memory system idle at the start and end of
# the wave); each split keeps at least this many key blocks.
DECODE_PROGRAMS_PER_SM = 2
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 64
COMBINE_ROWS = 16  # query rows per program of the split combine


# The forward's model: the rate each shape class (problems/attention.py forward_shape_class: head
# dim, mask) ran at, TFLOP/s over the visible pairs, bf16 on an H200 (MEASURED_ON; fp16 runs the
# same dots), BENCHMARKS.md "Gluon attention forward" (the dnngraph Triton column, 2026-11-28).
# Another class has no estimate; another target scales the rate by its peak (measured_seconds).
MEASURED_ON = H200
MEASURED_FORWARD_TFLOPS = {
    (64, "none"): 413,  # B8 H16 S2048 D64
    (128, "none"): 473,  # B4 H32 S4096 D128
    (128, "causal"): 429,  # B4 H32 S4096 D128 causal (GQA 32:8 432, B1 H16 S16384 472)
}
LAUNCH_SECONDS = 3e-6


def measured_seconds(flops: float, tflops: float, dot: str, target: Target) -> float:
    """Seconds of `flops` at a rate measured as `tflops` on MEASURED_ON, on `target` at the same
    fraction of its dense `dot` peak."""
    return flops * MEASURED_ON.peak(dot) / (tflops * 1e12 * target.peak(dot))


def wave_efficiency(programs: int, target: Target) -> float:
    """The fraction of the SMs' time `programs` equal programs keep busy (the last wave partly empty)."""
    waves = -(-programs // target.sms)
    return programs / (waves * target.sms)


def forward_seconds(tflops: float, flops: float, moved_bytes: int, programs: int, dot: str, target: Target) -> float:
    """The forward's model: its flops at a measured rate or its bytes at the bandwidth, whichever
    is longer, over the wave efficiency of its programs, plus a launch."""
    busy = max(measured_seconds(flops, tflops, dot, target), moved_bytes / target.bandwidth)
    return busy / wave_efficiency(programs, target) + LAUNCH_SECONDS


def forward_estimate(shape_class, flops: float, moved_bytes: int, sched: "AttentionSchedule", dot: str,
                     target: Target) -> Optional[float]:
    """Model seconds of the forward schedule `sched` where its shape class was measured
    (MEASURED_FORWARD_TFLOPS; not a decode schedule), else None."""
    tflops = MEASURED_FORWARD_TFLOPS.get(shape_class)
    if tflops is None or sched.packed or target.interpreted:
        return None
    return forward_seconds(tflops, flops, moved_bytes, sched.programs[0] * sched.programs[1], dot, target)


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttentionProblem:
    """What the schedule depends on (plain numbers, no tensors)."""

    batch: int
    heads: int
    kv_heads: int
    s_q: int
    s_kv: int
    head_dim: int
    value_dim: int
    element_bytes: int  # of q/k/v
    masked: bool = False  # a causal mask or a band: the diagonal blocks favour narrower tiles
    side_bytes: int = 0  # bytes per score element read beside q/k/v (a bias, a chain's masks)
    causal: bool = False  # a right bound and no left one: later query rows see more keys
    v_heads: int = 0  # v's head count where it differs from k's (0: the same): no packed decode
    fma_dots: bool = False  # IEEE fp32 dots: the FMA units, no mma layout whose warps could repeat rows


@dataclass(frozen=True)
class AttentionSchedule:
    problem: AttentionProblem
    config: AttentionConfig
    block_d: int  # head dim padded to a power of two (masked loads)
    block_dv: int
    programs: tuple  # grid (query tiles or key splits, batch x heads or batch x K/V heads)
    reason: str
    packed: bool = False  # decode: a K/V head's query heads share one tile
    splits: int = 1
    chunk: int = 0  # keys per split
    head_group: int = 0  # the grid interleaves this many heads' tiles, longest first (0: off): head_group()

    @property
    def config_text(self) -> str:
        c = self.config
        decode = f" packed splits={self.splits} chunk={self.chunk}" if self.packed else ""
        return (f"BLOCK_M={c.block_m} BLOCK_N={c.block_n} BLOCK_D={self.block_d} BLOCK_DV={self.block_dv} "
                f"num_warps={c.num_warps} num_stages={c.num_stages} grid={list(self.programs)}{decode}")

    @property
    def partial_bytes(self) -> int:
        """Workspace of the split partials (o and log-sum-exp per split and query row)."""
        p = self.problem
        return p.batch * p.heads * p.s_q * self.splits * (self.block_dv + 1) * 4 if self.splits > 1 else 0


@dataclass(frozen=True)
class ForcedAttention:
    """What a build forces of the attention kernels (BuildOptions' sdpa fields): the forward's
    tiles, the backward kernels', the decode key splits, the heads a causal grid interleaves."""

    forward: Optional[AttentionConfig] = None
    dkdv: Optional[AttentionConfig] = None
    dq: Optional[AttentionConfig] = None
    splits: Optional[int] = None
    head_group: Optional[int] = None

    @property
    def backward(self) -> dict:
        """The backward kernels' forced configs by kernel ("dkdv", "dq")."""
        return {which: config for which, config in (("dkdv", self.dkdv), ("dq", self.dq)) if config is not None}


def forced_attention(options) -> "ForcedAttention":
    """What a build's options (BuildOptions) force of the attention kernels."""
    o = options
    return ForcedAttention(o.sdpa_config, o.sdpa_dkdv_config, o.sdpa_dq_config, o.sdpa_splits, o.sdpa_head_group)


NOT_FORCED = ForcedAttention()


# fp32 accumulator registers a thread may hold at most on halved warps before a wgmma head dot's
# copies are the cheaper cost: ptxas (sm_90a) spilled at 128 (the bf16 forward at 64 query rows,
# D 256, on 4 warps: 12 bytes, the fp8 one 892) and not at 64 (D 128); 8 warps, the head dot
# computed twice, spilled none (2026-11-29). Timed on the H200, 64 query rows on 4 warps instead of
# 8 ran 1.07-1.32x faster at D 64/128 (benchmarks/sweep_short_queries.py, BENCHMARKS.md)
CROWDED_ACCUMULATOR_REGISTERS = 128


def _accumulators_crowd(rows: int, widths: tuple, num_warps: int) -> bool:
    """Whether fp32 accumulators of `rows` rows and `widths` columns each would crowd a thread's
    registers on half of `num_warps` (see CROWDED_ACCUMULATOR_REGISTERS)."""
    threads = 32 * max(1, num_warps // 2)
    return sum(rows * width for width in widths) // threads >= CROWDED_ACCUMULATOR_REGISTERS


def _warps_filled(config: AttentionConfig, problem: AttentionProblem, rows: int, cols: tuple,
                  target: Target, accumulators: tuple) -> AttentionConfig:
    """`config` on no more warps than its chained dots of `rows` rows fill on `target`
    (heuristics/mma.py): a 32-row query tile on 4 warps laid every warp along the rows, 64 rows
    of warps for 32, on mma.sync (the bf16 forward at Sq 21, Skv 19, D 16 with the H200's
    tiles); without wgmma, so would a 64-row tile on 8 warps, and with it too where the tile's
    head dot (q k^T) feeds another: Triton puts every warp along its rows (a 128-row table tile
    shrunk to 64 query rows kept 8 warps, its scores computed twice). Those copies are kept where
    halving would crowd the registers with the kernel's accumulators (`accumulators`: the widths of
    its [rows, width] fp32 accumulators; the dots filling them are laid out over every warp)."""
    if problem.fma_dots:
        return config
    copies = _accumulators_crowd(rows, accumulators, config.num_warps)
    warps = fitting_warps(rows, cols, config.num_warps, chained=True, wgmma=has_wgmma(target.capability),
                          wgmma_head_copies=copies)
    return dataclasses.replace(config, num_warps=warps)


def _table_entry(problem: AttentionProblem, target: Target) -> AttentionConfig:
    if target.interpreted:
        return AttentionConfig(*INTERPRETER_TILE)
    width = max(problem.head_dim, problem.value_dim)
    table = GPU_TILES[problem.masked] if problem.element_bytes <= 2 else GPU_TILES_FP32
    for limit, block_m, block_n, warps, stages in table:
        if width <= limit:
            return AttentionConfig(block_m, block_n, warps, stages)
    return AttentionConfig(*table[-1][1:])


def _decode_schedule(problem: AttentionProblem, target: Target, budget_bytes,
                     forced: ForcedAttention) -> AttentionSchedule:
    group = problem.heads // problem.kv_heads
    block_m = max(MIN_BLOCK_M, pow2_at_least(group * problem.s_q))
    width = max(problem.head_dim, problem.value_dim)
    block_n, warps, stages = DECODE_TILE[128 if width <= 128 else 256]
    if target.interpreted:
        block_n, warps, stages = INTERPRETER_TILE[1:]
    block_d, block_dv = (max(16, pow2_at_least(d)) for d in (problem.head_dim, problem.value_dim))
    programs = problem.batch * problem.kv_heads
    blocks = -(-problem.s_kv // block_n)
    splits = -(-DECODE_PROGRAMS_PER_SM * target.sms // programs)
    splits = max(1, min(splits, blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))
    splits = forced.splits or splits
    while splits > 1 and budget_bytes is not None and \
            problem.batch * problem.heads * problem.s_q * splits * (block_dv + 1) * 4 > budget_bytes:
        splits //= 2
    chunk = -(-blocks // splits) * block_n
    splits = -(-problem.s_kv // chunk)
    reason = (f"decode: {group} query heads x {problem.s_q} rows packed per K/V head, {programs} programs, "
              f"keys in {splits} split(s) of {chunk}")
    heads = head_group(programs, False, target)  # 0 within grid axis y
    config = _warps_filled(AttentionConfig(block_m, block_n, warps, stages), problem, block_m, (block_n, block_dv),
                           target, (block_dv,))
    return AttentionSchedule(problem, config, block_d, block_dv,
                             grid(splits, programs, heads), reason, True, splits, chunk, head_group=heads)


# Causal masks give the query tiles (the key blocks of dK/dV) unequal work, from one key block to
# all of them: the grid walks (batch, head) fastest and launches the longest tiles first, so the
# short ones fill the last wave (longest-processing-time order).
LONGEST_FIRST_NOTE = "; causal: {} heads' tiles interleaved, the longest first"
# Interleaved heads, measured on the H100 (.dbg/sweep_attn.py, back to back, us of the forward
# [128, 64] tiles / the backward's dK/dV + dQ + delta): B1 H32:8 S4096 D128 causal 0 heads (the
# plain grid: one head's tiles in order, then the next) 357 / 1315, 1 (reversed only) 354 /
# 1304, 4 317 / 1056, 8 315 / 1055, 32 318 / 1043; B4 H32 S4096 1271 / 4324, 1 1274 / 4316, 4
# 1236 / 4290, 8 1241 / 4262, 32 1246 / 4396, 128 1626 / 4970 (every head's K/V at once: out of
# L2). Through do_bench (L2 flushed), 0 / 8 heads, TFLOP/s forward / backward: B4 H32 S4096
# 424 / 439, 313 / 311; B1 H16 S16384 428 / 439, 327 / 325; B4 H32:8 S4096 420 / 425, 304 / 318.
LONGEST_FIRST_HEADS = 8


def head_group(heads: int, longest_first: bool, target: Target, forced: Optional[int] = None) -> int:
    """The heads whose tiles a grid interleaves (a divisor of `heads`; 0: the plain grid): for
    `longest_first` (causal masks) LONGEST_FIRST_HEADS (or `forced`) or the nearest divisor
    below; past grid axis y's limit on `target` of (batch, head) pairs, the least divisor that
    brings the groups within it (`heads` itself at worst)."""
    wanted = forced if forced is not None else LONGEST_FIRST_HEADS
    group = max((g for g in range(1, min(wanted, heads) + 1) if heads % g == 0), default=0) if longest_first else 0
    axis_y = target.max_grid[1]
    if heads // max(group, 1) > axis_y:
        group = next(g for g in range(-(-heads // axis_y), heads + 1) if heads % g == 0)
    return group


def grid(tiles: int, heads: int, group: int) -> tuple:
    """The (axis 0, axis 1) programs of `tiles` per head, `group` heads interleaved."""
    return (group * tiles, heads // group) if group else (tiles, heads)


# A forward config plans for the target's shared memory per block (the H100's 227 KiB). The
# model below counts 224 KiB for [128, 128] D-128 tiles at 3 stages, which compile and run (464
# TFLOP/s); with a bf16 bias and a bool mask tile per stage the op-level softcap chain asked the
# compiler for 256 KiB and failed, which the side bytes now count.


def _shared_bytes(config: AttentionConfig, problem: AttentionProblem, block_d: int, block_dv: int) -> int:
    """Pipelined K, V and side tiles per stage, plus the resident q tile."""
    per_stage = config.block_n * (block_d + block_dv) * problem.element_bytes
    per_stage += config.block_m * config.block_n * problem.side_bytes
    return config.num_stages * per_stage + config.block_m * block_d * problem.element_bytes


def _fit_shared_memory(config, problem, block_d, block_dv, target: Target) -> AttentionConfig:
    """Fewer stages, then narrower key tiles, until the pipelined tiles fit the shared memory of
    `target`."""
    while _shared_bytes(config, problem, block_d, block_dv) > target.shared_memory:
        if config.num_stages > 2:
            config = AttentionConfig(config.block_m, config.block_n, config.num_warps, config.num_stages - 1)
        elif config.block_n > 16:
            config = AttentionConfig(config.block_m, config.block_n // 2, config.num_warps, config.num_stages)
        elif config.num_stages > 1:
            config = AttentionConfig(config.block_m, config.block_n, config.num_warps, 1)
        else:
            break
    return config


def check_head_dims(problem: AttentionProblem, target: Target):
    """UnsupportedError for head dims past the GPU tables."""
    width = max(problem.head_dim, problem.value_dim)
    if not target.interpreted and width > MAX_GPU_HEAD_DIM:
        raise UnsupportedError(f"sdpa: head dims {problem.head_dim}/{problem.value_dim} exceed the "
                               f"{MAX_GPU_HEAD_DIM} the GPU kernels take")


def schedule(problem: AttentionProblem, target: Target, budget_bytes=None,
             forced: ForcedAttention = NOT_FORCED) -> AttentionSchedule:
    """The forward kernel's tiles and grid for `problem` on `target`; `budget_bytes` bounds the
    workspace of split partials (None: no bound); `forced` what the build forces."""
    check_head_dims(problem, target)
    group = problem.heads // problem.kv_heads
    # a packed tile reads one k head and one v head: not where v has its own head count
    if forced.forward is None and problem.s_q <= DECODE_MAX_SQ and group * problem.s_q <= DECODE_MAX_ROWS \
            and not problem.v_heads:
        return _decode_schedule(problem, target, budget_bytes, forced)
    config = forced.forward or _table_entry(problem, target)
    # short query sequences: no wider tile than the rows (16 at least, for tl.dot)
    block_m = min(config.block_m, max(MIN_BLOCK_M, pow2_at_least(problem.s_q)))
    as_forced = forced.forward is not None and block_m == config.block_m
    if block_m != config.block_m:
        config = AttentionConfig(block_m, config.block_n, config.num_warps, config.num_stages)
    block_d, block_dv = (max(16, pow2_at_least(d)) for d in (problem.head_dim, problem.value_dim))
    if forced.forward is None and not target.interpreted:
        config = _fit_shared_memory(config, problem, block_d, block_dv, target)
    if not as_forced:  # a forced config runs as given (as matmul's do) unless its rows were cut
        config = _warps_filled(config, problem, config.block_m, (config.block_n, block_dv), target, (block_dv,))
    tiles, heads = -(-problem.s_q // config.block_m), problem.batch * problem.heads
    group = head_group(heads, problem.causal, target, forced.head_group)
    origin = "BuildOptions.sdpa_config" if forced.forward else "table"
    reason = (f"head dims {problem.head_dim}/{problem.value_dim} -> [{config.block_m} queries, "
              f"{config.block_n} keys] tiles from the {origin} config"
              + (LONGEST_FIRST_NOTE.format(group) if group else ""))
    return AttentionSchedule(problem, config, block_d, block_dv, grid(tiles, heads, group), reason, head_group=group)


# Backward tiles, (head dim at most, dK/dV kernel config, dQ kernel config), each config
# (BLOCK_M queries a step or per program, BLOCK_N keys, num_warps, num_stages); the dK/dV program
# holds two [BLOCK_N, D] fp32 accumulators, the dQ program one [BLOCK_M, D]. Chosen on the H100
# (bf16, .dbg sweep of 7 dK/dV and 6 dQ configs, the other kernel at its default; total us):
# D64 B8 H16 S2048: dK/dV [32, 64] 4 warps 3 stages 1198 full / 737 causal ([64, 128] 4 warps:
# 4260 full, a register cliff, / 742 causal), dQ [64, 64] 4 warps 740 causal (128 x 64 on 8 warps
# 886); D128 B4 H32 S4096: dK/dV [64, 64] 4 warps 7194 full / 4545 causal ([64, 128] 8 warps
# 7452 / 4468), dQ [64, 64] 4 warps 7349 / 4253 ([128, 64] 8 warps 7444 / 4518). D256 halves
# the tiles (two [64, 256] fp32 accumulators already fill the registers).
GPU_BACKWARD_TILES = ((64, (32, 64, 4, 3), (64, 64, 4, 2)), (128, (64, 64, 4, 2), (64, 64, 4, 2)),
                      (256, (32, 64, 8, 1), (64, 32, 8, 1)))
# Causal D128 after the grids interleaved heads (heuristics below), through do_bench (L2 flushed;
# bench_attention.py --rows bwd, TFLOP/s with dK/dV [64, 64] 4 warps 2 stages / [32, 64] 4 warps
# 3 stages / [64, 128] 8 warps 3 stages): B4 H32 S4096 causal 312 / 295 / 320, B1 H16 S16384
# causal 331 / 313 / 344, B4 H32:8 S4096 causal 314 / 319 / 319; unmasked B4 H32 S4096 379 /
# 361 / 367 (so unmasked keeps [64, 64]). Every dK/dV config here spills (255 registers: 150
# spilled at [64, 64] 4 warps, 100 at [64, 128] 8 warps); a dK kernel and a dV kernel apart (one
# accumulator each) measured 681 + 521 us against 889 together, scores as q k^T with k and v as
# B operands 621 against 661 (with an error of 2e-2 at [32, 128] 8 warps: not adopted).
GPU_BACKWARD_TILES_CAUSAL = ((64, (32, 64, 4, 3), (64, 64, 4, 2)), (128, (64, 128, 8, 3), (64, 64, 4, 2)),
                             (256, (32, 64, 8, 1), (64, 32, 8, 1)))
GPU_BACKWARD_TILES_FP32 = ((64, (32, 64, 4, 2), (64, 32, 4, 2)), (128, (32, 64, 4, 1), (64, 32, 4, 1)),
                           (256, (16, 32, 4, 1), (32, 16, 4, 1)))
DELTA_ROWS = 64  # rows of o and dO per program of the delta preprocess (a streaming row sum)


@dataclass(frozen=True)
class BackwardSchedule:
    problem: AttentionProblem
    configs: dict  # "delta" | "dkdv" | "dq" -> AttentionConfig
    block_d: int
    block_dv: int
    reason: str
    bias_dims: tuple = ()  # [B, H, Sq, Skv] of a bias whose gradient is wanted (the dbias kernel)
    head_groups: dict = dataclasses.field(default_factory=dict)  # "dkdv" / "dq" / "delta" -> head_group
    max_grid: tuple = CUDA_GRID_LIMITS  # the target's launch limits per grid axis (x, y, z)

    def programs(self, which: str) -> tuple:
        p, c = self.problem, self.configs[which]
        if which == "dbias":  # a program per [BLOCK_M, BLOCK_N] tile of the bias, per (batch, head)
            b, h, s_q, s_kv = self.bias_dims
            tiles = (-(-s_kv // c.block_n), -(-s_q // c.block_m), b * h)
            return laid_out(tiles, self.folds(which))
        if which == "dkdv":
            tiles, heads = -(-p.s_kv // c.block_n), p.batch * p.kv_heads
        else:
            tiles, heads = -(-p.s_q // c.block_m), p.batch * p.heads
        return grid(tiles, heads, self.head_group(which))

    def head_group(self, which: str) -> int:
        """The interleave the kernel `which` renders (the one its grid was laid out with)."""
        return self.head_groups.get(which, 0)

    def folds(self, which: str) -> bool:
        """Whether the kernel `which` takes its grid folded into axis x: the dbias kernel's query
        tiles or (batch, head) pairs past grid axes y or z (the others group heads instead)."""
        if which != "dbias":
            return False
        b, h, s_q, _ = self.bias_dims
        grid = (1, -(-s_q // self.configs[which].block_m), b * h)
        return not all(count <= limit for count, limit in zip(grid, self.max_grid))

    def config_text(self, which: str) -> str:
        c = self.configs[which]
        return (f"{which}: BLOCK_M={c.block_m} BLOCK_N={c.block_n} BLOCK_D={self.block_d} "
                f"BLOCK_DV={self.block_dv} num_warps={c.num_warps} num_stages={c.num_stages} "
                f"grid={list(self.programs(which))}")


def _backward_shared_bytes(which: str, config: AttentionConfig, problem: AttentionProblem, block_d: int,
                           block_dv: int) -> int:
    """The dK/dV kernel's pipelined q and dO tiles per stage plus its resident K and V tiles; the
    dQ kernel's pipelined K and V tiles plus its resident q and dO tiles. Side tiles (a bias) are
    left out: unlike the forward's, no backward build here has been seen to run out of shared
    memory over them, and every tile of the H100's tables fits its 227 KiB without them."""
    walked, resident = (config.block_m, config.block_n) if which == "dkdv" else (config.block_n, config.block_m)
    per_stage = walked * (block_d + block_dv) * problem.element_bytes
    return config.num_stages * per_stage + resident * (block_d + block_dv) * problem.element_bytes


def _fit_backward(which: str, config: AttentionConfig, problem: AttentionProblem, block_d: int, block_dv: int,
                  target: Target) -> AttentionConfig:
    """Fewer stages, then a narrower walked tile (queries for dK/dV, keys for dQ), until a
    backward kernel's tiles fit the shared memory of `target` (the H100's tables fit its own)."""
    while _backward_shared_bytes(which, config, problem, block_d, block_dv) > target.shared_memory:
        if config.num_stages > 1:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        elif which == "dkdv" and config.block_m > 16:
            config = dataclasses.replace(config, block_m=config.block_m // 2)
        elif which == "dq" and config.block_n > 16:
            config = dataclasses.replace(config, block_n=config.block_n // 2)
        else:
            break
    return config


def _backward_warps_filled(which: str, config: AttentionConfig, problem: AttentionProblem, block_d: int,
                           block_dv: int, target: Target) -> AttentionConfig:
    """A backward kernel's config on the warps its dots fill: the dK/dV kernel's dots have the
    key tile's rows (k q^T, v dO^T, then P^T dO and dS^T q), the dQ kernel's the query tile's.
    Their accumulators: dK and dV, or dQ (the D256 tables' 8 warps on 64 rows keep their head
    dots' copies: halved, two [64, 256] accumulators would take 256 registers a thread)."""
    if which == "dkdv":
        return _warps_filled(config, problem, config.block_n, (config.block_m, block_d, block_dv), target,
                             (block_d, block_dv))
    return _warps_filled(config, problem, config.block_m, (config.block_n, block_d, block_dv), target, (block_d,))


def backward_schedule(problem: AttentionProblem, target: Target, bias_dims: tuple = (),
                      forced: ForcedAttention = NOT_FORCED) -> BackwardSchedule:
    """Tiles of the backward kernels for `problem` on `target` (and of the dbias kernel, which
    walks query and key blocks as the dQ kernel does, when `bias_dims` are given); `forced`
    what the build forces."""
    check_head_dims(problem, target)
    block_d, block_dv = (max(16, pow2_at_least(d)) for d in (problem.head_dim, problem.value_dim))
    if target.interpreted:
        tile = AttentionConfig(*INTERPRETER_TILE)
        configs = {"dkdv": tile, "dq": tile}
    else:
        width = max(problem.head_dim, problem.value_dim)
        table = GPU_BACKWARD_TILES_FP32 if problem.element_bytes > 2 else (
            GPU_BACKWARD_TILES_CAUSAL if problem.causal else GPU_BACKWARD_TILES)
        _, dkdv, dq = next((row for row in table if width <= row[0]), table[-1])
        configs = {"dkdv": AttentionConfig(*dkdv), "dq": AttentionConfig(*dq)}
        configs = {which: _fit_backward(which, config, problem, block_d, block_dv, target)
                   for which, config in configs.items()}
    configs = {which: _backward_warps_filled(which, config, problem, block_d, block_dv, target)
               for which, config in configs.items()}
    configs.update(forced.backward)  # as given, as matmul's forced configs
    if bias_dims:
        configs["dbias"] = configs["dq"]
    rows = INTERPRETER_TILE[0] if target.interpreted else DELTA_ROWS
    configs["delta"] = AttentionConfig(rows, 16, 1 if target.interpreted else 4, 1)
    reason = (f"head dims {problem.head_dim}/{problem.value_dim}: dK/dV [{configs['dkdv'].block_n} keys, "
              f"{configs['dkdv'].block_m} queries a step], dQ [{configs['dq'].block_m} queries, "
              f"{configs['dq'].block_n} keys a step]")
    if forced.backward:
        reason = f"forced by BuildOptions.sdpa_{'/'.join(forced.backward)}_config; " + reason
    groups = {"dkdv": head_group(problem.batch * problem.kv_heads, problem.causal, target, forced.head_group),
              "dq": head_group(problem.batch * problem.heads, problem.causal, target, forced.head_group),
              # the delta rows are equal work: a group only past grid axis y
              "delta": head_group(problem.batch * problem.heads, False, target)}
    if groups["dq"]:
        reason += LONGEST_FIRST_NOTE.format(groups["dq"])
    return BackwardSchedule(problem, configs, block_d, block_dv, reason, tuple(bias_dims), groups, target.max_grid)


# Op-level chains (attention written as ops: the score ops rendered in the kernels, their side
# tensors loaded per tile) hold more live values per score than the plain kernels and want
# smaller tiles. H100, the benchmark's softcap backward (B4 H16 S2048 D128 causal, cap 50,
# .dbg/prof_chain.py, us per kernel): log-sum-exp pass [64, 64] 4 warps 464 ([128, 64] 8 warps
# 542, [128, 128] 8 warps 622); dK/dV [32, 64] 4 warps 1094 ([64, 64] 4 warps 1309, [64, 128]
# 8 warps 1651, [64, 64] 8 warps 2248); dQ [64, 64] 4 warps 852 ([64, 32] 845, [128, 64] 8 warps
# 946). The forward kernel of the chain (same shape, us): [64, 32] 4 warps 645 (the sdpa table's
# [128, 128] 8 warps 735, [64, 64] 4 warps 782, [128, 64] 8 warps 872, [64, 128] 4 warps 1057,
# [64, 64] 4 warps 3 stages 1223). 16-bit operands up to head dim 128; wider or 32-bit chains
# take the sdpa tables.
GPU_CHAIN_TILES = {"forward": (64, 32, 4, 2), "lse": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 64, 4, 2)}
GPU_CHAIN_MAX_WIDTH = 128


def _chain_tiles(problem: AttentionProblem, target: Target) -> bool:
    return (not target.interpreted and problem.element_bytes <= 2
            and max(problem.head_dim, problem.value_dim) <= GPU_CHAIN_MAX_WIDTH)


def chain_schedule(problem: AttentionProblem, target: Target, which: str = "forward",
                   forced: ForcedAttention = NOT_FORCED) -> AttentionSchedule:
    """Tiles of an op-level chain's forward kernel, or ("lse") of its backward's log-sum-exp
    pass (the forward kernel without P V). The plain grid: the chain kernels take no head
    interleave, only the groups that keep (batch, head) pairs within grid axis y."""
    sched = schedule(problem, target, 0, forced)
    config, reason = sched.config, sched.reason
    if forced.forward is None and _chain_tiles(problem, target):
        block_m, block_n, warps, stages = GPU_CHAIN_TILES[which]
        config = AttentionConfig(min(block_m, config.block_m), block_n, warps, stages)
        config = _warps_filled(config, problem, config.block_m, (block_n, sched.block_dv), target,
                               (sched.block_dv,))
        reason = f"op-level chain: [{config.block_m} queries, {block_n} keys] {which} tiles"
    heads = problem.batch * problem.heads
    group = head_group(heads, False, target)
    programs = grid(-(-problem.s_q // config.block_m), heads, group)
    return dataclasses.replace(sched, config=config, programs=programs, head_group=group, reason=reason)


def chain_backward_schedule(problem: AttentionProblem, target: Target,
                            forced: ForcedAttention = NOT_FORCED) -> BackwardSchedule:
    """Tiles of an op-level backward's dK/dV and dQ kernels (the plain grids, as chain_schedule)."""
    pairs = {"dkdv": problem.batch * problem.kv_heads, "dq": problem.batch * problem.heads}
    groups = {which: head_group(count, False, target) for which, count in pairs.items()}
    sched = dataclasses.replace(backward_schedule(problem, target, forced=forced),
                                head_groups={which: group for which, group in groups.items() if group})
    if forced.backward or not _chain_tiles(problem, target):
        return sched
    chain_tiles = {which: _backward_warps_filled(which, _fit_backward(which, AttentionConfig(*GPU_CHAIN_TILES[which]),
                                                                      problem, sched.block_d, sched.block_dv, target),
                                                 problem, sched.block_d, sched.block_dv, target)
                   for which in ("dkdv", "dq")}
    configs = dict(sched.configs, **chain_tiles)
    return dataclasses.replace(sched, configs=configs, reason="op-level chain: " + sched.reason)
