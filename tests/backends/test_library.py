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


def _attention(**attrs):
    g = dg.Graph(name="attn", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, k, v = (g.tensor(name=name, dim=[1, 2, 70, 16]) for name in "qkv")
    o, stats = g.sdpa(q, k, v, is_inference=False, **attrs)
    o.set_output(True)
    stats.set_output(True)
    return g, o, (q, k, v)


@pytest.mark.parametrize("attrs", [{"use_causal_mask": True},
                                   {"use_causal_mask": True, "diagonal_band_left_bound": 20}])
def test_sdpa_forward_holds_its_block_body_once(attrs):
    g, _, _ = _attention(**attrs)
    g.build(options=dg.BuildOptions(sdpa_config=heur.AttentionConfig(16, 16, 1, 1)))
    (source,) = _sources(g)
    assert "from dnngraph.backends.triton.codegen import library as lib" in source
    assert source.count("lib.block_runs(") == 1
    assert source.count("@triton.jit\ndef attend_blocks(") == 1
    assert source.count("for start_n in range(") == 1
    assert source.count("tl.dot(q_tile") == 1  # the qk product
    assert source.count("tl.dot(p_tile") == 1  # the pv product
    calls = [line.strip() for line in source.splitlines() if "= attend_blocks(" in line]
    assert [call.endswith(flag) for call, flag in zip(calls, ("True)", "False)", "True)"))] == [True] * 3


def test_sdpa_backward_kernels_hold_their_block_bodies_once():
    g = dg.Graph(name="attn", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, k, v, o, d_o = (g.tensor(name=name, dim=[1, 2, 70, 16]) for name in ("q", "k", "v", "o", "dO"))
    stats = g.tensor(name="stats", dim=[1, 2, 70, 1])
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True):
        grad.set_output(True)
    g.build(options=dg.BuildOptions(sdpa_config=heur.AttentionConfig(16, 16, 1, 1)))
    looped = [s for s in _sources(g) if "attend_blocks" in s]
    assert len(looped) == 2  # dK/dV and dQ
    for source in looped:
        assert source.count("@triton.jit\ndef attend_blocks(") == 1
        assert source.count("for start_n in range(") + source.count("for start_m in range(") == 1
        assert source.count("= attend_blocks(") == 3
        assert source.count("lib.block_runs(") == 1
