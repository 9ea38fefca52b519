"""sdpa's softmax extras on CPU through the interpreter, against the float64 reference: the sink
token (forward, dsink in sdpa_backward and through autograd), ALiBi, the score_max /
score_sum_exp outputs and a one-element tensor attn_scale; each alone and with the masks, GQA,
padding and odd sizes; bad input; the sm_90 compile of the variants; GPU versions at realistic
sizes (marked gpu)."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import sdpa as heur
from dnngraph.ops.sdpa import alibi_slopes
from helpers import check, compiled_for_sm90, run

TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}


def extras_case(shape_q, shape_kv, dtype=torch.float32, sink=False, alibi=False, scale_tensor=False,
                scores=False, backward=False, lens=None, seed=0, device="cpu", **attrs):
    """A graph of sdpa (and sdpa_backward fed with its o and stats) with the extras asked for,
    and its inputs on `device`; every output marked."""
    gen = torch.Generator().manual_seed(seed)
    b, h, s_q, d = shape_q
    h_kv, s_kv = shape_kv
    g = dg.Graph(name="extras", io_data_type=TYPES[dtype], intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    values = {"q": torch.randn(b, h, s_q, d, generator=gen), "k": torch.randn(b, h_kv, s_kv, d, generator=gen),
              "v": torch.randn(b, h_kv, s_kv, d, generator=gen)}
    values = {name: t.to(dtype) for name, t in values.items()}
    if sink:
        values["sink_token"] = torch.randn(1, h, 1, 1, generator=gen) * 2
    if scale_tensor:
        values["attn_scale"] = torch.tensor([[[[0.3]]]])
    if lens is not None:
        for name, lengths in zip(("seq_len_q", "seq_len_kv"), lens):
            values[name] = torch.tensor(lengths, dtype=torch.int32).view(b, 1, 1, 1)
    handles = {name: g.tensor_like(t, name) for name, t in values.items()}
    extra = {name: handles[name] for name in ("sink_token", "attn_scale", "seq_len_q", "seq_len_kv") if name in handles}
    forward = g.sdpa(handles["q"], handles["k"], handles["v"], is_inference=False, use_alibi_mask=alibi,
                     score_max=scores, score_sum_exp=scores, **extra, **attrs)
    o, stats = forward[:2]
    for t in forward:
        t.set_output(True)
    if backward:
        values["dO"] = torch.randn(b, h, s_q, d, generator=gen).to(dtype)
        handles["dO"] = g.tensor_like(values["dO"], "dO")
        for grad in g.sdpa_backward(handles["q"], handles["k"], handles["v"], o, handles["dO"], stats,
                                    use_alibi_mask=alibi, **extra, **attrs):
            grad.set_output(True)
    return g, {handles[name]: t.to(device) for name, t in values.items()}


MASKS = {"none": {}, "causal": {"use_causal_mask": True},
         "causal_bottom_right": {"use_causal_mask_bottom_right": True},
         "window": {"use_causal_mask": True, "diagonal_band_left_bound": 4}}
FEATURES = {"sink": {"sink": True}, "alibi": {"alibi": True}, "scale_tensor": {"scale_tensor": True},
            "scores": {"scores": True}}


# Sq 7: the decode kernel (the group's heads packed in one tile); Sq 37: query tiles of 16
# (forced), several per head, and the fully visible run between masked ones
SHAPES = {"packed": ((2, 4, 7, 16), (2, 13)), "tiled": ((1, 6, 37, 16), (2, 45))}
TILE = heur.AttentionConfig(16, 16, 1, 1)
TILES = dg.BuildOptions(sdpa_config=TILE, sdpa_dkdv_config=TILE, sdpa_dq_config=TILE)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_forward_each_feature_with_each_mask(feature, mask, shape):
    g, inputs = extras_case(*SHAPES[shape], **FEATURES[feature], **MASKS[mask])
    check(g, inputs, options=TILES if shape == "tiled" else None)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("feature", ["sink", "alibi", "scale_tensor"])
def test_backward_each_feature_with_a_mask(feature, mask, shape):
    g, inputs = extras_case(*SHAPES[shape], backward=True, **FEATURES[feature], **MASKS[mask])
    check(g, inputs, options=TILES if shape == "tiled" else None)


def test_all_together_with_gqa_padding_and_a_row_that_sees_no_key():
    """Query 0 of batch 1 sees no key (seq_len_kv 0 there): with the sink alone in its
    denominator o = 0 and stats = the sink; score_max -inf, score_sum_exp 0."""
    g, inputs = extras_case((2, 6, 7, 16), (3, 13), sink=True, alibi=True, scale_tensor=True, scores=True,
                            backward=True, lens=([7, 5], [13, 0]), use_causal_mask=True)
    outputs = check(g, inputs)
    sink = next(t for h, t in inputs.items() if h.name == "sink_token")
    o, stats, score_max, score_sum = (outputs[t.name] for t in g.outputs()[:4])
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.allclose(stats[1, :, :5], sink.view(6, 1, 1).expand(6, 5, 1))
    assert (score_max[1] == float("-inf")).all() and (score_sum[1] == 0).all()


def test_sink_with_a_fully_masked_row_through_the_band():
    """A band that leaves the first rows no key: o = 0 there, dsink still counts the others."""
    g, inputs = extras_case((1, 2, 9, 16), (1, 11), sink=True, backward=True, diagonal_band_left_bound=1,
                            lens=([9], [4]))
    check(g, inputs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_with_every_extra(dtype):
    g, inputs = extras_case((1, 4, 9, 32), (2, 21), dtype, sink=True, alibi=True, scale_tensor=True, scores=True,
                            backward=True, use_causal_mask_bottom_right=True)
    check(g, inputs, dtype)


def test_decode_keeps_one_split_and_packs_heads():
    """A decode (Sq 1) with a sink and the score outputs: the key splits are off (no combine of
    the sink or the keys' max), the packed tile holds the group's heads."""
    g, inputs = extras_case((2, 8, 1, 16), (2, 37), sink=True, alibi=True, scores=True)
    g.build(options=dg.BuildOptions(sdpa_splits=4))
    assert len(g.plan.launches) == 1
    assert "sink_s1, mask=row_in" in open(g.plan.launches[0].source_path).read()  # padded rows read no sink
    check(g, inputs)


def test_alibi_and_tensor_scale_ride_the_split_decode():
    """Without a sink or score outputs the decode may split its keys: ALiBi and a tensor scale
    ride every split and the combine."""
    g, inputs = extras_case((2, 8, 1, 16), (2, 70), alibi=True, scale_tensor=True)
    g.build(options=dg.BuildOptions(sdpa_splits=3))
    assert g.plan.launches[-1].config_text.startswith("combine")
    check(g, inputs)


def test_sink_with_dropout_forward_and_backward():
    g, inputs = extras_case((1, 4, 23, 16), (2, 29), sink=True, alibi=True, backward=True,
                            dropout=(0.25, 7, 3), use_causal_mask=True)
    check(g, inputs)


def test_unread_dsink_is_still_written_somewhere_safe():
    """as_function differentiating q alone: the backward's dsink has no reader, and the graph
    still builds and runs (sdpa_backward stores every gradient it has)."""
    gen = torch.Generator().manual_seed(5)
    g = dg.Graph(name="unread", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q_t, k_t, v_t = (torch.randn(1, 2, 6, 16, generator=gen) for _ in range(3))
    sink_t = torch.randn(1, 2, 1, 1, generator=gen)
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    sink = g.tensor_like(sink_t, "sink")
    o, _ = g.sdpa(q, k, v, sink_token=sink)
    o.set_output(True)
    fn = g.as_function([q, k, v, sink], [o])
    leaf = q_t.clone().requires_grad_(True)
    fn(leaf, k_t, v_t, sink_t).sum().backward()
    ref = q_t.double().clone().requires_grad_(True)
    scores = torch.cat([ref @ k_t.double().transpose(-1, -2) / 4.0, sink_t.double().expand(1, 2, 6, 1)], -1)
    (torch.softmax(scores, -1)[..., :6] @ v_t.double()).sum().backward()
    assert torch.allclose(leaf.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_score_outputs_of_the_wrong_shape_fail_at_execute_and_write_nothing():
    g, inputs = extras_case((1, 2, 7, 16), (1, 9), scores=True)
    g.build()
    outputs = {t: torch.full(t.dim, float("nan")) for t in g.outputs()}
    smax = next(t for t in g.outputs() if t.name.endswith("score_max"))
    outputs[smax] = torch.full((1, 2, 7, 2), float("nan"))
    with pytest.raises(dg.ExecutionError):
        g.execute({**inputs, **outputs})
    assert all(torch.isnan(t).all() for t in outputs.values())


@pytest.mark.parametrize("heads", [1, 3, 6, 8, 12])
def test_alibi_slopes_follow_the_definition(heads):
    slopes = alibi_slopes(heads)
    n = 1 << (heads.bit_length() - 1)
    assert slopes[:n] == [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    assert slopes[n:] == [2.0 ** (-8.0 * k / (2 * n)) for k in range(1, 2 * (heads - n), 2)]


def test_dsink_matches_its_closed_form_and_autograd():
    """dsink_h = -sum_{b,i} p_sink * rowsum(dO * o) (p_sink = exp(sink - lse)) equals float64
    autograd through the reference; the kernel's dsink matches both; as_function's backward
    gives the sink a gradient too."""
    g, inputs = extras_case((2, 3, 7, 16), (3, 13), sink=True, backward=True, use_causal_mask=True)
    outputs = run(g, inputs)
    refs = g.reference(inputs)
    by = {h.name: t for h, t in inputs.items()}
    o_name, stats_name = (t.name for t in g.outputs()[:2])
    p_sink = torch.exp(by["sink_token"].double() - refs[stats_name])
    delta = (by["dO"].double() * refs[o_name]).sum(-1, keepdim=True)
    closed = -(p_sink * delta).sum((0, 2), keepdim=True)
    dsink_name = [t.name for t in g.outputs() if tuple(t.dim) == (1, 3, 1, 1)][0]
    assert torch.allclose(refs[dsink_name], closed, rtol=1e-9, atol=1e-12)
    assert torch.allclose(outputs[dsink_name].double(), closed, rtol=1e-4, atol=1e-5)


def test_autograd_reaches_the_sink():
    gen = torch.Generator().manual_seed(3)
    g = dg.Graph(name="sinkgrad", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q_t, k_t, v_t = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    sink_t = torch.randn(1, 2, 1, 1, generator=gen)
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    sink = g.tensor_like(sink_t, "sink")
    o, _ = g.sdpa(q, k, v, sink_token=sink, use_alibi_mask=True, use_causal_mask=True)
    o.set_output(True)
    fn = g.as_function([q, k, v, sink], [o])
    leaves = [t.clone().requires_grad_(True) for t in (q_t, k_t, v_t, sink_t)]
    fn(*leaves).square().sum().backward()
    ref_leaves = [t.double().clone().requires_grad_(True) for t in (q_t, k_t, v_t, sink_t)]
    scores = ref_leaves[0] @ ref_leaves[1].transpose(-1, -2) / 4.0
    pos = torch.arange(5)
    scores = scores + (pos.view(1, -1) - pos.view(-1, 1)).double() * torch.tensor(alibi_slopes(2)).view(1, 2, 1, 1)
    scores = scores.masked_fill(pos.view(1, -1) > pos.view(-1, 1), float("-inf"))
    full = torch.cat([scores, ref_leaves[3].expand(1, 2, 5, 1)], -1)
    out = torch.softmax(full, -1)[..., :5] @ ref_leaves[2]
    out.square().sum().backward()
    for got, want in zip(leaves, ref_leaves):
        assert torch.allclose(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


def test_autograd_reaches_a_tensor_scale():
    """d attn_scale = sum(q * dq) / scale, against float64 autograd through the reference math."""
    gen = torch.Generator().manual_seed(4)
    g = dg.Graph(name="scalegrad", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q_t, k_t, v_t = torch.randn(1, 4, 9, 16, generator=gen), *(torch.randn(1, 2, 11, 16, generator=gen) for _ in "kv")
    scale_t = torch.tensor([0.35])
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    scale = g.tensor_like(scale_t, "scale")
    o, _ = g.sdpa(q, k, v, attn_scale=scale, use_alibi_mask=True, use_causal_mask_bottom_right=True)
    o.set_output(True)
    fn = g.as_function([q, k, v, scale], [o])
    leaves = [t.clone().requires_grad_(True) for t in (q_t, k_t, v_t, scale_t)]
    fn(*leaves).square().sum().backward()
    ref = [t.double().clone().requires_grad_(True) for t in (q_t, k_t, v_t, scale_t)]
    kk, vv = (t.repeat_interleave(2, 1) for t in ref[1:3])
    rows, cols = torch.arange(9).view(-1, 1), torch.arange(11).view(1, -1)
    scores = ref[0] @ kk.transpose(-1, -2) * ref[3]
    scores = scores + (cols - rows).double() * torch.tensor(alibi_slopes(4)).view(1, 4, 1, 1)
    scores = scores.masked_fill(cols > rows + 2, float("-inf"))
    (torch.softmax(scores, -1) @ vv).square().sum().backward()
    for got, want in zip(leaves, ref):
        assert torch.allclose(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


BAD = {
    "sink of the wrong shape": lambda g, t: g.sdpa(t["q"], t["k"], t["v"], sink_token=t["sink_bad"]),
    "sink not float32": lambda g, t: g.sdpa(t["q"], t["k"], t["v"], sink_token=t["sink_half"]),
    "scale of two elements": lambda g, t: g.sdpa(t["q"], t["k"], t["v"], attn_scale=t["two"]),
    "integer scale": lambda g, t: g.sdpa(t["q"], t["k"], t["v"], attn_scale=t["int_scale"]),
    "alibi not a bool": lambda g, t: g.sdpa(t["q"], t["k"], t["v"], use_alibi_mask=1),
    "score_max not a bool": lambda g, t: g.sdpa(t["q"], t["k"], t["v"], score_max="yes"),
    "backward sink of the wrong shape": lambda g, t: g.sdpa_backward(t["q"], t["k"], t["v"], t["q"], t["q"],
                                                                     t["stats"], sink_token=t["sink_bad"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_and_adds_nothing(case):
    g = dg.Graph(name="bad", io_data_type=dg.float32)
    t = {"q": g.tensor(name="q", dim=[1, 4, 7, 16]), "k": g.tensor(name="k", dim=[1, 2, 13, 16]),
         "v": g.tensor(name="v", dim=[1, 2, 13, 16]),
         "stats": g.tensor(name="stats", dim=[1, 4, 7, 1], data_type=dg.float32),
         "sink_bad": g.tensor(name="sink_bad", dim=[1, 2, 1, 1], data_type=dg.float32),
         "sink_half": g.tensor(name="sink_half", dim=[1, 4, 1, 1], data_type=dg.float16),
         "two": g.tensor(name="two", dim=[1, 1, 1, 2], data_type=dg.float32),
         "int_scale": g.tensor(name="int_scale", dim=[1, 1, 1, 1], data_type=dg.int32)}
    before = len(g.nodes)
    with pytest.raises(dg.ValidationError):
        BAD[case](g, t)
    assert len(g.nodes) == before


def test_serialization_round_trip_keeps_the_extras():
    g, inputs = extras_case((1, 2, 5, 16), (1, 9), sink=True, alibi=True, scale_tensor=True, scores=True,
                            backward=True, use_causal_mask=True)
    g2 = dg.Graph.from_json(g.to_json())
    by_name = {t.name: t for t in g2.inputs()}
    check(g2, {by_name[h.name]: t for h, t in inputs.items()})


def sm90_graphs():
    """Built graphs of the extras for the sm_90 compile check: forward (sink, ALiBi, tensor
    scale, score outputs) and its backward kernels (delta, dK/dV, dQ, dsink)."""
    g, _ = extras_case((1, 4, 70, 64), (2, 90), torch.bfloat16, sink=True, alibi=True, scale_tensor=True,
                       scores=True, backward=True, use_causal_mask=True)
    g.build()
    yield "sdpa extras with backward", g


def test_extras_compile_for_sm90():
    assert "compiled 5 kernels for sm_90" in compiled_for_sm90("test_sdpa_extras:sm90_graphs", timeout=400)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_each_feature_at_realistic_sizes_gpu(feature, mask, dtype):
    g, inputs = extras_case((2, 8, 1024, 128), (4, 1031), dtype, backward=feature != "scores", device="cuda",
                            **FEATURES[feature], **MASKS[mask])
    check(g, inputs, dtype, device="cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_everything_together_gpu():
    g, inputs = extras_case((2, 16, 2048, 64), (4, 2048), torch.bfloat16, sink=True, alibi=True, scale_tensor=True,
                            scores=True, backward=True, lens=([2048, 1000], [2048, 1500]), device="cuda",
                            use_causal_mask=True)
    check(g, inputs, torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
