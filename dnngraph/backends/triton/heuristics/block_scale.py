"""Configs of the block-scale kernels (quantize, dequantize): blocks per program and warps,
ranked by a bandwidth model of the target.

Each thread holds RUN consecutive quantization blocks whole (codegen/block_scale.py): RUN =
BLOCK_G / (32 * num_warps), so a config fixes how many elements a thread has in flight
(RUN * BLOCK) and how many programs cover the tensor. The kernels are memory-bound: the model is
the tensor's bytes at the target's bandwidth (padded to whole programs) plus a fixed cost per
program over the waves of resident programs, so wider programs win where they still fill the
machine; a thread's blocks are capped at what the H200 measured best (MODEL_MAX_RUN).
"""
from __future__ import annotations

from dataclasses import dataclass

from ....errors import ValidationError
from ....target import Target
from .pointwise import PROGRAM_OVERHEAD, pow2_at_least

THREADS_PER_WARP = 32
WARPS = (4, 8)
# Elements of x a thread holds (RUN * BLOCK), timed by `benchmarks/bench_quantize.py --sweep`.
# The model takes one block per thread (RUN = 1): on the H200 (2026-11-29, (8192, 14336),
# BENCHMARKS.md) that ran fastest or within 1.3% of it for every format and x dtype, and more
# per thread lost: bf16 -> MXFP8 92-93 us at RUN=1 against 117-118 at 2 and 157 at 4; fp32 ->
# MXFP8 169-170 against 179-180 and 217-219; fp32 -> NVFP4 131 against 156 at 2 and 156-163 at 4;
# bf16 -> NVFP4 106.7-107.3 against 105.3-108.1 at 2 and 111-132 at 4. (The bandwidth model alone
# prefers the widest programs: it sees no cost in a thread's serial work per element.)
THREAD_ELEMENTS = (16, 32, 64, 128)
MODEL_MAX_RUN = 1


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
        spills = config.run > MODEL_MAX_RUN
        return spills, round(estimate_us(config, blocks, block, bytes_per_element, target), 3), config.num_warps
    return sorted(candidates(blocks, block), key=key)
