"""Adversarial review of the sdpa family (CPU interpreter): each test is the smallest repro of a
defect found in review, or a hostile case that held up, compared with the float64 reference."""
import pytest
import torch

import dnngraph as dg
from helpers import check, run

TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}
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


def _qkv(b, h, h_kv, s_q, s_kv, d, dv=None, seed=0):
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
    q_t, k_t, v_t = _qkv(1, 2, 2, s_q, s_kv, 8)
    _forward(q_t, k_t, v_t, **BOUNDS[bounds])
    _backward(q_t, k_t, v_t, **BOUNDS[bounds])


def test_bounds_past_the_sequences_decode_split():
    q_t, k_t, v_t = _qkv(2, 4, 2, 2, 70, 8)
    _forward(q_t, k_t, v_t, diagonal_band_right_bound=BIG, options=dg.BuildOptions(sdpa_splits=3))


# --- D2: lengths outside [0, S]: kernels and reference disagreed, forward and backward too --------
@pytest.mark.parametrize("lens", [dict(seq_len_kv=[40, 3]), dict(seq_len_q=[18, 3]),
                                  dict(seq_len_q=[-3, 50], seq_len_kv=[5, -2])])
def test_lengths_past_the_sequence_are_clamped_everywhere(lens):
    """Bottom-right shifts by len_kv - len_q: the forward clamped len_kv to Skv but not len_q, the
    backward clamped both, the reference neither."""
    q_t, k_t, v_t = _qkv(2, 2, 2, 17, 19, 8)
    extra = {name: _lens(values) for name, values in lens.items()}
    _forward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)
    _backward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)


def test_backward_agrees_with_the_forward_kernel_for_a_long_query_length():
    """o and stats from the forward kernel, then the backward kernel: one visibility rule."""
    q_t, k_t, v_t = _qkv(2, 2, 2, 17, 19, 8)
    extra = {"seq_len_q": _lens([18, 3])}
    outputs = _forward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)
    saved = (outputs["sdpa.o"], outputs["sdpa.stats"])
    _backward(q_t, k_t, v_t, extra, saved=saved, use_causal_mask_bottom_right=True)


def test_int64_lengths_are_not_truncated_to_int32():
    """2^32 + 3 keys was read as 3 (`.to(tl.int32)` before the clamp)."""
    q_t, k_t, v_t = _qkv(2, 2, 2, 17, 19, 8)
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
    q_t, k_t, v_t = _qkv(1, 2, 2, 17, 19, 8)
    q_t[0, 1, 3, 2] = float("nan")
    _forward(q_t, k_t, v_t)
    q_t, k_t, v_t = _qkv(1, 2, 2, 17, 19, 8)
    k_t[0, 0, 4, 1] = float("inf")
    _forward(q_t, k_t, v_t, stats=False)
    bias = torch.randn(1, 1, 1, 19)
    bias[0, 0, 0, 3] = float("inf")
    _forward(*_qkv(1, 2, 2, 17, 19, 8), {"bias": bias}, stats=False)


def test_garbage_past_the_lengths_never_reaches_the_output():
    """K/V past seq_len_kv (an uninitialized cache) and q/dO past seq_len_q may hold anything."""
    q_t, k_t, v_t = _qkv(2, 2, 2, 17, 19, 8)
    k_t[1, :, 10:], v_t[1, :, 10:], q_t[1, :, 5:] = float("nan"), float("nan"), float("nan")
    extra = {"seq_len_kv": _lens([19, 10]), "seq_len_q": _lens([17, 5])}
    _forward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)
    _backward(q_t, k_t, v_t, extra, use_causal_mask_bottom_right=True)


def test_backward_of_rows_masked_whole_by_a_minus_inf_bias_is_zero():
    """o of such a row is 0 whatever q and k are: its gradients are 0, not NaN."""
    q_t, k_t, v_t = _qkv(1, 2, 2, 17, 19, 8)
    bias = torch.randn(1, 2, 17, 19)
    bias[0, 0, 3, :] = float("-inf")
    bias[0, 1, :, 5:] = float("-inf")
    _forward(q_t, k_t, v_t, {"bias": bias})
    _backward(q_t, k_t, v_t, {"bias": bias})


# --- D5: attributes the op call should reject -------------------------------------------------------
BAD = {
    "integer q/k/v": lambda g: g.sdpa(*(g.tensor(name=n, dim=[1, 2, 4, 8], data_type=dg.int32) for n in "qkv")),
    "fp16 stats": lambda g: g.sdpa_backward(
        *(g.tensor(name=n, dim=[1, 2, 4, 8]) for n in ("q", "k", "v", "o", "dO")),
        g.tensor(name="stats", dim=[1, 2, 4, 1], data_type=dg.float16)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_types_are_validation_errors_at_the_call(case):
    g = dg.Graph(io_data_type=dg.float32)
    with pytest.raises(dg.ValidationError):
        BAD[case](g)


# --- D6: bf16 on the CPU: the interpreter's tl.dot multiplies bf16 bit patterns -------------------
def test_bf16_on_the_interpreter_matches_the_reference():
    """Triton 3.6's interpreter stores bf16 as uint16 and tl.dot multiplies the raw bits (upstream
    triton-lang/triton#11584): o came out ~1e9. runtime.py widens bf16 dot operands when
    interpreting; the answer must be the reference's."""
    q_t, k_t, v_t = (t.bfloat16() for t in _qkv(1, 2, 2, 16, 16, 16))
    _forward(q_t, k_t, v_t)


# --- held up: hostile cases that pass ------------------------------------------------------------
def test_size_one_axes_and_tiny_head_dims():
    _forward(*_qkv(1, 1, 1, 1, 1, 1))
    _backward(*_qkv(1, 1, 1, 1, 1, 1))
    _forward(*_qkv(1, 2, 2, 5, 7, 2, 3), use_causal_mask_bottom_right=True)
    _backward(*_qkv(2, 4, 2, 5, 7, 2, 5), use_causal_mask_bottom_right=True)


def test_every_option_at_once_backward_without_workspace():
    q_t, k_t, v_t = _qkv(2, 4, 2, 17, 19, 8, 6)
    extra = {"bias": torch.randn(1, 4, 17, 1), "seq_len_q": _lens([17, 3]), "seq_len_kv": _lens([5, 19])}
    attrs = dict(diagonal_alignment="bottom_right", diagonal_band_left_bound=3, diagonal_band_right_bound=2,
                 dropout=(0.4, 2**64 - 1, 2**63 - 1 - 10**6), attn_scale=-0.7)
    _backward(q_t, k_t, v_t, extra, workspace_limit=0, **attrs)


def test_json_round_trip_of_every_attribute():
    q_t, k_t, v_t = _qkv(2, 4, 2, 17, 19, 8)
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
    q_t, k_t, v_t = _qkv(2, 4, 2, 17, 19, 8)
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
