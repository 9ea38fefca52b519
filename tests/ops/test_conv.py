"""Convolution family on CPU (interpreter): fprop, dgrad and wgrad in 1D/2D/3D, NCHW, NHWC and odd
strides, groups 1, 2 and C, padding past the filter radius, dilation, stride past the filter,
channel counts of 1 and 3, both modes, fused prologues and epilogues, forced variants, and the
bad inputs every op must reject. On the GPU (marked gpu): bf16 (the interpreter's bf16 dot is
wrong), fp16 and tf32/IEEE fp32 at real tile sizes, ResNet-like layers in NHWC and NCHW, 3D,
grouped, both backward ops against torch.autograd, split-K wgrad bitwise reproducible, and the
1x1 matmul path through TMA."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import check

RANKS = {1: dict(x=[2, 6, 13], w=[4, 3, 3], padding=[2], stride=[2], dilation=[2]),
         2: dict(x=[2, 6, 7, 9], w=[4, 3, 3, 2], padding=[1, 3], stride=[1, 3], dilation=[2, 1]),
         3: dict(x=[1, 6, 5, 6, 7], w=[6, 3, 3, 1, 2], padding=[1, 0, 2], stride=[2, 1, 1], dilation=[1, 1, 2])}


def stored(shape, layout, dtype=torch.float32):
    """A tensor of logical `shape` stored NCHW (contiguous), NHWC (channels innermost) or with odd
    strides (every other element of a wider buffer, axes permuted)."""
    rank = len(shape)
    if layout == "nchw":
        return torch.randn(shape).to(dtype)
    if layout == "nhwc":
        order = [0] + list(range(2, rank)) + [1]
        physical = torch.randn([shape[a] for a in order]).to(dtype)
        return physical.permute([order.index(a) for a in range(rank)])
    wide = [n * 2 if a % 2 else n for a, n in enumerate(shape)]
    physical = torch.randn(list(reversed(wide))).to(dtype).permute(list(range(rank - 1, -1, -1)))
    return physical[tuple(slice(None, None, 2) if a % 2 else slice(None) for a in range(rank))]


def conv_autograd(x_t, w_t, mode, wrt, layout="nchw", **conv):
    """(dy, torch.autograd's gradient of `wrt`) of conv2d(x, w) in float64 for a random dy (in
    `layout`); mode "convolution" flips the filter, as the graph's mode does."""
    w_used = w_t.flip((2, 3)) if mode == "convolution" else w_t
    y = torch.nn.functional.conv2d(x_t, w_used, **conv)
    dy_t = torch.randn_like(y)
    if layout == "nhwc":
        dy_t = dy_t.contiguous(memory_format=torch.channels_last)
    (expected,) = torch.autograd.grad(y, wrt, dy_t)
    return dy_t, expected


def graph(dtype=dg.float32, **kwargs):
    return dg.Graph(name="conv", io_data_type=dtype, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32, **kwargs)


def grouped(case: dict, groups: int) -> dict:
    """The case with `groups`: channels 6 and filters 6 divide 1, 2, 3 and 6."""
    case = dict(case, x=list(case["x"]), w=list(case["w"]))
    case["w"][0] = 6
    case["w"][1] = case["x"][1] // groups
    return case


def geometry(case):
    return dict(padding=case["padding"], stride=case["stride"], dilation=case["dilation"])


@pytest.mark.parametrize("rank", sorted(RANKS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "odd"])
@pytest.mark.parametrize("groups", [1, 2, 6])
def test_fprop(rank, layout, groups):
    case = grouped(RANKS[rank], groups)
    x_t, w_t = stored(case["x"], layout), stored(case["w"], layout)
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, groups=groups, **geometry(case)).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t})
    assert len(g.plan.launches) == 1


@pytest.mark.parametrize("mode", ["convolution", "cross_correlation"])
@pytest.mark.parametrize("channels,filters", [(1, 3), (3, 1), (3, 3), (1, 1)])
def test_fprop_small_channels_and_modes(mode, channels, filters):
    x_t, w_t = stored([2, channels, 11, 6], "nhwc"), stored([filters, channels, 5, 2], "nchw")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    # padding larger than the filter radius, stride larger than the filter
    g.conv_fprop(x, w, padding=[4, 3], stride=[6, 3], dilation=[1, 1], mode=mode).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t})


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("groups", [1, 2])
def test_pointwise_conv_takes_the_matmul_path(layout, groups):
    x_t, w_t = stored([2, 6, 5, 7], layout), stored([4, 6 // groups, 1, 1], layout)
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    b = g.tensor(name="b", dim=[1, 4, 1, 1])
    g.relu(g.add(g.conv_fprop(x, w, padding=[0, 0], groups=groups), b)).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t, "b": torch.randn(1, 4, 1, 1)})
    source = g.plan.launches[0].source_path.read_text()
    assert ("TAPS" in source) == (layout == "nchw"), "NHWC 1x1 runs on the matmul loaders, NCHW gathers"


VARIANTS = {"tiled": mm.MatmulConfig("tiled", 32, 16, 16, 4, 2),
            "split_k": mm.MatmulConfig("split_k", 32, 16, 16, 4, 2, split_k=3),
            "small_m": mm.MatmulConfig("small_m", 16, 16, 16, 4, 2)}


@pytest.fixture(params=["tiled", "split_k", "small_m"])
def variant(request):
    """One implicit-GEMM variant, forced (forced(variant)) whatever the model would pick."""
    return request.param


def forced(variant: str) -> dg.BuildOptions:
    """Options running conv variant `variant` whatever the model would pick."""
    return dg.BuildOptions(conv_config=VARIANTS[variant])


def test_fused_epilogue_every_variant(variant):
    """bias, residual, relu and a cast, with the pre-activation stored as an extra output."""
    x_t, w_t = stored([2, 5, 6, 7], "nhwc"), stored([7, 5, 3, 3], "odd")
    residual_t = stored([2, 7, 6, 7], "nchw")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    b, r = g.tensor(name="b", dim=[1, 7, 1, 1]), g.tensor_like(residual_t, name="r")
    pre = g.add(g.add(g.conv_fprop(x, w, padding=[1, 1]), b), r).set_output(True).set_name("pre")
    g.cast(g.relu(pre), data_type=dg.float16).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t, "b": torch.randn(1, 7, 1, 1), "r": residual_t}, tolerance=1e-3,
          options=forced(variant))
    assert [l.group.kind for l in g.plan.launches][0] == "conv"
    assert len(g.plan.launches) == (2 if variant == "split_k" else 1)


def test_batchnorm_relu_prologue_keeps_padding_zero():
    """scale * x + bias, relu, applied at load: the padded border contributes 0, not relu(bias)."""
    x_t, w_t = stored([2, 4, 5, 6], "nhwc"), stored([3, 4, 3, 3], "nchw")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    scale, bias = g.tensor(name="scale", dim=[1, 4, 1, 1]), g.tensor(name="bias", dim=[1, 4, 1, 1])
    act = g.relu(g.add(g.mul(x, scale), bias))
    g.conv_fprop(act, w, padding=[2, 1]).set_output(True).set_name("y")
    inputs = {"x": x_t, "w": w_t, "scale": torch.randn(1, 4, 1, 1), "bias": torch.rand(1, 4, 1, 1) + 1.0}
    check(g, inputs)
    assert len(g.plan.launches) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mixed_and_half_types(dtype):
    x_t, w_t = stored([2, 5, 7, 6], "nhwc", dtype), stored([4, 5, 3, 3], "nchw", torch.float16)
    g = graph(dg.dtypes.from_torch(dtype))
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[1, 1]).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t}, tolerance=2e-3)


def test_nan_and_inf_propagate():
    x_t, w_t = stored([1, 3, 5, 5], "nhwc"), stored([2, 3, 3, 3], "nchw")
    x_t[0, 1, 2, 2] = float("nan")
    x_t[0, 0, 0, 0] = float("inf")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[1, 1]).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t})


def test_integer_operands_are_rejected():
    g = graph()
    x = g.tensor(name="x", dim=[1, 3, 5, 5], data_type=dg.int32)
    w = g.tensor(name="w", dim=[2, 3, 3, 3])
    g.conv_fprop(x, w, padding=[1, 1]).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="int32"):
        g.build()


@pytest.mark.parametrize("call,match", [
    (lambda g, x, w: g.conv_fprop(x, w, padding=[1, 1], groups=4), "groups"),
    (lambda g, x, w: g.conv_fprop(x, w, padding=[-1, 1]), "padding"),
    (lambda g, x, w: g.conv_fprop(x, w, padding=[0, 0], dilation=[9, 1]), "larger than"),
    (lambda g, x, w: g.conv_fprop(x, w, padding=[1, 1], stride=[0, 1]), "stride"),
    (lambda g, x, w: g.conv_dgrad(g.tensor(name="dy", dim=[2, 4, 5, 5]), w, x_dim=[2, 6, 9, 9],
                                  padding=[1, 1]), "dy must be"),
    (lambda g, x, w: g.conv_wgrad(g.tensor(name="dy", dim=[2, 4, 4, 4]), x, w_dim=[4, 6, 3, 3],
                                  padding=[1, 1]), "dy must be"),
    (lambda g, x, w: g.conv_dgrad(g.tensor(name="dy", dim=[2, 4, 5, 5]), w, x_dim=[2, 6, 5],
                                  padding=[1, 1]), "padding needs 1"),
])
def test_bad_input_is_a_validation_error(call, match):
    g = graph()
    x, w = g.tensor(name="x", dim=[2, 6, 5, 5]), g.tensor(name="w", dim=[4, 6, 3, 3])
    nodes = len(g.nodes) if hasattr(g, "nodes") else None
    with pytest.raises(dg.ValidationError, match=match):
        call(g, x, w)
    if nodes is not None:
        assert len(g.nodes) == nodes


def _dgrad_graph(case, groups, layout, mode="cross_correlation", dtype=torch.float32):
    x_dim, w_dim = case["x"], case["w"]
    w_t = stored(w_dim, layout, dtype)
    probe = torch.zeros(x_dim)
    reference = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[len(x_dim) - 3]
    y_dim = list(reference(probe, torch.zeros(w_dim), groups=groups, **geometry(case)).shape)
    dy_t = stored(y_dim, layout, dtype)
    g = graph(dg.dtypes.from_torch(dtype))
    dy, w = g.tensor_like(dy_t, name="dy"), g.tensor_like(w_t, name="w")
    dx = g.conv_dgrad(dy, w, x_dim=x_dim, groups=groups, mode=mode, **geometry(case))
    return g, dx, {"dy": dy_t, "w": w_t}




@pytest.mark.parametrize("stride,dilation,padding", [((2, 3), (1, 1), (1, 0)), ((3, 2), (2, 3), (4, 2)),
                                                     ((4, 1), (1, 1), (0, 0)), ((2, 2), (2, 2), (3, 3))])
@pytest.mark.parametrize("mode", ["convolution", "cross_correlation"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_dgrad_stride_phases_match_autograd(stride, dilation, padding, mode, layout):
    """Every phase, including those no tap reaches (stride past the filter: dx there is 0), against
    torch.autograd; a phase costs one kernel, never a zero-inserted dy. In NHWC the phases with
    one tap per axis are 1x1 convs on the matmul path, at a tap inside the filter."""
    x_t = torch.randn(2, 4, 11, 9, dtype=torch.float64, requires_grad=True)
    w_t = torch.randn(6, 4, 3, 2, dtype=torch.float64)
    dy_t, expected = conv_autograd(x_t, w_t, mode, x_t, layout, stride=stride, padding=padding, dilation=dilation)
    g = graph()
    dy, w = g.tensor_like(dy_t.float(), name="dy"), g.tensor_like(w_t.float(), name="w")
    g.conv_dgrad(dy, w, x_dim=[2, 4, 11, 9], padding=list(padding), stride=list(stride),
                 dilation=list(dilation), mode=mode).set_output(True).set_name("dx")
    out = check(g, {"dy": dy_t.float(), "w": w_t.float()})["dx"]
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-4)
    phases = min(stride[0], 11) * min(stride[1], 9)
    assert len(g.plan.launches) == phases


def test_dgrad_drelu_epilogue():
    """relu_backward(dx, x): the dReLU of the previous layer rides on the dgrad epilogue."""
    case = grouped(RANKS[2], 1)
    g, dx, inputs = _dgrad_graph(case, 1, "nhwc")
    x_t = stored(case["x"], "nhwc")
    x = g.tensor_like(x_t, name="x")
    g.relu_backward(dx, x).set_output(True).set_name("dx_relu")
    check(g, {**inputs, "x": x_t})
    assert len({l.group.kind for l in g.plan.launches}) == 1 and g.plan.launches[0].group.kind == "conv"


def _wgrad_graph(case, groups, layout, mode="cross_correlation"):
    x_t = stored(case["x"], layout)
    reference = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[len(case["x"]) - 3]
    y_dim = list(reference(torch.zeros(case["x"]), torch.zeros(case["w"]), groups=groups, **geometry(case)).shape)
    dy_t = stored(y_dim, layout)
    g = graph()
    dy, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(x_t, name="x")
    dw = g.conv_wgrad(dy, x, w_dim=case["w"], groups=groups, mode=mode, **geometry(case))
    return g, dw, {"dy": dy_t, "x": x_t}


@pytest.mark.parametrize("rank", sorted(RANKS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "odd"])
@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_backward(op, rank, layout, groups):
    case = grouped(RANKS[rank], groups)
    g, out, inputs = (_dgrad_graph if op == "dgrad" else _wgrad_graph)(case, groups, layout)
    out.set_output(True).set_name("out")
    check(g, inputs)


@pytest.mark.parametrize("mode", ["convolution", "cross_correlation"])
def test_wgrad_matches_autograd_and_is_bitwise_reproducible(mode):
    options = dg.BuildOptions(conv_config=mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=4))
    x_t = torch.randn(3, 4, 9, 8, dtype=torch.float64)
    w_t = torch.randn(5, 4, 3, 2, dtype=torch.float64, requires_grad=True)
    dy_t, expected = conv_autograd(x_t, w_t, mode, w_t, stride=(2, 1), padding=(1, 2), dilation=(1, 2))
    g = graph()
    dy, x = g.tensor_like(dy_t.float(), name="dy"), g.tensor_like(x_t.float(), name="x")
    g.conv_wgrad(dy, x, w_dim=[5, 4, 3, 2], padding=[1, 2], stride=[2, 1], dilation=[1, 2],
                 mode=mode).set_output(True).set_name("dw")
    first = check(g, {"dy": dy_t.float(), "x": x_t.float()}, options=options)["dw"]
    assert torch.allclose(first.double(), expected, rtol=1e-4, atol=1e-4)
    assert [l.config_text.split()[0] for l in g.plan.launches] == ["split_k", "split-K"]
    second = check(g, {"dy": dy_t.float(), "x": x_t.float()}, options=options)["dw"]
    assert torch.equal(first, second)


def test_wgrad_prologue_on_dy_and_epilogue():
    """relu_backward(dy, y) as a prologue on dy, a scale and a cast in the epilogue: one kernel."""
    case = grouped(RANKS[2], 1)
    x_t = stored(case["x"], "nhwc")
    y_dim = list(torch.nn.functional.conv2d(torch.zeros(case["x"]), torch.zeros(case["w"]), **geometry(case)).shape)
    dy_t, y_t = stored(y_dim, "nhwc"), stored(y_dim, "odd")
    g = graph()
    dy, y, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(y_t, name="y"), g.tensor_like(x_t, name="x")
    dw = g.conv_wgrad(g.relu_backward(dy, y), x, w_dim=case["w"], **geometry(case))
    g.cast(g.scale(dw, 0.5), data_type=dg.float16).set_output(True).set_name("dw")
    check(g, {"dy": dy_t, "y": y_t, "x": x_t}, tolerance=1e-3)
    assert len(g.plan.launches) == 1 and g.plan.launches[0].group.kind == "conv"


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("pointwise", [False, True])
def test_conv_with_batchnorm_statistics_is_one_group(variant, layout, pointwise):
    """conv (+ bias) -> genstats: the per-channel sum and sum of squares BatchNorm training needs
    come out of the conv's epilogue (column partials folded in order), not from a second pass."""
    x_t, w_t = stored([2, 6, 7, 5], layout), stored([6, 3, 3, 3], layout)
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.conv_fprop(x, w, padding=[1, 1], groups=2)
    if pointwise:
        y = g.add(y, g.tensor(name="b", dim=[1, 6, 1, 1]))
    y.set_output(True).set_name("y")
    total, squares = g.genstats(y)
    total.set_output(True).set_name("sum")
    squares.set_output(True).set_name("sq_sum")
    inputs = {"x": x_t, "w": w_t, **({"b": torch.randn(1, 6, 1, 1)} if pointwise else {})}
    check(g, inputs, options=forced(variant))
    assert [grp.kind for grp in g.plan.groups] == ["conv"]
    main = 2 if variant == "split_k" else 1
    assert len(g.plan.launches) == main + 1  # + the fold of the column partials


def test_pointwise_conv_with_statistics_on_the_matmul_path():
    x_t, w_t = stored([2, 8, 5, 7], "nhwc"), stored([6, 8, 1, 1], "nhwc")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.conv_fprop(x, w, padding=[0, 0]).set_output(True).set_name("y")
    total, squares = g.genstats(y)
    total.set_output(True).set_name("sum")
    squares.set_output(True).set_name("sq_sum")
    check(g, {"x": x_t, "w": w_t})
    assert [grp.kind for grp in g.plan.groups] == ["conv"]


@pytest.mark.parametrize("op", ["conv_fprop", "conv_dgrad", "conv_wgrad"])
def test_every_axis_of_size_one(op):
    """N = C = K = 1 and a one-pixel input: every stride is 0, the tiles must still be tiles
    (found by the random-graph test: a scalar pointer with a block mask)."""
    g = graph()
    geometry_1d = dict(padding=[1], stride=[2], dilation=[1], mode="convolution")
    a_t, b_t = torch.randn(1, 1, 1), torch.randn(1, 1, 3)
    if op == "conv_fprop":
        a, b = g.tensor_like(a_t, name="x"), g.tensor_like(b_t, name="w")
        g.exp(g.conv_fprop(g.add(a, g.tensor(name="s", dim=[1, 1, 1])), b, **geometry_1d)).set_output(True)
        inputs = {"x": a_t, "w": b_t, "s": torch.randn(1, 1, 1)}
    elif op == "conv_dgrad":
        a, b = g.tensor_like(a_t, name="dy"), g.tensor_like(b_t, name="w")
        g.conv_dgrad(a, b, x_dim=[1, 1, 1], **geometry_1d).set_output(True)
        inputs = {"dy": a_t, "w": b_t}
    else:
        a, b = g.tensor_like(a_t, name="dy"), g.tensor_like(torch.randn(1, 1, 1), name="x")
        g.conv_wgrad(a, b, w_dim=[1, 1, 3], **geometry_1d).set_output(True)
        inputs = {"dy": a_t, "x": torch.randn(1, 1, 1)}
    check(g, inputs)


@pytest.mark.parametrize("op", ["conv_fprop", "conv_dgrad", "conv_wgrad"])
def test_a_stored_value_fused_into_the_input_is_written(op):
    """exp(a) feeds the conv and is an output: the conv fuses it at load, and a pointwise kernel
    of the prologue stores it (found in review: it was never written)."""
    g = graph()
    a_t, b_t = torch.randn(2, 3, 5, 5), torch.randn(3, 4, 3, 3) if op != "conv_wgrad" else torch.randn(2, 4, 5, 5)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    e = g.exp(a).set_output(True).set_name("e")
    if op == "conv_fprop":
        b_t = torch.randn(4, 3, 3, 3)
        b = g.tensor_like(b_t, name="b2")
        g.conv_fprop(e, b, padding=[1, 1]).set_output(True).set_name("out")
        inputs = {"a": a_t, "b2": b_t}
    elif op == "conv_dgrad":
        g.conv_dgrad(e, b, x_dim=[2, 4, 5, 5], padding=[1, 1]).set_output(True).set_name("out")
        inputs = {"a": a_t, "b": b_t}
    else:
        g.conv_wgrad(e, b, w_dim=[3, 4, 3, 3], padding=[1, 1]).set_output(True).set_name("out")
        inputs = {"a": a_t, "b": b_t}
    check(g, inputs)


@pytest.mark.parametrize("op", ["conv_fprop", "conv_dgrad", "conv_wgrad"])
def test_one_computed_tensor_as_both_operands(op):
    """e = exp(x) read at the input (prologue position) and as the other operand: e stays in
    memory for the second reader (found in review: a KeyError at execute)."""
    g = graph()
    x_t = torch.randn(3, 3, 3, 3)
    e = g.exp(g.tensor_like(x_t, name="x"))
    if op == "conv_fprop":
        g.conv_fprop(e, e, padding=[1, 1]).set_output(True).set_name("out")
    elif op == "conv_dgrad":
        g.conv_dgrad(e, e, x_dim=[3, 3, 3, 3], padding=[1, 1]).set_output(True).set_name("out")
    else:
        g.conv_wgrad(e, e, w_dim=[3, 3, 3, 3], padding=[1, 1]).set_output(True).set_name("out")
    check(g, {"x": x_t})


def test_statistics_fold_over_many_row_tiles():
    """More row tiles than one chunk of the column fold holds (200 tiles of 16 rows): the chunks
    fold in order and every tile counts."""
    options = dg.BuildOptions(conv_config=mm.MatmulConfig("tiled", 16, 16, 16, 4, 2))
    x_t, w_t = stored([2, 3, 40, 40], "nhwc"), stored([5, 3, 3, 3], "nchw")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.conv_fprop(x, w, padding=[1, 1]).set_output(True).set_name("y")
    total, squares = g.genstats(y)
    total.set_output(True).set_name("sum")
    squares.set_output(True).set_name("sq_sum")
    check(g, {"x": x_t, "w": w_t}, options=options)
    fold = g.plan.launches[-1]
    assert "column-exit fold" in fold.config_text


# --- wgrad with few channels per group: the filter taps folded into the GEMM's columns ----------
FOLDED = {  # x, w, padding, stride, dilation, groups, x layout, dw layout, mode
    "stem 7x7/2 C3": ([2, 3, 13, 11], [5, 3, 7, 7], [3, 3], [2, 2], [1, 1], 1, "nhwc", "nhwc", "cross_correlation"),
    # one channel with more filters than the depthwise kernels take (a grayscale stem)
    "5x3 C1 dilated": ([2, 1, 9, 10], [6, 1, 5, 3], [2, 1], [1, 2], [2, 2], 1, "nchw", "nchw", "convolution"),
    "3x3 C2 odd": ([3, 2, 7, 6], [3, 2, 3, 3], [1, 0], [2, 1], [1, 1], 1, "odd", "nhwc", "cross_correlation"),
    "3x3x3/2 C5": ([1, 5, 5, 6, 7], [4, 5, 3, 3, 3], [1, 1, 0], [2, 1, 2], [1, 1, 1], 1, "nhwc", "nchw",
                   "cross_correlation"),
    "5x5 groups2 C3": ([2, 6, 9, 8], [4, 3, 5, 5], [2, 1], [2, 1], [1, 2], 2, "nhwc", "nhwc", "convolution"),
    "1d 7/2 C3": ([2, 3, 23], [6, 3, 7], [3], [2], [1], 1, "nchw", "nhwc", "cross_correlation"),
}


def _dense_strides(dim, layout) -> list:
    """Packed strides of `dim` in NCHW (contiguous) or NHWC (channels innermost) order."""
    order = list(range(len(dim))) if layout == "nchw" else [0] + list(range(2, len(dim))) + [1]
    strides, step = [0] * len(dim), 1
    for axis in reversed(order):
        strides[axis], step = step, step * dim[axis]
    return strides


def _folded_graph(name, dtype=torch.float32):
    x_dim, w_dim, padding, stride, dilation, groups, x_layout, dw_layout, mode = FOLDED[name]
    case = dict(padding=padding, stride=stride, dilation=dilation)
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[len(x_dim) - 3]
    y_dim = list(conv(torch.zeros(x_dim), torch.zeros(w_dim), groups=groups, **case).shape)
    x_t, dy_t = stored(x_dim, x_layout, dtype), stored(y_dim, x_layout, dtype)
    g = graph(dg.dtypes.from_torch(dtype))
    dy, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(x_t, name="x")
    dw = g.conv_wgrad(dy, x, w_dim=w_dim, groups=groups, mode=mode, **case)
    return g, dw.set_stride(_dense_strides(w_dim, dw_layout)), {"dy": dy_t, "x": x_t}


def _folded(launch) -> bool:
    return "_folded" in launch.source_path.name and "filter taps folded into N" in launch.reason


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_wgrad_folds_the_taps_of_few_channels(name):
    """C per group 1, 2, 3, 5 with 7x7, 5x3, 3x3x3 and 1D filters, strides, dilation, groups and
    both modes: one GEMM whose columns are (channel, taps), dw written through its own strides
    (NHWC or NCHW whatever the inputs' layout)."""
    g, dw, inputs = _folded_graph(name)
    dw.set_output(True).set_name("dw")
    check(g, inputs)
    assert len(g.plan.launches) in (1, 2) and _folded(g.plan.launches[0])
    source = g.plan.launches[0].source_path.read_text()
    assert _reassigned_in_loops(source) <= _accumulators(source), _reassigned_in_loops(source)


def test_wgrad_folded_stem_matches_autograd_and_is_bitwise_reproducible():
    options = dg.BuildOptions(conv_config=mm.MatmulConfig("split_k", 16, 32, 16, 4, 2, split_k=5))
    x_t = torch.randn(2, 3, 15, 14, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w_t = torch.randn(4, 3, 7, 7, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.conv2d(x_t, w_t, stride=2, padding=3)
    dy_t = torch.randn_like(y).contiguous(memory_format=torch.channels_last)
    (expected,) = torch.autograd.grad(y, w_t, dy_t)
    g = graph()
    dy, x = g.tensor_like(dy_t.float(), name="dy"), g.tensor_like(x_t.float(), name="x")
    dw = g.conv_wgrad(dy, x, w_dim=[4, 3, 7, 7], padding=[3, 3], stride=[2, 2], dilation=[1, 1])
    dw.set_output(True).set_name("dw")
    first = check(g, {"dy": dy_t.float(), "x": x_t.float()}, options=options)["dw"]
    assert torch.allclose(first.double(), expected, rtol=1e-4, atol=1e-4)
    assert [l.config_text.split()[0] for l in g.plan.launches] == ["split_k", "split-K"]
    assert _folded(g.plan.launches[0])
    second = check(g, {"dy": dy_t.float(), "x": x_t.float()}, options=options)["dw"]
    assert torch.equal(first, second)


def test_wgrad_folded_prologue_and_epilogue_every_variant(variant):
    """relu_backward on dy at load; scale, a full-size operand of odd strides added (its columns
    decomposed like dw's) and a cast in the epilogue, in the main kernel or the split-K combine."""
    g, dw, inputs = _folded_graph("5x5 groups2 C3")
    dy_t = inputs["dy"]
    y_t, previous_t = stored(list(dy_t.shape), "odd"), stored([4, 3, 5, 5], "odd")
    g2 = graph()
    dy, y, x = g2.tensor_like(dy_t, name="dy"), g2.tensor_like(y_t, name="y"), g2.tensor_like(inputs["x"], name="x")
    previous = g2.tensor_like(previous_t, name="previous")
    dw = g2.conv_wgrad(g2.relu_backward(dy, y), x, w_dim=[4, 3, 5, 5], padding=[2, 1], stride=[2, 1],
                       dilation=[1, 2], groups=2, mode="convolution")
    g2.cast(g2.add(g2.scale(dw, 0.5), previous), data_type=dg.float16).set_output(True).set_name("dw")
    check(g2, {"dy": dy_t, "y": y_t, "x": inputs["x"], "previous": previous_t}, tolerance=1e-3,
          options=forced(variant))
    assert [l.group.kind for l in g2.plan.launches] == ["conv"] * len(g2.plan.launches)
    assert _folded(g2.plan.launches[0])
    assert len(g2.plan.launches) == (2 if variant == "split_k" else 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_wgrad_folded_half_and_full_precision(dtype):
    g, dw, inputs = _folded_graph("stem 7x7/2 C3", dtype)
    dw.set_output(True).set_name("dw")
    check(g, inputs, tolerance=2e-3 if dtype == torch.float16 else None)
    assert _folded(g.plan.launches[0])


@pytest.mark.parametrize("x_dim,w_dim", [([1, 64, 4, 5], [8, 64, 3, 3]), ([2, 3, 6, 5], [4, 3, 1, 1]),
                                         ([1, 32, 5, 4], [4, 32, 3, 1])])
def test_wgrad_keeps_one_gemm_per_tap_for_many_channels_or_one_tap(x_dim, w_dim):
    """C_in 64 and 32 (the per-tap N block is full) and a 1x1 filter (no taps to fold)."""
    x_t = stored(x_dim, "nhwc")
    dy_dim = [x_dim[0], w_dim[0]] + [n - r + 3 for n, r in zip(x_dim[2:], w_dim[2:])]
    dy_t = stored(dy_dim, "nhwc")
    g = graph()
    dy, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(x_t, name="x")
    g.conv_wgrad(dy, x, w_dim=w_dim, padding=[1, 1], stride=[1, 1], dilation=[1, 1]).set_output(True).set_name("dw")
    check(g, {"dy": dy_t, "x": x_t})
    assert not any(_folded(l) or "_folded" in l.source_path.name for l in g.plan.launches)
    assert "one GEMM per filter tap" in g.plan.launches[0].reason


@pytest.mark.parametrize("rank", sorted(RANKS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("groups", [1, 2])
def test_wgrad_per_tap_pose_on_few_channels(rank, layout, groups):
    """The per-tap pose, which the fold now takes over for these shapes, still computes them."""
    options = dg.BuildOptions(conv_fold_channels_below=0)
    g, out, inputs = _wgrad_graph(grouped(RANKS[rank], groups), groups, layout, "convolution")
    out.set_output(True).set_name("out")
    check(g, inputs, options=options)
    assert "one GEMM per filter tap" in g.plan.launches[0].reason


# --- fprop (and dgrad) with few channels per group: the filter taps folded into K ---------------
# the wgrad shapes; the grouped one reads its filters in odd strides (dw's layout there)
FPROP_FOLDED = {**FOLDED, "5x5 groups2 C3": FOLDED["5x5 groups2 C3"][:7] + ("odd", "convolution")}


def _fprop_folded_graph(name, dtype=torch.float32):
    x_dim, w_dim, padding, stride, dilation, groups, x_layout, w_layout, mode = FPROP_FOLDED[name]
    x_t, w_t = stored(x_dim, x_layout, dtype), stored(w_dim, w_layout, dtype)
    g = graph(dg.dtypes.from_torch(dtype))
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.conv_fprop(x, w, padding=padding, stride=stride, dilation=dilation, groups=groups, mode=mode)
    return g, x, y, {"x": x_t, "w": w_t}


def _folded_k(launch) -> bool:
    return "_folded" in launch.source_path.name and "filter taps folded into K" in launch.reason


@pytest.mark.parametrize("name", sorted(FPROP_FOLDED))
def test_fprop_folds_the_taps_of_few_channels(name):
    """C per group 1, 2, 3, 5 with 7x7/2, 5x3 dilated, 3x3x3/2 and 1D filters, groups, both modes,
    NHWC/NCHW/odd strides: one GEMM whose k is (taps, channel), K walked whole."""
    g, _, y, inputs = _fprop_folded_graph(name)
    y.set_output(True).set_name("y")
    check(g, inputs)
    assert len(g.plan.launches) == 1 and _folded_k(g.plan.launches[0])
    source = g.plan.launches[0].source_path.read_text()
    assert "chan = " in source and "valid_a = " in source
    assert _reassigned_in_loops(source) <= _accumulators(source), _reassigned_in_loops(source)


def _assigned(statements) -> set:
    import ast

    return {t.id for s in statements for n in ast.walk(s) if isinstance(n, (ast.Assign, ast.AugAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}


def _reassigned_in_loops(source: str) -> set:
    """Names a kernel assigns before a for loop and again inside it: loop-carried values, which
    Triton requires to keep their type and shape (the interpreter does not check it; the GPU
    compiler refused a remainder `rest` of the [BLOCK_M] row split reused by the k split)."""
    import ast

    carried = set()
    for body in (n.body for n in ast.walk(ast.parse(source)) if hasattr(n, "body") and isinstance(n.body, list)):
        for i, statement in enumerate(body):
            if isinstance(statement, ast.For):
                carried |= _assigned(body[:i]) & _assigned(statement.body)
    return carried


def _accumulators(source: str) -> set:
    """Names made as a filled tile (tl.zeros / tl.full): the loop-carried values meant as such."""
    import re

    return set(re.findall(r"^\s*(\w+) = tl\.(?:zeros|full)\(", source, re.M))


def test_fprop_folded_stem_matches_torch():
    x_t = torch.randn(2, 3, 15, 14, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w_t = torch.randn(6, 3, 7, 7, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    expected = torch.nn.functional.conv2d(x_t, w_t, stride=2, padding=3)
    g = graph()
    x, w = g.tensor_like(x_t.float(), name="x"), g.tensor_like(w_t.float(), name="w")
    g.conv_fprop(x, w, padding=[3, 3], stride=[2, 2], dilation=[1, 1]).set_output(True).set_name("y")
    out = check(g, {"x": x_t.float(), "w": w_t.float()})["y"]
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-4)
    assert _folded_k(g.plan.launches[0])
    assert out.stride() == expected.stride()  # NHWC in, NHWC out


def test_fprop_folded_prologue_and_epilogue_every_variant(variant):
    """A batchnorm scale-bias-relu on x at load (the padding still 0), bias, a residual of odd
    strides, relu and a cast, the pre-activation stored too: K = 75 ragged over the forced 16."""
    inputs = _fprop_folded_graph("5x5 groups2 C3")[3]
    x_t, w_t = inputs["x"], inputs["w"]
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    scale, shift = g.tensor(name="scale", dim=[1, 6, 1, 1]), g.tensor(name="shift", dim=[1, 6, 1, 1])
    act = g.relu(g.add(g.mul(x, scale), shift))
    y = g.conv_fprop(act, w, padding=[2, 1], stride=[2, 1], dilation=[1, 2], groups=2, mode="convolution")
    residual_t = stored(list(y.dim), "odd")
    b, r = g.tensor(name="b", dim=[1, 4, 1, 1]), g.tensor_like(residual_t, name="r")
    pre = g.add(g.add(y, b), r).set_output(True).set_name("pre")
    g.cast(g.relu(pre), data_type=dg.float16).set_output(True).set_name("out")
    check(g, {"x": x_t, "w": w_t, "scale": torch.randn(1, 6, 1, 1), "shift": torch.rand(1, 6, 1, 1) + 1.0,
              "b": torch.randn(1, 4, 1, 1), "r": residual_t}, tolerance=1e-3, options=forced(variant))
    assert [l.group.kind for l in g.plan.launches] == ["conv"] * len(g.plan.launches)
    assert _folded_k(g.plan.launches[0])
    assert len(g.plan.launches) == (2 if variant == "split_k" else 1)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_fprop_folded_with_batchnorm_statistics(variant, layout):
    """conv -> bias -> genstats on the folded stem: the column exits ride on the folded GEMM."""
    x_t, w_t = stored([2, 3, 13, 11], layout), stored([5, 3, 7, 7], layout)
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.add(g.conv_fprop(x, w, padding=[3, 3], stride=[2, 2]), g.tensor(name="b", dim=[1, 5, 1, 1]))
    y.set_output(True).set_name("y")
    total, squares = g.genstats(y)
    total.set_output(True).set_name("sum")
    squares.set_output(True).set_name("sq_sum")
    check(g, {"x": x_t, "w": w_t, "b": torch.randn(1, 5, 1, 1)}, options=forced(variant))
    assert [grp.kind for grp in g.plan.groups] == ["conv"] and _folded_k(g.plan.launches[0])
    assert len(g.plan.launches) == (2 if variant == "split_k" else 1) + 1  # + the column fold


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fprop_folded_half_and_full_precision(dtype):
    g, _, y, inputs = _fprop_folded_graph("stem 7x7/2 C3", dtype)
    y.set_output(True).set_name("y")
    check(g, inputs, dtype=dtype)
    assert _folded_k(g.plan.launches[0])


@pytest.mark.parametrize("x_dim,w_dim", [([1, 64, 4, 5], [8, 64, 3, 3]), ([1, 32, 5, 4], [4, 32, 3, 1]),
                                         ([2, 3, 6, 5], [4, 3, 1, 1])])
def test_fprop_keeps_per_tap_k_for_many_channels_or_one_tap(x_dim, w_dim):
    """C_in 64 and 32 (a per-tap k step is full) and a 1x1 filter (no taps to fold)."""
    x_t, w_t = stored(x_dim, "nhwc"), stored(w_dim, "nhwc")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1]).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t})
    assert not any("_folded" in l.source_path.name for l in g.plan.launches)
    assert "folded" not in g.plan.launches[0].reason


def test_fprop_one_channel_few_filters_runs_depthwise():
    """C_in 1 with at most depthwise MAX_MULTIPLIER filters is a depthwise conv: the direct
    kernels take it before any GEMM pose (folded or not)."""
    x_t, w_t = stored([2, 1, 9, 8], "nhwc"), stored([2, 1, 3, 3], "nchw")
    g = graph()
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[1, 1], stride=[2, 1]).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t})
    assert [l.source_path.name.split("_")[-2] for l in g.plan.launches] == ["depthwise"]


@pytest.mark.parametrize("mode", ["convolution", "cross_correlation"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_dgrad_of_few_filters_folds_its_phases(mode, layout):
    """A transposed conv from 3 channels (dgrad reducing over 3 filters): each stride phase with
    more than one tap folds (taps, filter) into K; against torch.autograd."""
    x_t = torch.randn(2, 5, 13, 11, dtype=torch.float64, requires_grad=True)
    w_t = torch.randn(3, 5, 7, 5, dtype=torch.float64)
    dy_t, expected = conv_autograd(x_t, w_t, mode, x_t, layout, stride=2, padding=(3, 2), dilation=(1, 1))
    g = graph()
    dy, w = g.tensor_like(dy_t.float(), name="dy"), g.tensor_like(w_t.float(), name="w")
    g.conv_dgrad(dy, w, x_dim=[2, 5, 13, 11], padding=[3, 2], stride=[2, 2], dilation=[1, 1],
                 mode=mode).set_output(True).set_name("dx")
    out = check(g, {"dy": dy_t.float(), "w": w_t.float()})["dx"]
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-4)
    assert len(g.plan.launches) == 4 and all(_folded_k(l) for l in g.plan.launches)


def test_dgrad_of_the_stem_keeps_per_tap_k():
    """The stem's dgrad reduces over 64 filters: per-tap k steps are full, nothing folds."""
    g, dx, inputs = _dgrad_graph(dict(x=[1, 3, 9, 8], w=[64, 3, 7, 7], padding=[3, 3], stride=[2, 2],
                                      dilation=[1, 1]), 1, "nhwc")
    dx.set_output(True).set_name("dx")
    check(g, inputs)
    assert not any("folded" in l.reason for l in g.plan.launches)


@pytest.mark.parametrize("rank", sorted(RANKS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "odd"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("op", ["fprop", "dgrad"])
def test_per_tap_k_on_few_channels(op, rank, layout, groups):
    """The per-tap pose, which the fold now takes over for these shapes, still computes them."""
    options = dg.BuildOptions(conv_fold_channels_below=0)
    case = grouped(RANKS[rank], groups)
    if op == "fprop":
        x_t, w_t = stored(case["x"], layout), stored(case["w"], layout)
        g = graph()
        x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
        g.conv_fprop(x, w, groups=groups, **geometry(case)).set_output(True).set_name("out")
        inputs = {"x": x_t, "w": w_t}
    else:
        g, out, inputs = _dgrad_graph(case, groups, layout)
        out.set_output(True).set_name("out")
    check(g, inputs, options=options)
    assert not any("_folded" in l.source_path.name for l in g.plan.launches)
    assert any("one k run per filter tap" in l.reason for l in g.plan.launches)


def test_a_forced_persistent_config_runs_the_implicit_gemm_as_tiled():
    """The implicit GEMM loads through pointers (no descriptors): a persistent config forced for
    it, epilogue knobs and all, runs as the tiled kernel with the same tile, and is right."""
    forced_config = mm.MatmulConfig("persistent", 32, 64, 16, 4, 2, epilogue_subtile=2, tma_store=True)
    g = graph()
    x_t, w_t = stored([2, 8, 6, 7], "nhwc"), stored([24, 8, 3, 3], "nhwc")
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.relu(g.conv_fprop(x, w, padding=[1, 1])).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t}, options=dg.BuildOptions(conv_config=forced_config))
    assert g.plan.launches[0].config_text.startswith("tiled 32x64x16 warps=4 stages=2")


# --- on the GPU: bf16, fp16 and tf32/IEEE fp32 at real tile sizes, ResNet-like layers, TMA -------
LAYERS = {  # x, w, padding, stride, dilation, groups
    "3x3": ([4, 64, 28, 28], [64, 64, 3, 3], [1, 1], [1, 1], [1, 1], 1),
    "3x3s2": ([4, 128, 29, 27], [96, 128, 3, 3], [1, 1], [2, 2], [1, 1], 1),
    "stem": ([2, 3, 67, 61], [64, 3, 7, 7], [3, 3], [2, 2], [1, 1], 1),
    "1x1": ([4, 256, 14, 14], [128, 256, 1, 1], [0, 0], [1, 1], [1, 1], 1),
    "1x1s2": ([4, 256, 14, 14], [512, 256, 1, 1], [0, 0], [2, 2], [1, 1], 1),
    "grouped": ([4, 64, 15, 15], [64, 8, 3, 3], [2, 2], [1, 1], [2, 2], 8),
    "3d": ([2, 32, 7, 12, 12], [32, 32, 3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1),
    "1d": ([4, 64, 301], [96, 64, 5], [2], [1], [1], 1),
}


def _case(name):
    x, w, padding, stride, dilation, groups = LAYERS[name]
    return dict(x=x, w=w, padding=padding, stride=stride, dilation=dilation), groups


def _cuda(inputs):
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_fprop_bias_relu_bf16(name, layout):
    """("stem" (C 3) and "grouped" (C 8 per group) fold the taps into K; the rest not.)"""
    case, groups = _case(name)
    x_t, w_t = stored(case["x"], layout, torch.bfloat16), stored(case["w"], layout, torch.bfloat16)
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    bias = g.tensor(name="b", dim=[1, case["w"][0]] + [1] * (len(case["x"]) - 2))
    g.relu(g.add(g.conv_fprop(x, w, groups=groups, **geometry(case)), bias)).set_output(True).set_name("y")
    inputs = {"x": x_t, "w": w_t, "b": torch.randn(bias.dim).to(torch.bfloat16)}
    check(g, _cuda(inputs), torch.bfloat16, "cuda")
    assert {l.group.kind for l in g.plan.launches} == {"conv"} and len(g.plan.groups) == 1
    folded = ["filter taps folded into K" in l.reason for l in g.plan.launches]
    assert folded == [name in ("stem", "grouped")] * len(folded)


@pytest.mark.gpu
def test_fprop_stem_folded_bf16_with_statistics():
    """The ResNet-50 stem at a real tile size: 7x7/2 over 3 channels, folded K = 147, bias and the
    BatchNorm statistics in the epilogue, NHWC bf16."""
    x_t = stored([8, 3, 224, 224], "nhwc", torch.bfloat16)
    w_t = stored([64, 3, 7, 7], "nhwc", torch.bfloat16)
    g = dg.Graph(name="stem", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.add(g.conv_fprop(x, w, padding=[3, 3], stride=[2, 2], dilation=[1, 1]), g.tensor(name="b", dim=[1, 64, 1, 1]))
    y.set_output(True).set_name("y")
    total, squares = g.genstats(y)
    total.set_output(True).set_name("sum").set_data_type(dg.float32)
    squares.set_output(True).set_name("sq_sum").set_data_type(dg.float32)
    inputs = {"x": x_t, "w": w_t, "b": torch.randn(1, 64, 1, 1).to(torch.bfloat16)}
    check(g, _cuda(inputs), torch.bfloat16, "cuda")
    assert "filter taps folded into K" in g.plan.launches[0].reason


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["3x3", "3x3s2", "grouped", "3d", "1x1s2", "stem"])
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_backward_bf16_against_autograd(name, op):
    """(wgrad of "stem" (C 3) and "grouped" (C 8 per group) folds the taps into N; the rest not.)"""
    case, groups = _case(name)
    x64 = torch.randn(case["x"], dtype=torch.float64, device="cuda", requires_grad=True)
    w64 = torch.randn(case["w"], dtype=torch.float64, device="cuda", requires_grad=True)
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[len(case["x"]) - 3]
    y = conv(x64, w64, groups=groups, **geometry(case))
    dy64 = torch.randn_like(y)
    dx64, dw64 = torch.autograd.grad(y, (x64, w64), dy64)
    channels_last = torch.channels_last if len(case["x"]) == 4 else torch.contiguous_format
    dy_t = dy64.to(torch.bfloat16).contiguous(memory_format=channels_last)
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16)
    dy = g.tensor_like(dy_t, name="dy")
    if op == "dgrad":
        w_t = w64.detach().to(torch.bfloat16)
        w = g.tensor_like(w_t, name="w")
        g.conv_dgrad(dy, w, x_dim=case["x"], groups=groups, **geometry(case)).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "w": w_t}, dx64
    else:
        x_t = x64.detach().to(torch.bfloat16).contiguous(memory_format=channels_last)
        x = g.tensor_like(x_t, name="x")
        g.conv_wgrad(dy, x, w_dim=case["w"], groups=groups, **geometry(case)).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "x": x_t}, dw64
    out = check(g, inputs, torch.bfloat16, "cuda")["out"]
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < 1.6e-2, error


@pytest.mark.gpu
def test_wgrad_split_k_bitwise_reproducible():
    options = dg.BuildOptions(conv_config=mm.MatmulConfig("split_k", 64, 64, 64, 4, 4, split_k=16))
    case, _ = _case("3x3")
    dy_t = stored([4, 64, 28, 28], "nhwc", torch.bfloat16).cuda()
    x_t = stored(case["x"], "nhwc", torch.bfloat16).cuda()
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    dy, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(x_t, name="x")
    g.conv_wgrad(dy, x, w_dim=case["w"], **geometry(case)).set_output(True).set_name("dw")
    g.build(options=options)
    outs = []
    for _ in range(2):
        (handle,) = g.outputs()
        dw = torch.empty_strided(handle.dim, handle.stride, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
        g.execute({"dy": dy_t, "x": x_t, "dw": dw})
        outs.append(dw)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("tf32", [False, True])
def test_fp32_conv_precision(tf32):
    case, _ = _case("3x3")
    x_t, w_t = stored(case["x"], "nhwc").cuda(), stored(case["w"], "nhwc").cuda()
    g = dg.Graph(name="conv", io_data_type=dg.float32, allow_tf32=tf32)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, **geometry(case)).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t}, torch.float32, "cuda", tolerance=2e-3 if tf32 else 2e-5)


@pytest.mark.gpu
def test_pointwise_conv_runs_on_tma():
    x_t = stored([32, 256, 28, 28], "nhwc", torch.bfloat16).cuda()  # inside the sizes Gluon was measured at
    w_t = stored([512, 256, 1, 1], "nhwc", torch.bfloat16).cuda()
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[0, 0]).set_output(True).set_name("y")
    # the Triton backend runs it as its persistent TMA GEMM
    check(g, {"x": x_t, "w": w_t}, torch.bfloat16, "cuda", options=dg.BuildOptions(backends=("triton",)))
    assert g.plan.launches[0].config_text.startswith("persistent")
    if torch.cuda.get_device_capability() == (9, 0):  # a default build on Hopper: Gluon's implicit GEMM
        check(g, {"x": x_t, "w": w_t}, torch.bfloat16, "cuda", options=dg.BuildOptions())
        assert g.plan.launches[0].backend == "gluon"
