"""How many warps a tensor-core dot tile can use without replicating them over rows it lacks.

Triton 3.6 lays a tl.dot out on NVIDIA tensor cores in one of two ways:
  wgmma (mma v3)   Hopper (sm_90) only; a warpgroup (4 warps) owns 64 rows of the result. Chosen when the
                   dot's rows are a multiple of 64 and the warps a multiple of 4 (and the
                   operand types and K qualify). warpsPerTileV3 lays a lone dot out from
                   [4, 1], doubling M while the rows exceed the warps' and N after: no warp
                   sits on missing rows. A dot whose result feeds another dot (the head of a
                   chain: attention's q k^T) takes every warp along M instead, whatever its
                   rows: 8 warps on a 64-row query tile compute its scores twice (sm_90
                   TTGIR, warpsPerCTA [8, 1] on tensor<64x64xf32>, 2026-11-29); the dot it
                   feeds is laid out as a lone one.
  mma.sync (v2)    otherwise; a warp owns a 16 x 8 block of the result. The warps are placed
                   on a [warps along M, warps along N] grid by warpsPerTileV2 (AccelerateMatmul):
                   a lone dot halves its rows and columns in turn, rows first on a tie, and
                   puts the warps left over when both are down to one block along M; dots
                   chained through registers (attention: P = softmax(q k^T) feeding P v)
                   share one layout, every warp along M when the first dot laid out has at
                   least as many rows as columns, else every warp along N.
A warp grid covering more than the dot's rows replicates the tile across warps: the same math
done several times at best, and at worst wrong results (the fp8 attention's chained dots on a
32-row tile and 4 warps gave NaN rows on the H200, 2026-11-29). The rule here (fitting_warps)
keeps every family's num_warps to what its dot tiles fill; tests/sm90_compile.py's
replicated_mma_dots counts what the compiler actually laid out (tests/backends/test_mma_rows.py).
"""
from __future__ import annotations

# mma.sync m16n8: the rows and columns of the result one warp owns
WARP_ROWS = 16
WARP_COLS = 8
# wgmma: one warpgroup of 4 warps owns 64 rows
WARPGROUP_WARPS = 4
WARPGROUP_ROWS = 64


def has_wgmma(capability) -> bool:
    """Whether a device of compute `capability` ((major, minor); None: the interpreter) runs
    dots on wgmma: Hopper alone (other GPUs lay every dot out on mma.sync or, Blackwell, on
    instructions whose layouts this rule does not model, so it treats them as mma.sync)."""
    return capability is not None and capability[0] == 9


def on_wgmma(rows: int, num_warps: int) -> bool:
    """Whether a dot of `rows` rows on `num_warps` can take wgmma's layout on Hopper (the
    operand types and K permitting), which never replicates warps over rows."""
    return rows % WARPGROUP_ROWS == 0 and num_warps % WARPGROUP_WARPS == 0


def lone_dot_warps(rows: int, cols: int, num_warps: int) -> tuple:
    """(warps along M, warps along N) Triton 3.6 gives a lone dot of [rows, cols] on mma.sync:
    the warps balance the blocks each warp repeats (register pressure), rows first on a tie,
    and any warps past one block each go along M."""
    repeats = [max(1, -(-rows // WARP_ROWS)), max(1, -(-cols // WARP_COLS))]
    warps = [1, 1]
    while warps[0] * warps[1] < num_warps:
        if repeats[0] >= repeats[1]:
            warps[0] *= 2
            repeats[0] = max(1, repeats[0] // 2)
        else:
            warps[1] *= 2
            repeats[1] //= 2
    return warps[0], warps[1]


def replicates_rows(rows: int, cols: tuple, num_warps: int, chained: bool = False, wgmma: bool = True,
                    wgmma_head_copies: bool = False) -> bool:
    """Whether dot tiles of `rows` rows on `num_warps` put warps on rows they lack. `cols` holds
    the columns of each dot with those rows: lone dots (each laid out by itself), or, `chained`,
    dots sharing one layout through registers, which Triton takes from the first one it lays
    out: on mma.sync every warp along M when that one has no more columns than rows. `wgmma`:
    the device has it (has_wgmma), and tiles fit for it are laid out there: a lone dot never
    replicates, a chain's head dot has every warp along M. `wgmma_head_copies`: accept those
    copies (a caller whose dots fed by the head hold accumulators that fewer warps would spill:
    the copies cost score work, halving would double every thread's accumulator registers)."""
    if wgmma and on_wgmma(rows, num_warps):
        return chained and not wgmma_head_copies and num_warps * WARP_ROWS > rows
    if chained:
        along_m = num_warps if any(width <= rows for width in cols) else 1
    else:
        along_m = max(lone_dot_warps(rows, width, num_warps)[0] for width in cols)
    return along_m * WARP_ROWS > rows


def fitting_warps(rows: int, cols: tuple, num_warps: int, chained: bool = False, wgmma: bool = True,
                  wgmma_head_copies: bool = False) -> int:
    """`num_warps`, halved until no warp of the dot tiles (see replicates_rows) sits on rows
    they lack: a tile's work spread over fewer warps, not repeated on idle ones."""
    while num_warps > 1 and replicates_rows(rows, cols, num_warps, chained, wgmma, wgmma_head_copies):
        num_warps //= 2
    return num_warps
