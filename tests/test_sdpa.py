"""sdpa forward (flash attention) on CPU through the interpreter, against the float64 reference:
every mask alone and combined, padding, GQA/MQA, head dims that are not powers of two, d_qk != d_v,
layouts, bias broadcasts, dropout, paged K/V, the fused epilogue, and bad input."""
import pytest
import torch

import dnngraph as dg
from dnngraph.heuristics import sdpa as heur
from helpers import check, rel_err, run

TORCH_TYPES = {torch.float32: dg.float32, torch.float16: dg.float16}


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
    g = dg.Graph(name="attn", io_data_type=TORCH_TYPES[dtype], intermediate_data_type=dg.float32,
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
    g = dg.Graph(name="ops", io_data_type=TORCH_TYPES[dtype], intermediate_data_type=dg.float32,
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
