"""CTC configs: the state block that holds an entry's extended labels, the class block of the
gradient's occupancy tile, and the warps, all from the sizes (no ranking: one program per batch
entry runs a recursion over frames whose cost is its step latency)."""
from __future__ import annotations

from dataclasses import dataclass

from ....errors import UnsupportedError

# An entry's extended labels (2 * S + 1 states) live in registers: past this many states a
# program would spill them at every frame.
MAX_STATES = 8192
# Elements of the gradient's [BLOCK_C, BLOCK_L] tile matching states to classes at each frame:
# 64 per thread at 4 warps.
OCCUPANCY_TILE = 8192
# Entries whose lengths one step of the concatenated targets' offset sum reads.
MAX_BLOCK_N = 1024
# States one warp holds in a recursion (8 per lane): a whole speech target (S=100: 201 states) in
# one warp, whose tl.gather of the s - 1 and s - 2 neighbours compiles to warp shuffles, 8 per
# state (sm_90 PTX: 64 per gather). The shuffles grow with the square of the states per lane (16:
# 256 per gather; 32: 1024 and register spills), so longer sequences take more warps, whose
# gathers go through shared memory.
RECURSION_STATES_PER_WARP = 256
# Warps of the [BLOCK_C, BLOCK_L] occupancy tile (64 elements per thread at 8192).
FRAME_WARPS = 4
# Frames per program of the gradient's per-frame kernel on a GPU: enough programs to fill the
# device at a speech batch (T=500, N=32: 2016), each loading its entry's labels once for 8 frames.
GPU_BLOCK_T = 8


@dataclass(frozen=True)
class CtcConfig:
    block_l: int  # states per program: a power of two >= 2 * label_width + 1
    block_c: int  # classes per step of the gradient's occupancy tile
    block_n: int  # entries per step of sums over the batch
    num_warps: int  # the per-frame gradient kernel's
    block_t: int  # frames per program of the gradient's per-frame kernel
    recursion_warps: int  # warps of the programs running a recursion over frames

    def text(self) -> str:
        return (f"BLOCK_L={self.block_l} BLOCK_C={self.block_c} BLOCK_N={self.block_n} BLOCK_T={self.block_t} "
                f"num_warps={self.num_warps} recursion_warps={self.recursion_warps}")


def _power_of_two(count: int) -> int:
    return 1 << max(0, int(count) - 1).bit_length()


def schedule(geometry, where: str, interpreted: bool) -> CtcConfig:
    """The config of a CtcGeometry's kernels; UnsupportedError naming `where` past MAX_STATES.
    Interpreted (CPU tensors), each program costs its setup again: one per entry does every frame."""
    states = 2 * geometry.label_width + 1
    block_l = max(16, _power_of_two(states))
    if block_l > MAX_STATES:
        form = "concatenated targets hold" if geometry.concatenated else "padded targets hold up to"
        raise UnsupportedError(f"{where}: {form} {geometry.label_width} labels, {states} extended states; the "
                               f"kernel keeps at most {MAX_STATES} in registers")
    block_c = max(1, min(_power_of_two(geometry.classes), OCCUPANCY_TILE // block_l))
    block_n = min(MAX_BLOCK_N, max(16, _power_of_two(geometry.batch)))
    block_t = geometry.steps if interpreted else min(GPU_BLOCK_T, geometry.steps)
    return CtcConfig(block_l, block_c, block_n, FRAME_WARPS, block_t, recursion_warps(block_l))


def recursion_warps(block_l: int) -> int:
    """Warps of a program running the recursion: one up to RECURSION_STATES_PER_WARP states (its
    step's neighbour exchanges, tl.gather, stay warp shuffles: no shared memory, no barrier on
    the sequential path), one more per RECURSION_STATES_PER_WARP states beyond (up to 8)."""
    return min(8, max(1, block_l // RECURSION_STATES_PER_WARP))
