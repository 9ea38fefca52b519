"""The device library (codegen/library.py) and the structure it takes out of generated source:
the tile order it computes is Triton's tl.swizzle2d order, GEMM kernels call it instead of
carrying the arithmetic, the sdpa forward holds its key-block body once (one generated
device function called per run of blocks), not one copy per run, and attention kernels take their
block ranges from lib.key_range / lib.query_range, which keep to the masks' visibility rule."""
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


# --- attention's block ranges: lib.key_range / lib.query_range -----------------------------------
INLINE_BOUNDS = ("q_lo", "q_hi", "hi = tl.maximum(hi, 0)", "tl.minimum(lo, hi) //", "full_lo = tl.maximum(",
                 "full_hi = tl.minimum(", "full_hi = tl.where(", "hi = tl.where(first_pos < len_q")


@pytest.mark.parametrize("attrs", [{"use_causal_mask": True},
                                   {"diagonal_band_left_bound": 20, "diagonal_band_right_bound": 9}])
def test_attention_kernels_call_the_library_ranges(attrs):
    """The forward and dQ kernels take their key blocks from lib.key_range, the dK/dV kernel its
    query blocks from lib.query_range: one call each, none of the bound arithmetic inline."""
    g, _, _ = _attention(**attrs)
    g.build(options=dg.BuildOptions(sdpa_config=heur.AttentionConfig(16, 16, 1, 1)))
    (forward,) = _sources(g)
    g = dg.Graph(name="attn", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, k, v, o, d_o = (g.tensor(name=name, dim=[1, 2, 70, 16]) for name in ("q", "k", "v", "o", "dO"))
    stats = g.tensor(name="stats", dim=[1, 2, 70, 1])
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, **attrs):
        grad.set_output(True)
    g.build(options=dg.BuildOptions(sdpa_config=heur.AttentionConfig(16, 16, 1, 1)))
    (dkdv,) = [s for s in _sources(g) if "for start_m in range(" in s]
    (dq,) = [s for s in _sources(g) if "for start_n in range(" in s]
    for source, call in ((forward, "lib.key_range("), (dq, "lib.key_range("), (dkdv, "lib.query_range(")):
        assert source.count("lib.key_range(") + source.count("lib.query_range(") == 1
        assert source.count(call) == 1
        assert source.count("lib.block_runs(") == 1
        assert not [text for text in INLINE_BOUNDS if text in source]


def _visible(i, j, shift, len_kv, left, right):
    """The rule every attention kernel masks with: row i sees key j."""
    return (0 <= j < len_kv and (right is None or j <= i + shift + right)
            and (left is None or j >= i + shift - left + 1))


@triton.jit
def _key_ranges(case_ptr, out_ptr, LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, IDLE: tl.constexpr, BLOCK_N: tl.constexpr, CASES: tl.constexpr):
    at = tl.arange(0, CASES)
    first, last, shift = tl.load(case_ptr + at * 5), tl.load(case_ptr + at * 5 + 1), tl.load(case_ptr + at * 5 + 2)
    len_q, len_kv = tl.load(case_ptr + at * 5 + 3), tl.load(case_ptr + at * 5 + 4)
    lo, hi, full_lo, full_hi = lib.key_range(first, last, shift, len_q, len_kv, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
                                             IDLE, BLOCK_N)
    tl.store(out_ptr + at * 4, lo)
    tl.store(out_ptr + at * 4 + 1, hi)
    tl.store(out_ptr + at * 4 + 2, full_lo)
    tl.store(out_ptr + at * 4 + 3, full_hi)


@triton.jit
def _query_ranges(case_ptr, out_ptr, LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr,
                  HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CASES: tl.constexpr):
    at = tl.arange(0, CASES)
    first_key, shift = tl.load(case_ptr + at * 4), tl.load(case_ptr + at * 4 + 1)
    len_q, len_kv = tl.load(case_ptr + at * 4 + 2), tl.load(case_ptr + at * 4 + 3)
    lo, hi, full_lo, full_hi = lib.query_range(first_key, shift, len_q, len_kv, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
                                               BLOCK_M, BLOCK_N)
    tl.store(out_ptr + at * 4, lo)
    tl.store(out_ptr + at * 4 + 1, hi)
    tl.store(out_ptr + at * 4 + 2, full_lo)
    tl.store(out_ptr + at * 4 + 3, full_hi)


BOUNDS = [(left, right) for left in (None, 1, 20) for right in (None, 0, 16)]
SHIFTS, LENS_Q, LENS_KV = (-20, 0, 5), (0, 20, 64), (0, 17, 70)


def _ranges(kernel, cases, *constexprs):
    padded = 1 << max(len(cases) - 1, 1).bit_length()
    table = torch.tensor(cases + [cases[-1]] * (padded - len(cases)), dtype=torch.int32)
    out = torch.full((padded, 4), -99, dtype=torch.int32)
    kernel[(1,)](table, out, *constexprs, padded)
    return out[:len(cases)].tolist()


@pytest.mark.parametrize("left,right", BOUNDS)
@pytest.mark.parametrize("idle", [False, True])
def test_key_range_is_the_visibility_rule(left, right, idle):
    """[lo, hi) holds every key some row of [first_pos, last_pos] sees, from the first one's block
    to the last one; [full_lo, full_hi) is exactly the keys every row sees; a tile past len_q
    (with IDLE_PAST_LEN_Q) walks nothing."""
    block = 16
    tiles = [(0, 0), (0, 2), (0, 15), (16, 31), (32, 47), (48, 63)]
    cases = [[first, last, shift, len_q, len_kv] for first, last in tiles for shift in SHIFTS
             for len_q in LENS_Q for len_kv in LENS_KV]
    found = _ranges(_key_ranges, cases, left or 0, right or 0, left is not None, right is not None, idle, block)
    for (first, last, shift, len_q, len_kv), (lo, hi, full_lo, full_hi) in zip(cases, found):
        rows, keys = range(first, last + 1), range(-5, len_kv + 90)
        seen = [j for j in keys if any(_visible(i, j, shift, len_kv, left, right) for i in rows)]
        whole = [j for j in keys if all(_visible(i, j, shift, len_kv, left, right) for i in rows)]
        if idle and first >= len_q:
            assert (lo, hi) == (0, 0)
            seen = []
        assert lo % block == 0 and 0 <= lo <= hi <= max(len_kv, 0)
        if seen:
            assert (lo, hi) == (seen[0] // block * block, seen[-1] + 1), (first, last, shift, len_q, len_kv)
        if not (idle and first >= len_q):
            assert [j for j in keys if full_lo <= j < full_hi] == whole, (first, last, shift, len_q, len_kv)


@pytest.mark.parametrize("left,right", BOUNDS)
def test_query_range_is_the_visibility_rule(left, right):
    """[lo, hi) holds every query row that sees a key of the block (rows of [0, len_q), from the
    first one's block to the last one); [full_lo, full_hi) is exactly the rows that see all of its
    keys (none when the block passes len_kv)."""
    block_m, block_n = 16, 16
    cases = [[first_key, shift, len_q, len_kv] for first_key in (0, 16, 32, 64) for shift in SHIFTS
             for len_q in LENS_Q for len_kv in LENS_KV]
    found = _ranges(_query_ranges, cases, left or 0, right or 0, left is not None, right is not None,
                    block_m, block_n)
    for (first_key, shift, len_q, len_kv), (lo, hi, full_lo, full_hi) in zip(cases, found):
        block, rows = range(first_key, first_key + block_n), range(-5, len_q + 90)
        seen = [i for i in rows if 0 <= i < len_q and any(_visible(i, j, shift, len_kv, left, right) for j in block)]
        whole = [i for i in rows if 0 <= i < len_q and all(_visible(i, j, shift, len_kv, left, right) for j in block)]
        assert lo % block_m == 0 and 0 <= lo <= hi <= len_q
        assert all(lo <= i < hi for i in seen)
        # the mask alone (keys past len_kv aside) bounds the range exactly
        reach = [i for i in rows if 0 <= i < len_q and any(_visible(i, j, shift, 10**6, left, right) for j in block)]
        if reach:
            assert (lo, hi) == (reach[0] // block_m * block_m, reach[-1] + 1), (first_key, shift, len_q, len_kv)
        assert [i for i in rows if full_lo <= i < full_hi] == whole, (first_key, shift, len_q, len_kv)
