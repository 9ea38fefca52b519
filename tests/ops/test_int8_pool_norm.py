"""8-bit integer inputs (int8, uint8: quantized activations) to pooling, norms and softmax (issue
33, item 2). float32 holds every 8-bit value exactly, so the kernels compute on them as on their
float values: max pooling is exact (and stored back in int8 / uint8 bit for bit), average pooling
sums exactly in float32 (at most 2^24 / 255 taps) then divides, norms and softmax give float
outputs within float32's rounding of the float64 reference. Wider integers (int32, int64) are
still refused: float32 would round them."""
import pytest
import torch

import dnngraph as dg
from helpers import check, run

EIGHT_BIT = {"int8": (torch.int8, -128, 128), "uint8": (torch.uint8, 0, 256)}


def quantized(shape, kind: str, layout: str = "nchw") -> torch.Tensor:
    dtype, low, high = EIGHT_BIT[kind]
    values = torch.randint(low, high, list(shape), dtype=dtype)
    if layout == "nhwc":
        return values.to(memory_format=torch.channels_last)
    if layout == "strided":  # every other column of a wider buffer
        wide = torch.randint(low, high, list(shape[:-1]) + [shape[-1] * 2], dtype=dtype)
        return wide[..., ::2]
    return values


@pytest.mark.parametrize("kind", sorted(EIGHT_BIT))
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "strided"])
def test_max_pooling_of_8_bit_integers_is_exact_in_their_own_type(kind, layout):
    """Padded, strided, odd sizes; the result stored in the input's type and in float32, both
    equal to the reference bit for bit (extremes -128 / 0 and 127 / 255 included)."""
    torch.manual_seed(41)
    x = quantized([2, 3, 7, 9], kind, layout)
    x[0, 0, :2, :2] = EIGHT_BIT[kind][1]  # a window of the type's least value
    g = dg.Graph(name="maxpool8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    y = g.pooling(tx, mode="max", window=[3, 2], stride=[2, 2], padding=[1, 1]).set_output(True)
    same = g.pooling(tx, mode="max", window=[3, 2], stride=[2, 2], padding=[1, 1]).set_output(True)
    same.set_data_type(tx.data_type)
    out = run(g, {tx: x})
    refs = g.reference({tx: x})
    assert out[same.name].dtype == x.dtype
    assert torch.equal(out[same.name], refs[same.name])
    assert torch.equal(out[y.name].double(), refs[y.name])
    want = torch.nn.functional.max_pool2d(x.double(), [3, 2], [2, 2], [1, 1])
    assert torch.equal(out[same.name].double(), want)


@pytest.mark.parametrize("kind", sorted(EIGHT_BIT))
@pytest.mark.parametrize("mode", ["avg_include_pad", "avg_exclude_pad"])
def test_average_pooling_of_8_bit_integers_gives_floats(kind, mode):
    torch.manual_seed(42)
    x = quantized([2, 5, 9, 6], kind, "nhwc")
    g = dg.Graph(name="avgpool8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    g.pooling(tx, mode=mode, window=[3, 3], stride=[2, 1], padding=[1, 1]).set_output(True)
    check(g, {tx: x})


@pytest.mark.parametrize("kind", sorted(EIGHT_BIT))
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "batchnorm", "instancenorm", "softmax"])
def test_norms_and_softmax_take_8_bit_inputs_and_give_floats(kind, norm):
    """int8 / uint8 x in, float32 (and bf16) out: the statistics and the normalized values within
    float32's rounding of the float64 reference."""
    torch.manual_seed(43)
    x = quantized([3, 6, 5, 7], kind, "strided")
    g = dg.Graph(name="norm8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    inputs = {tx: x}
    if norm == "softmax":
        outputs = [g.softmax(tx, axis=-1)]
    else:
        per_row = [1, 6, 5, 7] if norm in ("layernorm", "rmsnorm") else [1, 6, 1, 1]
        scale, bias = torch.randn(per_row), torch.randn(per_row)
        ts, tb = g.tensor_like(scale, name="scale"), g.tensor_like(bias, name="bias")
        inputs.update({ts: scale, tb: bias})
        if norm == "rmsnorm":
            outputs = list(g.rmsnorm(tx, ts, tb))
        else:
            outputs = list(getattr(g, norm)(tx, ts, tb))[:3]
    for tensor in outputs:
        tensor.set_output(True)
    g.mul(outputs[0], 1.0).set_output(True).set_data_type(dg.bfloat16)
    check(g, inputs)


@pytest.mark.parametrize("wide", [dg.int32, dg.int64])
def test_wider_integer_inputs_are_still_refused(wide):
    """int32 and int64 values float32 would round: a typed UnsupportedError naming the cast."""
    for make in (lambda g, x: g.pooling(x, mode="max", window=[2, 2], stride=[2, 2], padding=[0, 0]),
                 lambda g, x: g.softmax(x, axis=-1)):
        g = dg.Graph(name="wide", io_data_type=dg.float32)
        x = g.tensor(name="x", dim=[1, 2, 4, 4], data_type=wide)
        make(g, x).set_output(True)
        with pytest.raises(dg.UnsupportedError, match="cast the input"):
            g.build()
        assert g.plan is None


# --- GPU, at real sizes ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(EIGHT_BIT))
def test_gpu_resnet_stem_max_pool_and_layernorm_of_8_bit_inputs(kind):
    """ResNet-50's stem max pool (3x3/2 over [32, 64, 112, 112] NHWC) exact in the input's type,
    and a transformer row layernorm of [4096, 4096] 8-bit inputs to bf16."""
    torch.manual_seed(44)
    x = quantized([32, 64, 112, 112], kind, "nhwc").cuda()
    g = dg.Graph(name="gpu_pool8", io_data_type=dg.float32)
    tx = g.tensor_like(x, name="x")
    y = g.pooling(tx, mode="max", window=[3, 3], stride=[2, 2], padding=[1, 1]).set_output(True)
    y.set_data_type(tx.data_type)
    out = run(g, {tx: x}, device="cuda")[y.name]
    assert torch.equal(out, torch.nn.functional.max_pool2d(x.float(), 3, 2, 1).to(x.dtype))
    rows = quantized([4096, 4096], kind).cuda()
    scale, bias = torch.randn(1, 4096, device="cuda"), torch.randn(1, 4096, device="cuda")
    g = dg.Graph(name="gpu_ln8", io_data_type=dg.bfloat16)
    tr, ts, tb = g.tensor_like(rows, name="x"), g.tensor_like(scale, name="s"), g.tensor_like(bias, name="b")
    g.layernorm(tr, ts, tb, norm_forward_phase="inference")[0].set_output(True)
    check(g, {tr: rows, ts: scale, tb: bias}, dtype=torch.bfloat16, device="cuda", reference_device="cuda")
