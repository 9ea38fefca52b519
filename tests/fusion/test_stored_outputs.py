"""A consumer sees a graph output as stored (DESIGN.md, "Data types"), in every kernel family.

Each graph stores a value `h` narrow (fp16 or bf16) and feeds it to a fused consumer. The inputs
make `h` a narrow-exact base plus a positive fraction below a quarter of the narrow type's
spacing: storing drops the fraction exactly (round to nearest and truncation agree, so these
tests do not lean on how the interpreter converts to bf16), and the consumers amplify the
difference: `h - t` with `t` the wide value (0 when consumed wide, minus the fraction when
consumed as stored), a reduction of `h`, a layernorm of near-constant rows. Most results are
then exact in float32, so the kernel must equal `g.reference` exactly; the reference itself is
checked against torch on the rounded value. A virtual `h` (not an output) keeps the wide value.
"""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check, rel_err, run

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NARROW = {"float16": (dg.float16, torch.float16), "bfloat16": (dg.bfloat16, torch.bfloat16)}
GEN = torch.Generator()


@pytest.fixture(autouse=True)
def _fresh_draws():
    """Every test draws the same inputs, whatever ran before it in its process."""
    GEN.manual_seed(26)


def _graph(**types) -> dg.Graph:
    return dg.Graph(name="stored", io_data_type=dg.float32, **types)


def _ints(shape, low=1, high=3) -> torch.Tensor:
    return torch.randint(low, high + 1, shape, generator=GEN).float()


def _fractions(shape, unit=2.0 ** -9) -> torch.Tensor:
    """0 to 3 units: below a quarter of fp16's spacing from 64 up (2**-4), bf16's from 1 up."""
    return torch.randint(0, 4, shape, generator=GEN).float() * unit


def _bases(shape) -> torch.Tensor:
    """Integers in [64, 128): exact in fp16 and bf16, where a fraction of 2**-9 is not."""
    return torch.randint(64, 128, shape, generator=GEN).float()


def _execute(g, inputs: dict, device: str) -> tuple[dict, dict]:
    """Outputs (poisoned first) on `device`, returned on the CPU, and the reference."""
    outputs = run(g, {name: value.to(device) for name, value in inputs.items()}, device)
    return {name: value.cpu() for name, value in outputs.items()}, g.reference(inputs)


def _assert_as_stored(outputs, refs, stored: str, consumer: str, wide: torch.Tensor):
    """`consumer` (h - t, t the wide h) equals the reference exactly, and the reference is what
    reading the stored `h` gives: minus the dropped fraction, never the 0 of a wide read."""
    assert torch.equal(outputs[stored].double(), refs[stored])
    assert torch.equal(outputs[consumer].double(), refs[consumer]), consumer
    expected = refs[stored] - wide.double()
    assert torch.equal(refs[consumer], expected)
    assert expected.abs().max() > 0, "the inputs drop no fraction: the test could not fail"


# --- pointwise ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("narrow", sorted(NARROW))
def test_pointwise_output_feeds_the_rest_of_its_chain_as_stored(narrow, device):
    g = _graph()
    x, r, t = (g.tensor(name=n, dim=[3, 37]) for n in ("x", "r", "t"))
    h = g.add(x, r, name="h_op").set_name("h").set_output(True).set_data_type(NARROW[narrow][0])
    g.mul(g.sub(h, t), 1.0, name="z_op").set_name("z").set_output(True)
    xt, rt = _bases([3, 37]), _fractions([3, 37])
    inputs = {"x": xt, "r": rt, "t": xt + rt}
    outputs, refs = _execute(g, inputs, device)
    assert len(g.plan.launches) == 1  # h is consumed inside the kernel that makes it
    _assert_as_stored(outputs, refs, "h", "z", xt + rt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", ["float8_e4m3", "float8_e5m2"])
def test_fp8_output_feeds_the_rest_of_its_chain_and_an_epilogue_as_stored(fp8, device):
    # bases 8 to 14 (even: exact in both fp8 types), fractions of 2**-4 below a quarter spacing
    g = _graph()
    fp8_type = getattr(dg, fp8)
    x, r, t = (g.tensor(name=n, dim=[5, 12]) for n in ("x", "r", "t"))
    h = g.add(x, r, name="h_op").set_name("h").set_output(True).set_data_type(fp8_type)
    g.sub(h, t, name="z_op").set_name("z").set_output(True)
    w = g.tensor(name="w", dim=[12, 7])
    c = g.matmul(x, w, name="c_op").set_name("c").set_output(True).set_data_type(fp8_type)
    g.sub(c, g.tensor(name="tc", dim=[5, 7]), name="zc_op").set_name("zc").set_output(True)
    xt, rt = torch.randint(4, 8, (5, 12), generator=GEN).float() * 2, _fractions([5, 12], 2.0 ** -4)
    wt = torch.zeros(12, 7)
    wt[0] = 1 + _fractions([7], 2.0 ** -8)  # c = x[:, 0] plus at most 14 * 3 / 256 < a quarter spacing
    wide_c = xt.double() @ wt.double()
    inputs = {"x": xt, "r": rt, "t": xt + rt, "w": wt, "tc": wide_c.float()}
    outputs, refs = _execute(g, inputs, device)
    _assert_as_stored(outputs, refs, "h", "z", xt + rt)
    _assert_as_stored(outputs, refs, "c", "zc", wide_c)


@pytest.mark.parametrize("device", DEVICES)
def test_integer_output_is_consumed_exact(device):
    # y is stored as int32 (truncated toward zero); its consumer reads the integer, not 2.5 x
    g = _graph()
    x = g.tensor(name="x", dim=[2, 19])
    y = g.mul(x, 2.5, name="y_op").set_name("y").set_output(True).set_data_type(dg.int32)
    g.add(y, 0.25, name="z_op").set_name("z").set_output(True)
    xt = torch.randn(2, 19, generator=GEN) * 8
    outputs, refs = _execute(g, {"x": xt}, device)
    truncated = torch.trunc(xt.double() * 2.5)
    assert torch.equal(outputs["y"], truncated.int()) and torch.equal(refs["y"], truncated.int())
    assert torch.equal(outputs["z"].double(), truncated + 0.25)
    assert torch.equal(refs["z"], truncated + 0.25)


@pytest.mark.parametrize("device", DEVICES)
def test_bool_output_consumed_downstream_is_exact(device):
    g = _graph()
    x = g.tensor(name="x", dim=[2, 23])
    y = g.mul(x, 3.0, name="y_op").set_name("y").set_output(True).set_data_type(dg.bool)
    g.add(y, 0.5, name="z_op").set_name("z").set_output(True)
    xt = torch.randn(2, 23, generator=GEN)
    xt[0, :5] = 0.0
    outputs, refs = _execute(g, {"x": xt}, device)
    assert torch.equal(outputs["z"].double(), (xt != 0).double() + 0.5)
    assert torch.equal(refs["z"], (xt != 0).double() + 0.5)


# --- matmul: the anchor's result, a prologue, an exit ----------------------------------------------
def _exact_product(m, k, n):
    """a @ b = an integer in [64, 128 + 2k) plus 0 to 3 units of 2**-9, exact in fp32."""
    a = torch.cat([_ints([m, k], 0, 1), torch.ones(m, 1)], dim=1)
    b = torch.cat([_ints([k, n], 0, 1), 64 + _fractions([1, n])], dim=0)
    return a, b, a.double() @ b.double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("narrow", sorted(NARROW))
def test_matmul_output_feeds_its_epilogue_as_stored(narrow, device):
    m, k, n = 9, 5, 11
    g = _graph()
    a, b = g.tensor(name="a", dim=[m, k + 1]), g.tensor(name="b", dim=[k + 1, n])
    t = g.tensor(name="t", dim=[m, n])
    c = g.matmul(a, b, name="c_op").set_name("c").set_output(True).set_data_type(NARROW[narrow][0])
    g.sub(c, t, name="z_op").set_name("z").set_output(True)
    at, bt, wide = _exact_product(m, k, n)
    outputs, refs = _execute(g, {"a": at, "b": bt, "t": wide.float()}, device)
    assert len(g.plan.launches) == 1
    _assert_as_stored(outputs, refs, "c", "z", wide)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_row_exit_reduces_the_stored_output(device):
    m, k, n = 7, 4, 13
    g = _graph()
    a, b = g.tensor(name="a", dim=[m, k + 1]), g.tensor(name="b", dim=[k + 1, n])
    c = g.matmul(a, b, name="c_op").set_name("c").set_output(True).set_data_type(dg.float16)
    g.reduction(c, "sum", axes=[1], name="s_op").set_name("s").set_output(True)
    at, bt, wide = _exact_product(m, k, n)
    outputs, refs = _execute(g, {"a": at, "b": bt}, device)
    assert "[matmul]" in g.explain().split("kernel 0 ")[1].split("\n")[0] and "s_op" in g.explain()
    stored_sum = wide.half().double().sum(dim=1, keepdim=True)
    assert torch.equal(refs["s"], stored_sum) and not torch.equal(stored_sum, wide.sum(dim=1, keepdim=True))
    assert torch.equal(outputs["s"].double(), stored_sum)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("narrow", sorted(NARROW))
def test_matmul_prologue_output_feeds_the_dot_as_stored(narrow, device):
    m, k, n = 6, 8, 10
    g = _graph()
    x, r = g.tensor(name="x", dim=[m, k]), g.tensor(name="r", dim=[m, k])
    w = g.tensor(name="w", dim=[k, n])
    h = g.add(x, r, name="h_op").set_name("h").set_output(True).set_data_type(NARROW[narrow][0])
    g.matmul(h, w, name="y_op").set_name("y").set_output(True)
    xt, rt, wt = _bases([m, k]), _fractions([m, k]), _ints([k, n])
    outputs, refs = _execute(g, {"x": xt, "r": rt, "w": wt}, device)
    expected = xt.double() @ wt.double()  # the stored h is x: the fractions are dropped
    assert torch.equal(refs["y"], expected)
    assert torch.equal(outputs["y"].double(), expected)
    assert not torch.equal(expected, (xt + rt).double() @ wt.double())


# --- convolution: epilogue, genstats exit, depthwise ----------------------------------------------
def _exact_conv(batch, channels, filters, size, groups=1):
    """x and w whose valid 3x3 convolution is an integer in [64, 200) plus 0 to 3 units of
    2**-9 per filter, exact in fp32: channel 0 of each group is 1 and its centre weight carries
    64 and the fraction."""
    x = _ints([batch, channels, size, size], 0, 1)
    w = _ints([filters, channels // groups, 3, 3], 0, 1)
    x[:, ::channels // groups] = 1.0
    w[:, 0, 1, 1] = 64 + _fractions([filters]).clamp(min=2.0 ** -9)  # a fraction in every filter
    wide = F.conv2d(x.double(), w.double(), groups=groups)
    return x, w, wide


def _conv(g, x, w, groups=1):
    return g.conv_fprop(x, w, padding=[0, 0], stride=[1, 1], dilation=[1, 1], groups=groups, name="c_op")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [1, 4], ids=["implicit_gemm", "depthwise"])
def test_conv_output_feeds_its_epilogue_as_stored(groups, device):
    xt, wt, wide = _exact_conv(2, 4, 4, 6, groups)
    g = _graph()
    x, w = g.tensor_like(xt, "x"), g.tensor_like(wt, "w")
    t = g.tensor(name="t", dim=list(wide.shape))
    c = _conv(g, x, w, groups).set_name("c").set_output(True).set_data_type(dg.float16)
    g.sub(c, t, name="z_op").set_name("z").set_output(True)
    outputs, refs = _execute(g, {"x": xt, "w": wt, "t": wide.float()}, device)
    assert len(g.plan.launches) == 1
    _assert_as_stored(outputs, refs, "c", "z", wide)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [1, 4], ids=["implicit_gemm", "depthwise"])
def test_conv_prologue_output_feeds_the_convolution_as_stored(groups, device):
    g = _graph()
    x, r = g.tensor(name="x", dim=[2, 4, 6, 6]), g.tensor(name="r", dim=[2, 4, 6, 6])
    w = g.tensor(name="w", dim=[4, 4 // groups, 3, 3])
    h = g.add(x, r, name="h_op").set_name("h").set_output(True).set_data_type(dg.float16)
    _conv(g, h, w, groups).set_name("y").set_output(True)
    xt, rt, wt = _bases([2, 4, 6, 6]), _fractions([2, 4, 6, 6]), _ints([4, 4 // groups, 3, 3], 0, 1)
    outputs, refs = _execute(g, {"x": xt, "r": rt, "w": wt}, device)
    assert "conv_fprop" in g.explain().split("kernel 1 ")[1].split("reads")[0]  # h recomputed there
    expected = F.conv2d(xt.double(), wt.double(), groups=groups)  # the stored h is x
    assert torch.equal(refs["y"], expected)
    assert torch.equal(outputs["y"].double(), expected)
    assert not torch.equal(expected, F.conv2d(xt.double() + rt.double(), wt.double(), groups=groups))


@pytest.mark.parametrize("device", DEVICES)
def test_conv_genstats_exit_reduces_the_stored_output(device):
    xt, wt, wide = _exact_conv(2, 3, 5, 5)
    g = _graph()
    x, w = g.tensor_like(xt, "x"), g.tensor_like(wt, "w")
    c = _conv(g, x, w).set_name("c").set_output(True).set_data_type(dg.float16)
    total, squares = g.genstats(c, name="stats")
    total.set_name("sum").set_output(True)
    squares.set_name("sq").set_output(True)
    outputs, refs = _execute(g, {"x": xt, "w": wt}, device)
    stored = wide.half().double()
    expected_sum = stored.sum(dim=(0, 2, 3), keepdim=True).view(refs["sum"].shape)
    expected_sq = (stored * stored).sum(dim=(0, 2, 3), keepdim=True).view(refs["sq"].shape)
    assert torch.equal(refs["sum"], expected_sum) and torch.equal(refs["sq"], expected_sq)
    assert torch.equal(outputs["sum"].double(), expected_sum)
    assert torch.equal(outputs["sq"].double(), expected_sq)


# --- rows: norms (the cuDNN frontend notebook), reductions, softmax ---------------------------------
def _near_constant_rows(rows, cols, narrow_dtype):
    """x on the narrow type's grid near 1, r a positive fraction below a quarter of its spacing:
    a row's spread is a few spacings, so the dropped fractions move its layernorm by O(1)."""
    spacing = torch.finfo(narrow_dtype).eps
    x = 1 + torch.randint(0, 2, (rows, cols), generator=GEN).float() * spacing
    r = torch.rand(rows, cols, generator=GEN) * spacing / 4
    return x, r


def _add_layernorm(narrow_type, stored: bool):
    g = _graph()
    cols = 37
    x, r = g.tensor(name="x", dim=[5, cols]), g.tensor(name="r", dim=[5, cols])
    scale, bias = g.tensor(name="scale", dim=[1, cols]), g.tensor(name="bias", dim=[1, cols])
    h = g.add(x, r, name="h_op").set_name("h")
    if stored:
        h.set_output(True).set_data_type(narrow_type)
    y, mean, inv_var = g.layernorm(h, scale, bias, epsilon=1e-5, name="ln")
    y.set_name("y").set_output(True)
    mean.set_name("mean").set_output(True)
    return g


def _layernorm(h, scale, bias):
    return F.layer_norm(h.double(), [h.shape[-1]], scale.double().view(-1), bias.double().view(-1), eps=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("narrow", sorted(NARROW))
def test_add_layernorm_reads_the_add_as_stored_cudnn_notebook(narrow, device):
    narrow_type, narrow_dtype = NARROW[narrow]
    g = _add_layernorm(narrow_type, stored=True)
    xt, rt = _near_constant_rows(5, 37, narrow_dtype)
    st, bt = torch.randn(1, 37, generator=GEN), torch.randn(1, 37, generator=GEN)
    outputs, refs = _execute(g, {"x": xt, "r": rt, "scale": st, "bias": bt}, device)
    assert len(g.plan.launches) == 1  # the add is the norm's prologue
    as_stored, wide = _layernorm(xt, st, bt), _layernorm(xt + rt, st, bt)
    assert torch.equal(refs["h"], xt.double())
    assert rel_err(refs["y"], as_stored) < 1e-12
    assert rel_err(wide, as_stored) > 0.01, "the dropped fractions must matter"
    assert torch.equal(outputs["h"].double(), xt.double())
    # fp32's mean of values near 1 is off by ~1e-7, a spread of a few 2**-11 by ~1e-4
    assert rel_err(outputs["y"], refs["y"]) < 1e-3
    assert rel_err(outputs["mean"], refs["mean"]) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_virtual_add_keeps_the_wide_value_in_the_layernorm(device):
    g = _add_layernorm(dg.float16, stored=False)
    xt, rt = _near_constant_rows(5, 37, torch.float16)
    st, bt = torch.randn(1, 37, generator=GEN), torch.randn(1, 37, generator=GEN)
    outputs, refs = _execute(g, {"x": xt, "r": rt, "scale": st, "bias": bt}, device)
    wide, as_rounded = _layernorm(xt.double() + rt.double(), st, bt), _layernorm(xt, st, bt)
    assert rel_err(refs["y"], wide) < 1e-12
    assert rel_err(outputs["y"], wide) < 1e-3
    assert rel_err(as_rounded, wide) > 0.01


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "max"])
def test_reduction_output_feeds_its_epilogue_as_stored(mode, device):
    g = _graph()
    x, r = g.tensor(name="x", dim=[4, 3, 9]), g.tensor(name="r", dim=[4, 1, 9])
    t = g.tensor(name="t", dim=[4, 1, 9])
    h = g.reduction(g.add(x, r), mode, axes=[1], name="h_op").set_name("h").set_output(True)
    h.set_data_type(dg.float16)
    g.sub(h, t, name="z_op").set_name("z").set_output(True)
    xt, rt = _ints([4, 3, 9], 20, 40), _fractions([4, 1, 9])
    wide = getattr(xt.double() + rt.double(), "amax" if mode == "max" else "sum")(dim=1, keepdim=True)
    outputs, refs = _execute(g, {"x": xt, "r": rt, "t": wide.float()}, device)
    assert len(g.plan.launches) == 1
    _assert_as_stored(outputs, refs, "h", "z", wide)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_output_feeds_its_epilogue_as_stored(device):
    g = _graph()
    x, t = g.tensor(name="x", dim=[6, 29]), g.tensor(name="t", dim=[6, 29])
    p = g.softmax(x, axis=-1, name="p_op").set_name("p").set_output(True).set_data_type(dg.float16)
    g.sub(p, t, name="z_op").set_name("z").set_output(True)
    xt = torch.randn(6, 29, generator=GEN)
    wide = torch.softmax(xt.double(), dim=-1)
    outputs, refs = _execute(g, {"x": xt, "t": wide.float()}, device)
    expected = wide.half().double() - wide.float().double()
    assert rel_err(refs["z"], expected) < 1e-6
    # a wide read would give about fp32's error of the softmax: a relative error near 1 here
    assert rel_err(outputs["z"], refs["z"]) < 0.05


# --- pooling --------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_pooling_output_and_prologue_are_consumed_as_stored(device):
    g = _graph()
    x, r = g.tensor(name="x", dim=[2, 3, 7, 7]), g.tensor(name="r", dim=[2, 3, 7, 7])
    t = g.tensor(name="t", dim=[2, 3, 3, 3])
    h = g.add(x, r, name="h_op").set_name("h").set_output(True).set_data_type(dg.float16)
    y = g.pooling(h, "avg_include_pad", [3, 3], [2, 2], [0, 0], name="pool").set_name("y")
    y.set_output(True)
    m = g.pooling(g.add(x, r), "max", [3, 3], [2, 2], [0, 0], name="mpool").set_name("m")
    m.set_output(True).set_data_type(dg.float16)
    g.sub(m, t, name="z_op").set_name("z").set_output(True)
    xt, rt = _bases([2, 3, 7, 7]), _fractions([2, 3, 7, 7])
    wide_max = F.max_pool2d(xt.double() + rt.double(), 3, 2)
    outputs, refs = _execute(g, {"x": xt, "r": rt, "t": wide_max.float()}, device)
    expected_avg = F.avg_pool2d(xt.double(), 3, 2)  # the average of the stored h
    assert rel_err(refs["y"], expected_avg) < 1e-12
    assert rel_err(outputs["y"], expected_avg) < 1e-6
    assert rel_err(F.avg_pool2d(xt.double() + rt.double(), 3, 2), expected_avg) > 1e-6
    _assert_as_stored(outputs, refs, "m", "z", wide_max)


# --- attention ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_output_feeds_its_epilogue_as_stored(device):
    gen = torch.Generator().manual_seed(3)
    q_t, k_t, v_t = (torch.randn(1, 2, n, 16, generator=gen) for n in (9, 11, 11))
    g = _graph()
    q, k, v = g.tensor_like(q_t, "q"), g.tensor_like(k_t, "k"), g.tensor_like(v_t, "v")
    o, _ = g.sdpa(q, k, v, name="attn")
    o.set_name("o").set_output(True).set_data_type(dg.float16)
    wide = F.scaled_dot_product_attention(q_t.double(), k_t.double(), v_t.double())
    t = g.tensor(name="t", dim=list(wide.shape))
    g.sub(o, t, name="z_op").set_name("z").set_output(True)
    outputs, refs = _execute(g, {"q": q_t, "k": k_t, "v": v_t, "t": wide.float()}, device)
    expected = wide.half().double() - wide.float().double()
    assert rel_err(refs["z"], expected) < 1e-6
    assert rel_err(outputs["z"], refs["z"]) < 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_attention_chain_with_a_stored_score_output_matches_the_reference(device):
    gen = torch.Generator().manual_seed(4)
    q_t, kt_t, v_t = torch.randn(1, 2, 7, 8, generator=gen), torch.randn(1, 2, 8, 9, generator=gen), \
        torch.randn(1, 2, 9, 8, generator=gen)
    g = _graph()
    q, kt, v = g.tensor_like(q_t, "q"), g.tensor_like(kt_t, "kt"), g.tensor_like(v_t, "v")
    scores = g.scale(g.matmul(q, kt), 0.35, name="scaled").set_name("s")
    scores.set_output(True).set_data_type(dg.float16)
    g.matmul(g.softmax(scores, axis=-1), v, name="pv").set_name("o").set_output(True)
    outputs, refs = _execute(g, {"q": q_t, "kt": kt_t, "v": v_t}, device)
    stored = (torch.matmul(q_t.double(), kt_t.double()) * 0.35).half().double()
    expected = torch.matmul(torch.softmax(stored, dim=-1), v_t.double())
    assert rel_err(refs["o"], expected) < 1e-12
    assert rel_err(outputs["o"], refs["o"]) < 1e-5


# --- autodiff -------------------------------------------------------------------------------------
def test_backward_differentiates_at_the_stored_value():
    g = _add_layernorm(dg.float16, stored=True)
    xt, rt = _near_constant_rows(5, 37, torch.float16)
    st, bt = torch.randn(1, 37, generator=GEN), torch.randn(1, 37, generator=GEN)
    fn = g.as_function(inputs=["x", "r", "scale", "bias"], outputs=["h", "y"])
    args = [xt.clone().requires_grad_(), rt.clone(), st.clone(), bt.clone()]
    h, y = fn(*args)
    dy = torch.randn(y.shape, generator=GEN)
    y.backward(dy)
    leaf = xt.double().clone().requires_grad_()
    stored = leaf + (leaf.detach() + rt.double()).half().double() - leaf.detach()  # straight through
    wide_leaf = xt.double().clone().requires_grad_()
    torch.autograd.backward(_layernorm(stored, st, bt), dy.double())
    torch.autograd.backward(_layernorm(wide_leaf + rt.double(), st, bt), dy.double())
    assert rel_err(args[0].grad, leaf.grad) < 1e-5
    assert rel_err(wide_leaf.grad, leaf.grad) > 1e-4, "the dropped fractions must matter"


@pytest.mark.parametrize("returned", [["y"], ["h", "y"]], ids=["h_left_out", "h_returned"])
def test_backward_of_a_fused_chain_reads_the_stored_value(returned):
    # y = (h - t)^2 with h stored fp16: dy/dx = 2 (h - t) dy, minus twice the dropped fraction
    # (0 if the backward kernel recomputed h wide in its registers); the function computes what
    # the graph computes whether or not it returns h
    g = _graph()
    x, r, t = (g.tensor(name=n, dim=[3, 21]) for n in ("x", "r", "t"))
    h = g.add(x, r, name="h_op").set_name("h").set_output(True).set_data_type(dg.float16)
    z = g.sub(h, t)
    g.mul(z, z, name="y_op").set_name("y").set_output(True)
    xt, rt = _bases([3, 21]), _fractions([3, 21])
    fn = g.as_function(inputs=["x", "r", "t"], outputs=returned)
    leaf = xt.clone().requires_grad_()
    y = fn(leaf, rt, xt + rt)[-1] if len(returned) > 1 else fn(leaf, rt, xt + rt)
    dy = _ints([3, 21])
    assert torch.equal(y.double(), (xt.half().double() - (xt + rt).double()) ** 2)
    y.backward(dy)
    expected = 2 * (xt.half().double() - (xt + rt).double()) * dy.double()
    assert expected.abs().max() > 0
    assert torch.equal(leaf.grad.double(), expected)


# --- virtual intermediates that pass through memory -----------------------------------------------
@pytest.mark.parametrize("intermediate", ["float16", "float32"])
def test_virtual_between_kernels_is_stored_in_the_intermediate_type(intermediate):
    g = dg.Graph(name="chain", io_data_type=dg.float16, intermediate_data_type=NARROW.get(
        intermediate, (dg.float32,))[0])
    a, b, c = (g.tensor(name=n, dim=[9, 9]) for n in ("a", "b", "c"))
    ab = g.matmul(a, b, name="ab")
    g.matmul(ab, c, name="abc").set_name("y").set_output(True)
    g.build()
    assert f"ab.c [9, 9] {intermediate} stride [9, 1] (workspace)" in g.explain()
    inputs = {n: torch.randn(9, 9, generator=GEN).half() for n in "abc"}
    check(g, inputs, torch.float16)
