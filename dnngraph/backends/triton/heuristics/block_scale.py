"""Configs of the block-scale kernels (quantize, dequantize): blocks per program and warps,
ranked by a bandwidth model of the target.

Each thread holds RUN consecutive quantization blocks whole (codegen/block_scale.py): RUN =
BLOCK_G / (32 * num_warps), so a config fixes how many elements a thread has in flight
(RUN * BLOCK) and how many programs cover the tensor. The kernels are memory-bound: the model is
the tensor's bytes at the target's bandwidth (padded to whole programs) plus a fixed cost per
program over the waves of resident programs, so wider programs win where they still fill the
machine; a thread's elements are capped at what the H200 measured best (MODEL_MAX_THREAD_ELEMENTS).
"""
from __future__ import annotations

from dataclasses import dataclass

from ....errors import ValidationError
from ....target import Target
from .pointwise import PROGRAM_OVERHEAD, pow2_at_least

THREADS_PER_WARP = 32
WARPS = (4, 8)
# Elements of x a thread holds (RUN * BLOCK), timed by `benchmarks/bench_quantize.py --sweep`.
# The model takes at most 32: on the H200 (2026-11-29, (8192, 14336), BENCHMARKS.md) every
# format and x dtype ran fastest there, and more per thread lost:
# bf16 -> MXFP8 92-94 us at 32 (RUN=1) against 118 at 64 and 157-158 at 128; fp32 -> MXFP8
# 169 against 179-180 and 217-219; bf16 -> NVFP4 105-109 at 32 (RUN=2) against 111-132 at 64
# and 154-215 at 128; fp32 -> NVFP4 156.5-157 at 32 against 157-163 at 64 and 186-269 at 128.
# (The bandwidth model alone prefers the widest programs: it sees no cost in a thread's serial
# work per element.) 16 (NVFP4 at RUN=1) is a candidate the sweep times, not yet measured.
THREAD_ELEMENTS = (16, 32, 64, 128)
MODEL_MAX_THREAD_ELEMENTS = 32


@dataclass(frozen=True)
class BlockScaleConfig:
    block_g: int  # quantization blocks per program (a power of two)
    num_warps: int

    def __post_init__(self):
        for name in ("block_g", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValidationError(f"BlockScaleConfig.{name}: expects a power of two, got {value!r}")

    @property
    def run(self) -> int:
        """Consecutive blocks each thread holds (1 where a program has fewer blocks than threads)."""
        return max(1, self.block_g // (THREADS_PER_WARP * self.num_warps))

    def text(self) -> str:
        return f"BLOCK_G={self.block_g} num_warps={self.num_warps} RUN={self.run}"


def fitted(config: BlockScaleConfig, blocks: int) -> BlockScaleConfig:
    """`config` shrunk to a problem of `blocks` blocks: no more blocks per program than there
    are, and no more warps than a program has blocks for (a warp holds at least 32 blocks)."""
    block_g = min(config.block_g, pow2_at_least(blocks))
    warps = max(1, min(config.num_warps, block_g // THREADS_PER_WARP))
    return BlockScaleConfig(block_g, warps)


def candidates(blocks: int, block: int) -> list:
    """Every config worth timing for `blocks` blocks of `block` elements (distinct, fitted)."""
    found = []
    for warps in WARPS:
        for elements in THREAD_ELEMENTS:
            run = max(1, elements // block)
            config = fitted(BlockScaleConfig(run * THREADS_PER_WARP * warps, warps), blocks)
            if config not in found:
                found.append(config)
    return found


def estimate_us(config: BlockScaleConfig, blocks: int, block: int, bytes_per_element: float,
                target: Target) -> float:
    """Model time in microseconds: padded bytes at the target's bandwidth plus the programs'
    fixed cost per wave."""
    programs = -(-blocks // config.block_g)
    resident = target.sms * max(1, target.threads_per_sm // (THREADS_PER_WARP * config.num_warps))
    waves = -(-programs // resident)
    padded = programs * config.block_g * block * bytes_per_element
    return 1e6 * (padded / target.bandwidth + waves * PROGRAM_OVERHEAD)


def rank(blocks: int, block: int, bytes_per_element: float, target: Target) -> list:
    """The candidates, best first: within the register cap by model time (then fewer warps),
    the rest after."""
    def key(config):
        spills = config.run * block > MODEL_MAX_THREAD_ELEMENTS
        return spills, round(estimate_us(config, blocks, block, bytes_per_element, target), 3), config.num_warps
    return sorted(candidates(blocks, block), key=key)
