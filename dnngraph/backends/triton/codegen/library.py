"""Device functions of the fixed structure generated kernels share (imported as `lib`).

A generated kernel holds only what fusion changes; what every kernel of a family does the same
way lives here, as @triton.jit functions that Triton inlines into the caller (the same IR as the
text they replace, so the same loop structure, loads and dots). Like triton_math (`tm`) and
triton_reduce (`tr`), this module is imported by the generated source:

    from dnngraph.backends.triton.codegen import library as lib
"""
import triton
import triton.language as tl


@triton.jit
def tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile `tile` (row-major over tiles_m x tiles_n) in grouped
    order: GROUP_M row tiles walk their columns together, so they share B's columns in L2.

    The order is tl.swizzle2d(tile // tiles_n, tile % tiles_n, tiles_m, tiles_n, GROUP_M)
    (tests/backends/test_library.py checks it); written on the flat index, it skips swizzle2d's
    round trip through (row, column) and back, the arithmetic the kernels ran before this helper."""
    group_size = GROUP_M * tiles_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group_size) % rows_in_group
    pid_n = (tile % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def block_runs(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """(run_a, run_b): the run of blocks of BLOCK every row sees whole, [full_lo, full_hi)
    shrunk to block edges and clamped into [lo, hi] (lo on a block edge). An attention loop walks
    [lo, run_a) masked, [run_a, run_b) unmasked, [run_b, hi) masked."""
    run_a = tl.minimum(tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, lo), hi)
    run_b = tl.maximum(tl.minimum(full_hi // BLOCK * BLOCK, hi), run_a)
    return run_a, run_b
