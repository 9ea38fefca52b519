"""Matmul configs: the candidate space per problem and an analytic model that ranks it.

A config picks a kernel variant and its tiles:
  tiled       one program per output tile, grouped tile order for L2 reuse, pointer loads (any
              strides, any alignment);
  persistent  one program per SM walking tiles, operands through TMA tensor descriptors
              (Hopper; unit stride on one of the two matrix axes, 16-byte aligned rows);
  split_k     K cut into SPLIT_K chunks written as fp32 partials, then a combine kernel that
              adds them in a fixed order (deterministic) and runs the epilogue; for small M*N
              with a long K, where output tiles alone cannot fill the SMs;
  small_m     decode shapes (M <= 64): 16-row tiles, wide K steps, split-K when N is short.
The model is a roofline over waves: per program, the time of its tile's flops at the tensor-core
rate (scaled by how well the tile shape feeds the cores) or its bytes at one SM's share of
bandwidth, whichever is longer; waves quantized over SMs x programs per SM (shared memory and
registers decide how many fit); then the whole problem's HBM bytes as a floor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ....errors import UnsupportedError
from ....target import Target
from ....runtime.tuning_cache import WARPS, record_choice, record_field, record_int
from .mma import fitting_warps

# The tensor-core (and FMA) rate per dot type is the target's (target.py: measured on the H100).
# A tile of BM x BN does BM*BN*2 flops per (BM + BN) loaded values each k step; wgmma keeps the
# cores busy from about 85 flops per loaded value (128x256 tiles). Smaller tiles starve, less than
# linearly: 128x128 (64) ran at 0.89 of 128x256 at 4096^3 bf16 on the H100 here, hence ^0.4.
FULL_RATE_INTENSITY = 85.0
FEED_EXPONENT = 0.4
# A 128x128 accumulator on one warpgroup (4 warps) ran at 0.90 of the same tile on 8 warps.
ONE_WARPGROUP_PENALTY = 0.9
# One SM alone streams about 4x its fair share of HBM bandwidth (decode shapes are limited by
# how many SMs pull bytes, not by HBM).
SM_BANDWIDTH_SHARE = 4.0
L2_BANDWIDTH = 1.0e13  # bytes/s, operand re-reads across tiles hit L2 (H100: ~10-12 TB/s)
MAX_REGISTERS_PER_THREAD = 255
OPERAND_REGISTERS = 64  # per thread besides the accumulator: addresses, fragments, epilogue
LAUNCH_SECONDS = 3.0e-6  # one extra kernel (split-K combine, row-exit fold)
LOAD_LATENCY = 1.0e-6  # seconds from issuing a tile load to using it, under load (H100 HBM)
K_STEP_SECONDS = 0.08e-6  # issue and barrier cost of one k step of a program
# Pointer loads (address math, cp.async) feed wgmma a little less well than TMA: the tiled
# 128x256 kernel ran at 0.985 and 0.966 of the persistent one at 4096^3 and 8192^3 (H100 here).
VARIANT_EFFICIENCY = {"persistent": 1.0, "tiled": 0.97, "split_k": 0.97, "small_m": 0.97}
GROUP_M = 8  # tiles per group in the grouped order: 8 row tiles share B columns in L2
SPLIT_COMBINE_BLOCK = (64, 128)  # combine kernel tile (BLOCK_M, BLOCK_N): a copy-like pass
# Column exits (a conv's per-channel statistics) leave one partial per row tile: 784 of them per
# channel at 32x56x56 with 128-row tiles. Folding them one tile at a time took one program per
# 128 channels hundreds of microseconds (stats at 0.2x of conv + batchnorm on the H100 for the
# 64-channel layers); the fold reads [FOLD_TILES, BLOCK_COLS] chunks instead. Chosen by the
# count (32 KB of fp32 per chunk, 32 values per thread on 4 warps), not timed yet.
COLUMN_FOLD_BLOCK = (128, 32)  # (tiles, columns) per chunk of the column-exit fold
# Operands converted at load (a mixed dot) pass through registers, so the rate
# falls with the converted side's share of the tile: efficiency ** (2 * side / (BM + BN)). A feeds
# wgmma from registers; B goes back to shared memory, which costs more. H100, 2048x4096x4096:
# fp32 x bf16 ran at 0.81 of bf16 x bf16 (128x256 tiles), bf16 x fp32 at 0.56 (256x128).
CONVERTED_A_EFFICIENCY = 0.78
CONVERTED_B_EFFICIENCY = 0.44
# IEEE fp32 FMA tiles on 8 warps ran at 0.94-0.95 of the 4-warp ones (128x128 against 64x128).
FMA_EIGHT_WARP_EFFICIENCY = 0.95
SMALL_M_LIMIT = 64
FORCED_BY = "BuildOptions.matmul_config"  # what a forced config's reason names
SPLIT_CHOICES = (2, 4, 8, 16)
# bounds a tuning-cache record must respect (wider than any candidate, far below nonsense)
MAX_BLOCK = 512
MAX_STAGES = 8
MAX_SPLIT_K = 64
MAX_SUBTILES = 4
MIN_SUBTILE_COLUMNS = 16  # an epilogue subtile's columns, at least (candidates and records)

# (BLOCK_M, BLOCK_N, BLOCK_K for 2-byte types, warps, stages): tiles seen best in Triton's
# tutorials and in sweeps here; BLOCK_K scales with the element size (fp8 x2, fp32 /2).
TILES = (
    (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 256, 64, 8, 4),
)
# Persistent: 128x256 at 3 stages led the sweep (632/643 TFLOP/s at 4096^3/8192^3 with bias+gelu);
# 256x128 needs 4 stages (576 -> 627). Flattening the tile loop won on 4096x11008x4096 (584 -> 601)
# and lost on the squares (632 -> 613): both are candidates, the model cannot tell them apart.
PERSISTENT_TILES = ((128, 256, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4))
# Epilogue subtiling with TMA stores: a candidate for autotuning, ranked right after the same tile
# without it (the two tie in the model), except under a wide epilogue, where the plain tile spills
# (SPILLED_EPILOGUE_EFFICIENCY below) and the subtiled one is the model's first choice.
# The 128x256 accumulator holds 128 fp32 values per thread on 8 warps; running the fused epilogue
# on two [BLOCK_M, BLOCK_N / 2] halves in turn keeps half of the epilogue's values live and lets
# one half's TMA store drain while the next half computes (Triton's persistent matmul tutorial
# does the same). Offered for the 128x256 tile alone: the autotuner times the model's top 6, and
# a twin of 256x128 as well would push the tiled 128x256 (the tuned best at 2048 rows, model rank
# 5) out of them. What is known without a GPU (sm_90 builds of y = gelu(a @ b + bias) bf16
# 4096^3, ptxas -v of Triton 3.6's PTX): the plain 128x256 w8 s3 kernel uses 255 registers and
# spills 68 bytes, the 256x128 w8 s4 one 255 and 96; with subtile2 they use 254 and 250 and
# spill nothing (subtile2 tma-store: 251 and 243, subtile4 tma-store: 205).
SUBTILE_TILES = ((128, 256, 64, 8, 3),)
# Column subtiles of the candidate: 2, or 4 where the staging of 2 does not fit beside the operand
# stages (three bf16 outputs of a SwiGLU forward that saves gate and silu(gate): 6 bytes per
# element). The Llama MLP backward's epilogue ran 565 TFLOP/s with 2, 554 with 4 and 528 with 2
# subtiles stored through pointers (4096x14336x4096, sweep below).
SUBTILE_CANDIDATES = (2, 4)
# A wide epilogue (one reading and writing >= 6 bytes per output element: a Llama MLP's backward
# through its down projection reads gate and up and writes d_gate and d_up, 8 bytes) keeps more
# than the accumulator live. Where that accumulator is over 64 fp32 values per thread at once
# (128x256 on 8 warps, 128x128 on 4), the epilogue spills: at 4096x14336x4096 bf16 the plain
# 128x256 tile ran 314 TFLOP/s, 128x128 on 4 warps 268, against 565 for 128x256 subtile2
# tma-store and 442 for 128x128 on 8 warps (`sweep_matmul.py --epilogue silu_backward`, H100,
# 2026-11-24; torch.compile 601). A 4-byte epilogue (silu(gate) * up) did not spill: 598 plain,
# 599 subtile2 tma-store. So the model takes 314 / 565 of the rate from such tiles, compute- or
# memory-bound. (The subtiled builds are not spill-free either: ptxas reported 255 registers and
# 32-60 bytes of spills for these epilogues on 2 or 4 subtiles, against 132 bytes for a bf16 and
# an fp32 output on the plain tile; the small spills did not show in the times.)
WIDE_EPILOGUE_BYTES = 6
EPILOGUE_LIVE_ACCUMULATORS = 64  # fp32 accumulator values per thread an epilogue runs on unspilled
SPILLED_EPILOGUE_EFFICIENCY = 0.56
SPLIT_TILES = ((64, 64, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4))
# IEEE fp32 runs tl.dot on the FMA units: operands go shared -> registers and each thread owns
# BLOCK_M*BLOCK_N/threads accumulators. Resource reports of sm_90 builds here: 128x128x32 on 8
# warps 184 registers, 128x64 / 64x128 on 4 warps 165-195, 64x64 on 4 warps 96, no spills;
# 128x256 on 8 warps and 128x128 on 4 warps spill (255 registers + stack), so they are left out.
FMA_TILES = ((128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
             (64, 64, 64, 4, 3))
# Accumulators per thread from which FMA tiles run at the full FMA rate (fewer: more shared-memory
# operand loads per FMA).
FMA_FULL_RATE_OUTPUTS = 64
# Decode tiles. 16x32x256 was dropped: the model liked its 4x more programs, but it never won on
# the H100 (1x11008x4096: 54 us vs 45 us for 16x128x128).
SMALL_M_TILES = ((16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 128, 64, 4, 4), (32, 64, 128, 4, 4),
                 (64, 64, 64, 4, 4), (32, 128, 64, 4, 4))


# --- the dot type: which tensor cores a matmul runs on (plain data; codegen only renders it) ----
# A matmul whose floating operands differ computes on the tensor cores of the narrower type with
# fp32 accumulation; the wider operand is converted as its tile is loaded, before tl.dot:
#   fp32 x fp32        tf32 when the graph allows it, else IEEE fp32 (FMA units, no tensor cores)
#   fp32 x bf16        bf16 (the fp32 side is rounded to bf16 at load: bf16 accuracy)
#   fp32 x fp16        fp16 (rounded to fp16 at load: fp16 accuracy and range)
#   fp16 x bf16        bf16: every fp16 value lies inside bf16's range, while a bf16 value past
#                      65504 would become inf in fp16; the 3 mantissa bits the fp16 side loses
#                      leave it as accurate as the bf16 side already is
#   fp8 x fp8          the type itself; e4m3 x e5m2 widens both to fp16 (exact for both)
#   fp8 x fp16|bf16    the 16-bit type (fp8 widens exactly to either)
#   fp8 x fp32         bf16: fp8 widens exactly and fp32 rounds as in fp32 x bf16 (rounding an
#                      unscaled fp32 operand to fp8 would keep 3 mantissa bits and overflow at 448)
#   int8 x int8        int8 with int32 accumulation (exact); int8 never mixes with a float
#                      (the ops refuse it: no conversion would keep the integer result exact)
_DOT_OF_TYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3": "fp8",
                "float8_e5m2": "fp8", "int8": "int8"}
_TRITON_OF_DOT = {"fp32": "tl.float32", "tf32": "tl.float32", "fp16": "tl.float16", "bf16": "tl.bfloat16"}
_MIXED_DOTS = {frozenset(("fp32", "bf16")): "bf16", frozenset(("fp32", "fp16")): "fp16",
               frozenset(("fp16", "bf16")): "bf16", frozenset(("fp8", "fp16")): "fp16",
               frozenset(("fp8", "bf16")): "bf16", frozenset(("fp8", "fp32")): "bf16"}


@dataclass(frozen=True)
class DotChoice:
    """How a matmul's operands reach tl.dot: the Triton type each side is converted to at load,
    the model's dot name (its peak rate) and tl.dot's input_precision ("" for 16-bit and fp8)."""

    a_type: str
    b_type: str
    dot: str  # "bf16" | "fp16" | "fp8" | "tf32" | "fp32" | "int8"
    precision: str  # "ieee" | "tf32" | ""


def choose_dot(a_type: str, b_type: str, a_triton: str, b_triton: str, allow_tf32: bool) -> DotChoice:
    """The dot of a matmul of `a_type` x `b_type` (dtype names; `*_triton` their Triton types),
    by the precision rule above. Raises KeyError for a type no matmul kernel takes."""
    a_dot, b_dot = _DOT_OF_TYPE[a_type], _DOT_OF_TYPE[b_type]
    if a_type == b_type and a_dot in ("fp8", "int8"):
        return DotChoice(a_triton, b_triton, a_dot, "")
    if a_dot == b_dot == "fp8":  # e4m3 x e5m2: both widen exactly to fp16
        return DotChoice("tl.float16", "tl.float16", "fp16", "")
    if a_dot == b_dot == "fp32":
        return DotChoice("tl.float32", "tl.float32", *(("tf32", "tf32") if allow_tf32 else ("fp32", "ieee")))
    dot = a_dot if a_dot == b_dot else _MIXED_DOTS[frozenset((a_dot, b_dot))]
    return DotChoice(_TRITON_OF_DOT[dot], _TRITON_OF_DOT[dot], dot, "")


@dataclass(frozen=True)
class MatmulProblem:
    """What the model needs to know of one matmul kernel (plain data; the cache key)."""

    batch: int
    m: int
    n: int
    k: int
    dot: str  # "bf16" | "fp16" | "fp8" | "tf32" | "fp32" | "int8"
    a_bytes: int  # element sizes in memory
    b_bytes: int
    out_bytes: int  # bytes written and read per output element by the epilogue (stores, operands)
    tma: bool  # descriptors legal for A and B (layout, alignment) on this device
    a_layout: str  # "row" (K contiguous) | "col" (M contiguous) | "strided"
    b_layout: str  # "row" (N contiguous) | "col" (K contiguous) | "strided"
    epilogue: str = ""  # a short text of the fused work (part of the signature only)
    store_bytes: Optional[int] = None  # of out_bytes, those stored (TMA staging); None: all of them

    @property
    def staged_bytes(self) -> int:
        """Bytes per output element a TMA-store epilogue stages in shared memory (an upper bound:
        the sm_90 builds here gave outputs of one type a single staging buffer, which the model
        does not count on)."""
        return self.out_bytes if self.store_bytes is None else self.store_bytes

    def signature(self) -> str:
        """A stable text naming everything that changes the best config."""
        stored = f" s{self.store_bytes}" if self.staged_bytes != self.out_bytes else ""
        return (f"b{self.batch} m{self.m} n{self.n} k{self.k} {self.dot} a{self.a_bytes}{self.a_layout} "
                f"b{self.b_bytes}{self.b_layout} o{self.out_bytes}{stored} tma{int(self.tma)} {self.epilogue}").strip()


@dataclass(frozen=True)
class MatmulConfig:
    variant: str  # "tiled" | "persistent" | "split_k" | "small_m"
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    flatten: bool = False  # persistent: one software pipeline across tile boundaries
    warp_specialize: bool = False  # persistent: TMA producer warps apart from the wgmma warps
    epilogue_subtile: int = 1  # persistent: column subtiles the epilogue runs on one by one
    tma_store: bool = False  # persistent: outputs that qualify stored through tensor descriptors
    group_m: int = GROUP_M
    estimate_us: float = 0.0

    @property
    def text(self) -> str:
        extras = f" SPLIT_K={self.split_k}" if self.split_k > 1 else ""
        extras += " flatten" if self.flatten else ""
        extras += " warp-specialized" if self.warp_specialize else ""
        extras += f" subtile{self.epilogue_subtile}" if self.epilogue_subtile > 1 else ""
        extras += " tma-store" if self.tma_store else ""
        return (f"{self.variant} {self.block_m}x{self.block_n}x{self.block_k} warps={self.num_warps} "
                f"stages={self.num_stages}{extras}")

    def key(self) -> tuple:
        return (self.variant, self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages,
                self.split_k, self.flatten, self.warp_specialize, self.epilogue_subtile, self.tma_store)

    def to_record(self) -> dict:
        record = {"variant": self.variant, "block_m": self.block_m, "block_n": self.block_n,
                  "block_k": self.block_k, "num_warps": self.num_warps, "num_stages": self.num_stages,
                  "split_k": self.split_k, "flatten": self.flatten, "warp_specialize": self.warp_specialize}
        # written only when set: records of configs without them read back exactly as before
        if self.epilogue_subtile != 1:
            record["epilogue_subtile"] = self.epilogue_subtile
        if self.tma_store:
            record["tma_store"] = True
        return record

    @staticmethod
    def from_record(record: dict) -> "MatmulConfig":
        """The config a tuning-cache record holds; ValueError for an unknown variant or an
        illegal value (wrong type, a block size that is not a power of two in range, ...)."""
        block = lambda name: record_int(record, name, 1, MAX_BLOCK, power_of_two=True)
        num_warps = record_field(record, "num_warps", int)
        if num_warps not in WARPS:
            raise ValueError(f"num_warps {num_warps} is not one of {list(WARPS)}")
        config = MatmulConfig(record_choice(record, "variant", VARIANT_EFFICIENCY), block("block_m"),
                              block("block_n"), block("block_k"), num_warps,
                              record_int(record, "num_stages", 1, MAX_STAGES),
                              record_int(record, "split_k", 1, MAX_SPLIT_K, default=1),
                              record_field(record, "flatten", bool, default=False),
                              record_field(record, "warp_specialize", bool, default=False),
                              record_int(record, "epilogue_subtile", 1, MAX_SUBTILES, power_of_two=True, default=1),
                              record_field(record, "tma_store", bool, default=False))
        knobs = config.epilogue_subtile > 1 or config.tma_store
        if knobs and config.variant != "persistent":
            raise ValueError(f"epilogue subtiles and TMA stores are persistent-kernel knobs, not {config.variant}'s")
        if config.block_n // config.epilogue_subtile < MIN_SUBTILE_COLUMNS:
            raise ValueError(f"{config.epilogue_subtile} subtiles of {config.block_n} columns are narrower than "
                             f"{MIN_SUBTILE_COLUMNS}")
        return config


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


DOT_BYTES = {"fp8": 1, "int8": 1, "bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}


def dot_bytes(dot: str) -> int:
    """The bytes of one operand element a dot type multiplies."""
    return DOT_BYTES[dot]


def _dot_bytes(problem: MatmulProblem) -> int:
    return dot_bytes(problem.dot)


# Dot types whose wgmma reads both operands K-major from shared memory (A [M, K] rows, B as
# [N, K]): a descriptor of another layout cannot feed them (PTX wgmma: only 16-bit types transpose)
K_MAJOR_DOTS = ("fp8", "tf32", "int8")


def min_block_k(dot: str) -> int:
    """The narrowest BLOCK_K tl.dot takes for a dot type: 32 for 8-bit operands (fp8, int8: the
    NVIDIA backend's min_dot_size), 16 otherwise."""
    return 32 if dot in ("fp8", "int8") else 16


def _scaled_k(block_k: int, problem: MatmulProblem) -> int:
    """BLOCK_K for the dot type: the same bytes per k step as 64 two-byte values (128 for int8
    and fp8, whose wgmma takes 32 bytes of K per instruction)."""
    return max(min_block_k(problem.dot), block_k * 2 // _dot_bytes(problem))


def _shrink(config_tile, problem: MatmulProblem):
    """Clamp tiles to the problem (no 256-row tile for 100 rows) keeping powers of two >= 16,
    and the warps to what the shrunk tile's dot fills (heuristics/mma.py: a 16x16 tile on 4
    warps would repeat its rows on two of them); IEEE fp32 runs on the FMA units, no mma."""
    bm, bn, bk, warps, stages = config_tile
    bk = _scaled_k(bk, problem)
    while bm > 16 and bm // 2 >= problem.m:
        bm //= 2
    while bn > 16 and bn // 2 >= problem.n:
        bn //= 2
    while bk > min_block_k(problem.dot) and bk // 2 >= problem.k:
        bk //= 2
    if problem.dot != "fp32":
        warps = fitting_warps(bm, (bn,), warps)
    return bm, bn, bk, warps, stages


def shared_bytes(config: MatmulConfig, problem: MatmulProblem) -> int:
    """Operand staging buffers: num_stages copies of an A tile and a B tile; with TMA stores, a
    staging buffer of one column subtile per stored byte of an output element (staged_bytes).
    sm_90 builds here matched it (plus 32 bytes of barriers): 256x128 at 4 stages 196640 bytes,
    229408 with subtile2 tma-store of a bf16 output."""
    per_stage = config.block_m * config.block_k * problem.a_bytes + config.block_k * config.block_n * problem.b_bytes
    staging = config.block_m * config.block_n // config.epilogue_subtile * problem.staged_bytes
    epilogue = staging if config.tma_store else 0
    return config.num_stages * per_stage + epilogue


def programs_per_sm(config: MatmulConfig, problem: MatmulProblem, target: Target) -> int:
    """How many programs fit on one SM of `target` at once (0: the config does not fit at all)."""
    by_shared = target.shared_memory // max(1, shared_bytes(config, problem))
    threads = config.num_warps * 32
    accumulator = config.block_m * config.block_n // threads
    per_thread = accumulator + OPERAND_REGISTERS
    if per_thread > MAX_REGISTERS_PER_THREAD:
        return 0
    by_registers = target.registers // (per_thread * threads)
    return max(0, min(by_shared, by_registers, target.threads_per_sm // threads))


def candidates(problem: MatmulProblem, target: Target, splits: tuple = SPLIT_CHOICES) -> list[MatmulConfig]:
    """Every config worth ranking for `problem` (deduplicated, all fitting an SM of `target`);
    `splits` the split-K factors to consider."""
    found: dict = {}

    def add(variant, tile, split=1, flatten=False, subtile=1):
        bm, bn, bk, warps, stages = _shrink(tile, problem)
        config = MatmulConfig(variant, bm, bn, bk, warps, stages, split, flatten=flatten,
                              epilogue_subtile=subtile, tma_store=subtile > 1)
        if programs_per_sm(config, problem, target) >= 1 and config.key() not in found:
            found[config.key()] = config

    def add_subtiled(tile):
        # the fewest subtiles whose TMA-store staging fits beside the operand stages
        bm, bn, bk, warps, stages = _shrink(tile, problem)
        for parts in SUBTILE_CANDIDATES:
            config = MatmulConfig("persistent", bm, bn, bk, warps, stages, epilogue_subtile=parts, tma_store=True)
            if bn // parts >= MIN_SUBTILE_COLUMNS and programs_per_sm(config, problem, target) >= 1:
                found.setdefault(config.key(), config)
                return

    small = problem.m <= SMALL_M_LIMIT
    fma = problem.dot == "fp32"
    for tile in (SMALL_M_TILES if small else FMA_TILES if fma else TILES):
        add("small_m" if small else "tiled", tile)
    if problem.tma and not small and not fma:  # the persistent tiles are wgmma tiles
        for tile in PERSISTENT_TILES:
            add("persistent", tile)
            add("persistent", tile, flatten=True)
        for tile in SUBTILE_TILES:
            add_subtiled(tile)
    for tile in (SMALL_M_TILES if small else SPLIT_TILES):
        bm, bn, bk, _, _ = _shrink(tile, problem)
        output_tiles = _cdiv(problem.m, bm) * _cdiv(problem.n, bn) * problem.batch
        if output_tiles >= 2 * target.sms:  # two full waves of output tiles: nothing to gain from splitting
            continue
        for split in splits:
            if problem.k >= split * bk * 4:  # each split keeps >= 4 k steps
                add("small_m" if small else "split_k", tile, split)
    return list(found.values())


def _conversion_efficiency(config: MatmulConfig, problem: MatmulProblem) -> float:
    """The rate left after converting operands on their way to the dot (a mixed dot)."""
    dot_bytes = _dot_bytes(problem)
    efficiency = 1.0
    if problem.a_bytes != dot_bytes:
        efficiency *= CONVERTED_A_EFFICIENCY ** (2 * config.block_m / (config.block_m + config.block_n))
    if problem.b_bytes != dot_bytes:
        efficiency *= CONVERTED_B_EFFICIENCY ** (2 * config.block_n / (config.block_m + config.block_n))
    return efficiency


def _feed(config: MatmulConfig, problem: MatmulProblem) -> float:
    """The fraction of the dot type's peak rate the tile shape sustains."""
    if problem.dot == "fp32":  # FMA units: accumulators per thread decide the operand traffic
        outputs = config.block_m * config.block_n / (config.num_warps * 32)
        feed = min(1.0, outputs / FMA_FULL_RATE_OUTPUTS) ** 0.5
        feed *= FMA_EIGHT_WARP_EFFICIENCY if config.num_warps == 8 else 1.0
    else:
        intensity = config.block_m * config.block_n / (config.block_m + config.block_n)
        feed = min(1.0, intensity / FULL_RATE_INTENSITY) ** FEED_EXPONENT
        if config.num_warps == 4 and config.block_m * config.block_n >= 128 * 128:
            feed *= ONE_WARPGROUP_PENALTY
    return feed * VARIANT_EFFICIENCY[config.variant] * _conversion_efficiency(config, problem)


def _epilogue_efficiency(config: MatmulConfig, problem: MatmulProblem) -> float:
    """The rate left where a wide epilogue spills (see WIDE_EPILOGUE_BYTES): of the tensor
    cores and of the memory system alike (a 4096x4096x1024 GEMM whose epilogue reads and writes
    ~15 bytes per element, the model's HBM floor 95 us, ran 372 us on the plain 128x256 tile)."""
    live = config.block_m * config.block_n // (config.num_warps * 32 * config.epilogue_subtile)
    spills = problem.out_bytes >= WIDE_EPILOGUE_BYTES and live > EPILOGUE_LIVE_ACCUMULATORS
    return SPILLED_EPILOGUE_EFFICIENCY if spills else 1.0


def estimate(config: MatmulConfig, problem: MatmulProblem, target: Target) -> float:
    """Model seconds for `config` on `problem` on `target`."""
    tiles = _cdiv(problem.m, config.block_m) * _cdiv(problem.n, config.block_n) * problem.batch
    units = tiles * config.split_k
    k_chunk = _cdiv(_cdiv(problem.k, config.split_k), config.block_k) * config.block_k
    feed = _feed(config, problem)
    unit_compute = 2.0 * config.block_m * config.block_n * k_chunk / (target.peak(problem.dot) / target.sms * feed)
    stage_bytes = (config.block_m * problem.a_bytes + config.block_n * problem.b_bytes) * config.block_k
    unit_bytes = stage_bytes * (k_chunk // config.block_k)
    # programs resident on one SM share its tensor cores and its bandwidth; one program keeps
    # num_stages tiles of loads in flight (Little's law over the load latency)
    fits = 1 if config.variant == "persistent" else max(1, programs_per_sm(config, problem, target))
    resident = max(1, min(fits, _cdiv(units, target.sms)))
    rounds = _cdiv(units, target.sms * resident)
    sm_bandwidth = target.bandwidth / target.sms * SM_BANDWIDTH_SHARE
    program_bandwidth = min(config.num_stages * stage_bytes / LOAD_LATENCY, sm_bandwidth / resident)
    steps = k_chunk // config.block_k
    fill = 0.0 if config.variant == "persistent" else config.num_stages * LOAD_LATENCY
    round_seconds = max(resident * unit_compute, unit_bytes / program_bandwidth) + steps * K_STEP_SECONDS + fill
    compute = rounds * round_seconds
    a_total = problem.batch * problem.m * problem.k * problem.a_bytes
    b_total = problem.batch * problem.k * problem.n * problem.b_bytes
    c_total = problem.batch * problem.m * problem.n * problem.out_bytes
    partials, extra = 0.0, 0.0
    if config.split_k > 1:
        partials = 2.0 * config.split_k * problem.batch * problem.m * problem.n * 4
        extra = LAUNCH_SECONDS
    dram = (a_total + b_total + c_total + partials) / target.bandwidth
    l2 = (a_total * _cdiv(problem.n, config.block_n) + b_total * _cdiv(problem.m, config.block_m)) / L2_BANDWIDTH
    return max(compute, dram, l2) / _epilogue_efficiency(config, problem) + extra


@dataclass(frozen=True)
class MatmulSchedule:
    problem: MatmulProblem
    ranked: tuple  # MatmulConfig, best first
    config: MatmulConfig
    reason: str


def rank(problem: MatmulProblem, target: Target) -> list[MatmulConfig]:
    """Candidates with their model time on `target`, best first."""
    ranked = [replace(c, estimate_us=estimate(c, problem, target) * 1e6)
              for c in candidates(problem, target)]
    if not ranked:
        raise UnsupportedError(f"matmul {problem.signature()}: no tile fits the {target.shared_memory} bytes of "
                               f"shared memory or the registers of {target.name}")
    floor_us = min(c.estimate_us for c in ranked)

    def tie_break(c):
        # at the HBM floor, more programs pull bytes from more SMs (12544x64x576: 64x64 tiles ran
        # 14.0 us, 256x64 17.9 us); otherwise bigger tiles, wide-N first (128x256 beat 256x128
        # at 3 stages), no split (no partials), no flattening (it lost on the squares), no
        # subtiled epilogue where the model ties it with the plain tile (narrow epilogues: within
        # +-2% at 4096^3 gelu, -2 to -9% at 8192^3)
        tiles = _cdiv(problem.m, c.block_m) * _cdiv(problem.n, c.block_n) * problem.batch * c.split_k
        slots = target.sms * (1 if c.variant == "persistent" else max(1, programs_per_sm(c, problem, target)))
        programs = min(tiles, slots)
        at_floor = c.estimate_us <= floor_us * 1.001 and c.split_k == 1
        return (round(c.estimate_us, 3), c.split_k, -programs if at_floor else 0, -c.block_m * c.block_n,
                c.block_m > c.block_n, c.flatten, c.epilogue_subtile)

    ranked.sort(key=tie_break)
    return ranked


def schedule(problem: MatmulProblem, target: Target, forced: Optional[MatmulConfig] = None) -> MatmulSchedule:
    """The model's choice for `problem` on `target`, with the ranked list autotuning draws from;
    `forced` runs whatever the model says."""
    ranked = rank(problem, target)
    best = ranked[0]
    tflops = 2.0 * problem.batch * problem.m * problem.n * problem.k / max(best.estimate_us, 1e-3) / 1e6
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us "
              f"(~{tflops:.0f} TFLOP/s) for batch {problem.batch} x {problem.m}x{problem.n}x{problem.k} "
              f"{problem.dot}")
    if forced is not None:
        if forced.variant == "persistent" and not problem.tma:  # descriptors illegal here
            forced = replace(forced, variant="tiled", epilogue_subtile=1, tma_store=False)
        reason = f"forced by {FORCED_BY} over the {best.text} of " + reason
        ranked.insert(0, forced)
        best = forced
    return MatmulSchedule(problem, tuple(ranked), best, reason)
