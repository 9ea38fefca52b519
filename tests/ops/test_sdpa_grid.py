"""Causal attention grids interleave a group of heads' tiles, the longest first: the schedule's
grid shapes, and the forward and backward against the float64 reference under every interleave
(a divisor of the heads or not, one head, all of them), with tiles small enough that each head
has several, Sq != Skv, both diagonal alignments and padded lengths."""
import pytest
import torch

import dataclasses

from dnngraph.backends.triton.heuristics import sdpa as heur
import dnngraph as dg
from helpers import check
from test_sdpa import MASKS, _run, _run_backward, _run_dbias, paged_graph

H100 = dg.target.H100
TILE = heur.AttentionConfig(16, 16, 1, 1)
# A grid axis y (and z) of 3 programs: the groups the limits force show on small shapes
SMALL_GRID = dataclasses.replace(dg.target.INTERPRETER, max_grid=(2**31 - 1, 3, 3))


def forced(tiles: bool = False, backward: bool = False, **fields) -> dg.BuildOptions:
    """Options with TILE forced for the forward (`tiles`) and the backward kernels (`backward`)."""
    if tiles:
        fields["sdpa_config"] = TILE
    if backward:
        fields.update(sdpa_dkdv_config=TILE, sdpa_dq_config=TILE)
    return dg.BuildOptions(**fields)


def _problem(causal=True, batch=1, heads=32, kv_heads=8, s=4096, masked=True):
    return heur.AttentionProblem(batch, heads, kv_heads, s, s, 128, 128, 2, masked, 0, causal)


def test_causal_grids_interleave_heads_and_bands_keep_the_plain_grid():
    sched = heur.schedule(_problem(), H100)
    tiles = -(-4096 // sched.config.block_m)
    assert sched.head_group == heur.LONGEST_FIRST_HEADS
    assert sched.programs == (heur.LONGEST_FIRST_HEADS * tiles, 32 // heur.LONGEST_FIRST_HEADS)
    assert "longest first" in sched.reason
    back = heur.backward_schedule(_problem(), H100)
    assert back.programs("dkdv") == (8 * -(-4096 // back.configs["dkdv"].block_n), 1)  # 8 K/V heads, one group
    assert back.programs("dq")[1] == 32 // heur.LONGEST_FIRST_HEADS
    assert back.programs("delta") == (-(-4096 // back.configs["delta"].block_m), 32)  # rows, not tiles
    band = heur.schedule(_problem(causal=False), H100)
    assert band.head_group == 0 and band.programs == (-(-4096 // band.config.block_m), 32)
    assert heur.backward_schedule(_problem(causal=False), H100).head_groups == {"dkdv": 0, "dq": 0, "delta": 0}


@pytest.mark.parametrize("heads,want", [(12, 6), (7, 7), (9, 3), (1, 1), (32, 8)])
def test_the_group_divides_the_heads(heads, want):
    assert heur.head_group(heads, True, H100) == want


@pytest.mark.parametrize("element_bytes,width", [(2, 128), (4, 128), (2, 256)])  # chain tiles, fp32, wide
def test_decode_and_op_level_chains_keep_the_plain_grid(element_bytes, width):
    """The chain kernels render no interleave: their schedules never ask for one, whether the
    chain tiles apply or the plain sdpa schedule is taken (fp32, wide heads, forced configs)."""
    decode = heur.schedule(heur.AttentionProblem(2, 8, 2, 1, 300, 64, 64, 2, True, 0, True), H100)
    assert decode.packed and decode.head_group == 0
    problem = heur.AttentionProblem(1, 32, 32, 4096, 4096, width, width, element_bytes, True, 0, True)
    for force in (heur.NOT_FORCED, heur.ForcedAttention(*[heur.AttentionConfig(64, 64, 4, 2)] * 3)):
        chain = heur.chain_schedule(problem, H100, forced=force)
        assert chain.head_group == 0 and chain.programs == (-(-4096 // chain.config.block_m), 32)
        back = heur.chain_backward_schedule(problem, H100, force)
        assert back.head_groups == {} and back.programs("dq")[1] == 32


GROUPS = [0, 1, 4, 5, 12]  # plain; reversed only; a divisor of 12; 5 -> 4; every head at once


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("mask,s_q,s_kv", [("causal", 37, 29), ("causal_bottom_right", 29, 45),
                                           ("right_only", 40, 40)])
def test_forward_under_every_interleave(group, mask, s_q, s_kv):
    _run((2, 6, s_q, 16), (3, s_kv), seed=group, options=forced(tiles=True, sdpa_head_group=group), **MASKS[mask])


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("mask,s_q,s_kv", [("causal", 37, 29), ("causal_bottom_right", 29, 45)])
def test_backward_under_every_interleave(group, mask, s_q, s_kv):
    _run_backward((2, 6, s_q, 16), (3, s_kv), seed=group, options=forced(backward=True, sdpa_head_group=group),
                  **MASKS[mask])


def test_padded_lengths_under_the_interleave():
    lens = ([1, 19, 0], [23, 1, 7])
    _run((3, 3, 19, 16), (3, 23), lens=lens, options=forced(tiles=True, sdpa_head_group=3),
         **MASKS["causal_bottom_right"])
    _run_backward((3, 3, 19, 16), (3, 23), lens=lens, options=forced(True, True, sdpa_head_group=3),
                  **MASKS["causal_bottom_right"])


@pytest.mark.parametrize("heads,causal,want", [(70000, False, 2), (65537, False, 65537), (65535, False, 0),
                                               (8 * 65536, True, 16), (9 * 65537, True, 65537)])
def test_groups_keep_grid_axis_y_within_cudas_limit(heads, causal, want):
    group = heur.head_group(heads, causal, H100)
    assert group == want and heads // max(group, 1) <= H100.max_grid[1]


def _problem_graph(b, h, s_q, s_kv, d, backward=False):
    import dnngraph as dg
    g = dg.Graph(name="wide", io_data_type=dg.float16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q = g.tensor(name="q", dim=[b, h, s_q, d])
    k, v = (g.tensor(name=n, dim=[b, h, s_kv, d]) for n in ("k", "v"))
    if backward:
        o, d_o = g.tensor(name="o", dim=[b, h, s_q, d]), g.tensor(name="dO", dim=[b, h, s_q, d])
        stats = g.tensor(name="stats", dim=[b, h, s_q, 1], data_type=dg.float32)
        for grad in g.sdpa_backward(q, k, v, o, d_o, stats):
            grad.set_output(True)
    else:
        g.sdpa(q, k, v)[0].set_output(True)
    return g


def test_many_batch_heads_build_within_the_grid_limits():
    """70000 (batch, head) pairs: the forward, the backward (delta, dK/dV, dQ) and a decode group
    two heads per program column, every grid within CUDA's limits; the dbias kernel of a bias
    with as many (batch, head) pairs folds its grid into axis x; a grid past the limits is
    refused at build, named."""
    from dnngraph.runtime.launch import check_grid
    for s_q, backward in ((40, False), (40, True), (1, False)):
        g = _problem_graph(70000, 1, s_q, 40, 16, backward)
        g.build(options=dg.BuildOptions(target=H100))
        for launch in g.plan.launches:
            assert H100.grid_fits(launch.grid), launch.config_text
            assert launch.grid[1] in (35000, 1), launch.config_text  # 1: the split decode's combine
    g = dg.Graph(name="dbias", io_data_type=dg.float16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, k, v, o, d_o = (g.tensor(name=n, dim=[70000, 1, 40, 16]) for n in ("q", "k", "v", "o", "dO"))
    stats = g.tensor(name="stats", dim=[70000, 1, 40, 1], data_type=dg.float32)
    bias = g.tensor(name="bias", dim=[70000, 1, 40, 40])
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, bias=bias, compute_dbias=True):
        if grad is not None:
            grad.set_output(True)
    g.build(options=dg.BuildOptions(target=H100))
    dbias = g.plan.launches[-1]
    assert dbias.config_text.startswith("dbias") and dbias.grid[1:] == (1, 1)
    with pytest.raises(dg.UnsupportedError, match=r"kernel_x: grid \[1, 65536, 1\]"):
        check_grid((1, 65536, 1), "/tmp/kernel_x.py", H100)
    check_grid((2**31 - 1, 65535, 65535), "/tmp/kernel_x.py", H100)


@pytest.mark.parametrize("splits", [None, 3])
def test_decode_with_groups_forced_by_the_grid_limit(splits):
    """Decode programs (K/V heads x batch) past a grid axis y of 3: groups of 3 heads' splits."""
    options = forced(target=SMALL_GRID, sdpa_splits=splits)
    _run((3, 8, 3, 16), (2, 77), lens=([3, 1, 2], [77, 5, 0]), options=options, **MASKS["causal_bottom_right"])
    _run((2, 4, 1, 24), (2, 50), bias_dim=(2, 4, 1, 50), dropout=(0.2, 11, 13), options=options)


@pytest.mark.parametrize("mask", ["none", "band", "causal"])
def test_forward_and_backward_with_groups_forced_by_the_grid_limit(mask):
    """A grid axis y of 3 programs: 8 (batch, head) pairs take groups of 4, the plain masks too,
    and the delta kernel with them; against the float64 reference."""
    _run((2, 4, 37, 16), (2, 29), options=forced(tiles=True, target=SMALL_GRID), **MASKS[mask])
    options = forced(True, True, target=SMALL_GRID)
    _run_backward((2, 4, 37, 16), (2, 29), options=options, **MASKS[mask])
    _run_backward((2, 4, 37, 16), (2, 29), workspace_limit=0, options=options, **MASKS[mask])


@pytest.mark.parametrize("group", [3, 8])
@pytest.mark.parametrize("mask", ["right_only", "causal_bottom_right"])
def test_interleave_with_dropout_bias_gqa_and_lengths(group, mask):
    """Dropout's counters, a bias, GQA and per-batch lengths under the interleave, the backward
    with and without the delta workspace."""
    options = forced(True, True, sdpa_head_group=group)
    attrs = dict(MASKS[mask], dropout=(0.25, 99, 2**34 + 1))
    lens = ([37, 5, 20], [45, 33, 1])
    _run((3, 4, 37, 16), (2, 45), bias_dim=(3, 4, 37, 45), lens=lens, options=options, **attrs)
    _run_backward((3, 4, 37, 16), (2, 45), bias_dim=(1, 4, 37, 45), lens=lens, options=options, **attrs)
    _run_backward((3, 4, 37, 16), (2, 45), bias_dim=(3, 1, 1, 45), workspace_limit=0, options=options, **attrs)


def test_dbias_and_paged_prefill_under_the_interleave():
    options = forced(True, True, sdpa_head_group=4)
    _run_dbias((2, 4, 35, 16), (2, 41), (1, 4, 35, 41), use_causal_mask_bottom_right=True,
               dropout=(0.2, 7, 3), lens=([35, 9], [41, 20]), options=options)
    g, inputs = paged_graph(12, 33, [48, 33, 40])
    g.build(options=options)
    assert "interleaved" in g.plan.launches[0].reason, g.plan.launches[0].reason
    check(g, inputs)


def test_the_h100_schedules_run_through_the_interpreter():
    """The GPU tables (fp32 tiles) and the default interleave, padded lengths, forward and backward."""
    options = dg.BuildOptions(target=H100)
    _run((2, 6, 150, 16), (3, 170), lens=([150, 70], [170, 100]), options=options, **MASKS["causal_bottom_right"])
    _run_backward((2, 6, 150, 16), (3, 170), lens=([150, 70], [170, 100]), options=options,
                  **MASKS["causal_bottom_right"])
