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
# Frames per program of the gradient's per-frame kernel on a GPU: enough programs to fill the
# device at a speech batch (T=500, N=32: 2016), each loading its entry's labels once for 8 frames.
GPU_BLOCK_T = 8


@dataclass(frozen=True)
class CtcConfig:
    block_l: int  # states per program: a power of two >= 2 * label_width + 1
    block_c: int  # classes per step of the gradient's occupancy tile
    block_n: int  # entries per step of sums over the batch
    num_warps: int
    block_t: int  # frames per program of the gradient's per-frame kernel

    def text(self) -> str:
        return (f"BLOCK_L={self.block_l} BLOCK_C={self.block_c} BLOCK_N={self.block_n} BLOCK_T={self.block_t} "
                f"num_warps={self.num_warps}")


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
    # two states per thread, 1 to 8 warps: a frame's step is a few dependent shuffles and exps
    num_warps = min(8, max(1, block_l // 64))
    block_t = geometry.steps if interpreted else min(GPU_BLOCK_T, geometry.steps)
    return CtcConfig(block_l, block_c, block_n, num_warps, block_t)
