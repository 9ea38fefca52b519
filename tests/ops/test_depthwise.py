"""Depthwise convolution (one input channel per group) on CPU (interpreter): the direct kernels
of fprop, dgrad and wgrad in 1D/2D/3D, NCHW, NHWC and odd strides, channel multipliers 1 and 2,
odd sizes, padding past the filter radius, dilation, stride past the filter, both modes, fused
epilogues and prologues whose padding stays zero, torch.autograd, bitwise-reproducible wgrad,
routing and the structure of the plan. On the GPU (marked gpu), in bf16: MobileNetV2 3x3 (stride 1
and 2) and ConvNeXt 7x7 layers, fprop + bias + relu in NHWC and NCHW, dgrad and wgrad against
torch.autograd, wgrad bit for bit across runs."""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from dnngraph.backends.triton.heuristics import depthwise as dw_heuristics
from helpers import check, compiled_for_sm90
from test_codegen_names import _code_tokens
from test_conv import stored

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
RANKS = {  # spatial sizes, filter, padding, stride, dilation
    1: dict(size=[13], filter=[3], padding=[2], stride=[2], dilation=[2]),
    2: dict(size=[7, 9], filter=[3, 2], padding=[1, 3], stride=[1, 3], dilation=[2, 1]),
    3: dict(size=[4, 5, 6], filter=[3, 1, 2], padding=[1, 0, 2], stride=[2, 1, 1], dilation=[1, 1, 2]),
}
CHANNELS = 5


def graph(dtype=dg.float32, **kwargs):
    return dg.Graph(name="depthwise", io_data_type=dtype, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32, **kwargs)


def dims(case, multiplier, batch=2, channels=CHANNELS):
    """(x dims, w dims, y dims) of a depthwise conv of `case`."""
    x_dim = [batch, channels] + case["size"]
    w_dim = [channels * multiplier, 1] + case["filter"]
    y = CONV[len(case["size"])](torch.zeros(x_dim), torch.zeros(w_dim), groups=channels, **geometry(case))
    return x_dim, w_dim, list(y.shape)


def geometry(case):
    return dict(padding=case["padding"], stride=case["stride"], dilation=case["dilation"])


def conv_graph(op, case, layout, multiplier=1, mode="cross_correlation", dtype=torch.float32):
    """(graph, conv output tensor, inputs) of one depthwise op."""
    x_dim, w_dim, y_dim = dims(case, multiplier)
    g = graph(dg.dtypes.from_torch(dtype))
    attrs = dict(groups=x_dim[1], mode=mode, **geometry(case))
    if op == "fprop":
        inputs = {"x": stored(x_dim, layout, dtype), "w": stored(w_dim, layout, dtype)}
        x, w = g.tensor_like(inputs["x"], name="x"), g.tensor_like(inputs["w"], name="w")
        return g, g.conv_fprop(x, w, **attrs), inputs
    if op == "dgrad":
        inputs = {"dy": stored(y_dim, layout, dtype), "w": stored(w_dim, layout, dtype)}
        dy, w = g.tensor_like(inputs["dy"], name="dy"), g.tensor_like(inputs["w"], name="w")
        return g, g.conv_dgrad(dy, w, x_dim=x_dim, **attrs), inputs
    inputs = {"dy": stored(y_dim, layout, dtype), "x": stored(x_dim, layout, dtype)}
    dy, x = g.tensor_like(inputs["dy"], name="dy"), g.tensor_like(inputs["x"], name="x")
    return g, g.conv_wgrad(dy, x, w_dim=w_dim, **attrs), inputs


def assert_depthwise(g, op):
    """One group, run by the depthwise kernels (no GEMM mainloop): one launch, two for wgrad."""
    assert len(g.plan.groups) == 1 and g.plan.groups[0].kind == "conv"
    launches = g.plan.launches
    assert len(launches) == (2 if op == "wgrad" else 1)
    for launch in launches:
        source = launch.source_path.read_text()
        assert "_depthwise" in launch.kernel.__name__ and "tl.dot" not in source
    assert "in tl.static_range(FILTER_" in launches[0].source_path.read_text() or op == "wgrad"  # the taps
    assert launches[0].config_text.split()[0] == ("wgrad" if op == "wgrad" else "gather")


@pytest.mark.parametrize("rank", sorted(RANKS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "odd"])
@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("multiplier", [1, 2])
def test_matches_reference(op, rank, layout, multiplier):
    mode = "convolution" if (rank + multiplier) % 2 else "cross_correlation"
    g, out, inputs = conv_graph(op, RANKS[rank], layout, multiplier, mode)
    out.set_output(True).set_name("out")
    check(g, inputs)
    assert_depthwise(g, op)


# past the unrolling budget (codegen/unrolling.py): a 1-D filter of 65 taps is a runtime loop;
# 4 filters a channel around 17 unrolled taps (68 bodies) roll the filters' loop in dgrad
LONG_FILTERS = {
    "65 taps": (dict(size=[69], filter=[65], padding=[32], stride=[1], dilation=[1]), 1, "for t_0 in tl.range(FILTER_0):"),
    "4 x 17 taps": (dict(size=[6, 23], filter=[2, 17], padding=[1, 8], stride=[1, 2], dilation=[1, 1]), 4,
                    "for m in tl.range(MULTIPLIER):"),
}


@pytest.mark.parametrize("name,merge", [(name, False) for name in sorted(LONG_FILTERS)] + [("65 taps", True)])
@pytest.mark.parametrize("op", ["fprop", "dgrad"])
def test_filters_past_the_unroll_budget_run_as_runtime_loops(op, name, merge):
    """Runtime tap loops, plain and merged columns (where a tap shifts one (w, c) run)."""
    case, multiplier, loop = LONG_FILTERS[name]
    g, out, inputs = conv_graph(op, case, "nhwc", multiplier, "convolution")
    out.set_output(True).set_name("out")
    forced = dw_heuristics.DepthwiseConfig("gather", 4, 32, 2, merge=True) if merge else None
    check(g, inputs, options=dg.BuildOptions(depthwise_config=forced) if merge else None)
    if merge:
        assert "merged" in g.plan.launches[0].config_text
    source = g.plan.launches[0].source_path.read_text()
    if op == "dgrad" or multiplier == 1:
        assert loop in source
    if name == "4 x 17 taps":
        assert "for t_1 in tl.static_range(FILTER_1):" in source


WIDE = dict(size=[11, 6], filter=[5, 2], padding=[4, 3], stride=[6, 3], dilation=[1, 2])


@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("mode", ["convolution", "cross_correlation"])
def test_padding_past_the_radius_and_stride_past_the_filter(op, mode):
    """Padding larger than the filter radius, stride larger than the filter (some dx untouched),
    dilation: every tap masked somewhere."""
    g, out, inputs = conv_graph(op, WIDE, "nhwc", 1, mode)
    out.set_output(True).set_name("out")
    check(g, inputs)
    assert_depthwise(g, op)


SAME_W = dict(size=[7, 9], filter=[3, 3], padding=[1, 2], stride=[1, 1], dilation=[1, 2])


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op", ["fprop", "dgrad"])
def test_merged_columns(op, layout, merge):
    """Columns over (w, c) in NHWC or (h, w) in NCHW, one memory run a tap shifts, with the
    per-channel prologue, a bias and an NCHW residual read per column: the same results as
    plain columns. Small tiles: several row and column tiles, ragged at both ends."""
    options = dg.BuildOptions(depthwise_config=dw_heuristics.DepthwiseConfig("gather", 4, 32, 2, merge=merge))
    x_dim, w_dim, y_dim = dims(SAME_W, 1)
    source_dim, out_dim = (x_dim, y_dim) if op == "fprop" else (y_dim, x_dim)
    g = graph()
    inputs = {"src": stored(source_dim, layout), "w": stored(w_dim, layout), "scale": torch.randn(1, CHANNELS, 1, 1),
              "shift": torch.rand(1, CHANNELS, 1, 1) + 1.0, "b": torch.randn(1, CHANNELS, 1, 1),
              "r": stored(out_dim, "nchw")}
    src, w, r = (g.tensor_like(inputs[k], name=k) for k in ("src", "w", "r"))
    scale, shift, b = (g.tensor(name=k, dim=[1, CHANNELS, 1, 1]) for k in ("scale", "shift", "b"))
    act = g.relu(g.add(g.mul(src, scale), shift))
    attrs = dict(groups=CHANNELS, mode="convolution", **geometry(SAME_W))
    out = g.conv_fprop(act, w, **attrs) if op == "fprop" else g.conv_dgrad(act, w, x_dim=x_dim, **attrs)
    g.relu(g.add(g.add(out, b), r)).set_output(True).set_name("y")
    check(g, inputs, options=options)
    assert_depthwise(g, op)
    source = g.plan.launches[0].source_path.read_text()
    assert ("cols_idx // size_" in source) == merge
    assert (" merged" in g.plan.launches[0].config_text) == merge


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_fused_epilogue(layout):
    """bias, residual, relu and a cast, the pre-activation stored as an extra output: one kernel."""
    case = RANKS[2]
    g, y, inputs = conv_graph("fprop", case, layout, multiplier=2)
    _, w_dim, y_dim = dims(case, 2)
    inputs.update(b=torch.randn(1, w_dim[0], 1, 1), r=stored(y_dim, "odd"))
    b, r = g.tensor(name="b", dim=[1, w_dim[0], 1, 1]), g.tensor_like(inputs["r"], name="r")
    pre = g.add(g.add(y, b), r).set_output(True).set_name("pre")
    g.cast(g.relu(pre), data_type=dg.float16).set_output(True).set_name("y")
    check(g, inputs, tolerance=1e-3)
    assert_depthwise(g, "fprop")


@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_scale_bias_relu_prologue_keeps_padding_zero(op):
    """relu(scale * v + bias) on the gathered operand (x, or dy) at load; bias > 0, so a padded
    position would add relu(bias) if the prologue ran there."""
    case = RANKS[2]
    x_dim, w_dim, y_dim = dims(case, 1)
    source_dim = x_dim if op == "fprop" else y_dim
    channels = source_dim[1]
    g = graph()
    src_t = stored(source_dim, "nhwc")
    src = g.tensor_like(src_t, name="src")
    scale, bias = g.tensor(name="scale", dim=[1, channels, 1, 1]), g.tensor(name="bias", dim=[1, channels, 1, 1])
    act = g.relu(g.add(g.mul(src, scale), bias))
    other_t = stored(x_dim if op == "wgrad" else w_dim, "nchw")
    other = g.tensor_like(other_t, name="other")
    attrs = dict(groups=channels, **geometry(case))
    if op == "fprop":
        out = g.conv_fprop(act, other, **attrs)
    elif op == "dgrad":
        out = g.conv_dgrad(act, other, x_dim=x_dim, **attrs)
    else:
        out = g.conv_wgrad(act, other, w_dim=w_dim, **attrs)
    out.set_output(True).set_name("out")
    check(g, {"src": src_t, "other": other_t, "scale": torch.randn(1, channels, 1, 1),
              "bias": torch.rand(1, channels, 1, 1) + 1.0})
    assert_depthwise(g, op)


@pytest.mark.parametrize("mode", ["convolution", "cross_correlation"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_backward_matches_autograd(mode, layout):
    """dgrad and wgrad against torch.autograd in float64: stride 2, dilation 2, multiplier 2."""
    x64 = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    w_used = w64.flip((2, 3)) if mode == "convolution" else w64
    geo = dict(stride=[2, 1], padding=[1, 2], dilation=[2, 1])
    y = F.conv2d(x64, w_used, groups=4, **geo)
    dy64 = torch.randn_like(y)
    dx64, dw64 = torch.autograd.grad(y, (x64, w64), dy64)
    memory = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    dy_t = dy64.float().contiguous(memory_format=memory)
    x_t = x64.detach().float().contiguous(memory_format=memory)
    w_t = w64.detach().float()
    g = graph()
    dy, w, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(w_t, name="w"), g.tensor_like(x_t, name="x")
    g.conv_dgrad(dy, w, x_dim=[2, 4, 9, 8], groups=4, mode=mode, **geo).set_output(True).set_name("dx")
    g.conv_wgrad(dy, x, w_dim=[8, 1, 3, 2], groups=4, mode=mode, **geo).set_output(True).set_name("dw")
    out = check(g, {"dy": dy_t, "w": w_t, "x": x_t})
    assert torch.allclose(out["dx"].double(), dx64, rtol=1e-4, atol=1e-4)
    assert torch.allclose(out["dw"].double(), dw64, rtol=1e-4, atol=1e-4)


def test_wgrad_is_bitwise_reproducible():
    """Several splits, each summed in a fixed order and combined in split order: two runs agree
    bit for bit."""
    options = dg.BuildOptions(depthwise_config=dw_heuristics.DepthwiseConfig("wgrad", 16, 8, 2, 4, 5))
    g, dw, inputs = conv_graph("wgrad", RANKS[2], "nhwc", 2)
    dw.set_output(True).set_name("dw")
    first = check(g, inputs, options=options)["dw"]
    assert g.plan.launches[0].config_text.startswith("wgrad 16x4x8 warps=2 SPLITS=5")
    second = check(g, inputs, options=options)["dw"]
    assert torch.equal(first, second)


def test_half_precision():
    g, out, inputs = conv_graph("fprop", RANKS[2], "nhwc", 1, dtype=torch.float16)
    g.relu(out).set_output(True).set_name("y")
    check(g, inputs, torch.float16)
    g, out, inputs = conv_graph("wgrad", RANKS[1], "nhwc", 2, dtype=torch.float16)
    out.set_output(True).set_name("dw")
    check(g, inputs, torch.float16)


def test_size_one_axes_and_broadcast_input():
    """N = 1 and H = 1, and an x broadcast along W (stride 0): its padding is zero too."""
    x_t = torch.randn(1, 3, 1, 1).expand(1, 3, 1, 6)
    w_t = torch.randn(3, 1, 1, 3)
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[0, 2], stride=[1, 1], dilation=[1, 1], groups=3).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t})
    assert_depthwise(g, "fprop")


def test_nan_and_inf_propagate():
    g, out, inputs = conv_graph("fprop", RANKS[2], "nhwc")
    inputs["x"][0, 1, 2, 2] = float("nan")
    inputs["x"][1, 0, 0, 0] = float("inf")
    out.set_output(True).set_name("y")
    check(g, inputs)


@pytest.mark.parametrize("groups,filters,direct", [(6, 6, True), (6, 24, True), (6, 30, False), (3, 6, False)])
def test_routing(groups, filters, direct):
    """One channel per group and at most MAX_MULTIPLIER filters per group: direct kernels;
    otherwise the implicit GEMM."""
    x_t, w_t = stored([1, 6, 5, 5], "nhwc"), stored([filters, 6 // groups, 3, 3], "nhwc")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=groups).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t})
    assert ("_depthwise" in g.plan.launches[0].kernel.__name__) == direct


def test_integer_operands_are_rejected():
    g = graph()
    x = g.tensor(name="x", dim=[1, 3, 5, 5], data_type=dg.int32)
    w = g.tensor(name="w", dim=[3, 1, 3, 3])
    g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=3).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="int32"):
        g.build()


def test_autotune_then_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "2")
    g, out, inputs = conv_graph("wgrad", RANKS[1], "nhwc")
    out.set_output(True).set_name("dw")
    g.build(autotune=True)
    assert all(launch.tuning.source == "tuned" for launch in g.plan.launches)
    check(g, inputs)
    g.build(autotune=True)
    assert all(launch.tuning.source == "cache" for launch in g.plan.launches)


def test_names_never_change_the_kernel():
    """Tensor names that are the kernel's own identifiers reach comments only."""
    sources = []
    for names in (("x", "w", "y"), ("acc", "weight", "src_ptr")):
        x_t, w_t = stored([2, 4, 5, 6], "nhwc"), stored([4, 1, 3, 3], "nchw")
        g = graph()
        x, w = g.tensor_like(x_t, name=names[0]), g.tensor_like(w_t, name=names[1])
        y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=4, name=names[2])
        g.relu(y, name=names[0] + "_relu").set_output(True).set_name(names[2] + "_out")
        check(g, {names[0]: x_t, names[1]: w_t})
        sources.append(_code_tokens(g.plan.launches[0].source_path.read_text()))
    assert sources[0] == sources[1]


def sm90_graphs():
    """Built graphs of every kernel shape for the sm_90 compile check: gather plain and merged,
    multiplier 2 and a prologue, wgrad with splits and its combine, 1D and 3D."""
    forced = {"fprop": dw_heuristics.DepthwiseConfig("gather", 16, 32, 4),
              "merged": dw_heuristics.DepthwiseConfig("gather", 4, 128, 4, merge=True),
              "wgrad": dw_heuristics.DepthwiseConfig("wgrad", 32, 16, 4, 4, 3)}
    cases = [("fprop", SAME_W, "nhwc", 2, "fprop"), ("fprop", SAME_W, "nhwc", 1, "merged"),
             ("dgrad", SAME_W, "nchw", 1, "merged"), ("dgrad", RANKS[2], "nhwc", 2, "fprop"),
             ("wgrad", RANKS[3], "nhwc", 2, "wgrad"), ("fprop", RANKS[1], "nchw", 1, "fprop"),
             ("fprop", LONG_FILTERS["65 taps"][0], "nhwc", 1, "merged"),  # runtime loops over the taps
             ("dgrad", LONG_FILTERS["4 x 17 taps"][0], "nhwc", 4, "fprop")]  # and over the filters
    for op, case, layout, multiplier, config in cases:
        g, out, _ = conv_graph(op, case, layout, multiplier, "convolution", torch.bfloat16)
        g.relu(out).set_output(True)
        g.build(options=dg.BuildOptions(depthwise_config=forced[config]))
        yield f"{op} {layout} multiplier {multiplier} {config}", g


def test_kernels_compile_for_sm90():
    """The interpreter skips Triton's type checks (a loop-carried value changing shape compiled
    only on the GPU): compile the kernels for sm_90 in a process without the interpreter."""
    assert "compiled 9 kernels for sm_90" in compiled_for_sm90("test_depthwise:sm90_graphs", timeout=300)


@pytest.mark.parametrize("groups,w_dim", [(4, [4, 1, 3, 3]), (1, [3, 4, 3, 3])])
def test_prologue_value_that_is_an_output_is_stored(groups, w_dim):
    """A conv's loads visit x positions several times (or never): a prologue value the graph
    outputs is written by a pointwise kernel first, on the depthwise and the GEMM path alike."""
    x_t, w_t = stored([2, 4, 5, 6], "nhwc"), stored(w_dim, "nchw")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    scale = g.tensor(name="scale", dim=[1, 4, 1, 1])
    act = g.relu(g.mul(x, scale)).set_output(True).set_name("act")
    g.conv_fprop(act, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=groups).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t, "scale": torch.randn(1, 4, 1, 1)})
    assert [launch.group.kind for launch in g.plan.launches] == ["pointwise", "conv"]


@pytest.mark.parametrize("mode", ["convolution", "cross_correlation"])
def test_wgrad_size_one_input_axis_keeps_its_padding_mask(mode):
    """x of width 1 (its stride is 0 there) under padding 1 and dilation 2: every tap lands in the
    padding, dw is 0 (found by the random-graph test: the mask of the stride-0 axis was dropped)."""
    g = dg.Graph(name="w1", io_data_type=dg.float32)
    dy_t, x_t = torch.randn(4, 1, 5, 1), torch.randn(4, 1, 7, 1)
    dy, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(x_t, name="x")
    g.conv_wgrad(dy, x, w_dim=[1, 1, 3, 2], padding=[0, 1], stride=[1, 3], dilation=[1, 2],
                 mode=mode).set_output(True).set_name("dw")
    check(g, {"dy": dy_t, "x": x_t})


def test_dgrad_stride_two_with_an_infinite_tap():
    """Taps that reach no dy element add nothing (a masked 0 times an inf weight made dx NaN at
    every other row and column; found in review)."""
    w_t = torch.randn(2, 1, 3, 3)
    w_t[1, 0, 1, 1] = float("inf")
    dy_t = torch.randn(1, 2, 3, 3)
    g = dg.Graph(name="dw_inf", io_data_type=dg.float32)
    dy, w = g.tensor_like(dy_t, name="dy"), g.tensor_like(w_t, name="w")
    g.conv_dgrad(dy, w, x_dim=[1, 2, 6, 6], padding=[1, 1], stride=[2, 2], dilation=[1, 1],
                 groups=2).set_output(True).set_name("dx")
    check(g, {"dy": dy_t, "w": w_t})


# --- on the GPU: MobileNetV2 and ConvNeXt layers in bf16 -----------------------------------------
LAYERS = {  # x dims, filter, padding, stride
    "mbv2 3x3": ([4, 144, 56, 56], 3, 1, 1),
    "mbv2 3x3/2": ([4, 144, 56, 56], 3, 1, 2),
    "convnext 7x7": ([2, 96, 56, 56], 7, 3, 1),
}


def _case(name):
    x_dim, size, padding, stride = LAYERS[name]
    w_dim = [x_dim[1], 1, size, size]
    return x_dim, w_dim, dict(padding=[padding] * 2, stride=[stride] * 2, dilation=[1, 1], groups=x_dim[1])


def _direct(g):
    return all("_depthwise" in launch.kernel.__name__ for launch in g.plan.launches)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_fprop_bias_relu_bf16(name, layout):
    x_dim, w_dim, attrs = _case(name)
    x_t, w_t = stored(x_dim, layout, torch.bfloat16), stored(w_dim, layout, torch.bfloat16)
    g = dg.Graph(name="depthwise", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    bias = g.tensor(name="b", dim=[1, w_dim[0], 1, 1])
    g.relu(g.add(g.conv_fprop(x, w, **attrs), bias)).set_output(True).set_name("y")
    inputs = {"x": x_t, "w": w_t, "b": torch.randn(1, w_dim[0], 1, 1).to(torch.bfloat16)}
    check(g, {k: v.cuda() for k, v in inputs.items()}, torch.bfloat16, "cuda")
    assert len(g.plan.groups) == 1 and len(g.plan.launches) == 1 and _direct(g)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_backward_bf16_against_autograd(name, op):
    x_dim, w_dim, attrs = _case(name)
    x64 = torch.randn(x_dim, dtype=torch.float64, device="cuda", requires_grad=True)
    w64 = torch.randn(w_dim, dtype=torch.float64, device="cuda", requires_grad=True)
    y = F.conv2d(x64, w64, **attrs)
    dy64 = torch.randn_like(y)
    dx64, dw64 = torch.autograd.grad(y, (x64, w64), dy64)
    dy_t = dy64.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    g = dg.Graph(name="depthwise", io_data_type=dg.bfloat16)
    dy = g.tensor_like(dy_t, name="dy")
    if op == "dgrad":
        w_t = w64.detach().to(torch.bfloat16)
        w = g.tensor_like(w_t, name="w")
        g.conv_dgrad(dy, w, x_dim=x_dim, **attrs).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "w": w_t}, dx64
    else:
        x_t = x64.detach().to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        x = g.tensor_like(x_t, name="x")
        g.conv_wgrad(dy, x, w_dim=w_dim, **attrs).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "x": x_t}, dw64
    # the float64 reference on the GPU: depthwise wgrad in float64 on a CPU shared by the GPU
    # run's workers took minutes
    out = check(g, inputs, torch.bfloat16, "cuda", reference_device="cuda")["out"]
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < 1.6e-2, error
    assert _direct(g)
    if op == "wgrad":  # the splits' partials are added in a fixed order: the same bits every run
        again = check(g, inputs, torch.bfloat16, "cuda", reference_device="cuda")["out"]
        assert torch.equal(out, again)
