"""The device library (codegen/library.py) and the structure it takes out of generated source:
the tile order it computes is Triton's tl.swizzle2d order, GEMM kernels call it instead of
carrying the arithmetic, and the sdpa forward holds its key-block body once (one generated
device function called per run of blocks), not one copy per run."""
import pytest
import torch

import dnngraph as dg  # (first: it picks the interpreter on a machine without a GPU)
import triton
import triton.language as tl
from dnngraph.backends.triton.codegen import library as lib
from dnngraph.backends.triton.heuristics import sdpa as heur


@triton.jit
def _tile_orders(out_ptr, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    tile = tl.program_id(0)
    pid_m, pid_n = lib.tile_of(tile, tiles_m, tiles_n, GROUP_M)
    sw_m, sw_n = tl.swizzle2d(tile // tiles_n, tile % tiles_n, tiles_m, tiles_n, GROUP_M)
    tl.store(out_ptr + tile * 4 + 0, pid_m)
    tl.store(out_ptr + tile * 4 + 1, pid_n)
    tl.store(out_ptr + tile * 4 + 2, sw_m)
    tl.store(out_ptr + tile * 4 + 3, sw_n)


def _orders(tiles_m, tiles_n, group):
    out = torch.full((tiles_m * tiles_n, 4), -1, dtype=torch.int32)
    _tile_orders[(tiles_m * tiles_n,)](out, tiles_m, tiles_n, group)
    return out


@pytest.mark.parametrize("tiles_m,tiles_n,group", [(1, 1, 8), (5, 3, 2), (17, 4, 8), (8, 9, 8), (3, 7, 1)])
def test_tile_order_is_swizzle2d(tiles_m, tiles_n, group):
    out = _orders(tiles_m, tiles_n, group)
    assert torch.equal(out[:, :2], out[:, 2:])
    # a permutation of the tiles, grouped: GROUP_M row tiles walk their columns together
    assert sorted(map(tuple, out[:, :2].tolist())) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
    for tile, (pid_m, pid_n) in enumerate(out[:, :2].tolist()):
        first = tile // (group * tiles_n) * group
        rows = min(tiles_m - first, group)
        assert (pid_m, pid_n) == (first + tile % (group * tiles_n) % rows, tile % (group * tiles_n) // rows)


def _sources(g) -> list:
    return [launch.source_path.read_text() for launch in g.plan.launches]


def test_gemm_kernels_call_the_library_tile_order():
    g = dg.Graph()
    a, w = g.tensor(name="a", dim=[2, 40, 24]), g.tensor(name="w", dim=[24, 36])
    g.relu(g.matmul(a, w)).set_output(True)
    g.build()
    (source,) = [s for s in _sources(g) if "tl.dot(" in s]
    assert "from dnngraph.backends.triton.codegen import library as lib" in source
    assert source.count("lib.tile_of(") == 1
    assert "group_size" not in source and "rows_in_group" not in source
