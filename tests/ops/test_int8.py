"""int8 matmul and convolution (issue 33, item 2): int8 x int8 operands, int32 accumulation on the
tensor cores, int32 outputs bit-exact with the float64 reference (which sums the integers
exactly), float epilogues (per-tensor and per-channel scales, bias, activation) to bf16/fp32
within the output type's rounding, requantization to int8 (round to nearest even, saturation to
[-128, 127]), and the bad inputs: int8 with a float operand, a K that could overflow int32, fp8
scales on int8 (int8 gradients: test_int8_conv_grad.py). CPU (interpreter) at odd sizes with every kernel variant; GPU
(marked gpu) at real sizes against torch._int_mm."""
import math

import pytest
import torch

import dnngraph as dg
from dnngraph import dtypes
from dnngraph.backends.triton.heuristics import conv as conv_heuristics
from dnngraph.backends.triton.heuristics import matmul as mm
from dnngraph.backends import registry
from dnngraph.backends.triton.lower.matmul import MatmulBuild
from dnngraph.fusion import partition
from dnngraph.ops.matmul import INT8_MAX_K
from helpers import check, poisoned, run

DEVICE = dg.target.H100
# every GEMM variant, forced; BLOCK_K 32 is the narrowest an 8-bit tl.dot takes on the GPU
VARIANTS = {
    "tiled": mm.MatmulConfig("tiled", 32, 32, 32, 4, 2),
    "small_m": mm.MatmulConfig("small_m", 16, 32, 64, 4, 2),
    "split_k": mm.MatmulConfig("split_k", 32, 16, 32, 4, 2, split_k=3),
    "persistent": mm.MatmulConfig("persistent", 32, 32, 32, 4, 2),
}


def quantized(shape, low=-128, high=128, device="cpu") -> torch.Tensor:
    """Random int8 values in [low, high)."""
    return torch.randint(low, high, list(shape), dtype=torch.int8, device=device)


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """`values` (last two axes a matrix) stored row-major, column-major, or every other column of a
    wider buffer (strided)."""
    if layout == "row":
        return values.contiguous()
    if layout == "col":
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    wide = torch.zeros(list(values.shape[:-1]) + [values.shape[-1] * 2], dtype=values.dtype)
    wide[..., ::2] = values
    return wide[..., ::2]


def exact(graph, inputs: dict, options=None) -> dict:
    """Execute with poisoned outputs and require every output equal to the reference, bit for bit."""
    outputs = run(graph, inputs, options=options)
    refs = graph.reference(inputs)
    for name, out in outputs.items():
        assert out.dtype == refs[name].dtype, name
        assert torch.equal(out, refs[name]), f"{name}: {(out.long() - refs[name].long()).abs().max()} off"
    return outputs


def matmul_graph(a: torch.Tensor, b: torch.Tensor, io=dg.bfloat16):
    g = dg.Graph(name="int8_mm", io_data_type=io)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    return g, ta, tb, g.matmul(ta, tb)


# --- the data type --------------------------------------------------------------------------------
def test_int8_is_a_data_type_by_name_and_torch_dtype():
    assert dg.int8 is dtypes.by_name("int8") is dtypes.from_torch(torch.int8) is dtypes.resolve("int8")
    assert not dg.int8.is_floating and dg.int8.itemsize == 1


def test_conversion_to_int8_rounds_to_nearest_even_and_saturates():
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.49, 127.5, -128.5, -127.5, 1e9, -1e9,
                           math.inf, -math.inf, math.nan, -0.0])
    want = [0, 2, 2, 0, -2, 126, 127, 127, -128, -128, 127, -128, 127, -128, 0, 0]
    assert dtypes.to_int8(values).tolist() == want
    assert dtypes.to_int8(torch.tensor([300, -300, 5], dtype=torch.int32)).tolist() == [127, -128, 5]


@pytest.mark.parametrize("source", ["float", "int32"])
def test_cast_to_int8_in_a_pointwise_kernel_matches_the_rule(source):
    """g.cast to int8 (and an int8 output) in a pointwise kernel: ties to even, saturation, NaN to 0,
    from floats and from int32 values past the range."""
    if source == "float":
        x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.5, -128.5, 1e9, -math.inf, math.inf, math.nan, 3.7, -3.7])
    else:
        x = torch.tensor([300, -300, 127, -128, 5, 2**31 - 1, -2**31], dtype=torch.int32)
    g = dg.Graph(name="cast", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    g.cast(tx, data_type=dg.int8).set_output(True)
    outputs = exact(g, {tx: x})
    assert list(outputs.values())[0].tolist() == dtypes.to_int8(x).tolist()


def test_int8_pointwise_math_is_exact_int32_then_saturates_on_store():
    """int8 operands widen to int32 (torch's int8 add wraps: 100 + 100 would be -56): the kernel
    and the reference both add in int32 and the int8 store saturates."""
    x = torch.tensor([[100, -100, 5, 127]], dtype=torch.int8)
    y = torch.tensor([[100, -100, -7, 1]], dtype=torch.int8)
    g = dg.Graph(name="add8", io_data_type=dg.int8)
    tx, ty = g.tensor_like(x, name="x"), g.tensor_like(y, name="y")
    s = g.add(tx, ty).set_output(True).set_data_type(dg.int8)
    w = g.add(tx, ty).set_output(True).set_data_type(dg.int32)
    out = exact(g, {tx: x, ty: y})
    assert out[s.name].tolist() == [[127, -128, -2, 127]]
    assert out[w.name].tolist() == [[200, -200, -2, 128]]



def test_integer_constants_with_int8_operands_fit_int32_where_the_math_runs():
    """int8 operands compute in int32: an integral constant past int32 is refused at the op call
    (as with an int32 tensor), one past int8 but within int32 is exact, and an int64 operand
    widens the math (and the allowed constants) to int64."""
    x = torch.tensor([[100, -128, 5]], dtype=torch.int8)
    wide = torch.tensor([[1, 2, 3]], dtype=torch.int64)
    g = dg.Graph(name="const8", io_data_type=dg.int64)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(wide, name="wide")
    condition = g.tensor(name="c", dim=[1, 3], data_type=dg.bool)
    for make in (lambda: g.add(tx, 2**40), lambda: g.mul(tx, -2**31 - 1), lambda: g.maximum(tx, 2**40),
                 lambda: g.where(condition, tx, 2**40)):  # (a bool condition does not widen the math)
        with pytest.raises(dg.ValidationError, match="int32"):
            make()
    assert g.nodes == []
    g.add(tx, 100000).set_output(True)
    g.add(g.add(tx, tw), 2**40).set_output(True)
    out = exact(g, {tx: x, tw: wide})
    assert list(out.values())[0].tolist() == [[100100, 99872, 100005]]


@pytest.mark.parametrize("layout_op", ["concatenate", "concatenate_then_add", "transpose_copy", "strided_slice",
                                       "reshape_of_transpose"])
def test_int8_through_layout_ops_that_copy(layout_op):
    """int8 values moved by the layout ops' copy kernels (a copy stores to a buffer the build makes
    up, not a graph tensor) come out bit for bit, and a consumer of the copy widens them."""
    torch.manual_seed(17)
    x, y = quantized([5, 7]), quantized([7, 5]).t()  # y: a transposed (column-major) part
    g = dg.Graph(name="layout8", io_data_type=dg.int8)
    tx, ty = g.tensor_like(x, name="x"), g.tensor_like(y, name="y")
    if layout_op == "concatenate":
        out = g.concatenate([tx, ty], axis=1)
    elif layout_op == "concatenate_then_add":
        out = g.add(g.concatenate([tx, ty], axis=0), 100)  # saturates on the int8 store
    elif layout_op == "transpose_copy":
        out = g.transpose(ty, [1, 0]).set_stride([5, 1])
    elif layout_op == "strided_slice":
        out = g.slice(ty, [slice(1, 5), slice(0, 7, 3)])
    else:
        out = g.reshape(g.transpose(tx, [1, 0]), [5, 7])
    out.set_output(True)
    exact(g, {tx: x, ty: y})

# --- matmul: int32 out, exact ---------------------------------------------------------------------
def test_int8_matmul_yields_int32_by_default():
    g, ta, tb, c = matmul_graph(quantized([5, 7]), quantized([7, 3]))
    assert c.data_type is dg.int32


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layouts", [("row", "row"), ("row", "col"), ("col", "strided")],
                         ids=["N-major-B", "K-major-B", "col-A-strided-B"])
def test_int8_matmul_int32_is_exact_in_every_variant_and_layout(variant, layouts):
    torch.manual_seed(1)
    a = laid_out(quantized([37, 75]), layouts[0])
    b = laid_out(quantized([75, 19]), layouts[1])
    g, ta, tb, c = matmul_graph(a, b)
    c.set_output(True)
    out = exact(g, {ta: a, tb: b}, dg.BuildOptions(matmul_config=VARIANTS[variant]))
    assert torch.equal(out[c.name].long(), a.long() @ b.long())


@pytest.mark.parametrize("a_shape, b_shape", [
    ([2, 3, 9, 33], [2, 3, 33, 5]),  # batched
    ([2, 3, 9, 33], [3, 33, 5]),  # b broadcast over the first batch axis
    ([2, 1, 9, 33], [1, 4, 33, 5]),  # both broadcast (size-1 batch axes)
    ([4, 9, 33], [33, 5]),  # a shared weight: the batches fold into the rows
    ([1, 1], [1, 1]),  # size-1 M, N and K
    ([1, 40], [40, 1]),
])
def test_int8_matmul_batched_and_broadcast_is_exact(a_shape, b_shape):
    torch.manual_seed(2)
    a, b = quantized(a_shape), quantized(b_shape)
    g, ta, tb, c = matmul_graph(a, b)
    c.set_output(True)
    exact(g, {ta: a, tb: b})


def test_int8_matmul_broadcast_stride_zero_operand_is_exact():
    torch.manual_seed(3)
    a = quantized([1, 21, 40]).expand(3, 21, 40)  # stride 0 over the batch
    b = quantized([3, 40, 6])
    g, ta, tb, c = matmul_graph(a, b)
    c.set_output(True)
    exact(g, {ta: a, tb: b})


@pytest.mark.parametrize("sign", [1, -1], ids=["largest", "most-negative"])
def test_int8_matmul_extremes_reach_the_int32_limit_exactly(sign):
    """-128 * -128 products over the longest K the op takes (131071) sum to 2147467264, 16384 short
    of 2^31 - 1; -128 * 127 ones to the most negative sum; a few rows of random values around them."""
    k = INT8_MAX_K
    a = torch.full((3, k), -128, dtype=torch.int8)
    b = torch.full((k, 2), -128 if sign > 0 else 127, dtype=torch.int8)
    a[2] = quantized([k])
    g, ta, tb, c = matmul_graph(a, b)
    c.set_output(True)
    out = exact(g, {ta: a, tb: b}, dg.BuildOptions(matmul_config=mm.MatmulConfig("tiled", 16, 16, 512, 4, 2)))
    extreme = k * 128 * 128 if sign > 0 else -k * 128 * 127
    assert out[c.name][0].tolist() == [extreme, extreme]
    assert out[c.name][2].tolist() == (a[2].long() @ b.long()).tolist()


def test_int8_matmul_refuses_a_k_that_could_overflow():
    g = dg.Graph(name="long", io_data_type=dg.float32)
    ta = g.tensor(name="a", dim=[2, INT8_MAX_K + 1], data_type=dg.int8)
    tb = g.tensor(name="b", dim=[INT8_MAX_K + 1, 2], data_type=dg.int8)
    with pytest.raises(dg.ValidationError, match="overflow"):
        g.matmul(ta, tb)
    assert g.nodes == []  # the failed call changed nothing
    ok = g.tensor(name="ok", dim=[INT8_MAX_K, 2], data_type=dg.int8)
    g.matmul(g.tensor(name="a_ok", dim=[2, INT8_MAX_K], data_type=dg.int8), ok)  # the limit itself is taken


@pytest.mark.parametrize("late", ["long_k", "mixed", "conv_long_k", "through_a_view"])
def test_int8_operands_typed_after_the_op_are_checked_at_build(late):
    """set_data_type after the op call makes operands the call would have refused: the build
    refuses them as the call does (ValidationError), never running an int32 sum that wraps nor
    failing inside the lowering; setting both operands one after the other is fine."""
    g = dg.Graph(name="late8", io_data_type=dg.float32)
    k = INT8_MAX_K + 1 if late in ("long_k", "through_a_view") else 8
    if late == "conv_long_k":
        channels = INT8_MAX_K // 9 + 1
        ta = g.tensor(name="x", dim=[1, channels, 3, 3], data_type=dg.float32)
        tb = g.tensor(name="w", dim=[1, channels, 3, 3], data_type=dg.float32)
        y = g.conv_fprop(ta, tb, padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    else:
        ta = g.tensor(name="a", dim=[2, k], data_type=dg.float32)
        tb = g.tensor(name="b", dim=[k, 2], data_type=dg.float32)
        a = g.reshape(ta, [2, k]) if late == "through_a_view" else ta  # the view takes a's type
        y = g.matmul(a, tb)
    y.set_output(True)
    ta.set_data_type(dg.int8)
    if late != "mixed":
        tb.set_data_type(dg.int8)
    with pytest.raises(dg.ValidationError, match="overflow" if late != "mixed" else "int8"):
        g.build()
    assert g.plan is None
    if late == "mixed":
        tb.set_data_type(dg.int8)
        g.build()  # both int8 now: taken


@pytest.mark.parametrize("other", [dg.float32, dg.bfloat16, dg.int32])
def test_int8_times_another_type_is_a_validation_error(other):
    g = dg.Graph(name="mixed", io_data_type=dg.float32)
    ta = g.tensor(name="a", dim=[4, 8], data_type=dg.int8)
    tb = g.tensor(name="b", dim=[8, 4], data_type=other)
    for first, second in ((ta, tb), (tb, ta)):
        with pytest.raises(dg.ValidationError, match="int8"):
            g.matmul(first, second)
    # a virtual operand of another type (a cast of the int8 input) mixed with int8 is refused too
    with pytest.raises(dg.ValidationError, match="int8"):
        g.matmul(g.cast(ta, data_type=dg.float32), g.tensor(name="b8", dim=[8, 4], data_type=dg.int8))
    assert [n.op for n in g.nodes] == ["cast"]


def test_int8_matmul_refuses_fp8_style_scales():
    a, b = quantized([4, 8]), quantized([8, 3])
    g = dg.Graph(name="scaled", io_data_type=dg.float32)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    scale = g.tensor(name="s", dim=[1, 1], data_type=dg.float32)
    with pytest.raises(dg.ValidationError, match="mul"):
        g.matmul(ta, tb, scale_a=scale)


# --- matmul: float epilogues and requantization ---------------------------------------------------
@pytest.mark.parametrize("variant", ["tiled", "split_k", "persistent"])
def test_per_channel_scales_bias_relu_to_bf16(variant):
    """y = relu(int32(a @ b) * scale_a * scale_b[n] + bias[n]) in bf16: the int32 accumulator
    converted to float32, the chain fused, within bf16's rounding of the float64 reference."""
    torch.manual_seed(4)
    a, b = quantized([2, 29, 67]), quantized([67, 23])
    scale_a = torch.tensor([[0.02]])
    scale_b = torch.rand(1, 23) * 1e-3 + 1e-4
    bias = torch.randn(1, 23)
    g = dg.Graph(name="dequant", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    tsa, tsb, tbias = (g.tensor_like(t, name=n) for t, n in ((scale_a, "sa"), (scale_b, "sb"), (bias, "bias")))
    y = g.relu(g.add(g.mul(g.mul(g.matmul(ta, tb), tsa), tsb), tbias))
    y.set_output(True)
    g.build(options=dg.BuildOptions(matmul_config=VARIANTS[variant]))
    assert len(g.plan.launches) == (2 if variant == "split_k" else 1)  # one kernel (+ split-K's combine)
    check(g, {ta: a, tb: b, tsa: scale_a, tsb: scale_b, tbias: bias}, dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", ["tiled", "split_k"])
def test_requantize_to_int8_saturates_and_rounds_ties_to_even(variant):
    """A power-of-two scale (exact in float32 as in float64): rows 0 and 1 are made of ties (one
    nonzero in A against +-64 in B: +-1.5 and +-2.5), which round to even; random rows saturate
    at both ends; all bit-exact, the int32 product stored beside them."""
    torch.manual_seed(5)
    a, b = quantized([33, 50]), quantized([50, 17])
    a[:2] = 0
    a[0, 7], a[1, 7] = 12, 20
    b[7] = torch.tensor([64, -64] * 8 + [64], dtype=torch.int8)
    g = dg.Graph(name="requant", io_data_type=dg.float32)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    c = g.matmul(ta, tb).set_output(True)
    q = g.mul(c, 1.0 / 512).set_output(True).set_data_type(dg.int8)
    out = exact(g, {ta: a, tb: b}, dg.BuildOptions(matmul_config=VARIANTS[variant]))
    values = out[q.name]
    assert values[0].tolist() == [2, -2] * 8 + [2]  # 12 * 64 / 512 = 1.5 -> 2
    assert values[1].tolist() == [2, -2] * 8 + [2]  # 20 * 64 / 512 = 2.5 -> 2
    assert (values == 127).any() and (values == -128).any()  # saturated both ways


def test_requantize_with_a_per_channel_float_scale_is_within_one_step():
    """A general float32 scale: the kernel's float32 product and the reference's float64 one may
    round a value lying within float32's error of a .5 tie differently; elsewhere they agree."""
    torch.manual_seed(6)
    a, b = quantized([40, 64]), quantized([64, 24])
    scale = torch.rand(1, 24) * 4e-3
    g = dg.Graph(name="requant_pc", io_data_type=dg.int8)
    ta, tb, ts = g.tensor_like(a, name="a"), g.tensor_like(b, name="b"), g.tensor_like(scale, name="s")
    q = g.mul(g.matmul(ta, tb), ts).set_output(True)
    assert q.data_type is dg.int8
    out = run(g, {ta: a, tb: b, ts: scale})[q.name]
    ref = g.reference({ta: a, tb: b, ts: scale})[q.name]
    assert out.dtype == torch.int8
    assert (out.long() - ref.long()).abs().max() <= 1
    assert (out == ref).float().mean() > 0.99


def test_int32_product_cast_to_int8_saturates_from_the_integer():
    torch.manual_seed(7)
    a, b = quantized([9, 30]), quantized([30, 11])
    g = dg.Graph(name="narrow", io_data_type=dg.float32)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    q = g.cast(g.matmul(ta, tb), data_type=dg.int8).set_output(True)
    out = exact(g, {ta: a, tb: b})[q.name]
    assert torch.equal(out, (a.long() @ b.long()).clamp(-128, 127).to(torch.int8))


def test_int8_output_read_by_a_fused_consumer_sees_the_saturated_value():
    """An int8 graph output inside the chain: its consumer reads it as stored (saturated), as in a
    separate kernel."""
    torch.manual_seed(8)
    a, b = quantized([12, 20]), quantized([20, 7])
    g = dg.Graph(name="chain", io_data_type=dg.float32)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    q = g.mul(g.matmul(ta, tb), 0.25).set_output(True).set_data_type(dg.int8)
    doubled = g.mul(q, 2).set_output(True).set_data_type(dg.int32)
    out = exact(g, {ta: a, tb: b})
    assert torch.equal(out[doubled.name], out[q.name].int() * 2)


def test_quantization_of_a_float_operand_fuses_into_the_int8_matmul_loader():
    """cast(x * 0.5, int8) feeding A: quantized at load (rounded, saturated: x reaches +-150), one
    kernel, the int32 product exact."""
    torch.manual_seed(16)
    x = torch.randn(37, 70) * 100
    x[0, :4] = torch.tensor([1.0, 3.0, -5.0, float("nan")])  # ties 0.5, 1.5, -2.5 and NaN
    w = quantized([70, 19])
    g = dg.Graph(name="dynamic_quant", io_data_type=dg.float32)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    c = g.matmul(g.cast(g.mul(tx, 0.5), data_type=dg.int8), tw).set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    out = exact(g, {tx: x, tw: w})[c.name]
    assert torch.equal(out.long(), dtypes.to_int8(x * 0.5).long() @ w.long())


@pytest.mark.parametrize("probabilities", ["int8", "float32"])
def test_attention_written_as_ops_with_scaled_probabilities_builds(probabilities):
    """s = q8 @ k8 (int32), p = softmax(s / 64), then p times a constant (requantized to int8, or
    a float scale) @ v: the attention matchers read p's readers, and a mul by a constant is none
    of theirs (the backward matcher took it for ds' = p * (dP - delta) and raised AttributeError
    on its absent tensor operand)."""
    torch.manual_seed(18)
    q8, k8 = quantized([1, 2, 16, 32]), quantized([1, 2, 32, 16])
    v = quantized([1, 2, 16, 8]) if probabilities == "int8" else torch.randn(1, 2, 16, 8)
    g = dg.Graph(name="qattention", io_data_type=dg.float32)
    tq, tk, tv = g.tensor_like(q8, name="q"), g.tensor_like(k8, name="k"), g.tensor_like(v, name="v")
    p = g.softmax(g.mul(g.matmul(tq, tk), 1.0 / 64), axis=-1)
    if probabilities == "int8":
        p = g.cast(g.mul(p, 127.0), data_type=dg.int8)
    else:
        p = g.mul(p, 2.0)
    o = g.matmul(p, tv).set_output(True)
    assert o.data_type is (dg.int32 if probabilities == "int8" else dg.float32)
    # the kernels' float32 softmax may round a probability to the other int8 step than float64 does
    check(g, {tq: q8, tk: k8, tv: v}, tolerance=1e-2 if probabilities == "int8" else None)


def test_int8_graph_round_trips_through_json():
    a, b = quantized([5, 9]), quantized([9, 4])
    g, ta, tb, c = matmul_graph(a, b)
    g.mul(c, 0.5).set_output(True).set_data_type(dg.int8)
    g2 = dg.Graph.from_json(g.to_json())
    assert [t.data_type for t in g2.outputs()] == [dg.int8]
    exact(g2, {"a": a, "b": b})


def test_execute_refuses_a_float_tensor_bound_to_an_int8_input():
    a, b = quantized([5, 9]), quantized([9, 4])
    g, ta, tb, c = matmul_graph(a, b)
    c.set_output(True)
    g.build()
    out = poisoned(c)
    with pytest.raises(dg.ExecutionError):
        g.execute({ta: a.float(), tb: b, c: out})
    assert (out == -12345).all()  # nothing written



@pytest.mark.parametrize("data_type, value", [(dg.int8, 300), (dg.int8, -129), (dg.int32, 2**40)])
def test_a_host_scalar_past_its_integer_type_is_an_execution_error(data_type, value):
    """A pass-by-value input takes a number its integer type holds: past it (int8 300, int32
    2**40), execute raises ExecutionError and writes nothing (it was torch's RuntimeError from
    filling the staging tensor); the edges of the range are taken."""
    x = quantized([3, 4])
    g = dg.Graph(name="scalar8", io_data_type=dg.int64)
    tx = g.tensor_like(x, name="x")
    s = g.tensor(name="s", dim=[1, 1], data_type=data_type).set_is_pass_by_value(True)
    y = g.add(tx, s).set_output(True)
    g.build()
    out = poisoned(y)
    with pytest.raises(dg.ExecutionError, match="s"):
        g.execute({tx: x, s: value, y: out})
    assert (out == -12345).all()
    # int8's edges; int32's largest less 127, so that x + s (int32 math) does not wrap
    edge = 127 if value > 0 and data_type is dg.int8 else (-128 if data_type is dg.int8 else 2**31 - 128)
    g.execute({tx: x, s: edge, y: out})
    assert torch.equal(out, x.long() + edge)

# --- convolution -----------------------------------------------------------------------------------
def conv_input(shape, layout):
    """int8 values of logical `shape` stored NCHW, NHWC, or strided (every other channel of a
    wider buffer, spatial axes transposed in memory)."""
    if layout == "strided":
        wide = quantized([shape[0], shape[1] * 2] + list(shape[2:][::-1]))
        return wide[:, ::2].transpose(-1, -2) if len(shape) == 4 else wide[:, ::2]
    values = quantized(shape)
    if layout == "nhwc":
        return values.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    return values


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("case", [
    dict(x=[2, 6, 9, 7], w=[8, 3, 3, 3], padding=[1, 2], stride=[2, 1], dilation=[1, 1], groups=2),
    dict(x=[1, 16, 6, 5], w=[12, 16, 3, 3], padding=[1, 1], stride=[1, 1], dilation=[2, 1], groups=1),
    dict(x=[2, 5, 7, 6], w=[5, 1, 3, 3], padding=[1, 1], stride=[1, 2], dilation=[1, 1], groups=5),  # depthwise
    dict(x=[2, 24, 5, 3], w=[10, 24, 1, 1], padding=[0, 0], stride=[1, 1], dilation=[1, 1], groups=1),  # 1x1: matmul
], ids=["grouped", "dilated", "depthwise", "pointwise"])
def test_int8_conv_fprop_int32_is_exact(layout, case):
    torch.manual_seed(9)
    case = dict(case)
    x, w = conv_input(case.pop("x"), layout), conv_input(case.pop("w"), layout)
    g = dg.Graph(name="conv8", io_data_type=dg.float32)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    y = g.conv_fprop(tx, tw, **case).set_output(True)
    assert y.data_type is dg.int32
    exact(g, {tx: x, tw: w})


def test_int8_conv_1d_and_3d_are_exact():
    torch.manual_seed(10)
    for x_shape, w_shape, conv in (([2, 4, 11], [5, 4, 3], dict(padding=[2], stride=[2], dilation=[1])),
                                   ([1, 4, 4, 5, 3], [6, 2, 3, 1, 2],
                                    dict(padding=[1, 0, 1], stride=[1, 1, 2], dilation=[1, 1, 1], groups=2))):
        x, w = quantized(x_shape), quantized(w_shape)
        g = dg.Graph(name="conv8", io_data_type=dg.float32)
        tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
        g.conv_fprop(tx, tw, **conv).set_output(True)
        exact(g, {tx: x, tw: w})


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_int8_conv_per_channel_dequant_bias_relu_to_bf16_and_requant(layout):
    """The int8 conv of a quantized network layer: int32 -> per-channel scale, bias, relu, stored
    in bf16 and requantized to int8 (the next layer's input) from one kernel."""
    torch.manual_seed(11)
    x, w = conv_input([2, 8, 7, 6], layout), conv_input([6, 8, 3, 3], layout)
    scale = torch.rand(1, 6, 1, 1) * 1e-3 + 1e-4
    bias = torch.randn(1, 6, 1, 1)
    g = dg.Graph(name="qconv", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    ts, tbias = g.tensor_like(scale, name="scale"), g.tensor_like(bias, name="bias")
    y = g.relu(g.add(g.mul(g.conv_fprop(tx, tw, padding=[1, 1], stride=[1, 1], dilation=[1, 1]), ts), tbias))
    y.set_output(True)
    q = g.mul(y, 64.0).set_output(True).set_data_type(dg.int8)
    g.build()
    assert len(g.plan.launches) == 1
    outputs = run(g, {tx: x, tw: w, ts: scale, tbias: bias})
    refs = g.reference({tx: x, tw: w, ts: scale, tbias: bias})
    assert (outputs[y.name].double() - refs[y.name]).norm() / refs[y.name].norm() < 1.6e-2
    # q reads y as stored (bf16) in kernel and reference alike; the float32 product by 64 is exact
    assert torch.equal(outputs[q.name], refs[q.name])
    assert (outputs[q.name] == 127).any()


def test_int8_conv_with_a_float_filter_and_an_overflowing_reduction_are_refused():
    g = dg.Graph(name="bad", io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[1, 4, 5, 5], data_type=dg.int8)
    w = g.tensor(name="w", dim=[2, 4, 3, 3], data_type=dg.float32)
    with pytest.raises(dg.ValidationError, match="int8"):
        g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    channels = INT8_MAX_K // 9 + 1  # channels x 3x3 taps just past the limit
    big_x = g.tensor(name="big_x", dim=[1, channels, 3, 3], data_type=dg.int8)
    big_w = g.tensor(name="big_w", dim=[1, channels, 3, 3], data_type=dg.int8)
    with pytest.raises(dg.ValidationError, match="overflow"):
        g.conv_fprop(big_x, big_w, padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    assert g.outputs() == []


# --- heuristics --------------------------------------------------------------------------------------
def _problem(m=4096, n=4096, k=4096, layouts=("row", "col"), tma=True):
    return mm.MatmulProblem(1, m, n, k, "int8", 1, 1, 4, tma, *layouts)


def test_int8_dot_choice_and_k_steps():
    assert mm.choose_dot("int8", "int8", "tl.int8", "tl.int8", False) == mm.DotChoice("tl.int8", "tl.int8", "int8", "")
    ranked = mm.rank(_problem(), DEVICE)
    assert all(c.block_k == 128 for c in ranked if c.variant in ("tiled", "persistent"))
    assert ranked[0].variant == "persistent"
    ops = 2 * 4096 ** 3 / (ranked[0].estimate_us * 1e-6) / 1e12
    assert 700 < ops < 1600  # TOPS: the int8 (fp8-class) rate, not bf16's
    assert all(mm.shared_bytes(c, _problem()) <= DEVICE.shared_memory for c in ranked)


@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (16, 11008, 4096), (64, 64, 65536), (4096, 4096, 40),
                                     (4096, 4096, 8)])
def test_int8_candidates_never_step_k_below_32_and_have_no_cliff(m, n, k):
    """tl.dot takes 8-bit operands in K steps of at least 32 (narrower fails to compile on the
    GPU); short K and decode shapes stay near the bf16 problem's time or better."""
    int8 = _problem(m, n, k)
    bf16 = mm.MatmulProblem(1, m, n, k, "bf16", 2, 2, 4, True, "row", "col")
    ranked = mm.rank(int8, DEVICE)
    assert min(c.block_k for c in ranked) >= 32
    assert ranked[0].estimate_us <= 1.05 * mm.rank(bf16, DEVICE)[0].estimate_us


def test_int8_tma_needs_k_major_operands():
    """wgmma reads 8-bit operands K-major only: the persistent (TMA) kernel is offered for A
    row-major with B as [N, K] (col) alone."""
    a = quantized([64, 64])
    for b, persistent in ((quantized([64, 64]), False), (quantized([64, 64]).t().contiguous().t(), True)):
        g, ta, tb, c = matmul_graph(a, b)
        c.set_output(True)
        (group,) = partition(g, registry.families())
        build = MatmulBuild(g, group, dg.target.H100)
        assert build.problem.tma is persistent


def test_int8_conv_narrow_k_steps_stay_at_32():
    problem = conv_heuristics.ConvProblem(1, 4096, 64, 3, 9, "int8", 1, 1, 4, "x w", "", False)
    assert min(c.block_k for c in conv_heuristics.candidates(problem, DEVICE)) >= 32


def _modelled_us(graph) -> float:
    """The model's time of a one-kernel graph built for the H100 (explain's "model rank" line)."""
    graph.build(options=dg.BuildOptions(target=DEVICE))
    (line,) = [line for line in graph.explain().splitlines() if "model rank" in line]
    return float(line.split(" us ")[0].split(": ")[-1])


def test_int8_depthwise_conv_has_no_cliff():
    """A depthwise int8 conv (MobileNet's, NHWC) is modelled no slower than the bf16 one: as an
    implicit GEMM of N = 1 per group it was 36x slower (1310 us against 37 us)."""
    times = {}
    for data_type in (dg.bfloat16, dg.int8):
        g = dg.Graph(name="dw", io_data_type=dg.bfloat16)
        x = g.tensor(name="x", dim=[32, 256, 56, 56], stride=[802816, 1, 14336, 256], data_type=data_type)
        w = g.tensor(name="w", dim=[256, 1, 3, 3], stride=[9, 1, 3, 1], data_type=data_type)
        y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=256)
        y.set_output(True).set_data_type(dg.bfloat16)  # the same output bytes (int8's int32 stored as bf16)
        times[data_type.name] = _modelled_us(g)
    assert times["int8"] <= 1.05 * times["bfloat16"], times


@pytest.mark.parametrize("taps", [9, 1024, 1025])
def test_int8_depthwise_conv_is_exact_at_the_extremes(taps):
    """-128 x -128 but for one odd product (-127 x -127): a depthwise (or channel-multiplier)
    conv's sum reaches (taps - 1) x 2^14 + 16129, an odd integer past float32's exact ones (2^24)
    beyond 1024 taps, where a float32 accumulator would round it; each stays exact whichever
    kernel runs it, an int epilogue and requantization too."""
    width = taps + 6
    x = torch.full((2, 3, width), -128, dtype=torch.int8)
    x[1] = quantized([3, width])
    w = torch.full((6, 1, taps), -128, dtype=torch.int8)  # channel multiplier 2
    x[0, 0, 2], w[0, 0, 2] = -127, -127  # output 1 reads x[0 .. taps - 1] (padding 1): tap 2 meets x[2]
    g = dg.Graph(name="dw8", io_data_type=dg.int32)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    y = g.conv_fprop(tx, tw, padding=[1], stride=[1], dilation=[1], groups=3).set_output(True)
    g.sub(y, 7).set_output(True)
    g.mul(y, 2.0 ** -20).set_output(True).set_data_type(dg.int8)
    out = exact(g, {tx: x, tw: w})
    assert out[y.name][0, 0, 1].item() == (taps - 1) * 128 * 128 + 127 * 127


# --- torch backend ------------------------------------------------------------------------------------
def test_torch_int_mm_compiles_to_a_dnngraph_int8_matmul():
    from dnngraph import torch_backend
    torch.manual_seed(12)
    a, b = quantized([40, 64]), quantized([64, 24])
    scale = torch.rand(24)
    fn = lambda a, b, s: (torch._int_mm(a, b).float() * s).to(torch.bfloat16)
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    got = torch.compile(fn, backend="dnngraph", fullgraph=True, dynamic=False)(a, b, scale)
    assert torch.equal(got, fn(a, b, scale))
    left = [target for report in torch_backend.REPORTS for target, _ in report.torch_ops]
    assert not any("_int_mm" in t for t in left), left


def test_torch_conversions_to_int8_stay_in_torch():
    """torch's float -> int8 conversion truncates and wraps; dnngraph's saturates: it stays in torch
    and the compiled program still gives torch's answer."""
    from dnngraph import torch_backend
    x = torch.tensor([1.7, -1.7, 300.0, 2.5])
    fn = lambda x: (x * 1.0).to(torch.int8)
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    got = torch.compile(fn, backend="dnngraph", dynamic=False)(x)
    assert torch.equal(got, fn(x))
    left = [(target, why) for report in torch_backend.REPORTS for target, why in report.torch_ops]
    assert any("int8" in why for _, why in left), left



def _left_in_torch(fn, *args):
    """(compiled result, torch's, the ops left in torch with why) of `fn` under the dnngraph backend."""
    from dnngraph import torch_backend
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    got = torch.compile(fn, backend="dnngraph", dynamic=False)(*args)
    return got, fn(*args), [(str(target), why) for report in torch_backend.REPORTS for target, why in report.torch_ops]


@pytest.mark.parametrize("compare", [lambda x: x < 300, lambda x: x == -129, lambda x: x >= torch.tensor(300),
                                     lambda x: x.int() != torch.tensor(2**32 + 44), lambda x: x[0] > 300],
                         ids=["int8-vs-300", "int8-vs-minus-129", "int8-vs-0d-int64", "int32-vs-0d-int64",
                              "0d-int8-vs-300"])
def test_torch_comparisons_that_wrap_the_other_operand_stay_in_torch(compare):
    """torch compares an integer tensor with a number or a 0-d tensor in the tensor's own type, the
    other operand converted with wrap-around (int8 x < 300 compares with 44); dnngraph would
    compare the true values (int8 widened to int32): such a comparison stays in torch, and the
    compiled program gives torch's answer. One within the type's range is dnngraph's."""
    x = torch.tensor([127, -128, 44, 0, -127, 5], dtype=torch.int8)
    got, want, left = _left_in_torch(compare, x)
    assert torch.equal(got, want)
    assert any("wrap" in why for _, why in left), left
    got, want, left = _left_in_torch(lambda x: (x < 100) & (x != -128), x)
    assert torch.equal(got, want) and not any("lt" in target or "ne" in target for target, _ in left), left


# --- GPU, at real sizes ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (8192, 8192, 8192), (17, 4096, 4096), (4096, 11008, 4096),
                                   (1000, 1000, 65536), (4097, 4095, 4096)])
def test_gpu_int8_matmul_is_exact_against_torch_int_mm(shape):
    m, n, k = shape
    torch.manual_seed(13)
    a = quantized([m, k], device="cuda")
    b = quantized([n, k], device="cuda").t()  # K-major B: the TMA / wgmma layout
    g, ta, tb, c = matmul_graph(a, b)
    c.set_output(True)
    out = run(g, {ta: a, tb: b}, device="cuda")[c.name]
    want = torch._int_mm(a, b) if m > 16 and k % 8 == 0 and n % 8 == 0 else (a.double() @ b.double()).int()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_gpu_int8_matmul_every_variant_exact_and_dequant_epilogue(b_layout):
    torch.manual_seed(14)
    a = quantized([1031, 2050], device="cuda")
    b = quantized([2050, 777], device="cuda")
    b = b if b_layout == "row" else b.t().contiguous().t()
    scale = torch.rand(1, 777, device="cuda") * 1e-4
    for config in (None, mm.MatmulConfig("tiled", 128, 128, 128, 8, 3), mm.MatmulConfig("split_k", 64, 64, 128, 4, 4, 4),
                   mm.MatmulConfig("small_m", 16, 64, 128, 4, 4), mm.MatmulConfig("persistent", 128, 256, 128, 8, 3)):
        g = dg.Graph(name="gpu8", io_data_type=dg.bfloat16)
        ta, tb, ts = g.tensor_like(a, name="a"), g.tensor_like(b, name="b"), g.tensor_like(scale, name="s")
        c = g.matmul(ta, tb).set_output(True)
        y = g.mul(c, ts).set_output(True)
        q = g.mul(c, 1.0 / 4096).set_output(True).set_data_type(dg.int8)
        options = None if config is None else dg.BuildOptions(matmul_config=config)
        out = run(g, {ta: a, tb: b, ts: scale}, device="cuda", options=options)
        refs = g.reference({ta: a.cpu(), tb: b.cpu(), ts: scale.cpu()})
        assert torch.equal(out[c.name].cpu(), refs[c.name])
        assert torch.equal(out[q.name].cpu(), refs[q.name])
        assert (out[y.name].double().cpu() - refs[y.name]).norm() / refs[y.name].norm() < 1.6e-2


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [
    dict(x=[32, 64, 56, 56], w=[64, 64, 3, 3], padding=[1, 1], stride=[1, 1]),
    dict(x=[32, 128, 28, 28], w=[256, 128, 3, 3], padding=[1, 1], stride=[2, 2]),
    dict(x=[32, 256, 14, 14], w=[1024, 256, 1, 1], padding=[0, 0], stride=[1, 1]),
    dict(x=[32, 3, 224, 224], w=[64, 3, 7, 7], padding=[3, 3], stride=[2, 2]),
    dict(x=[32, 512, 7, 7], w=[512, 16, 3, 3], padding=[1, 1], stride=[1, 1], groups=32),
], ids=["res2-3x3", "res3-down", "res4-1x1", "stem", "grouped"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_gpu_int8_resnet_conv_layers_exact_and_requantized(layer, layout):
    torch.manual_seed(15)
    layer = dict(layer)
    x = conv_input(layer.pop("x"), layout).cuda()
    w = conv_input(layer.pop("w"), layout).cuda()
    g = dg.Graph(name="gpuconv8", io_data_type=dg.bfloat16)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    y = g.conv_fprop(tx, tw, dilation=[1, 1], **layer).set_output(True)
    q = g.relu(g.mul(y, 1.0 / 2048)).set_output(True).set_data_type(dg.int8)
    out = run(g, {tx: x, tw: w}, device="cuda")
    refs = g.reference({tx: x, tw: w})
    assert torch.equal(out[y.name].cpu(), refs[y.name].cpu())
    assert torch.equal(out[q.name].cpu(), refs[q.name].cpu())



@pytest.mark.gpu
@pytest.mark.parametrize("layer", [
    dict(x=[32, 256, 56, 56], w=[256, 1, 3, 3], padding=[1, 1], stride=[1, 1], groups=256),
    dict(x=[32, 512, 28, 28], w=[1024, 1, 5, 5], padding=[2, 2], stride=[2, 2], groups=512),  # multiplier 2
], ids=["mobilenet-dw3x3", "dw5x5-s2-multiplier"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_gpu_int8_depthwise_conv_exact_and_requantized(layer, layout):
    """The direct depthwise kernels on int8 (float32 sums, exact below 1024 taps)."""
    torch.manual_seed(19)
    layer = dict(layer)
    x = conv_input(layer.pop("x"), layout).cuda()
    w = conv_input(layer.pop("w"), layout).cuda()
    g = dg.Graph(name="gpudw8", io_data_type=dg.bfloat16)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    y = g.conv_fprop(tx, tw, dilation=[1, 1], **layer).set_output(True)
    q = g.relu(g.mul(y, 1.0 / 256)).set_output(True).set_data_type(dg.int8)
    out = run(g, {tx: x, tw: w}, device="cuda")
    assert "depthwise" in g.explain()
    refs = g.reference({tx: x, tw: w})
    assert torch.equal(out[y.name].cpu(), refs[y.name].cpu())
    assert torch.equal(out[q.name].cpu(), refs[q.name].cpu())

# --- sm_90 compiles (no GPU needed) ----------------------------------------------------------------------
def sm90_graphs():
    """int8 kernels planned for the H100, for the sm_90 compile check: the model's persistent TMA
    matmul (K-major B) with a dequant + requant epilogue, the tiled kernel over an N-major B,
    split-K with its int32 partials and combine, an implicit-GEMM NHWC conv with its epilogue."""
    h100 = dg.BuildOptions(target=dg.target.H100)
    a, b_kmajor = quantized([512, 512]), quantized([256, 512]).t()
    g, ta, tb, c = matmul_graph(a, b_kmajor)
    scale = g.tensor(name="scale", dim=[1, 256], data_type=dg.float32)
    g.mul(c, scale).set_output(True)
    g.mul(c, 1.0 / 4096).set_output(True).set_data_type(dg.int8)
    yield "persistent dequant+requant", g.build(options=h100)
    g, ta, tb, c = matmul_graph(quantized([300, 256]), quantized([256, 200]))
    c.set_output(True)
    yield "tiled N-major B", g.build(options=dg.BuildOptions(target=dg.target.H100,
                                                             matmul_config=mm.MatmulConfig("tiled", 128, 128, 128, 8, 3)))
    yield "split-K", g.build(options=dg.BuildOptions(target=dg.target.H100,
                                                     matmul_config=mm.MatmulConfig("split_k", 64, 64, 128, 4, 4, 2)))
    g = dg.Graph(name="conv8", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[8, 64, 28, 28], stride=[50176, 1, 1792, 64], data_type=dg.int8)
    w = g.tensor(name="w", dim=[64, 64, 3, 3], stride=[576, 1, 192, 64], data_type=dg.int8)
    scale = g.tensor(name="scale", dim=[1, 64, 1, 1], data_type=dg.float32)
    y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    g.relu(g.mul(y, scale)).set_output(True)
    yield "conv NHWC", g.build(options=h100)
    g = dg.Graph(name="dynamic_quant", io_data_type=dg.float32)
    x, w = g.tensor(name="x", dim=[256, 512]), g.tensor(name="w", dim=[512, 384], data_type=dg.int8)
    g.matmul(g.cast(g.mul(x, 0.5), data_type=dg.int8), w).set_output(True)
    yield "quantized at load", g.build(options=h100)
    g = dg.Graph(name="depthwise8", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[8, 64, 28, 28], stride=[50176, 1, 1792, 64], data_type=dg.int8)
    w = g.tensor(name="w", dim=[64, 1, 3, 3], data_type=dg.int8)
    scale = g.tensor(name="scale", dim=[1, 64, 1, 1], data_type=dg.float32)
    y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=64)
    g.mul(y, scale).set_output(True)
    yield "depthwise direct", g.build(options=h100)


def test_int8_kernels_compile_for_sm90():
    from helpers import compiled_for_sm90
    output = compiled_for_sm90("test_int8:sm90_graphs", timeout=500)
    assert "compiled 7 kernels for sm_90" in output
    # every main GEMM kernel's dot is the int8 tensor-core wgmma accumulating in int32; the direct
    # depthwise kernel has none
    mma = [line for line in output.splitlines() if line.startswith("mma ") and "combine" not in line]
    main = [line for line in mma if "wgmma" in line]
    assert len(main) == 5 and all(".s32.s8.s8" in line for line in main), mma
    assert any(line.startswith("mma depthwise direct") and line.endswith(": -") for line in mma), mma
