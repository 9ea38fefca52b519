"""sdpa forward on the GPU: bf16/fp16 at realistic shapes and every head dim class, against the
float64 reference (computed on the GPU), with the compiled kernel bound at build."""
import pytest
import torch

import dnngraph as dg
from helpers import check

pytestmark = pytest.mark.gpu
CUDA = "cuda"
TYPES = {torch.bfloat16: dg.bfloat16, torch.float16: dg.float16, torch.float32: dg.float32}


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


@pytest.mark.parametrize("d,dv", [(64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_bf16(d, dv, causal):
    _case(2, 4, 4, 300, 333, d, dv, use_causal_mask=causal)


@pytest.mark.parametrize("h,h_kv", [(32, 4), (16, 1)])
def test_gqa_and_mqa_fp16_bshd(h, h_kv):
    _case(2, h, h_kv, 257, 257, 128, dtype=torch.float16, layout="bshd", use_causal_mask=True)


@pytest.mark.parametrize("attrs", [{"use_causal_mask": True, "diagonal_band_left_bound": 128},
                                   {"use_causal_mask_bottom_right": True},
                                   {"diagonal_band_left_bound": 64, "diagonal_band_right_bound": 32}])
def test_windows_and_bottom_right_with_padding(attrs):
    _case(3, 4, 2, 411, 700, 64, lens=[700, 1, 333], **attrs)


def test_bias_and_dropout():
    _case(2, 4, 4, 200, 300, 64, bias=(2, 1, 200, 300), dropout=(0.2, 77, 2**40))


def test_fp32_inputs_ieee():
    _case(1, 2, 2, 129, 131, 64, dtype=torch.float32, use_causal_mask=True)


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


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_head_dims_bf16(d, dv, causal):
    _backward_case(2, 4, 4, 300, 333, d, dv, use_causal_mask=causal)


def test_backward_gqa_window_dropout_fp16():
    _backward_case(2, 8, 2, 257, 301, 64, dtype=torch.float16, use_causal_mask_bottom_right=True,
                   diagonal_band_left_bound=100, dropout=(0.1, 5, 7))


@pytest.mark.parametrize("bias_dim", [(1, 8, 300, 333), (2, 1, 1, 333), (2, 8, 300, 333)])
def test_backward_dbias_bf16(bias_dim):
    _backward_case(2, 8, 2, 300, 333, 128, bias_dim=bias_dim, use_causal_mask=True, dropout=(0.1, 3, 4))


def test_backward_is_bitwise_reproducible():
    g, inputs, first = _backward_case(2, 8, 2, 512, 512, 128, use_causal_mask=True)
    for _ in range(3):
        outputs = {t: torch.empty_like(first[t.name]) for t in g.outputs()}
        g.execute({**inputs, **outputs})
        for t, value in outputs.items():
            assert torch.equal(value, first[t.name]), t.name


@pytest.mark.parametrize("b,s_kv", [(2, 8192), (64, 1000)])
def test_decode_split_and_packed(b, s_kv):
    """Few programs (B2 x 8 K/V heads): keys split and merged; many: one program per K/V head."""
    g = _case(b, 32, 8, 1, s_kv, 128, lens=[s_kv - 3 * i for i in range(b)], use_causal_mask_bottom_right=True)
    assert g.plan.launches[0].config_text.find("packed") >= 0


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


@pytest.mark.parametrize("d", [128, 256])
def test_bias_at_wide_heads_fits_shared_memory(d):
    """A bf16 bias tile per pipelined stage: the tiles shrink until they fit shared memory."""
    _case(1, 2, 2, 257, 300, d, bias=(1, 2, 257, 300))


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
              torch.bfloat16, device=CUDA, tolerance=2e-2)
