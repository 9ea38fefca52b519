"""dg.uint8 (issue 33, item 2): a graph tensor type for pointwise ops, conversions and
reductions. The rule (dtypes.py): math on uint8 runs in int32, as on int8 (a uint8 meeting an
int8 promotes to int32: exact, never an 8-bit wrap); a conversion to uint8 saturates to [0, 255],
floats rounded to nearest even, NaN, negative values and -inf to 0 (to_uint8). A matmul or conv
operand of uint8 is an UnsupportedError (Triton 3.6's tl.dot multiplies int8 x int8 only).
Kernels run through the interpreter on CPU, compared with g.reference bit for bit."""
import math

import pytest
import torch

import dnngraph as dg
from dnngraph import dtypes
from helpers import poisoned, run


def exact(graph, inputs: dict) -> dict:
    """Execute with poisoned outputs; every output equals the reference bit for bit."""
    outputs = run(graph, inputs)
    refs = graph.reference(inputs)
    for name, out in outputs.items():
        ref = refs[name]
        out = out.double() if ref.dtype == torch.float64 else out
        assert out.dtype == ref.dtype, name
        assert torch.equal(out, ref), f"{name}: {out.tolist()} != {ref.tolist()}"
    return outputs


def image_bytes(shape) -> torch.Tensor:
    return torch.randint(0, 256, list(shape), dtype=torch.uint8)


def test_uint8_is_a_data_type_by_name_and_torch_dtype():
    assert dg.uint8 is dtypes.by_name("uint8") is dtypes.from_torch(torch.uint8) is dtypes.resolve(torch.uint8)
    assert not dg.uint8.is_floating and not dg.uint8.is_bit_packed and dg.uint8.itemsize == 1
    g = dg.Graph(name="u8", io_data_type=dg.float32)
    assert g.tensor_like(image_bytes([2, 3]), name="x").data_type is dg.uint8


SPECIAL = [0.5, 1.5, 2.5, 254.5, 255.49, 255.5, 256.0, -0.4, -0.5, -0.6, -3.0, 1e9, -1e9, math.inf, -math.inf,
           math.nan, -0.0, 3.7, 127.5, 128.5]
SPECIAL_AS_UINT8 = [0, 2, 2, 254, 255, 255, 255, 0, 0, 0, 0, 255, 0, 255, 0, 0, 0, 4, 128, 128]


def test_conversion_to_uint8_rounds_to_nearest_even_and_saturates():
    assert dtypes.to_uint8(torch.tensor(SPECIAL, dtype=torch.float64)).tolist() == SPECIAL_AS_UINT8
    assert dtypes.to_uint8(torch.tensor([300, -1, -300, 255, 7], dtype=torch.int32)).tolist() == [255, 0, 0, 255, 7]
    assert dtypes.to_uint8(torch.tensor([True, False])).tolist() == [1, 0]


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_of_floats_to_uint8_in_a_kernel_matches_the_rule(source):
    """Ties to even, saturation at both ends, NaN, -0.0 and negative values to 0, in the kernel
    and the reference alike, from each float type (values as the source type holds them)."""
    x = torch.tensor(SPECIAL, dtype=torch.float32).to(source)
    g = dg.Graph(name="to_u8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    y = g.cast(tx, data_type=dg.uint8).set_output(True)
    out = exact(g, {tx: x})[y.name]
    assert out.tolist() == dtypes.to_uint8(x.double()).tolist()
    if source == torch.float32:
        assert out.tolist() == SPECIAL_AS_UINT8


@pytest.mark.parametrize("source", [torch.int32, torch.int64, torch.int8, torch.bool])
def test_cast_of_integers_to_uint8_saturates_instead_of_wrapping(source):
    values = {torch.int32: [300, -1, 255, 256, 2**31 - 1, -2**31, 0], torch.int64: [2**40, -2**40, 17, 255, 256],
              torch.int8: [-128, -1, 0, 127], torch.bool: [True, False, True]}[source]
    x = torch.tensor(values, dtype=source)
    g = dg.Graph(name="int_to_u8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    y = g.cast(tx, data_type=dg.uint8).set_output(True)
    out = exact(g, {tx: x})[y.name]
    assert out.tolist() == [min(max(int(v), 0), 255) for v in values]


@pytest.mark.parametrize("target", [dg.float32, dg.bfloat16, dg.float16, dg.int32, dg.int8])
def test_every_uint8_value_converts_out_exactly(target):
    """All 256 values, read through a transposed (non-contiguous) view: exact in each float type
    (bf16 holds integers to 256), int32 as is, int8 saturated at 127."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).t()
    g = dg.Graph(name="from_u8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    y = g.cast(tx, data_type=target).set_output(True)
    out = exact(g, {tx: x})[y.name]
    want = x.long().clamp(max=127) if target is dg.int8 else x.long()
    assert torch.equal(out.long(), want)


def test_uint8_output_of_float_math_saturates_as_stored():
    """A float op (x * 1.5 - 20) stored to uint8: rounded to even, saturated, NaN-free; a fused
    consumer of that output reads it as stored."""
    torch.manual_seed(31)
    x = torch.randn(5, 7) * 100
    x[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, 14.0])  # 14 * 1.5 - 20 = 1 exactly
    g = dg.Graph(name="store_u8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    q = g.sub(g.mul(tx, 1.5), 20.0).set_output(True).set_data_type(dg.uint8)
    doubled = g.mul(q, 2).set_output(True).set_data_type(dg.int32)
    out = exact(g, {tx: x})
    assert out[q.name][0, :4].tolist() == [0, 255, 0, 1]
    assert torch.equal(out[doubled.name], out[q.name].int() * 2)


def test_mixed_uint8_and_int8_math_promotes_to_int32():
    """uint8 200 + int8 -128 is 72, 255 * 127 is 32385, 0 - 127 is -127, and 10 > -1 is true: the
    math runs in int32 on the true values (no 8-bit reinterpretation or wrap); stores into uint8
    and int8 saturate."""
    a = torch.tensor([[200, 255, 0, 10, 128]], dtype=torch.uint8)
    b = torch.tensor([[-128, 127, 127, -1, -128]], dtype=torch.int8)
    g = dg.Graph(name="mixed", io_data_type=dg.int32)
    ta, tb = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    total = g.add(ta, tb).set_output(True)
    product = g.mul(ta, tb).set_output(True)
    difference = g.sub(ta, tb).set_output(True).set_data_type(dg.uint8)
    narrowed = g.add(ta, tb).set_output(True).set_data_type(dg.int8)
    greater = g.cmp_gt(ta, tb).set_output(True)
    largest = g.maximum(ta, tb).set_output(True)
    out = exact(g, {ta: a, tb: b})
    wide_a, wide_b = a.long(), b.long()
    assert out[total.name].tolist() == (wide_a + wide_b).tolist()
    assert out[product.name].tolist() == (wide_a * wide_b).tolist()
    assert out[difference.name].tolist() == (wide_a - wide_b).clamp(0, 255).tolist()
    assert out[narrowed.name].tolist() == (wide_a + wide_b).clamp(-128, 127).tolist()
    assert out[greater.name].tolist() == [[True, True, False, True, True]]  # 10 > -1 and 128 > -128 too
    assert out[largest.name].tolist() == torch.maximum(wide_a, wide_b).tolist()


def test_uint8_division_and_float_ops_compute_in_floating_point():
    a = torch.tensor([[7, 255, 0, 3]], dtype=torch.uint8)
    g = dg.Graph(name="u8_float", io_data_type=dg.float32)
    ta = g.tensor_like(a, name="a")
    q = g.div(ta, 2).set_output(True)
    r = g.sqrt(ta).set_output(True)
    out = run(g, {ta: a})
    refs = g.reference({ta: a})
    assert out[q.name].tolist() == [[3.5, 127.5, 0.0, 1.5]]
    assert torch.allclose(out[r.name].double(), refs[r.name], rtol=1e-6)


def test_integer_constants_meeting_uint8_fit_int32():
    g = dg.Graph(name="const_u8", io_data_type=dg.int32)
    ta = g.tensor(name="a", dim=[2, 3], data_type=dg.uint8)
    with pytest.raises(dg.ValidationError, match="int32"):
        g.add(ta, 2**40)
    assert g.nodes == []
    a = image_bytes([2, 3])
    y = g.add(ta, 100000).set_output(True)
    assert exact(g, {ta: a})[y.name].tolist() == (a.long() + 100000).tolist()


@pytest.mark.parametrize("mode", ["sum", "max", "min", "amax", "prod"])
@pytest.mark.parametrize("axes", [[1], [0, 2]], ids=["inner", "outer-and-last"])
def test_uint8_reductions_are_exact(mode, axes):
    """Reductions of uint8 over odd sizes, a non-contiguous input (transposed) and a size-1 axis:
    sums in int32 beyond 255 (never an 8-bit wrap), max and min stored back in uint8."""
    torch.manual_seed(32)
    x = image_bytes([5, 1, 9]).transpose(0, 2) if mode != "prod" else torch.randint(1, 3, (9, 1, 5), dtype=torch.uint8)
    g = dg.Graph(name="reduce_u8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    y = g.reduction(tx, mode=mode, axes=axes).set_output(True)
    y.set_data_type({"max": dg.uint8, "min": dg.uint8, "amax": dg.uint8}.get(mode, dg.int32))
    out = exact(g, {tx: x})[y.name]
    if mode == "sum":
        assert torch.equal(out.long(), x.long().sum(axes, keepdim=True))


def test_uint8_mean_is_refused_as_for_every_integer_type():
    """mean is defined on floats (as in torch): a typed error naming the cast to make."""
    g = dg.Graph(name="mean_u8", io_data_type=dg.float32)
    tx = g.tensor(name="x", dim=[3, 5], data_type=dg.uint8)
    g.reduction(tx, mode="mean", axes=[1]).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="cast"):
        g.build()
    h = dg.Graph(name="mean_u8_cast", io_data_type=dg.float32)
    tx = h.tensor(name="x", dim=[3, 5], data_type=dg.uint8)
    y = h.reduction(h.cast(tx, data_type=dg.float32), mode="mean", axes=[1]).set_output(True)
    x = image_bytes([3, 5])
    out = run(h, {tx: x})[y.name]
    assert torch.allclose(out.double(), x.double().mean(1, keepdim=True))


def test_uint8_broadcast_input_is_exact():
    torch.manual_seed(33)
    row = image_bytes([1, 7]).expand(4, 7)  # stride 0 over the rows
    col = image_bytes([4, 1])
    g = dg.Graph(name="bcast_u8", io_data_type=dg.uint8)
    tr, tc = g.tensor_like(row, name="row"), g.tensor_like(col, name="col")
    y = g.add(tr, tc).set_output(True)
    assert y.data_type is dg.uint8
    out = exact(g, {tr: row, tc: col})[y.name]
    assert torch.equal(out.long(), (row.long() + col.long()).clamp(max=255))


@pytest.mark.parametrize("op", ["matmul", "conv_fprop", "conv_dgrad", "conv_wgrad"])
@pytest.mark.parametrize("other", [dg.uint8, dg.int8], ids=["u8xu8", "u8xs8"])
def test_uint8_matmul_and_conv_operands_are_unsupported(op, other):
    """tl.dot takes no uint8 (Triton 3.6): a typed UnsupportedError at the op call that names the
    operand and the int8 zero-point way round, the graph unchanged."""
    g = dg.Graph(name="u8_dot", io_data_type=dg.float32)
    conv = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    if op == "matmul":
        a, b = g.tensor(name="a", dim=[4, 8], data_type=dg.uint8), g.tensor(name="b", dim=[8, 3], data_type=other)
        call = lambda: g.matmul(a, b)
    elif op == "conv_fprop":
        a, b = (g.tensor(name="x", dim=[1, 4, 5, 5], data_type=dg.uint8),
                g.tensor(name="w", dim=[2, 4, 3, 3], data_type=other))
        call = lambda: g.conv_fprop(a, b, **conv)
    elif op == "conv_dgrad":
        a, b = (g.tensor(name="dy", dim=[1, 2, 5, 5], data_type=other),
                g.tensor(name="w", dim=[2, 4, 3, 3], data_type=dg.uint8))
        call = lambda: g.conv_dgrad(a, b, [1, 4, 5, 5], **conv)
    else:
        a, b = (g.tensor(name="dy", dim=[1, 2, 5, 5], data_type=dg.uint8),
                g.tensor(name="x", dim=[1, 4, 5, 5], data_type=other))
        call = lambda: g.conv_wgrad(a, b, [2, 4, 3, 3], **conv)
    with pytest.raises(dg.UnsupportedError, match="uint8.*int8"):
        call()
    assert g.nodes == []


def test_uint8_input_bound_to_another_dtype_is_an_execution_error_that_writes_nothing():
    x = image_bytes([3, 4])
    g = dg.Graph(name="bind_u8", io_data_type=dg.int32)
    tx = g.tensor_like(x, name="x")
    y = g.add(tx, 1).set_output(True)
    g.build()
    out = poisoned(y)
    for wrong in (x.to(torch.int8), x.float(), x.bool()):
        with pytest.raises(dg.ExecutionError):
            g.execute({tx: wrong, y: out})
        assert (out == -12345).all()
    g.execute({tx: x, y: out})
    assert torch.equal(out, x.int() + 1)


def test_uint8_graph_round_trips_through_json():
    x = image_bytes([3, 5])
    g = dg.Graph(name="json_u8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    g.cast(g.mul(tx, 0.5), data_type=dg.uint8).set_output(True)
    g2 = dg.Graph.from_json(g.to_json())
    assert [t.data_type for t in g2.outputs()] == [dg.uint8]
    exact(g2, {"x": x})


@pytest.mark.gpu
def test_gpu_uint8_image_batch_normalized_and_requantized():
    """A uint8 image batch ([64, 3, 224, 224] NHWC) to float ((x - mean) * inv_std), requantized
    to uint8 (saturating, ties to even) and summed per channel in int32, on the GPU, against the
    reference bit for bit (the scale is a power of two, exact in float32 and float64)."""
    torch.manual_seed(34)
    x = image_bytes([64, 3, 224, 224]).to(memory_format=torch.channels_last).cuda()
    g = dg.Graph(name="gpu_u8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    centred = g.mul(g.sub(tx, 127.5), 0.25).set_output(True)
    requantized = g.add(g.mul(centred, 2.0), 128.0).set_output(True).set_data_type(dg.uint8)
    g.reduction(tx, mode="sum", axes=[0, 2, 3]).set_output(True).set_data_type(dg.int32)
    out = run(g, {tx: x}, device="cuda")
    refs = g.reference({tx: x})
    for name, value in out.items():
        ref = refs[name]
        assert torch.equal(value.double() if ref.dtype == torch.float64 else value, ref), name
    assert out[requantized.name].dtype == torch.uint8
