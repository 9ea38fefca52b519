"""Configs of the grouped (MoE) GEMMs: tile sizes from the problem's sizes, no timing.

The forward tiles (expert, M tile, N tile) with BLOCK_M rows of one expert; an expert's last
tile is partial, so BLOCK_M follows the mean rows per expert (small experts waste less of a
tile). The wgrad tiles (expert, K tile, N tile) and reduces over the expert's rows BLOCK_M at a
time, in order (deterministic)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ....runtime.tuning_cache import record_int
from .mma import fitting_warps


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row-tile slots that walk their N tiles together (the weight's tiles shared in L2)

    def to_record(self) -> dict:
        return {"block_m": self.block_m, "block_n": self.block_n, "block_k": self.block_k,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    @staticmethod
    def from_record(record: dict) -> "MoeConfig":
        """The config a record holds; ValueError for anything out of range (tl.dot needs tiles
        of 16 or more along each axis)."""
        block = lambda name: record_int(record, name, 16, 256, power_of_two=True)
        return MoeConfig(block("block_m"), block("block_n"), block("block_k"),
                         record_int(record, "num_warps", 1, 8, power_of_two=True),
                         record_int(record, "num_stages", 1, 8))

    def text(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} "
                f"num_warps={self.num_warps} num_stages={self.num_stages} GROUP_M={self.group_m}")


def _power_of_two_at_least(value: int, low: int, high: int) -> int:
    size = low
    while size < value and size < high:
        size *= 2
    return size


def schedule(op: str, rows: int, k: int, n: int, experts: int, interpreted: bool,
             forced: Optional[MoeConfig] = None, fma_dots: bool = False) -> MoeConfig:
    """The config of one grouped GEMM kernel (`forced` where BuildOptions.moe_config sets one).
    tl.dot needs 16 or more along each tile axis; `fma_dots`: IEEE fp32 dots (no tensor cores)."""
    if forced is not None:
        return forced
    if op == "moe_grouped_matmul":
        mean_rows = max(1, rows // max(1, experts))
        block_m = _power_of_two_at_least(mean_rows, 16, 64 if interpreted else 128)
        block_n = _power_of_two_at_least(n, 16, 64 if interpreted else 128)
        block_k = _power_of_two_at_least(k, 16, 32 if interpreted else 64)
    else:  # wgrad: an output tile of K x N, reduced over rows
        block_m = _power_of_two_at_least(rows // max(1, experts), 16, 32 if interpreted else 64)
        block_n = _power_of_two_at_least(n, 16, 64 if interpreted else 128)
        block_k = _power_of_two_at_least(k, 16, 64 if interpreted else 128)
    warps = 8 if block_m * block_n >= 128 * 128 or block_k * block_n >= 128 * 128 else 4
    if not fma_dots:  # no more warps than the dot fills (heuristics/mma.py); wgrad's dot rows are K
        warps = fitting_warps(block_m if op == "moe_grouped_matmul" else block_k, (block_n,), warps)
    return MoeConfig(block_m, block_n, block_k, warps, 3)
