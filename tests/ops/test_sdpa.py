"""sdpa forward (flash attention) on CPU through the interpreter, against the float64 reference:
every mask alone and combined, padding, GQA/MQA, head dims that are not powers of two, d_qk != d_v,
layouts, bias broadcasts, dropout, paged K/V, the fused epilogue, and bad input; the backward; on
the GPU (marked gpu) bf16/fp16 at realistic shapes and every head dim class, forward and
backward; and review findings: the smallest repro of each defect found in review, or a hostile
case that held up."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import sdpa as heur
from helpers import check, rel_err, run

TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}


def _bhsd(shape, layout, dtype, generator):
    """A [B, H, S, D] tensor stored BHSD, BSHD (heads inside the sequence) or with odd strides."""
    b, h, s, d = shape
    if layout == "bshd":
        return torch.randn(b, s, h, d, generator=generator).to(dtype).permute(0, 2, 1, 3)
    if layout == "odd":
        return torch.randn(b, h, s + 3, 2 * d + 1, generator=generator).to(dtype)[:, :, 2:, 1:2 * d + 1:2]
    return torch.randn(b, h, s, d, generator=generator).to(dtype)


def _qkv(shape_q, shape_kv, layout, dtype, value_dim, generator) -> tuple:
    """q [B, H, Sq, D], k and v [B, Hkv, Skv, D or value_dim] in `layout`."""
    b, h, s_q, d = shape_q
    h_kv, s_kv = shape_kv
    return (_bhsd((b, h, s_q, d), layout, dtype, generator), _bhsd((b, h_kv, s_kv, d), layout, dtype, generator),
            _bhsd((b, h_kv, s_kv, value_dim or d), layout, dtype, generator))


def _graph(dtype, q_t, k_t, v_t, **kwargs):
    g = dg.Graph(name="attn", io_data_type=TYPES[dtype], intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, k, v = (g.tensor_like(t, name) for t, name in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    return g, {q: q_t, k: k_t, v: v_t}, q, k, v


def _run(shape_q, shape_kv, dtype=torch.float32, layout="bhsd", value_dim=None, lens=None, bias_dim=None,
         seed=0, tolerance=None, options=None, **attrs):
    gen = torch.Generator().manual_seed(seed)
    b = shape_q[0]
    q_t, k_t, v_t = _qkv(shape_q, shape_kv, layout, dtype, value_dim, gen)
    g, inputs, q, k, v = _graph(dtype, q_t, k_t, v_t)
    if lens is not None:
        for name, values in zip(("seq_len_q", "seq_len_kv"), lens):
            if values is not None:
                t = g.tensor(name=name, dim=[b, 1, 1, 1], data_type=dg.int32)
                inputs[t] = torch.tensor(values, dtype=torch.int32).view(b, 1, 1, 1)
                attrs[name] = t
    if bias_dim is not None:
        bias = g.tensor(name="bias", dim=list(bias_dim))
        inputs[bias] = torch.randn(bias_dim, generator=gen).to(dtype)
        attrs["bias"] = bias
    o, stats = g.sdpa(q, k, v, is_inference=False, **attrs)
    o.set_output(True)
    stats.set_output(True)
    g.build(options=options)
    split = g.plan.launches[-1].config_text.startswith("combine")
    assert len(g.plan.launches) == (2 if split else 1)
    return check(g, inputs, dtype, tolerance=tolerance)


MASKS = {
    "none": {},
    "causal": {"use_causal_mask": True},
    "causal_bottom_right": {"use_causal_mask_bottom_right": True},
    "window": {"use_causal_mask": True, "diagonal_band_left_bound": 5},
    "window_bottom_right": {"use_causal_mask_bottom_right": True, "diagonal_band_left_bound": 4},
    "band": {"diagonal_band_left_bound": 3, "diagonal_band_right_bound": 6},
    "band_bottom_right": {"diagonal_alignment": "bottom_right", "diagonal_band_left_bound": 2,
                          "diagonal_band_right_bound": 1},
    "right_only": {"diagonal_band_right_bound": 2},
}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("s_q,s_kv", [(21, 37), (37, 21)])
def test_masks_sq_not_skv(mask, s_q, s_kv):
    """Sq > Skv bottom-right leaves the first rows with no key: zeros and -inf stats."""
    _run((2, 2, s_q, 16), (2, s_kv), **MASKS[mask])


@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "window"])
def test_padding_masks_with_lengths_of_one_and_zero(mask):
    """Per-batch lengths: a query length of 1, a key length of 1, a batch with no keys at all."""
    _run((3, 2, 19, 16), (2, 23), lens=([1, 19, 7], [23, 1, 0]), **MASKS[mask])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_query_and_multi_query(heads, kv_heads, dtype):
    _run((2, heads, 17, 16), (kv_heads, 29), dtype=dtype, use_causal_mask=True)


@pytest.mark.parametrize("head_dim,value_dim", [(24, 24), (40, 16), (16, 40), (8, 8)])
def test_head_dims_not_powers_of_two_and_dqk_not_dv(head_dim, value_dim):
    _run((2, 2, 18, head_dim), (2, 21), value_dim=value_dim)


@pytest.mark.parametrize("layout", ["bshd", "odd"])
def test_layouts_without_copies(layout):
    _run((2, 4, 19, 16), (2, 25), layout=layout, use_causal_mask=True)


@pytest.mark.parametrize("bias_dim", [(1, 1, 1, 26), (2, 1, 17, 26), (1, 3, 1, 1), (2, 3, 17, 26)])
def test_bias_broadcast_over_any_axis(bias_dim):
    _run((2, 3, 17, 16), (3, 26), bias_dim=bias_dim, use_causal_mask_bottom_right=True)


def test_scale_and_large_scores_stay_finite():
    """attn_scale 3 on unit-normal inputs gives scores far past exp's range in a naive softmax."""
    _run((1, 2, 33, 16), (2, 40), attn_scale=3.0)


def test_dropout_matches_the_reference_philox_mask():
    _run((2, 2, 17, 16), (2, 23), dropout=(0.3, 123456789012, 2**33 + 5), use_causal_mask=True)


def test_fp16_io_with_poisoned_outputs():
    _run((2, 2, 33, 32), (2, 47), dtype=torch.float16, use_causal_mask=True)


def test_forced_small_tiles_walk_every_block_run():
    """16 x 16 tiles over 70 keys: masked runs before and after the fully visible ones."""
    _run((1, 2, 70, 16), (2, 70), diagonal_band_left_bound=20, diagonal_band_right_bound=9,
         options=dg.BuildOptions(sdpa_config=heur.AttentionConfig(16, 16, 1, 1)))


def _paged(batch, kv_heads, page, pages_per_seq, head_dim, generator):
    pool_pages = batch * pages_per_seq + 3
    k_pool = torch.randn(pool_pages, kv_heads, page, head_dim, generator=generator)
    v_pool = torch.randn(pool_pages, kv_heads, page, head_dim, generator=generator)
    order = torch.randperm(pool_pages, generator=generator)[:batch * pages_per_seq]
    table = order.view(batch, 1, pages_per_seq, 1).to(torch.int32)
    return k_pool, v_pool, table


def paged_graph(pages_per_seq: int, s_q: int, seq_lens: list, junk_from_page=None) -> tuple:
    """(graph, inputs) of a paged sdpa, bottom-right causal, outputs o and stats: 3 sequences of
    `seq_lens` keys, 2 K/V heads in 4-key pages out of order, 4 query heads; sequence 1's table
    entries from `junk_from_page` on hold junk (never read)."""
    gen = torch.Generator().manual_seed(3)
    k_pool, v_pool, table = _paged(3, 2, 4, pages_per_seq, 16, gen)
    if junk_from_page is not None:
        table[1, 0, junk_from_page:, 0] = -7
    q_t = torch.randn(3, 4, s_q, 16, generator=gen)
    g, inputs, q, k, v = _graph(torch.float32, q_t, k_pool, v_pool)
    kt, vt = (g.tensor(name=n, dim=[3, 1, pages_per_seq, 1], data_type=dg.int32) for n in ("ktab", "vtab"))
    lens = g.tensor(name="lens", dim=[3, 1, 1, 1], data_type=dg.int32)
    inputs.update({kt: table, vt: table.clone(), lens: torch.tensor(seq_lens, dtype=torch.int32).view(3, 1, 1, 1)})
    o, stats = g.sdpa(q, k, v, is_inference=False, seq_len_kv=lens, paged_attention_k_table=kt,
                      paged_attention_v_table=vt, use_causal_mask_bottom_right=True)
    o.set_output(True)
    stats.set_output(True)
    return g, inputs


@pytest.mark.parametrize("s_q", [1, 9])
def test_paged_kv_pages_out_of_order(s_q):
    """Decode (Sq 1) and paged prefill; table entries past a sequence's length hold junk."""
    check(*paged_graph(5, s_q, [20, 9, 1], junk_from_page=3))  # sequence 1: 9 keys = 3 pages


def test_epilogue_cast_and_scale_fuse_into_one_kernel():
    gen = torch.Generator().manual_seed(5)
    q_t, k_t, v_t = (torch.randn(2, 2, 19, 16, generator=gen) for _ in range(3))
    g, inputs, q, k, v = _graph(torch.float32, q_t, k_t, v_t)
    o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    o.set_output(True).set_name("o_plain")
    g.cast(g.mul(o, 2.0), data_type=dg.float16).set_output(True).set_name("o16")
    g.build()
    assert len(g.plan.launches) == 1 and g.plan.launches[0].group.kind == "sdpa"
    check(g, inputs, tolerance=2e-3)


def test_names_that_look_like_kernel_variables():
    gen = torch.Generator().manual_seed(6)
    q_t, k_t, v_t = (torch.randn(1, 2, 17, 16, generator=gen) for _ in range(3))
    g = dg.Graph(name="acc")
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q_tile"), (k_t, "scores"), (v_t, "m_i")))
    o, stats = g.sdpa(q, k, v, is_inference=False, name="l_i")
    o.set_output(True).set_name("out")
    stats.set_output(True).set_name("lse")
    check(g, {q: q_t, k: k_t, v: v_t})


def test_inference_needs_no_stats_buffer():
    gen = torch.Generator().manual_seed(7)
    q_t, k_t, v_t = (torch.randn(1, 2, 17, 16, generator=gen) for _ in range(3))
    g, inputs, q, k, v = _graph(torch.float32, q_t, k_t, v_t)
    o, stats = g.sdpa(q, k, v)
    assert stats is None
    o.set_output(True)
    check(g, inputs)


BAD = {
    "head dims differ": lambda g, t: g.sdpa(t["q"], t["k16"], t["k16"]),
    "heads not a multiple": lambda g, t: g.sdpa(t["q"], t["k3"], t["k3"]),
    "negative left bound": lambda g, t: g.sdpa(t["q"], t["k"], t["k"], diagonal_band_left_bound=-1),
    "zero left bound": lambda g, t: g.sdpa(t["q"], t["k"], t["k"], diagonal_band_left_bound=0),
    "negative right bound": lambda g, t: g.sdpa(t["q"], t["k"], t["k"], diagonal_band_right_bound=-2),
    "two causal masks": lambda g, t: g.sdpa(t["q"], t["k"], t["k"], use_causal_mask=True,
                                            use_causal_mask_bottom_right=True),
    "causal with a right bound": lambda g, t: g.sdpa(t["q"], t["k"], t["k"], use_causal_mask=True,
                                                     diagonal_band_right_bound=3),
    "unknown alignment": lambda g, t: g.sdpa(t["q"], t["k"], t["k"], diagonal_alignment="center"),
    "paged table of the wrong shape": lambda g, t: g.sdpa(t["q"], t["pool"], t["pool"], seq_len_kv=t["lens"],
                                                          paged_attention_k_table=t["bad_table"],
                                                          paged_attention_v_table=t["bad_table"]),
    "paged without seq_len_kv": lambda g, t: g.sdpa(t["q"], t["pool"], t["pool"], paged_attention_k_table=t["table"],
                                                    paged_attention_v_table=t["table"]),
    "one paged table": lambda g, t: g.sdpa(t["q"], t["pool"], t["pool"], seq_len_kv=t["lens"],
                                           paged_attention_k_table=t["table"]),
    "float lengths": lambda g, t: g.sdpa(t["q"], t["k"], t["k"], seq_len_kv=t["flens"]),
    "dbias without a bias": lambda g, t: g.sdpa_backward(t["q"], t["k"], t["k"], t["q"], t["q"], t["stats"],
                                                         compute_dbias=True),
    "dbias of an integer bias": lambda g, t: g.sdpa_backward(t["q"], t["k"], t["k"], t["q"], t["q"], t["stats"],
                                                             bias=t["ibias"], compute_dbias=True),
    "dbias not a bool": lambda g, t: g.sdpa_backward(t["q"], t["k"], t["k"], t["q"], t["q"], t["stats"],
                                                     bias=t["bias"], compute_dbias="yes"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_validation_error_at_the_call(case):
    g = dg.Graph()
    t = {"q": g.tensor(name="q", dim=[2, 4, 8, 32]), "k": g.tensor(name="k", dim=[2, 2, 8, 32]),
         "k16": g.tensor(name="k16", dim=[2, 2, 8, 16]), "k3": g.tensor(name="k3", dim=[2, 3, 8, 32]),
         "pool": g.tensor(name="pool", dim=[9, 2, 4, 32]),
         "table": g.tensor(name="table", dim=[2, 1, 3, 1], data_type=dg.int32),
         "bad_table": g.tensor(name="bad_table", dim=[2, 3, 1], data_type=dg.int32),
         "lens": g.tensor(name="lens", dim=[2, 1, 1, 1], data_type=dg.int32),
         "flens": g.tensor(name="flens", dim=[2, 1, 1, 1]),
         "stats": g.tensor(name="stats", dim=[2, 4, 8, 1], data_type=dg.float32),
         "bias": g.tensor(name="bias", dim=[1, 4, 8, 8]),
         "ibias": g.tensor(name="ibias", dim=[1, 4, 8, 8], data_type=dg.int32)}
    with pytest.raises(dg.ValidationError):
        BAD[case](g, t)


# --- backward -------------------------------------------------------------------------------------
def _forward_values(q_t, k_t, v_t, inputs_extra, attrs):
    """o and stats of the float64 reference forward (what a training step saved)."""
    g = dg.Graph(name="fwd")
    q, k, v = (g.tensor_like(t.double().to(torch.float32), n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    extra = {name: g.tensor_like(t, name) for name, t in inputs_extra.items()}
    o, stats = g.sdpa(q, k, v, is_inference=False, **attrs, **extra)
    o.set_output(True)
    stats.set_output(True)
    refs = g.reference({"q": q_t, "k": k_t, "v": v_t, **inputs_extra})
    return refs[o.name], refs[stats.name]


def _run_backward(shape_q, shape_kv, dtype=torch.float32, layout="bhsd", value_dim=None, lens=None,
                  bias_dim=None, seed=0, tolerance=None, workspace_limit=None, options=None, **attrs):
    gen = torch.Generator().manual_seed(seed)
    b = shape_q[0]
    q_t, k_t, v_t = _qkv(shape_q, shape_kv, layout, dtype, value_dim, gen)
    extra = {}
    if lens is not None:
        for name, values in zip(("seq_len_q", "seq_len_kv"), lens):
            if values is not None:
                extra[name] = torch.tensor(values, dtype=torch.int32).view(b, 1, 1, 1)
    if bias_dim is not None:
        extra["bias"] = torch.randn(bias_dim, generator=gen).to(dtype)
    o_t, stats_t = _forward_values(q_t, k_t, v_t, extra, attrs)
    o_t = o_t.to(dtype)
    do_t = torch.randn(o_t.shape, generator=gen).to(dtype)
    g, inputs, q, k, v = _graph(dtype, q_t, k_t, v_t)
    o, d_o = g.tensor_like(o_t, "o"), g.tensor_like(do_t, "dO")
    stats = g.tensor_like(stats_t.float(), "stats")
    inputs.update({o: o_t, d_o: do_t, stats: stats_t.float()})
    for name, t in extra.items():
        tensor = g.tensor_like(t, name)
        inputs[tensor] = t
        attrs[name] = tensor
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, **attrs):
        grad.set_output(True)
    g.build(workspace_limit=workspace_limit, options=options)
    assert len(g.plan.launches) == (2 if workspace_limit == 0 else 3)
    return check(g, inputs, dtype, tolerance=tolerance)


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("s_q,s_kv", [(21, 37), (37, 21)])
def test_backward_masks_sq_not_skv(mask, s_q, s_kv):
    _run_backward((2, 2, s_q, 16), (2, s_kv), **MASKS[mask])


@pytest.mark.parametrize("mask", ["none", "causal_bottom_right", "window"])
def test_backward_padding_with_lengths_of_one_and_zero(mask):
    _run_backward((3, 2, 19, 16), (2, 23), lens=([1, 19, 7], [23, 1, 0]), **MASKS[mask])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_gqa_sums_over_the_group(heads, kv_heads, dtype):
    _run_backward((2, heads, 17, 16), (kv_heads, 29), dtype=dtype, use_causal_mask=True,
                  tolerance=5e-3 if dtype == torch.float16 else None)


@pytest.mark.parametrize("head_dim,value_dim", [(24, 24), (40, 16)])
@pytest.mark.parametrize("layout", ["bhsd", "odd"])
def test_backward_head_dims_and_layouts(head_dim, value_dim, layout):
    _run_backward((2, 2, 18, head_dim), (2, 21), value_dim=value_dim, layout=layout)


def test_backward_bias_dropout_and_no_workspace():
    """Bias and dropout recomputed from the same Philox counters; workspace 0 takes the row sums
    inside the dK/dV and dQ kernels instead of the preprocess."""
    attrs = dict(dropout=(0.25, 99, 2**34 + 1), use_causal_mask=True)
    _run_backward((2, 3, 17, 16), (3, 26), bias_dim=(1, 3, 17, 26), **attrs)
    _run_backward((2, 3, 17, 16), (3, 26), bias_dim=(2, 1, 1, 26), workspace_limit=0, **attrs)


def test_backward_forced_tiles_walk_every_run():
    tile = heur.AttentionConfig(16, 16, 1, 1)
    _run_backward((1, 2, 70, 16), (2, 66), diagonal_band_left_bound=20, diagonal_band_right_bound=9,
                  options=dg.BuildOptions(sdpa_dkdv_config=tile, sdpa_dq_config=tile))


# --- decode: query heads packed per K/V head, keys split and merged ------------------------------
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("mask", ["none", "causal_bottom_right", "window_bottom_right", "band"])
def test_decode_packed_and_split(splits, mask):
    """Sq 1-3 with GQA 4:1: every query row of a K/V head in one tile; forced splits merge their
    partials by log-sum-exp (padding leaves some splits empty)."""
    options = dg.BuildOptions(sdpa_splits=splits)
    _run((3, 8, 3, 16), (2, 77), lens=([3, 1, 2], [77, 5, 0]), options=options, **MASKS[mask])
    _run((2, 4, 1, 24), (1, 50), bias_dim=(2, 4, 1, 50), dropout=(0.2, 11, 13), options=options, **MASKS[mask])


def test_decode_split_with_epilogue_paged_and_no_workspace():
    gen = torch.Generator().manual_seed(8)
    k_pool, v_pool, table = _paged(2, 2, 4, 9, 16, gen)
    q_t = torch.randn(2, 8, 1, 16, generator=gen)
    for limit in (None, 0):
        g, inputs, q, k, v = _graph(torch.float32, q_t, k_pool, v_pool)
        kt = g.tensor(name="kt", dim=[2, 1, 9, 1], data_type=dg.int32)
        lens = g.tensor(name="lens", dim=[2, 1, 1, 1], data_type=dg.int32)
        inputs.update({kt: table, lens: torch.tensor([36, 13], dtype=torch.int32).view(2, 1, 1, 1)})
        o, stats = g.sdpa(q, k, v, is_inference=False, seq_len_kv=lens, paged_attention_k_table=kt,
                          paged_attention_v_table=kt)
        stats.set_output(True)
        g.cast(g.mul(o, 3.0), data_type=dg.float16).set_output(True).set_name("o16")
        g.build(workspace_limit=limit, options=dg.BuildOptions(sdpa_splits=4))
        assert len(g.plan.launches) == (2 if limit is None else 1)
        check(g, inputs, tolerance=2e-3)


# --- attention written as ops: the score chain becomes the flash kernel's score modifier ---------
def _op_level(dtype, b, h, s_q, s_kv, d, dv, softcap=None, rank=4, seed=9, kt_layout="transposed", dropout=None):
    gen = torch.Generator().manual_seed(seed)
    lead = [b, h] if rank == 4 else [b * h]
    q_t = torch.randn(lead + [s_q, d], generator=gen).to(dtype)
    k_t = torch.randn(lead + [s_kv, d], generator=gen).to(dtype)
    kt_t = k_t.transpose(-1, -2) if kt_layout == "transposed" else k_t.transpose(-1, -2).contiguous()
    v_t = torch.randn(lead + [s_kv, dv], generator=gen).to(dtype)
    bias_t = torch.randn([1] * (rank - 2) + [s_q, s_kv], generator=gen).to(dtype)
    mask_t = (torch.arange(s_kv).view(1, -1) <= torch.arange(s_q).view(-1, 1) + (s_kv - s_q))
    mask_t = mask_t.view([1] * (rank - 2) + [s_q, s_kv])
    g = dg.Graph(name="ops", io_data_type=TYPES[dtype], intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, kt, v = g.tensor_like(q_t, "q"), g.tensor_like(kt_t, "kt"), g.tensor_like(v_t, "v")
    bias, mask = g.tensor_like(bias_t, "acc"), g.tensor_like(mask_t, "scores")  # kernel-like names
    s = g.add(g.mul(g.matmul(q, kt), 1.0 / d ** 0.5), bias)
    if softcap is not None:
        s = g.mul(g.tanh(g.div(s, softcap)), softcap)
    s = g.where(mask, s, float("-inf"))
    inputs = {q: q_t, kt: kt_t, v: v_t, bias: bias_t, mask: mask_t}
    probs = g.softmax(s, axis=-1)
    if dropout is not None:  # (p, seed, offset), a tensor where the value is a torch tensor
        drop = []
        for name, value in zip(("seed", "offset"), dropout[1:]):
            if isinstance(value, torch.Tensor):
                inputs[g.tensor_like(value, name)] = value
                value = next(t for t in inputs if t.name == name)
            drop.append(value)
        probs = g.dropout(probs, dropout[0], *drop)
    g.matmul(probs, v).set_output(True).set_name("o")
    g.build()
    return g, inputs


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_op_level_attention_is_one_flash_kernel(softcap, rank, dtype):
    """scale + bias + softcap + a causal mask from `where` on a bool tensor: one kernel, one
    group of kind 'attention', the reference's numbers (rows past the mask's reach see no key)."""
    g, inputs = _op_level(dtype, 2, 3, 21, 37, 16, 24, softcap, rank)
    assert len(g.plan.launches) == 1 and g.plan.launches[0].group.kind == "attention"
    check(g, inputs, dtype)


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("tensors", [False, True])
def test_op_level_attention_with_dropout_is_one_kernel(rank, tensors):
    """softmax -> dropout -> matmul: the kernel draws the dropout op's counters (seed and offset
    as ints or as int64 tensors)."""
    seed, offset = 2**40 + 5, 77
    if tensors:
        seed, offset = torch.tensor([seed], dtype=torch.int64), torch.tensor([offset], dtype=torch.int64)
    g, inputs = _op_level(torch.float32, 2, 3, 19, 27, 16, 8, 4.0, rank, dropout=(0.3, seed, offset))
    assert len(g.plan.launches) == 1 and g.plan.launches[0].group.kind == "attention"
    check(g, inputs)


def test_op_level_dropout_that_returns_its_mask_stays_unfused():
    g = dg.Graph()
    q, kt, v = (g.tensor(name=n, dim=d) for n, d in (("q", [2, 9, 8]), ("kt", [2, 8, 11]), ("v", [2, 11, 5])))
    probs, mask = g.dropout(g.softmax(g.matmul(q, kt)), 0.5, 3, return_mask=True)
    g.matmul(probs, v).set_output(True)
    mask.set_output(True)
    g.build()
    assert "attention" not in [l.group.kind for l in g.plan.launches]
    gen = torch.Generator().manual_seed(4)
    check(g, {"q": torch.randn(2, 9, 8, generator=gen), "kt": torch.randn(2, 8, 11, generator=gen),
              "v": torch.randn(2, 11, 5, generator=gen)})


def test_op_level_attention_with_contiguous_kt_and_fully_masked_rows():
    """Sq > Skv with a bottom-right mask: the first rows see no key at all; the reference's
    softmax of an all -inf row is NaN, and so is the kernel's output there."""
    g, inputs = _op_level(torch.float32, 1, 2, 40, 23, 16, 16, None, 4, kt_layout="contiguous")
    assert len(g.plan.launches) == 1
    check(g, inputs)


def test_op_level_chain_that_does_not_fit_runs_unfused():
    """A chain on rank-5 operands is not the flash kernel's: it runs as matmul, softmax, matmul."""
    g = dg.Graph()
    q, kt, v = (g.tensor(name=n, dim=d) for n, d in (("q", [1, 2, 2, 9, 8]), ("kt", [1, 2, 2, 8, 11]),
                                                        ("v", [1, 2, 2, 11, 5])))
    g.matmul(g.softmax(g.mul(g.matmul(q, kt), 0.3)), v).set_output(True)
    g.build()
    assert [l.group.kind for l in g.plan.launches] == ["matmul", "softmax", "matmul"]
    gen = torch.Generator().manual_seed(1)
    check(g, {"q": torch.randn(1, 2, 2, 9, 8, generator=gen), "kt": torch.randn(1, 2, 2, 8, 11, generator=gen),
              "v": torch.randn(1, 2, 2, 11, 5, generator=gen)})


def test_head_dims_past_the_gpu_tables_are_unsupported_for_a_gpu():
    wide = heur.AttentionProblem(1, 2, 2, 64, 64, 320, 320, 2)
    with pytest.raises(dg.UnsupportedError, match="320"):
        heur.schedule(wide, dg.target.H100)
    with pytest.raises(dg.UnsupportedError, match="320"):
        heur.backward_schedule(wide, dg.target.H100)
    _run((1, 2, 17, 300), (2, 19))  # the interpreter runs any width


def test_dropout_seed_and_offset_tensors_forward_and_backward():
    """sdpa's dropout=(p, seed tensor, offset tensor): one graph, any step's seed and offset, the
    forward and the backward drawing the reference's Philox mask."""
    gen = torch.Generator().manual_seed(12)
    q_t, k_t, v_t = (torch.randn(2, 2, 17, 16, generator=gen) for _ in range(3))
    g, inputs, q, k, v = _graph(torch.float32, q_t, k_t, v_t)
    seed, offset = g.tensor(name="seed", dim=[1], data_type=dg.int64), g.tensor(name="offset", dim=[1], data_type=dg.int64)
    o, stats = g.sdpa(q, k, v, is_inference=False, dropout=(0.25, seed, offset), use_causal_mask=True)
    o.set_output(True)
    stats.set_output(True)
    d_o = g.tensor(name="dO", dim=[2, 2, 17, 16])
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, dropout=(0.25, seed, offset), use_causal_mask=True):
        grad.set_output(True)
    g.build()
    for seed_value, offset_value in ((-9, 5), (2**40, 2**35)):
        check(g, {**inputs, seed: torch.tensor([seed_value]), offset: torch.tensor([offset_value]),
                  d_o: torch.randn(2, 2, 17, 16, generator=gen)})


def test_backward_is_deterministic_in_either_mode():
    """use_deterministic_algorithm is accepted (the cuDNN frontend's name); both values build the
    same atomic-free kernels, so repeated runs and both modes agree bit for bit."""
    gen = torch.Generator().manual_seed(21)
    q_t, k_t, v_t, do_t = (torch.randn(1, 2, 19, 16, generator=gen) for _ in range(4))
    results = []
    for deterministic in (False, True, False):
        g, inputs, q, k, v = _graph(torch.float32, q_t, k_t, v_t)
        o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=True)
        d_o = g.tensor_like(do_t, "dO")
        for grad in g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True,
                                    use_deterministic_algorithm=deterministic):
            grad.set_output(True)
        results.append(check(g, {**inputs, d_o: do_t}))
    for other in results[1:]:
        assert all(torch.equal(results[0][name], other[name]) for name in results[0])


# --- dbias ----------------------------------------------------------------------------------------
def _run_dbias(shape_q, shape_kv, bias_dim, dtype=torch.float32, lens=None, seed=0, tolerance=None, options=None,
               **attrs):
    """sdpa_backward with compute_dbias: dq, dk, dv and dbias against autograd on the reference."""
    gen = torch.Generator().manual_seed(seed)
    b = shape_q[0]
    q_t, k_t, v_t = _qkv(shape_q, shape_kv, "bhsd", dtype, None, gen)
    extra = {"bias": torch.randn(bias_dim, generator=gen).to(dtype)}
    if lens is not None:
        for name, values in zip(("seq_len_q", "seq_len_kv"), lens):
            extra[name] = torch.tensor(values, dtype=torch.int32).view(b, 1, 1, 1)
    o_t, stats_t = _forward_values(q_t, k_t, v_t, extra, attrs)
    o_t, do_t = o_t.to(dtype), torch.randn(o_t.shape, generator=gen).to(dtype)
    g, inputs, q, k, v = _graph(dtype, q_t, k_t, v_t)
    o, d_o, stats = g.tensor_like(o_t, "o"), g.tensor_like(do_t, "dO"), g.tensor_like(stats_t.float(), "stats")
    inputs.update({o: o_t, d_o: do_t, stats: stats_t.float()})
    for name, t in extra.items():
        attrs[name] = g.tensor_like(t, name)
        inputs[attrs[name]] = t
    grads = g.sdpa_backward(q, k, v, o, d_o, stats, compute_dbias=True, **attrs)
    assert len(grads) == 4 and list(grads[3].dim) == list(bias_dim)
    for grad in grads:
        grad.set_output(True)
    g.build(options=options)
    assert len(g.plan.launches) == 4  # delta, dK/dV, dQ, dbias
    if bias_dim[3] > 1:
        return check(g, inputs, dtype, tolerance=tolerance)
    # constant along the keys: softmax ignores it, dbias is exactly 0 (the reference's is rounding)
    outputs, refs = run(g, inputs), g.reference(inputs)
    assert torch.equal(outputs[grads[3].name], torch.zeros(bias_dim, dtype=dtype))
    assert refs[grads[3].name].abs().max() < 1e-12
    for grad in grads[:3]:
        assert rel_err(outputs[grad.name], refs[grad.name]) < (tolerance or 2e-5), grad.name


@pytest.mark.parametrize("bias_dim", [(2, 3, 17, 26), (1, 3, 17, 26), (2, 1, 1, 26), (1, 1, 17, 26),
                                      (1, 1, 17, 1), (2, 3, 1, 1), (1, 1, 1, 1)])
def test_dbias_sums_over_every_broadcast_axis(bias_dim):
    _run_dbias((2, 3, 17, 16), (3, 26), bias_dim, use_causal_mask_bottom_right=True)


@pytest.mark.parametrize("mask", ["none", "window", "band_bottom_right"])
def test_dbias_with_masks_padding_dropout_and_gqa(mask):
    attrs = dict(MASKS[mask], dropout=(0.2, 7, 3))
    _run_dbias((3, 4, 19, 16), (2, 23), (1, 4, 19, 23), lens=([1, 19, 0], [23, 5, 4]), **attrs)


def test_dbias_fp16():
    _run_dbias((2, 2, 21, 16), (2, 18), (2, 2, 21, 18), dtype=torch.float16, use_causal_mask=True,
               tolerance=5e-3)


def test_backward_with_float32_do_and_o_from_graph_intermediates():
    """dO and o in float32 (a graph's intermediate values) with fp16 q, k, v: dO meets v on the
    tensor cores in fp16 (the interpreter refuses a dot of two types, as the compiler does)."""
    gen = torch.Generator().manual_seed(3)
    q_t, k_t, v_t = _qkv((2, 2, 19, 16), (2, 23), "bhsd", torch.float16, None, gen)
    o_t, stats_t = _forward_values(q_t, k_t, v_t, {}, {"use_causal_mask": True})
    do_t = torch.randn(o_t.shape, generator=gen)
    g, inputs, q, k, v = _graph(torch.float16, q_t, k_t, v_t)
    o, d_o = g.tensor_like(o_t.float(), "o"), g.tensor_like(do_t, "dO")
    stats = g.tensor_like(stats_t.float(), "stats")
    inputs.update({o: o_t.float(), d_o: do_t, stats: stats_t.float()})
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True):
        grad.set_output(True)
    for workspace in (None, 0):
        g.build(workspace_limit=workspace)
        check(g, inputs, torch.float16, tolerance=5e-3)


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_fp32_attention_follows_the_graphs_tf32_setting(allow_tf32):
    """fp32 q, k, v: IEEE dots unless the graph allows tf32, as the matmul does."""
    gen = torch.Generator().manual_seed(8)
    q_t, k_t, v_t = _qkv((1, 2, 17, 16), (2, 19), "bhsd", torch.float32, None, gen)
    g = dg.Graph(name="attn", allow_tf32=allow_tf32)
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    g.sdpa(q, k, v, use_causal_mask=True)[0].set_output(True)
    g.build()
    source = open(g.plan.launches[0].source_path).read()
    assert ('input_precision="tf32"' in source) == allow_tf32
    assert ('input_precision="ieee"' in source) != allow_tf32
    check(g, {q: q_t, k: k_t, v: v_t}, tolerance=2e-3 if allow_tf32 else None)


@pytest.mark.parametrize("unread", [0, 1, 2])
def test_backward_with_a_gradient_nobody_reads(unread):
    """dq, dk or dv neither an output nor read (k = q.detach() in a model: dk is dropped): the
    kernels still store it, so it needs memory of its own (it had none: KeyError at execute)."""
    gen = torch.Generator().manual_seed(4)
    q_t, k_t, v_t = _qkv((2, 2, 9, 8), (2, 11), "bhsd", torch.float32, None, gen)
    g, inputs, q, k, v = _graph(torch.float32, q_t, k_t, v_t)
    d_o_t = torch.randn(2, 2, 9, 8, generator=gen)
    d_o = g.tensor_like(d_o_t, "dO")
    inputs[d_o] = d_o_t
    o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=True)
    o.set_output(True)
    for position, grad in enumerate(g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)):
        if position != unread:
            grad.set_output(True)
    check(g, inputs)


# --- on the GPU: bf16/fp16 at realistic shapes, every head dim class, backward -------------------
CUDA = "cuda"


def _case(b, h, h_kv, s_q, s_kv, d, dv=None, dtype=torch.bfloat16, layout="bhsd", lens=None, bias=None,
          **attrs):
    gen = torch.Generator(device=CUDA).manual_seed(0)

    def make(heads, seq, dim):
        if layout == "bshd":
            return torch.randn(b, seq, heads, dim, generator=gen, device=CUDA).to(dtype).permute(0, 2, 1, 3)
        return torch.randn(b, heads, seq, dim, generator=gen, device=CUDA).to(dtype)

    q_t, k_t, v_t = make(h, s_q, d), make(h_kv, s_kv, d), make(h_kv, s_kv, dv or d)
    g = dg.Graph(io_data_type=TYPES[dtype], intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    inputs = {q: q_t, k: k_t, v: v_t}
    if lens is not None:
        t = g.tensor(name="lens", dim=[b, 1, 1, 1], data_type=dg.int32)
        inputs[t] = torch.tensor(lens, dtype=torch.int32, device=CUDA).view(b, 1, 1, 1)
        attrs["seq_len_kv"] = t
    if bias is not None:
        t = g.tensor(name="bias", dim=list(bias))
        inputs[t] = torch.randn(bias, generator=gen, device=CUDA).to(dtype)
        attrs["bias"] = t
    o, stats = g.sdpa(q, k, v, is_inference=False, **attrs)
    o.set_output(True)
    stats.set_output(True)
    g.build()
    check(g, inputs, dtype, device=CUDA)
    return g


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_bf16(d, dv, causal):
    _case(2, 4, 4, 300, 333, d, dv, use_causal_mask=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("h,h_kv", [(32, 4), (16, 1)])
def test_gqa_and_mqa_fp16_bshd(h, h_kv):
    _case(2, h, h_kv, 257, 257, 128, dtype=torch.float16, layout="bshd", use_causal_mask=True)


@pytest.mark.gpu
@pytest.mark.parametrize("attrs", [{"use_causal_mask": True, "diagonal_band_left_bound": 128},
                                   {"use_causal_mask_bottom_right": True},
                                   {"diagonal_band_left_bound": 64, "diagonal_band_right_bound": 32}])
def test_windows_and_bottom_right_with_padding(attrs):
    _case(3, 4, 2, 411, 700, 64, lens=[700, 1, 333], **attrs)


@pytest.mark.gpu
def test_bias_and_dropout():
    _case(2, 4, 4, 200, 300, 64, bias=(2, 1, 200, 300), dropout=(0.2, 77, 2**40))


@pytest.mark.gpu
def test_fp32_inputs_ieee():
    _case(1, 2, 2, 129, 131, 64, dtype=torch.float32, use_causal_mask=True)


@pytest.mark.gpu
@pytest.mark.parametrize("s_q", [1, 16])
def test_paged_decode(s_q):
    gen = torch.Generator(device=CUDA).manual_seed(1)
    b, h, h_kv, page, pages, d = 4, 32, 8, 16, 40, 128
    k_pool = torch.randn(b * pages + 5, h_kv, page, d, generator=gen, device=CUDA).bfloat16()
    v_pool = torch.randn(b * pages + 5, h_kv, page, d, generator=gen, device=CUDA).bfloat16()
    table = torch.randperm(b * pages + 5, generator=gen, device=CUDA)[:b * pages].view(b, 1, pages, 1).int()
    q_t = torch.randn(b, h, s_q, d, generator=gen, device=CUDA).bfloat16()
    g = dg.Graph(io_data_type=dg.bfloat16, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    q, k, v = g.tensor_like(q_t, "q"), g.tensor_like(k_pool, "k"), g.tensor_like(v_pool, "v")
    kt, vt = (g.tensor(name=n, dim=[b, 1, pages, 1], data_type=dg.int32) for n in ("kt", "vt"))
    lens = g.tensor(name="lens", dim=[b, 1, 1, 1], data_type=dg.int32)
    o, _ = g.sdpa(q, k, v, seq_len_kv=lens, paged_attention_k_table=kt, paged_attention_v_table=vt,
                  use_causal_mask_bottom_right=True)
    o.set_output(True)
    check(g, {q: q_t, k: k_pool, v: v_pool, kt: table, vt: table,
              lens: torch.tensor([640, 1, 333, 17], dtype=torch.int32, device=CUDA).view(b, 1, 1, 1)},
          torch.bfloat16, device=CUDA)


def _backward_case(b, h, h_kv, s_q, s_kv, d, dv=None, dtype=torch.bfloat16, bias_dim=None, **attrs):
    """Gradients of the reference forward's o and stats (float64 on the GPU, stored as dtype);
    with `bias_dim`, a bias of those dims and its gradient (compute_dbias)."""
    gen = torch.Generator(device=CUDA).manual_seed(2)
    q_t, k_t, v_t = (torch.randn(b, heads, seq, dim, generator=gen, device=CUDA).to(dtype)
                     for heads, seq, dim in ((h, s_q, d), (h_kv, s_kv, d), (h_kv, s_kv, dv or d)))
    bias_t = None if bias_dim is None else torch.randn(bias_dim, generator=gen, device=CUDA).to(dtype)
    fwd = dg.Graph()
    q, k, v = (fwd.tensor_like(t.float(), n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    values = {"q": q_t, "k": k_t, "v": v_t}
    if bias_t is not None:
        values["bias"] = bias_t
        attrs_fwd = dict(attrs, bias=fwd.tensor_like(bias_t.float(), "bias"))
    o, stats = fwd.sdpa(q, k, v, is_inference=False, **(attrs_fwd if bias_t is not None else attrs))
    o.set_output(True)
    stats.set_output(True)
    refs = fwd.reference(values)
    o_t, stats_t = refs[o.name].to(dtype), refs[stats.name].float()
    do_t = torch.randn(o_t.shape, generator=gen, device=CUDA).to(dtype)
    g = dg.Graph(io_data_type=TYPES[dtype], intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    q, k, v, o, d_o = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v"), (o_t, "o"), (do_t, "dO")))
    stats = g.tensor_like(stats_t, "stats")
    inputs = {q: q_t, k: k_t, v: v_t, o: o_t, d_o: do_t, stats: stats_t}
    if bias_t is not None:
        bias = g.tensor_like(bias_t, "bias")
        inputs[bias] = bias_t
        attrs = dict(attrs, bias=bias, compute_dbias=True)
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, **attrs):
        grad.set_output(True)
    return g, inputs, check(g, inputs, dtype, device=CUDA, tolerance=2e-2 if dtype == torch.bfloat16 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_head_dims_bf16(d, dv, causal):
    _backward_case(2, 4, 4, 300, 333, d, dv, use_causal_mask=causal)


@pytest.mark.gpu
def test_backward_gqa_window_dropout_fp16():
    _backward_case(2, 8, 2, 257, 301, 64, dtype=torch.float16, use_causal_mask_bottom_right=True,
                   diagonal_band_left_bound=100, dropout=(0.1, 5, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dim", [(1, 8, 300, 333), (2, 1, 1, 333), (2, 8, 300, 333)])
def test_backward_dbias_bf16(bias_dim):
    _backward_case(2, 8, 2, 300, 333, 128, bias_dim=bias_dim, use_causal_mask=True, dropout=(0.1, 3, 4))


@pytest.mark.gpu
def test_backward_is_bitwise_reproducible():
    g, inputs, first = _backward_case(2, 8, 2, 512, 512, 128, use_causal_mask=True)
    for _ in range(3):
        outputs = {t: torch.empty_like(first[t.name]) for t in g.outputs()}
        g.execute({**inputs, **outputs})
        for t, value in outputs.items():
            assert torch.equal(value, first[t.name]), t.name


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_kv", [(2, 8192), (64, 1000)])
def test_decode_split_and_packed(b, s_kv):
    """Few programs (B2 x 8 K/V heads): keys split and merged; many: one program per K/V head."""
    g = _case(b, 32, 8, 1, s_kv, 128, lens=[s_kv - 3 * i for i in range(b)], use_causal_mask_bottom_right=True)
    assert g.plan.launches[0].config_text.find("packed") >= 0


@pytest.mark.gpu
def test_op_level_softcap_chain_bf16():
    """The op-level chain (scale, bias, softcap, causal mask by where) as one flash kernel."""
    gen = torch.Generator(device=CUDA).manual_seed(4)
    b, h, s, d = 2, 4, 300, 64
    q_t, k_t, v_t = (torch.randn(b, h, s, d, generator=gen, device=CUDA).bfloat16() for _ in range(3))
    bias_t = torch.randn(1, h, 1, s, generator=gen, device=CUDA).bfloat16()
    mask_t = (torch.arange(s, device=CUDA).view(1, -1) <= torch.arange(s, device=CUDA).view(-1, 1)).view(1, 1, s, s)
    g = dg.Graph(io_data_type=dg.bfloat16, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    q, kt, v = g.tensor_like(q_t, "q"), g.tensor_like(k_t.transpose(-1, -2), "kt"), g.tensor_like(v_t, "v")
    bias, mask = g.tensor_like(bias_t, "bias"), g.tensor_like(mask_t, "mask")
    scores = g.add(g.mul(g.matmul(q, kt), d ** -0.5), bias)
    scores = g.where(mask, g.mul(g.tanh(g.div(scores, 20.0)), 20.0), float("-inf"))
    g.matmul(g.softmax(scores, axis=-1), v).set_output(True).set_name("o")
    g.build()
    assert len(g.plan.launches) == 1 and g.plan.launches[0].group.kind == "attention"
    check(g, {q: q_t, kt: k_t.transpose(-1, -2), v: v_t, bias: bias_t, mask: mask_t}, torch.bfloat16, device=CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_bias_at_wide_heads_fits_shared_memory(d):
    """A bf16 bias tile per pipelined stage: the tiles shrink until they fit shared memory."""
    _case(1, 2, 2, 257, 300, d, bias=(1, 2, 257, 300))


@pytest.mark.gpu
def test_seed_and_offset_tensors_on_the_gpu():
    """Philox seeds and offsets read from int64 tensors by the dropout kernel and by the sdpa
    forward and backward kernels (tl.randint on a loaded seed)."""
    gen = torch.Generator(device=CUDA).manual_seed(5)
    g = dg.Graph(io_data_type=dg.bfloat16, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    q_t, k_t, v_t = (torch.randn(2, 4, 200, 64, generator=gen, device=CUDA).bfloat16() for _ in range(3))
    q, k, v = g.tensor_like(q_t, "q"), g.tensor_like(k_t, "k"), g.tensor_like(v_t, "v")
    seed, offset = (g.tensor(name=n, dim=[1], data_type=dg.int64) for n in ("seed", "offset"))
    o, stats = g.sdpa(q, k, v, is_inference=False, dropout=(0.2, seed, offset), use_causal_mask=True)
    o.set_output(True)
    stats.set_output(True)
    g.dropout(o, 0.3, seed, offset).set_output(True).set_name("o_dropped")
    d_o = g.tensor(name="dO", dim=[2, 4, 200, 64])
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, dropout=(0.2, seed, offset), use_causal_mask=True):
        grad.set_output(True)
    for seed_value, offset_value in ((-3, 11), (2**50, 2**34)):
        check(g, {q: q_t, k: k_t, v: v_t, d_o: torch.randn(2, 4, 200, 64, generator=gen, device=CUDA).bfloat16(),
                  seed: torch.tensor([seed_value], device=CUDA), offset: torch.tensor([offset_value], device=CUDA)},
              torch.bfloat16, device=CUDA, tolerance=2e-2, reference_device=CUDA)


# --- review findings: the smallest repro of each defect, and hostile cases that held up ----------
BIG = 2**31 - 1


def _lens(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype).view(-1, 1, 1, 1)


def _forward(q_t, k_t, v_t, extra=None, tolerance=None, stats=True, options=None, **attrs):
    """Build sdpa (o, and stats unless told) with `extra` named inputs as keyword tensors (with
    `options` where given); check."""
    g = dg.Graph(name="review", io_data_type=TYPES[q_t.dtype], intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    inputs = {q: q_t, k: k_t, v: v_t}
    for name, t in (extra or {}).items():
        handle = g.tensor_like(t, name)
        inputs[handle] = t
        attrs[name] = handle
    o, lse = g.sdpa(q, k, v, is_inference=not stats, **attrs)
    o.set_output(True)
    if stats:
        lse.set_output(True)
    return check(g, inputs, q_t.dtype, tolerance=tolerance, options=options)


def _reference_forward(q_t, k_t, v_t, extra, attrs):
    g = dg.Graph(name="saved")
    handles = [g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v"))]
    named = {n: g.tensor_like(t, n) for n, t in extra.items()}
    o, stats = g.sdpa(*handles, is_inference=False, **attrs, **named)
    o.set_output(True)
    stats.set_output(True)
    refs = g.reference({"q": q_t, "k": k_t, "v": v_t, **extra})
    return refs[o.name].to(q_t.dtype), refs[stats.name].float()


def _backward(q_t, k_t, v_t, extra=None, tolerance=None, workspace_limit=None, saved=None, options=None, **attrs):
    """sdpa_backward from the reference forward's o and stats (or `saved`), built with `options`
    where given; checked."""
    extra = extra or {}
    o_t, stats_t = saved or _reference_forward(q_t, k_t, v_t, extra, attrs)
    do_t = torch.randn(o_t.shape, generator=torch.Generator().manual_seed(1)).to(q_t.dtype)
    g = dg.Graph(name="review_bwd", io_data_type=TYPES[q_t.dtype], intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    tensors = (q_t, k_t, v_t, o_t, do_t, stats_t)
    handles = [g.tensor_like(t, n) for t, n in zip(tensors, ("q", "k", "v", "o", "dO", "stats"))]
    inputs = dict(zip(handles, tensors))
    for name, t in extra.items():
        handle = g.tensor_like(t, name)
        inputs[handle] = t
        attrs[name] = handle
    for grad in g.sdpa_backward(*handles, **attrs):
        grad.set_output(True)
    g.build(workspace_limit=workspace_limit, options=options)
    return check(g, inputs, q_t.dtype, tolerance=tolerance)


def _seeded_qkv(b, h, h_kv, s_q, s_kv, d, dv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s_q, d, generator=gen), torch.randn(b, h_kv, s_kv, d, generator=gen),
            torch.randn(b, h_kv, s_kv, dv or d, generator=gen))


# --- D1: bounds near 2^31 overflow the int32 key-range arithmetic --------------------------------
BOUNDS = {"right": dict(diagonal_band_right_bound=BIG),
          "left": dict(diagonal_band_left_bound=BIG),
          "both_bottom_right": dict(diagonal_alignment="bottom_right", diagonal_band_left_bound=BIG,
                                    diagonal_band_right_bound=BIG),
          "window_bottom_right": dict(use_causal_mask_bottom_right=True, diagonal_band_left_bound=BIG)}


@pytest.mark.parametrize("bounds", sorted(BOUNDS))
@pytest.mark.parametrize("s_q,s_kv", [(17, 19), (37, 19)])
def test_bounds_past_the_sequences_mean_unbounded(bounds, s_q, s_kv):
    """A validated bound of 2^31 - 1 is 'no bound': `last_pos + 1 + shift + right` wrapped to a
    negative int32 and every key block was skipped (o all zeros, stats -inf)."""
    q_t, k_t, v_t = _seeded_qkv(1, 2, 2, s_q, s_kv, 8)
    _forward(q_t, k_t, v_t, **BOUNDS[bounds])
    _backward(q_t, k_t, v_t, **BOUNDS[bounds])


def test_bounds_past_the_sequences_decode_split():
    q_t, k_t, v_t = _seeded_qkv(2, 4, 2, 2, 70, 8)
    _forward(q_t, k_t, v_t, diagonal_band_right_bound=BIG, options=dg.BuildOptions(sdpa_splits=3))


# --- D2: lengths outside [0, S]: kernels and reference disagreed, forward and backward too --------
@pytest.mark.parametrize("lens", [dict(seq_len_kv=[40, 3]), dict(seq_len_q=[18, 3]),
                                  dict(seq_len_q=[-3, 50], seq_len_kv=[5, -2])])
def test_lengths_past_the_sequence_are_clamped_everywhere(lens):
    """Bottom-right shifts by len_kv - len_q: the forward clamped len_kv to Skv but not len_q, the
    backward clamped both, the reference neither."""
    q_t, k_t, v_t = _seeded_qkv(2, 2, 2, 17, 19, 8)
    extra = {name: _lens(values) for name, values in lens.items()}
    _forward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)
    _backward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)


def test_backward_agrees_with_the_forward_kernel_for_a_long_query_length():
    """o and stats from the forward kernel, then the backward kernel: one visibility rule."""
    q_t, k_t, v_t = _seeded_qkv(2, 2, 2, 17, 19, 8)
    extra = {"seq_len_q": _lens([18, 3])}
    outputs = _forward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)
    saved = (outputs["sdpa.o"], outputs["sdpa.stats"])
    _backward(q_t, k_t, v_t, extra, saved=saved, use_causal_mask_bottom_right=True)


def test_int64_lengths_are_not_truncated_to_int32():
    """2^32 + 3 keys was read as 3 (`.to(tl.int32)` before the clamp)."""
    q_t, k_t, v_t = _seeded_qkv(2, 2, 2, 17, 19, 8)
    extra = {"seq_len_kv": _lens([2**32 + 3, 19], torch.int64), "seq_len_q": _lens([2**32 + 1, 4], torch.int64)}
    _forward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)
    _backward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)


def test_paged_length_past_the_stated_maximum():
    gen = torch.Generator().manual_seed(4)
    k_pool, v_pool = torch.randn(13, 1, 4, 8, generator=gen), torch.randn(13, 1, 4, 8, generator=gen)
    table = torch.randperm(13, generator=gen)[:10].view(2, 1, 5, 1).to(torch.int32)
    q_t = torch.randn(2, 2, 3, 8, generator=gen)
    extra = {"seq_len_kv": _lens([20, 7]), "paged_attention_k_table": table, "paged_attention_v_table": table}
    _forward(q_t, k_pool, v_pool, extra, paged_attention_max_seq_len_kv=13, use_causal_mask_bottom_right=True)


# --- D3: the v table could hold fewer pages than the k table (reads past it) ---------------------
def test_page_tables_of_different_lengths_are_rejected():
    g = dg.Graph()
    q = g.tensor(name="q", dim=[2, 2, 3, 8])
    pool = g.tensor(name="pool", dim=[9, 2, 4, 8])
    k_table = g.tensor(name="kt", dim=[2, 1, 3, 1], data_type=dg.int32)
    v_table = g.tensor(name="vt", dim=[2, 1, 2, 1], data_type=dg.int32)
    lens = g.tensor(name="lens", dim=[2, 1, 1, 1], data_type=dg.int32)
    with pytest.raises(dg.ValidationError):
        g.sdpa(q, pool, pool, seq_len_kv=lens, paged_attention_k_table=k_table, paged_attention_v_table=v_table)


# --- D4: the reference hid NaN (nan_to_num) and let padding garbage in ---------------------------
def test_nan_and_inf_inputs_propagate_like_torch():
    """NaN in a query row, +inf in a key, +inf in the bias: those rows are NaN in torch's softmax
    (and in the kernel); the reference turned them into zeros. (A +inf score makes the kernel's
    stats NaN where torch's logsumexp says +inf: o only for those.)"""
    q_t, k_t, v_t = _seeded_qkv(1, 2, 2, 17, 19, 8)
    q_t[0, 1, 3, 2] = float("nan")
    _forward(q_t, k_t, v_t)
    q_t, k_t, v_t = _seeded_qkv(1, 2, 2, 17, 19, 8)
    k_t[0, 0, 4, 1] = float("inf")
    _forward(q_t, k_t, v_t, stats=False)
    bias = torch.randn(1, 1, 1, 19)
    bias[0, 0, 0, 3] = float("inf")
    _forward(*_seeded_qkv(1, 2, 2, 17, 19, 8), {"bias": bias}, stats=False)


def test_garbage_past_the_lengths_never_reaches_the_output():
    """K/V past seq_len_kv (an uninitialized cache) and q/dO past seq_len_q may hold anything."""
    q_t, k_t, v_t = _seeded_qkv(2, 2, 2, 17, 19, 8)
    k_t[1, :, 10:], v_t[1, :, 10:], q_t[1, :, 5:] = float("nan"), float("nan"), float("nan")
    extra = {"seq_len_kv": _lens([19, 10]), "seq_len_q": _lens([17, 5])}
    _forward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)
    _backward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)


def test_backward_of_rows_masked_whole_by_a_minus_inf_bias_is_zero():
    """o of such a row is 0 whatever q and k are: its gradients are 0, not NaN."""
    q_t, k_t, v_t = _seeded_qkv(1, 2, 2, 17, 19, 8)
    bias = torch.randn(1, 2, 17, 19)
    bias[0, 0, 3, :] = float("-inf")
    bias[0, 1, :, 5:] = float("-inf")
    _forward(q_t, k_t, v_t, {"bias": bias})
    _backward(q_t, k_t, v_t, {"bias": bias})


# --- D5: attributes the op call should reject -------------------------------------------------------
BAD_TYPES = {
    "integer q/k/v": lambda g: g.sdpa(*(g.tensor(name=n, dim=[1, 2, 4, 8], data_type=dg.int32) for n in "qkv")),
    "fp16 stats": lambda g: g.sdpa_backward(
        *(g.tensor(name=n, dim=[1, 2, 4, 8]) for n in ("q", "k", "v", "o", "dO")),
        g.tensor(name="stats", dim=[1, 2, 4, 1], data_type=dg.float16)),
}


@pytest.mark.parametrize("case", sorted(BAD_TYPES))
def test_bad_types_are_validation_errors_at_the_call(case):
    g = dg.Graph(io_data_type=dg.float32)
    with pytest.raises(dg.ValidationError):
        BAD_TYPES[case](g)


# --- D6: bf16 on the CPU: the interpreter's tl.dot multiplies bf16 bit patterns -------------------
def test_bf16_on_the_interpreter_matches_the_reference():
    """Triton 3.6's interpreter stores bf16 as uint16 and tl.dot multiplies the raw bits (upstream
    triton-lang/triton#11584): o came out ~1e9. runtime.py widens bf16 dot operands when
    interpreting; the answer must be the reference's."""
    q_t, k_t, v_t = (t.bfloat16() for t in _seeded_qkv(1, 2, 2, 16, 16, 16))
    _forward(q_t, k_t, v_t)


# --- held up: hostile cases that pass ------------------------------------------------------------
def test_size_one_axes_and_tiny_head_dims():
    _forward(*_seeded_qkv(1, 1, 1, 1, 1, 1))
    _backward(*_seeded_qkv(1, 1, 1, 1, 1, 1))
    _forward(*_seeded_qkv(1, 2, 2, 5, 7, 2, 3), use_causal_mask_bottom_right=True)
    _backward(*_seeded_qkv(2, 4, 2, 5, 7, 2, 5), use_causal_mask_bottom_right=True)


def test_every_option_at_once_backward_without_workspace():
    q_t, k_t, v_t = _seeded_qkv(2, 4, 2, 17, 19, 8, 6)
    extra = {"bias": torch.randn(1, 4, 17, 1), "seq_len_q": _lens([17, 3]), "seq_len_kv": _lens([5, 19])}
    attrs = dict(diagonal_alignment="bottom_right", diagonal_band_left_bound=3, diagonal_band_right_bound=2,
                 dropout=(0.4, 2**64 - 1, 2**63 - 1 - 10**6), attn_scale=-0.7)
    _backward(q_t, k_t, v_t, extra, workspace_limit=0, **attrs)


def test_json_round_trip_of_every_attribute():
    q_t, k_t, v_t = _seeded_qkv(2, 4, 2, 17, 19, 8)
    values = {"q": q_t, "k": k_t, "v": v_t, "b": torch.randn(1, 4, 1, 19), "lq": _lens([17, 4]),
              "lk": _lens([19, 6])}
    g = dg.Graph(name="rt")
    h = {n: g.tensor_like(t, n) for n, t in values.items()}
    attrs = dict(bias=h["b"], seq_len_q=h["lq"], seq_len_kv=h["lk"], dropout=(0.2, 2**64 - 1, 2**63 - 1),
                 diagonal_alignment="bottom_right", diagonal_band_left_bound=5, diagonal_band_right_bound=2,
                 attn_scale=0.3)
    o, stats = g.sdpa(h["q"], h["k"], h["v"], is_inference=False, **attrs)
    o.set_output(True)
    stats.set_output(True)
    for grad in g.sdpa_backward(h["q"], h["k"], h["v"], o, o, stats, **attrs):
        grad.set_output(True)
    text = g.to_json()
    g2 = dg.Graph.from_json(text)
    assert g2.to_json() == text
    first, second = run(g, values), run(g2, values)
    for name, value in first.items():
        assert torch.equal(value.nan_to_num(7.0), second[name].nan_to_num(7.0)), name


def test_names_that_look_like_decode_and_backward_variables():
    gen = torch.Generator().manual_seed(2)
    q_t, k_t, v_t = torch.randn(2, 4, 2, 8, generator=gen), torch.randn(2, 2, 40, 8, generator=gen), \
        torch.randn(2, 2, 40, 8, generator=gen)
    extra_t = torch.randn(1, 4, 1, 8, generator=gen)
    g = dg.Graph(name='weight"\n')
    names = ("part_row", "denom", "q_pos", "extra\n'''")
    q, k, v, extra = (g.tensor_like(t, n) for t, n in zip((q_t, k_t, v_t, extra_t), names))
    o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask_bottom_right=True, name="SPLITS")
    stats.set_output(True).set_name("lpart_ptr")
    g.add(o, extra, name="split").set_output(True).set_name("o_part")
    check(g, {q: q_t, k: k_t, v: v_t, extra: extra_t}, options=dg.BuildOptions(sdpa_splits=2))


# --- D7: wide (int64) offsets missed in the backward's dQ key loads and the bias loads -----------
def test_wide_index_kernels_cast_every_row_offset():
    """With some operand past 2^31 elements, row offsets go int64: the dQ kernel's K/V loads and
    every bias load multiplied int32 key or row indices by a stride (a 1M-key BSHD k, a
    [1, 1, 48k, 48k] bias wrap). Forced wide here: right numbers and no uncast row product."""
    import re
    wide = dg.BuildOptions(sdpa_index_64=True)
    q_t, k_t, v_t = _seeded_qkv(2, 4, 2, 17, 19, 8)
    bias = torch.randn(2, 19, 4, 17).permute(0, 2, 3, 1)  # keys strided: bias_s3 != 1
    for build in (_forward, _backward):
        build(q_t, k_t, v_t, {"bias": bias}, use_causal_mask=True, options=wide)
    g = dg.Graph()
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    b = g.tensor_like(bias, "bias")
    o, stats = g.sdpa(q, k, v, is_inference=False, bias=b)
    for grad in g.sdpa_backward(q, k, v, o, o, stats, bias=b):
        grad.set_output(True)
    g.build(options=wide)
    for launch in g.plan.launches:
        source = open(launch.source_path).read()
        assert not re.findall(r"\b(?:keys|rows|q_rows)\[[^\]]*\] \* \w+_s\d", source), launch.source_path


# --- D8: an attn_scale past float32 once scaled by log2(e) --------------------------------------
@pytest.mark.parametrize("scale", [1.7e308, -1e39])
def test_attn_scale_past_float32_is_a_validation_error(scale):
    """1.7e308 passed validation (finite) and rendered `qk_scale = inf`: NameError at execute;
    1e39 made every score inf in the float32 kernel (stats inf, o NaN)."""
    g = dg.Graph()
    q = g.tensor(name="q", dim=[1, 2, 4, 8])
    with pytest.raises(dg.ValidationError):
        g.sdpa(q, q, q, attn_scale=scale)
