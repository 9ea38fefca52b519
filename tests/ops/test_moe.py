"""MoE grouped GEMMs (moe_grouped_matmul and its wgrad) on CPU through the interpreter: forward,
both gradients and autograd against the float64 reference with poisoned outputs, over uneven
expert counts (empty experts, one expert with every token), odd K and N, every float type,
strided tokens, K-major weights, fused epilogues; typed errors; the kernels compiled for sm_90;
a Mixtral-sized case on the GPU."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics.moe import MoeConfig
from helpers import check, compiled_for_sm90, poisoned

TORCH_OF = {dg.float32: torch.float32, dg.float16: torch.float16, dg.bfloat16: torch.bfloat16}

# rows per expert: uneven, empty experts (first, middle, last), one expert with every token
COUNTS = {1: [29], 3: [0, 23, 14], 8: [5, 0, 11, 1, 0, 17, 3, 0]}
ALL_IN_ONE = [0, 0, 31, 0]


def _graph(dtype):
    return dg.Graph(name="moe", io_data_type=dtype, intermediate_data_type=dg.float32, compute_data_type=dg.float32)


def _offsets(counts, dtype=torch.int32, shape=None):
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)
    offsets = torch.tensor(starts, dtype=dtype)
    return offsets if shape is None else offsets.reshape(shape)


def _token(rows, k, t, layout):
    """Fresh random tokens: contiguous, strided (every other column of a wider tensor) or [1, T, K]."""
    if layout == "strided":
        return torch.randn(rows, 2 * k + 3).to(t)[:, 1:2 * k + 1:2]
    base = torch.randn(rows, k).to(t)
    return base.reshape(1, rows, k) if layout == "rank3" else base


def _weight(experts, k, n, t, kmajor):
    scaled = torch.randn(experts, k, n) / k ** 0.5
    if kmajor:  # [E, K, N] logically, stored [E, N, K]
        return scaled.transpose(1, 2).contiguous().to(t).transpose(1, 2)
    return scaled.to(t)


def forward_case(counts, k, n, dtype=dg.float32, layout="contiguous", kmajor=False, offset_dtype=torch.int32,
                 offset_shape=None, epilogue=None):
    rows, experts = sum(counts), len(counts)
    t = TORCH_OF[dtype]
    token, weight = _token(rows, k, t, layout), _weight(experts, k, n, t, kmajor)
    offsets = _offsets(counts, offset_dtype, offset_shape)
    g = _graph(dtype)
    tok, w, off = g.tensor_like(token, name="tok"), g.tensor_like(weight, name="w"), g.tensor_like(offsets, name="off")
    out = g.moe_grouped_matmul(tok, w, off)
    if epilogue is not None:
        out = epilogue(g, out)
    out.set_output(True).set_name("y")
    return g, {"tok": token, "w": weight, "off": offsets}


def _sources(g) -> list:
    return [launch.source_path.read_text() for launch in g.plan.launches]


@pytest.mark.parametrize("experts", [1, 3, 8])
@pytest.mark.parametrize("dtype", [dg.float32, dg.float16, dg.bfloat16])
def test_forward(experts, dtype):
    g, inputs = forward_case(COUNTS[experts], 19, 23, dtype)
    check(g, inputs, TORCH_OF[dtype])
    assert len(g.plan.launches) == 1


@pytest.mark.parametrize("layout,kmajor,offset_dtype,offset_shape", [
    ("strided", False, torch.int32, None), ("contiguous", True, torch.int64, None),
    ("rank3", True, torch.int32, (4, 1, 1)), ("strided", True, torch.int64, (4, 1, 1))])
def test_forward_layouts(layout, kmajor, offset_dtype, offset_shape):
    """Non-contiguous tokens, K-major weights, [1, T, K] tokens, int64 and [E, 1, 1] offsets;
    one expert holds every token."""
    g, inputs = forward_case(ALL_IN_ONE, 21, 33, dg.bfloat16, layout, kmajor, offset_dtype, offset_shape)
    check(g, inputs, torch.bfloat16)


SMALL_TILES = dg.BuildOptions(moe_config=MoeConfig(16, 16, 16, 4, 2))
GPU_TILES = dg.BuildOptions(moe_config=MoeConfig(128, 128, 64, 8, 3))


@pytest.mark.parametrize("dtype", [dg.float32, dg.bfloat16])
def test_many_tiles_per_expert(dtype):
    """Forced 16x16x16 tiles: experts span several row tiles (partial last ones), several N and
    K tiles; the forward, dtoken over the transposed view and the wgrad in one graph."""
    counts = [0, 37, 5, 20, 0]
    rows, t = sum(counts), TORCH_OF[dtype]
    token, weight = _token(rows, 45, t, "strided"), _weight(5, 45, 50, t, True)
    dout, offsets = torch.randn(rows, 50).to(t), _offsets(counts, torch.int64)
    g = _graph(dtype)
    tok, w, dy, off = (g.tensor_like(v, name=name) for v, name in
                       ((token, "tok"), (weight, "w"), (dout, "dy"), (offsets, "off")))
    g.gelu(g.moe_grouped_matmul(tok, w, off)).set_output(True).set_name("y")
    g.moe_grouped_matmul(dy, g.transpose(w, [0, 2, 1]), off).set_output(True).set_name("dtok")
    g.moe_grouped_matmul_wgrad(tok, dy, off).set_output(True).set_name("dw")
    check(g, {"tok": token, "w": weight, "dy": dout, "off": offsets}, t, options=SMALL_TILES)
    text = g.explain()
    assert "BLOCK_M=16 BLOCK_N=16 BLOCK_K=16" in text and "forced by BuildOptions.moe_config" in text


def test_fused_epilogue_one_kernel():
    """silu then a cast to bf16 ride the grouped GEMM's store: one kernel, explain() says so."""
    def epilogue(g, out):
        return g.cast(g.silu(out), dg.bfloat16)

    g, inputs = forward_case(COUNTS[3], 17, 41, dg.float32, epilogue=epilogue)
    check(g, inputs, torch.bfloat16)
    assert len(g.plan.launches) == 1
    text = g.explain()
    assert "[moe]" in text and "moe_grouped_matmul" in text and "silu" in text and "1 kernel(s)" in text
    assert "tl.sigmoid" in _sources(g)[0] or "silu" in _sources(g)[0]


def _swiglu(half, rows, store_gate=False, halves=None):
    def epilogue(g, out):
        first, second = halves or ((0, half), (half, 2 * half))
        gate, up = g.slice(out, [(0, rows), first]), g.slice(out, [(0, rows), second])
        if store_gate:
            gate.set_output(True).set_name("gate").set_data_type(dg.float32)
        return g.mul(g.silu(gate), up)
    return epilogue


@pytest.mark.parametrize("dtype,kmajor", [(dg.bfloat16, False), (dg.float32, True)])
def test_swiglu_over_paired_columns_is_one_kernel(dtype, kmajor):
    """silu(gate) * up over the two column halves of one grouped GEMM: each tile computes both
    halves, the whole output is never stored."""
    g, inputs = forward_case([10, 0, 27], 19, 2 * 13, dtype, kmajor=kmajor, epilogue=_swiglu(13, 37))
    check(g, inputs, TORCH_OF[dtype])
    assert len(g.plan.launches) == 1
    text = g.explain()
    assert "slice" in text and "silu" in text and "column pairs" in text


def test_swiglu_pairs_with_forced_tiles_and_a_stored_half():
    """Several N tiles per half (forced 16-wide tiles, F = 37), the gate half stored as an output
    too."""
    g, inputs = forward_case(COUNTS[8], 21, 2 * 37, dg.float32, epilogue=_swiglu(37, 37, store_gate=True))
    check(g, inputs, options=SMALL_TILES)
    assert len(g.plan.launches) == 1


def test_slices_other_than_halves_stay_apart():
    """Slices that are not the two halves (swapped roles stay a pair; an offset split does not)."""
    g, inputs = forward_case([10, 0, 27], 19, 26, dg.float32, epilogue=_swiglu(13, 37, halves=((13, 26), (0, 13))))
    check(g, inputs)
    assert len(g.plan.launches) == 1
    g, inputs = forward_case([10, 0, 27], 19, 26, dg.float32, epilogue=_swiglu(13, 37, halves=((0, 12), (12, 24))))
    check(g, inputs)
    assert len(g.plan.launches) == 2


def test_epilogue_with_operands():
    """A row bias [N] and a residual [T, N] fused into the epilogue (loaded at the tile)."""
    def epilogue(g, out):
        bias = g.tensor(name="bias", dim=[1, 29], data_type=dg.float32)
        residual = g.tensor(name="residual", dim=[33, 29], data_type=dg.float32)
        return g.add(g.relu(g.add(out, bias)), residual)

    g, inputs = forward_case([7, 0, 26], 15, 29, dg.float32, epilogue=epilogue)
    inputs.update(bias=torch.randn(1, 29), residual=torch.randn(33, 29))
    check(g, inputs)
    assert len(g.plan.launches) == 1


def _wgrad_case(counts, k, n, dtype, layout="contiguous"):
    rows = sum(counts)
    t = TORCH_OF[dtype]
    token, dout, offsets = _token(rows, k, t, layout), torch.randn(rows, n).to(t), _offsets(counts)
    g = _graph(dtype)
    tok, dy, off = (g.tensor_like(v, name=name) for v, name in ((token, "tok"), (dout, "dy"), (offsets, "off")))
    g.moe_grouped_matmul_wgrad(tok, dy, off).set_output(True).set_name("dw")
    return g, {"tok": token, "dy": dout, "off": offsets}


@pytest.mark.parametrize("experts,dtype,layout", [(1, dg.float32, "contiguous"), (3, dg.bfloat16, "strided"),
                                                  (8, dg.float16, "contiguous")])
def test_wgrad(experts, dtype, layout):
    """The weight gradient per expert, zero for the empty ones (the poison overwritten)."""
    g, inputs = _wgrad_case(COUNTS[experts], 19, 23, dtype, layout)
    outputs = check(g, inputs, TORCH_OF[dtype])
    for expert, count in enumerate(COUNTS[experts]):
        if count == 0:
            assert torch.equal(outputs["dw"][expert].float(), torch.zeros(19, 23))


@pytest.mark.parametrize("experts,dtype", [(3, dg.float32), (8, dg.bfloat16)])
def test_gradients_as_graph(experts, dtype):
    """dtoken as the same grouped GEMM over each expert's transposed weight (a view: no copy),
    dweight as the grouped wgrad, both against the float64 reference."""
    counts = COUNTS[experts]
    rows, t = sum(counts), TORCH_OF[dtype]
    token, weight = _token(rows, 13, t, "contiguous"), _weight(experts, 13, 27, t, False)
    dout, offsets = torch.randn(rows, 27).to(t), _offsets(counts)
    g = _graph(dtype)
    tok, w, dy, off = (g.tensor_like(v, name=name) for v, name in
                       ((token, "tok"), (weight, "w"), (dout, "dy"), (offsets, "off")))
    g.moe_grouped_matmul(dy, g.transpose(w, [0, 2, 1]), off).set_output(True).set_name("dtok")
    g.moe_grouped_matmul_wgrad(tok, dy, off).set_output(True).set_name("dw")
    check(g, {"tok": token, "w": weight, "dy": dout, "off": offsets}, t)
    assert len(g.plan.launches) == 2  # the transpose is a view


@pytest.mark.parametrize("dtype", [dg.float32, dg.bfloat16])
def test_autograd_through_as_function(dtype):
    """torch.autograd through as_function: the backward graph from the op's backward rule."""
    counts = COUNTS[8]
    rows = sum(counts)
    g, inputs = forward_case(counts, 11, 21, dtype)
    fn = g.as_function()
    token = inputs["tok"].clone().requires_grad_()
    weight = inputs["w"].clone().requires_grad_()
    out = fn(token, weight, inputs["off"])
    grad = torch.randn_like(out)
    out.backward(grad)
    token64 = token.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    starts = inputs["off"].tolist() + [rows]
    ref = torch.cat([token64[starts[e]:starts[e + 1]] @ weight64[e] for e in range(len(counts))])
    ref.backward(grad.double())
    limit = 2e-5 if dtype == dg.float32 else 1.6e-2
    for got, want in ((out, ref), (token.grad, token64.grad), (weight.grad, weight64.grad)):
        err = (got.double() - want).norm() / want.norm()
        assert err < limit, err


def test_bad_calls_raise_typed_errors_and_change_nothing():
    g = _graph(dg.float32)
    tok = g.tensor(name="tok", dim=[10, 8])
    w = g.tensor(name="w", dim=[3, 8, 5])
    off = g.tensor(name="off", dim=[3], data_type=dg.int32)
    bad = [
        (tok, w, g.tensor(name="off_f", dim=[3], data_type=dg.float32), "int32 or int64"),
        (tok, w, g.tensor(name="off_4", dim=[4], data_type=dg.int32), "one offset per expert"),
        (tok, w, g.tensor(name="off_2d", dim=[3, 2], data_type=dg.int32), "[E] or [E, 1, 1]"),
        (tok, g.tensor(name="w_k", dim=[3, 7, 5]), off, "inner dims differ"),
        (tok, g.tensor(name="w_2d", dim=[8, 5]), off, "[E, K, N]"),
        (g.tensor(name="tok_i", dim=[10, 8], data_type=dg.int32), w, off, "takes float32"),
        (g.tensor(name="tok_4d", dim=[1, 1, 10, 8]), w, off, "[T, C] or [1, T, C]"),
    ]
    nodes = len(g.nodes)
    for token, weight, offsets, words in bad:
        with pytest.raises(dg.ValidationError, match="moe_grouped_matmul") as raised:
            g.moe_grouped_matmul(token, weight, offsets)
        assert words in str(raised.value)
    with pytest.raises(dg.ValidationError, match="same rows"):
        g.moe_grouped_matmul_wgrad(tok, g.tensor(name="dy", dim=[9, 5]), off)
    assert len(g.nodes) == nodes


@pytest.mark.parametrize("offsets,words", [([0, 7, 3], "decreases"), ([0, 4, 12], "past T"),
                                           ([2, 4, 6], "start at 0")])
def test_bad_offsets_rejected_by_reference(offsets, words):
    """Offsets are data the kernel reads on the device; host-visible ones are checked by the
    reference (a compiled kernel clamps them and never reads or writes out of bounds)."""
    g, inputs = forward_case([3, 3, 4], 8, 5)
    inputs["off"] = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(dg.ValidationError, match=words):
        g.reference(inputs)


@pytest.mark.parametrize("offsets,words", [([0, 7, 3], "decreases"), ([0, 4, 12], "past T"),
                                           ([2, 4, 6], "start at 0")])
def test_bad_host_offsets_raise_at_execute_and_write_nothing(offsets, words):
    """Offsets on the host (CPU tensors) are checked before any kernel runs; the outputs keep
    their poison. The wgrad checks its own; a good call after a refused one runs."""
    g, inputs = forward_case([3, 3, 4], 8, 5, epilogue=lambda g, out: g.relu(out))
    g.build()
    out = poisoned(g.outputs()[0])
    with pytest.raises(dg.ExecutionError, match=words):
        g.execute({**inputs, "off": torch.tensor(offsets, dtype=torch.int32), "y": out})
    assert torch.isnan(out).all()
    w, inputs_w = _wgrad_case([3, 3, 4], 8, 5, dg.float32)
    w.build()
    dw = poisoned(w.outputs()[0])
    with pytest.raises(dg.ExecutionError, match="moe_grouped_matmul_wgrad"):
        w.execute({**inputs_w, "off": torch.tensor(offsets, dtype=torch.int32), "dw": dw})
    assert torch.isnan(dw).all()
    check(g, inputs)


def test_bad_binding_writes_nothing():
    g, inputs = forward_case(COUNTS[3], 9, 7)
    g.build()
    out = poisoned(g.outputs()[0])
    with pytest.raises(dg.ExecutionError):
        g.execute({**inputs, "off": torch.zeros(4, dtype=torch.int32), "y": out})
    with pytest.raises(dg.ExecutionError):
        g.execute({**inputs, "off": inputs["off"].long(), "y": out})
    assert torch.isnan(out).all()


def test_json_round_trip():
    g, inputs = forward_case(COUNTS[3], 9, 7, epilogue=lambda g, out: g.gelu(out))
    g2 = dg.Graph.from_json(g.to_json())
    check(g2, inputs)


def sm90_graphs():
    """The forward (with a fused silu and cast), the dtoken over a transposed weight view and the
    wgrad, bf16, for the sm_90 compile check."""
    g, _ = forward_case(COUNTS[8], 40, 72, dg.bfloat16, epilogue=lambda g, out: g.cast(g.silu(out), dg.bfloat16))
    g.build()
    yield "forward silu", g
    g = _graph(dg.bfloat16)
    tok, w = g.tensor(name="tok", dim=[40, 24]), g.tensor(name="w", dim=[8, 24, 72])
    dy, off = g.tensor(name="dy", dim=[40, 72]), g.tensor(name="off", dim=[8], data_type=dg.int32)
    g.moe_grouped_matmul(dy, g.transpose(w, [0, 2, 1]), off).set_output(True).set_name("dtok")
    g.moe_grouped_matmul_wgrad(tok, dy, off).set_output(True).set_name("dw")
    g.build()
    yield "dtoken and wgrad", g
    g.build(options=GPU_TILES)
    yield "dtoken and wgrad, GPU tiles", g
    g, _ = forward_case(COUNTS[8], 40, 72, dg.bfloat16, kmajor=True, epilogue=lambda g, out: g.silu(out))
    g.build(options=GPU_TILES)
    yield "forward silu K-major, GPU tiles", g
    g, _ = forward_case(COUNTS[8], 40, 2 * 72, dg.bfloat16, epilogue=_swiglu(72, sum(COUNTS[8])))
    g.build(options=GPU_TILES)
    yield "forward SwiGLU column pairs, GPU tiles", g


def test_kernels_compile_for_sm90():
    assert "compiled 7 kernels for sm_90" in compiled_for_sm90("test_moe:sm90_graphs", timeout=400)


def _routed_counts(tokens, experts, top_k, generator):
    """Rows per expert of `tokens` tokens each routed to `top_k` distinct experts at random."""
    choices = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    return torch.bincount(choices.reshape(-1), minlength=experts).tolist()


@pytest.mark.gpu
def test_mixtral_sized_on_gpu():
    """Mixtral-like FC1: E=8, K=4096, N=14336, 4096 tokens routed top-2 (8192 rows), bf16, with
    silu fused; the wgrad over the same rows. The float64 references (0.6 TFLOP) run on the GPU:
    on the CPU they took minutes."""
    generator = torch.Generator().manual_seed(0)
    counts = _routed_counts(4096, 8, 2, generator)
    rows, k, n = sum(counts), 4096, 14336
    device = "cuda"
    token = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(8, k, n, device=device) / k ** 0.5).to(torch.bfloat16)
    offsets = _offsets(counts).to(device)
    g = _graph(dg.bfloat16)
    tok, w, off = g.tensor_like(token, name="tok"), g.tensor_like(weight, name="w"), g.tensor_like(offsets, name="off")
    g.silu(g.moe_grouped_matmul(tok, w, off)).set_output(True).set_name("y")
    check(g, {"tok": token, "w": weight, "off": offsets}, torch.bfloat16, device=device, reference_device=device)
    dout = torch.randn(rows, 2048, device=device, dtype=torch.bfloat16)
    g = _graph(dg.bfloat16)
    tok, dy, off = g.tensor_like(token, name="tok"), g.tensor_like(dout, name="dy"), g.tensor_like(offsets, name="off")
    g.moe_grouped_matmul_wgrad(tok, dy, off).set_output(True).set_name("dw")
    check(g, {"tok": token, "dy": dout, "off": offsets}, torch.bfloat16, device=device, reference_device=device)


def test_autograd_through_swiglu():
    """as_function's autograd through the fused SwiGLU MoE: the slices' gradients meet in dout,
    then the grouped dtoken and wgrad."""
    counts = COUNTS[3]
    rows = sum(counts)
    g, inputs = forward_case(counts, 11, 2 * 9, dg.float32, epilogue=_swiglu(9, rows))
    token = inputs["tok"].clone().requires_grad_()
    weight = inputs["w"].clone().requires_grad_()
    out = g.as_function()(token, weight, inputs["off"])
    grad = torch.randn_like(out)
    out.backward(grad)
    token64 = token.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    starts = inputs["off"].tolist() + [rows]
    full = torch.cat([token64[starts[e]:starts[e + 1]] @ weight64[e] for e in range(len(counts))])
    ref = torch.nn.functional.silu(full[:, :9]) * full[:, 9:]
    ref.backward(grad.double())
    for got, want in ((out, ref), (token.grad, token64.grad), (weight.grad, weight64.grad)):
        assert (got.double() - want).norm() / want.norm() < 2e-5
