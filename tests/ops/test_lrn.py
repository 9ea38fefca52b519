"""Windowed normalization family (LRN, divisive normalization): kernels on CPU (interpreter)
against the float64 reference, the reference against torch, autograd, fusion, validation; GPU."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from dnngraph.fusion import partition
from helpers import check, compiled_for_sm90, rel_err, run

IO_TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}
GEN = torch.Generator().manual_seed(32)
# attributes per op: distinct alpha, beta and k so a swapped pair fails
LRN_ATTRS = dict(alpha=0.3, beta=0.75, k=1.5)
DIV_ATTRS = dict(alpha=0.8, beta=0.6, k=0.4)


def channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with channels innermost in memory (NWC, NHWC, NDHWC)."""
    order = [0] + list(range(2, tensor.dim())) + [1]
    return tensor.permute(order).contiguous().permute([0, tensor.dim() - 1] + list(range(1, tensor.dim() - 1)))


def sample(shape, dtype=torch.float32, layout="nchw") -> torch.Tensor:
    """Fresh random values (never zeros) in the requested layout."""
    value = (torch.randn(shape, generator=GEN) + 0.1).to(dtype)
    return channels_last(value) if layout == "nhwc" else value


def forward_graph(op, x_value, size, means_value=None, **attrs):
    g = dg.Graph(io_data_type=IO_TYPES[x_value.dtype])
    x = g.tensor_like(x_value, "x")
    inputs = {x: x_value}
    if op == "lrn":
        y = g.lrn(x, size=size, **attrs)
    else:
        means = None
        if means_value is not None:
            means = g.tensor_like(means_value, "means")
            inputs[means] = means_value
        y = g.divisive_normalization(x, size=size, means=means, **attrs)
    y.set_output(True)
    return g, inputs, y


def backward_graph(op, x_value, dy_value, size, means_value=None, **attrs):
    g = dg.Graph(io_data_type=IO_TYPES[x_value.dtype])
    x, dy = g.tensor_like(x_value, "x"), g.tensor_like(dy_value, "dy")
    inputs = {x: x_value, dy: dy_value}
    if op == "lrn":
        dx = g.lrn_backward(dy, x, size=size, **attrs)
    else:
        means = None
        if means_value is not None:
            means = g.tensor_like(means_value, "means")
            inputs[means] = means_value
        dx = g.divisive_normalization_backward(dy, x, size=size, means=means, **attrs)
    dx.set_output(True)
    return g, inputs, dx


# --- the reference is torch's local_response_norm ------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(2, 7, 5), (2, 3, 4, 5), (1, 6, 2, 3, 4), (2, 1, 3, 3)])
def test_reference_is_torchs_local_response_norm(shape, size):
    x_t = sample(shape).double()
    g, inputs, y = forward_graph("lrn", x_t.float(), size, **LRN_ATTRS)
    ref = g.reference({"x": x_t})[y.name]
    expected = F.local_response_norm(x_t, size, **LRN_ATTRS)
    assert torch.allclose(ref, expected, rtol=1e-12, atol=1e-12)


def test_divisive_reference_by_hand():
    """One element by the formula: c / (k + alpha / size^2 * sum of c^2 over the 3x3 window)^beta."""
    x_t, m_t = sample((1, 2, 4, 5)).double(), sample((1, 2, 1, 1)).double()
    g, inputs, y = forward_graph("div", x_t.float(), 3, m_t.float(), **DIV_ATTRS)
    ref = g.reference({"x": x_t, "means": m_t})[y.name]
    c = x_t - m_t
    for h, w in [(0, 0), (2, 3), (3, 4)]:
        window = c[0, 1, max(h - 1, 0):h + 2, max(w - 1, 0):w + 2]
        scale = DIV_ATTRS["k"] + DIV_ATTRS["alpha"] / 9 * (window ** 2).sum()
        assert math.isclose(ref[0, 1, h, w].item(), (c[0, 1, h, w] / scale ** DIV_ATTRS["beta"]).item(), rel_tol=1e-12)


# --- kernels against the reference ---------------------------------------------------------------
# (shape, size): C = 1, C < size, size 1, even sizes, odd extents, every rank
LRN_CASES = [((2, 7, 5, 6), 5), ((2, 7, 5, 6), 4), ((2, 1, 3, 5), 3), ((3, 3, 5), 5), ((1, 5, 3, 2, 3), 2),
             ((2, 6, 3, 3), 1), ((2, 4, 3, 3), 8)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape,size", LRN_CASES)
def test_lrn_forward_and_backward(shape, size, layout):
    x_t, dy_t = sample(shape, layout=layout), sample(shape, layout=layout)
    check(*forward_graph("lrn", x_t, size, **LRN_ATTRS)[:2])
    check(*backward_graph("lrn", x_t, dy_t, size, **LRN_ATTRS)[:2])


# (shape, size, means dims or None)
DIV_CASES = [((2, 3, 5, 6), 3, (1, 3, 1, 1)), ((2, 3, 5, 6), 2, None), ((1, 2, 7), 5, (1, 2, 7)),
             ((1, 2, 3, 4, 3), 2, (1, 2, 3, 4, 3)), ((2, 1, 4, 5), 1, (2, 1, 4, 5)), ((1, 2, 2, 3), 5, (1, 1, 1, 1)),
             ((1, 1, 3, 3, 4), 3, None)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape,size,means_dims", DIV_CASES)
def test_divisive_forward_and_backward(shape, size, means_dims, layout):
    x_t, dy_t = sample(shape, layout=layout), sample(shape, layout=layout)
    m_t = None if means_dims is None else sample(means_dims)
    check(*forward_graph("div", x_t, size, m_t, **DIV_ATTRS)[:2])
    check(*backward_graph("div", x_t, dy_t, size, m_t, **DIV_ATTRS)[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["lrn", "div"])
def test_narrow_types(op, dtype):
    shape = (2, 6, 5, 3)
    x_t, dy_t = sample(shape, dtype, "nhwc"), sample(shape, dtype)
    m_t = sample((1, 6, 1, 1), dtype) if op == "div" else None
    check(*forward_graph(op, x_t, 3, m_t, **LRN_ATTRS)[:2], dtype=dtype)
    check(*backward_graph(op, x_t, dy_t, 3, m_t, **LRN_ATTRS)[:2], dtype=dtype)


@pytest.mark.parametrize("op", ["lrn", "div"])
def test_strided_and_broadcast_inputs(op):
    """A sliced x (odd strides), a dy broadcast along H (stride 0), means broadcast as [1, C, 1, 1]."""
    x_t = sample((2, 10, 5, 7))[:, 1::2, :, 1:6]
    dy_t = sample((2, 5, 1, 5)).expand(2, 5, 5, 5)
    m_t = sample((1, 5, 1, 1)) if op == "div" else None
    assert not x_t.is_contiguous() and dy_t.stride(2) == 0
    check(*forward_graph(op, x_t, 3, m_t, **LRN_ATTRS)[:2])
    check(*backward_graph(op, x_t, dy_t, 3, m_t, **LRN_ATTRS)[:2])


@pytest.mark.parametrize("beta", [0.0, -0.5, 2.0])
def test_beta_zero_negative_and_integral(beta):
    x_t, dy_t = sample((2, 5, 3, 4)), sample((2, 5, 3, 4))
    attrs = dict(alpha=0.5, beta=beta, k=1.0)
    check(*forward_graph("lrn", x_t, 3, **attrs)[:2])
    check(*backward_graph("lrn", x_t, dy_t, 3, **attrs)[:2])


@pytest.mark.parametrize("beta", [0.75, 0.0])
@pytest.mark.parametrize("op", ["lrn", "div"])
def test_nan_and_infinity_spread_through_their_windows_as_in_torch(op, beta):
    """Special values in x and dy; beta 0 too, where torch's pow backward gives the scale an
    exact zero gradient (an infinite dy passes through as it is, an infinite x gives NaN)."""
    attrs = dict(LRN_ATTRS, beta=beta)
    x_t = sample((1, 6, 4, 5))
    x_t[0, 2, 1, 1] = float("nan")
    x_t[0, 4, 3, 0] = float("inf")
    x_t[0, 0, 0, 4] = float("-inf")
    m_t = sample((1, 6, 1, 1)) if op == "div" else None
    # check() requires NaN exactly where the float64 reference has NaN, and equal infinities
    y = next(iter(check(*forward_graph(op, x_t, 3, m_t, **attrs)[:2]).values()))
    assert torch.isnan(y[0, 2, 1, 1]) and torch.isfinite(y[0, 5, 0, 2])
    dy_t = sample((1, 6, 4, 5))
    dy_t[0, 1, 2, 2] = float("inf")
    dy_t[0, 5, 3, 3] = float("nan")
    check(*backward_graph(op, x_t, dy_t, 3, m_t, **attrs)[:2])


# backward bodies past codegen/lrn.py's BODY_TERMS_MAX: runtime loops walk the covering centres
# of the last windowed axes (LRN size 17: its channels; 5x5: the columns; 3x3x3: the last axis)
ROLLED_CASES = [("lrn", (1, 19, 3, 3), 17), ("div", (1, 2, 6, 7), 5), ("div", (1, 2, 4, 3, 5), 3)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op,shape,size", ROLLED_CASES)
def test_backward_past_the_body_budget_loops_over_covering_centres(op, shape, size, layout):
    """NaN and infinities in x and dy reach the same elements through the loops as through the
    straight-line body; the forward stays straight-line."""
    x_t, dy_t = sample(shape, layout=layout), sample(shape, layout=layout)
    x_t[(0, 1) + (1,) * (len(shape) - 2)] = float("nan")
    x_t[(0, 0) + (2,) * (len(shape) - 2)] = float("inf")
    dy_t[(-1, -1) + (0,) * (len(shape) - 2)] = float("inf")
    m_t = sample((1, shape[1]) + (1,) * (len(shape) - 2)) if op == "div" else None
    g, inputs = forward_graph(op, x_t, size, m_t, **LRN_ATTRS)[:2]
    check(g, inputs)
    assert "tl.range(" not in g.plan.launches[-1].source_path.read_text()
    g, inputs = backward_graph(op, x_t, dy_t, size, m_t, **LRN_ATTRS)[:2]
    check(g, inputs)
    assert "_roll in tl.range(" in g.plan.launches[-1].source_path.read_text()


def test_rolled_backward_ignores_covering_positions_outside_x_where_their_scale_is_zero():
    """k = 0 and zeros along a border: the loops' centres outside x (S = 0) add nothing."""
    x_t, dy_t = sample((1, 2, 6, 7)), sample((1, 2, 6, 7))
    x_t[:, :, :, :2] = 0.0
    g, inputs = backward_graph("div", x_t, dy_t, 5, alpha=1.0, beta=0.75, k=0.0)[:2]
    dx = next(iter(check(g, inputs).values()))
    assert torch.isfinite(dx[0, 0, 3, 0])
    assert "_roll in tl.range(" in g.plan.launches[-1].source_path.read_text()


def test_zero_k_and_zero_input_give_torchs_nan():
    """k = 0 and a window of zeros: 0 / 0 in torch and in the kernel alike."""
    x_t = sample((1, 4, 2, 3))
    x_t[0, :, 0, 0] = 0.0
    check(*forward_graph("lrn", x_t, 5, alpha=1.0, beta=0.75, k=0.0)[:2])


@pytest.mark.parametrize("op", ["lrn", "div"])
def test_backward_ignores_covering_positions_outside_x_even_where_their_scale_is_zero(op):
    """k = 0 and zeros at the border: a window centred outside x sums only zeros (S = 0), which
    must add nothing to dx (0 / 0 would), while every S inside x stays positive."""
    x_t, dy_t = sample((1, 3, 3, 3)), sample((1, 3, 3, 3))
    x_t[:, 0] = 0.0
    x_t[:, :, 0] = 0.0
    x_t[:, :, :, 0] = 0.0
    attrs = dict(alpha=1.0, beta=0.75, k=0.0)
    outputs = check(*backward_graph(op, x_t, dy_t, 3, **attrs)[:2])
    # a zero element next to a window centred outside x (channel -1; row and column -1)
    probe = (0, 0, 1, 1) if op == "lrn" else (0, 1, 0, 0)
    assert torch.isfinite(next(iter(outputs.values()))[probe])


@pytest.mark.parametrize("op", ["lrn", "div"])
def test_size_one_axes(op):
    """Every axis of extent 1 (dnngraph has no size-0 axes: dims are positive)."""
    x_t, dy_t = sample((1, 1, 1, 1)), sample((1, 1, 1, 1))
    check(*forward_graph(op, x_t, 3, **LRN_ATTRS)[:2])
    check(*backward_graph(op, x_t, dy_t, 2, **LRN_ATTRS)[:2])


# --- fusion --------------------------------------------------------------------------------------
def test_pointwise_producer_and_consumer_fuse_into_the_lrn_kernel():
    x_t, b_t = sample((2, 7, 3, 4)), sample((1, 7, 1, 1))
    g = dg.Graph(io_data_type=dg.float32)
    x, b = g.tensor_like(x_t, "x"), g.tensor_like(b_t, "b")
    y = g.add(g.lrn(g.relu(g.scale(x, 2.0)), 5, **LRN_ATTRS), b).set_output(True)
    groups = partition(g)
    assert [(gr.kind, [n.op for n in gr.nodes]) for gr in groups] == [("lrn", ["scale", "relu", "lrn", "add"])]
    check(g, {x: x_t, b: b_t})
    assert y.name in run(g, {x: x_t, b: b_t})


def test_prologue_value_that_is_an_output_is_stored_once_exactly():
    """A producer's value read several times by the window, and also a graph output."""
    x_t = sample((2, 5, 3, 3))
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor_like(x_t, "x")
    h = g.exp(x).set_output(True)
    g.lrn(h, 3, **LRN_ATTRS).set_output(True)
    dy = g.tensor_like(x_t, "dy")
    g.lrn_backward(g.neg(dy), h, 3, **LRN_ATTRS).set_output(True)
    check(g, {x: x_t, dy: sample((2, 5, 3, 3))})


def test_prologue_that_is_nonzero_at_zero_still_pads_with_zeros():
    """exp(0) = 1: positions outside x must count as zeros after the prologue, as torch pads."""
    x_t = sample((1, 3, 2, 2))
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor_like(x_t, "x")
    g.divisive_normalization(g.exp(x), 3, **DIV_ATTRS).set_output(True)
    check(g, {x: x_t})


def test_local_contrast_normalization_chains_a_mean_and_the_divisive_kernel():
    x_t = sample((2, 3, 6, 5), layout="nhwc")
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor_like(x_t, "x")
    y = g.local_contrast_normalization(x, 3, **DIV_ATTRS).set_output(True)
    outputs = check(g, {x: x_t})
    means = F.avg_pool2d(x_t.double(), 3, 1, 1, count_include_pad=False)
    c = x_t.double() - means
    scale = DIV_ATTRS["k"] + DIV_ATTRS["alpha"] / 9 * F.avg_pool2d(c * c, 3, 1, 1, count_include_pad=True) * 9
    assert rel_err(outputs[y.name], c / scale ** DIV_ATTRS["beta"]) < 1e-5
    with pytest.raises(dg.ValidationError):
        g.local_contrast_normalization(x, 4)
    with pytest.raises(dg.ValidationError, match="floating"):  # the mean's pooling would take it
        g.local_contrast_normalization(g.tensor(name="i", dim=[2, 3, 6, 5], data_type=dg.int32), 3)
    with pytest.raises(dg.ValidationError, match="alpha"):
        g.local_contrast_normalization(x, 3, alpha=-1.0)
    assert [n.op for n in g.nodes] == ["pooling", "divisive_normalization"]


# --- autograd ------------------------------------------------------------------------------------
def _autograd_check(g, inputs: dict, tolerance=5e-5):
    fn = g.as_function()
    args = [inputs[t.name].clone().requires_grad_(True) for t in fn.inputs]
    out = fn(*args)
    dy = torch.randn(out.shape, generator=GEN)
    out.backward(dy)
    leaves = {n: v.double().requires_grad_(True) for n, v in inputs.items()}
    with torch.enable_grad():
        ref = g.reference(leaves)[fn.outputs[0].name]
        grads = torch.autograd.grad(ref, [leaves[t.name] for t in fn.inputs], dy.double())
    assert rel_err(out, ref) < tolerance
    for tensor, arg, grad in zip(fn.inputs, args, grads):
        assert rel_err(arg.grad, grad) < tolerance, tensor.name


def test_lrn_autograd_against_torch():
    x_t = sample((2, 6, 3, 4))
    g = dg.Graph(io_data_type=dg.float32)
    g.lrn(g.tanh(g.tensor_like(x_t, "x")), 4, **LRN_ATTRS).set_output(True)
    _autograd_check(g, {"x": x_t})
    # and against torch's own module, independently of the reference
    leaf = x_t.double().requires_grad_(True)
    expected = F.local_response_norm(torch.tanh(leaf), 4, **LRN_ATTRS)
    args = x_t.clone().requires_grad_(True)
    out = g.as_function()(args)
    dy = torch.randn(out.shape, generator=GEN)
    out.backward(dy)
    expected.backward(dy.double())
    assert rel_err(out, expected) < 5e-5 and rel_err(args.grad, leaf.grad) < 5e-5


def test_divisive_autograd_gives_the_means_their_gradient():
    x_t, m_t = sample((2, 3, 4, 5)), sample((1, 3, 1, 5))
    g = dg.Graph(io_data_type=dg.float32)
    x, m = g.tensor_like(x_t, "x"), g.tensor_like(m_t, "means")
    g.divisive_normalization(x, 3, means=m, **DIV_ATTRS).set_output(True)
    _autograd_check(g, {"x": x_t, "means": m_t})


def test_local_contrast_normalization_autograd():
    x_t = sample((1, 2, 5, 4))
    g = dg.Graph(io_data_type=dg.float32)
    g.local_contrast_normalization(g.tensor_like(x_t, "x"), 3, **DIV_ATTRS).set_output(True)
    _autograd_check(g, {"x": x_t})


# --- serialization -------------------------------------------------------------------------------
def test_json_round_trip_runs_the_same():
    x_t = sample((2, 5, 3, 3))
    g, inputs, y = forward_graph("lrn", x_t, 4, **LRN_ATTRS)
    g2 = dg.Graph.from_json(g.to_json())
    expected = run(g, inputs)[y.name]
    assert torch.equal(run(g2, {"x": x_t})[y.name], expected)


# --- validation ----------------------------------------------------------------------------------
BAD_ATTRS = [dict(size=0), dict(size=-1), dict(size=True), dict(size=2.0), dict(size=3, alpha=-0.1),
             dict(size=3, k=-1.0), dict(size=3, k=float("nan")), dict(size=3, beta=float("inf")),
             dict(size=3, alpha="1")]


@pytest.mark.parametrize("attrs", BAD_ATTRS)
@pytest.mark.parametrize("op", ["lrn", "lrn_backward", "divisive_normalization", "divisive_normalization_backward"])
def test_bad_attributes_raise_and_leave_the_graph_unchanged(op, attrs):
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[2, 3, 4, 4])
    args = [x] if not op.endswith("_backward") else [g.tensor(name="dy", dim=[2, 3, 4, 4]), x]
    before = g.to_json()
    with pytest.raises(dg.ValidationError):
        getattr(g, op)(*args, **attrs)
    assert g.to_json() == before


@pytest.mark.parametrize("dims", [[4, 4], [3], [1, 2, 2, 2, 2, 2]])
def test_wrong_ranks_raise(dims):
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=dims)
    with pytest.raises(dg.ValidationError, match="rank"):
        g.lrn(x, 3)
    with pytest.raises(dg.ValidationError, match="rank"):
        g.divisive_normalization(x, 3)


def test_bad_operands_raise():
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[2, 3, 4, 4])
    with pytest.raises(dg.ValidationError, match="floating"):
        g.lrn(g.tensor(name="i", dim=[2, 3, 4, 4], data_type=dg.int32), 3)
    with pytest.raises(dg.ValidationError, match="dy"):
        g.lrn_backward(g.tensor(name="dy", dim=[2, 3, 4, 1]), x, 3)
    with pytest.raises(dg.ValidationError):
        g.divisive_normalization(x, 3, means=g.tensor(name="m", dim=[1, 2, 1, 1]))
    with pytest.raises(dg.ValidationError):  # means may broadcast to x, not x to means
        g.divisive_normalization(g.tensor(name="x1", dim=[1, 3, 4, 4]), 3, means=g.tensor(name="m1", dim=[2, 3, 4, 4]))


def test_window_too_large_to_unroll_is_unsupported_at_build():
    g = dg.Graph(io_data_type=dg.float32)
    x, dy = g.tensor(name="x", dim=[1, 2, 9, 9]), g.tensor(name="dy", dim=[1, 2, 9, 9])
    g.divisive_normalization_backward(dy, x, 12).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="unrolled"):
        g.build()


# --- GPU -----------------------------------------------------------------------------------------
GPU_SHAPES = [((32, 96, 55, 55), 5), ((32, 256, 27, 27), 5), ((8, 64, 56, 56), 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape,size", GPU_SHAPES)
def test_gpu_lrn_bf16_at_alexnet_sizes(shape, size, layout):
    x_t = sample(shape, torch.bfloat16, layout).cuda()
    dy_t = sample(shape, torch.bfloat16, layout).cuda()
    g, inputs, y = forward_graph("lrn", x_t, size, alpha=1e-4, beta=0.75, k=2.0)
    check(g, inputs, torch.bfloat16, device="cuda")
    g, inputs, dx = backward_graph("lrn", x_t, dy_t, size, alpha=1e-4, beta=0.75, k=2.0)
    check(g, inputs, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_divisive_and_lcn(dtype):
    x_t = sample((16, 32, 64, 64), dtype, "nhwc").cuda()
    dy_t = sample((16, 32, 64, 64), dtype, "nhwc").cuda()
    m_t = sample((1, 32, 1, 1), dtype).cuda()
    on_gpu = dict(dtype=dtype, device="cuda", reference_device="cuda")  # 2M-element float64 references
    check(*forward_graph("div", x_t, 5, m_t, **DIV_ATTRS)[:2], **on_gpu)
    check(*backward_graph("div", x_t, dy_t, 5, m_t, **DIV_ATTRS)[:2], **on_gpu)
    g = dg.Graph(io_data_type=IO_TYPES[dtype])
    x = g.tensor_like(x_t, "x")
    g.local_contrast_normalization(x, 3, **DIV_ATTRS).set_output(True)
    check(g, {x: x_t}, **on_gpu)


@pytest.mark.gpu
def test_gpu_lrn_autograd_and_torch_compile():
    x_t = sample((8, 64, 27, 27)).cuda()
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.LocalResponseNorm(5, 1e-4, 0.75, 2.0)).cuda()
    compiled = torch.compile(model, backend="dnngraph")
    leaf, ref_leaf = x_t.clone().requires_grad_(True), x_t.double().requires_grad_(True)
    out, expected = compiled(leaf), model.double()(ref_leaf)
    dy = torch.randn_like(out)
    out.backward(dy)
    expected.backward(dy.double())
    assert rel_err(out, expected) < 1e-4 and rel_err(leaf.grad, ref_leaf.grad) < 1e-4


@pytest.mark.parametrize("size,axes,backward", [(size, axes, backward) for size in range(1, 12)
                                                for axes in ((1,), (2, 3), (2, 3, 4)) for backward in (False, True)])
def test_schedules_take_power_of_two_warps_and_tiles(size, axes, backward):
    """Every config the windowed kernel may take has power-of-two warps and tile sides (Triton
    needs them), whatever the window's live values make of the per-thread cap."""
    from dnngraph.backends.triton.heuristics.lrn import MAX_WINDOW_TERMS, schedule, window_terms
    from dnngraph.fusion import partition
    from dnngraph.target import H200
    if window_terms(size, axes, backward) > MAX_WINDOW_TERMS:
        return
    dims = [4, 96, 9, 9, 9][:2 + len(axes) if axes != (1,) else 4]
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=dims)
    op = "lrn" if axes == (1,) else "divisive_normalization"
    if backward:
        getattr(g, op + "_backward")(g.tensor(name="dy", dim=dims), x, size).set_output(True)
    else:
        getattr(g, op)(x, size).set_output(True)
    (group,) = partition(g)
    config = schedule(group, H200, axes).config
    for value in (config.num_warps, config.block_rows, config.block_cols):
        assert value & (value - 1) == 0, config


def sm90_graphs():
    """Built graphs of every kernel form for the sm_90 compile check: LRN forward and backward
    (NCHW and NHWC, a prologue and an epilogue, beta 0), divisive forward and backward with
    broadcast means (2D 5x5, 3D), bf16."""
    forms = [("lrn", (8, 96, 13, 13), 5, "nchw", 0.75), ("lrn", (8, 96, 13, 13), 4, "nhwc", 0.75),
             ("lrn", (2, 16, 7, 7), 3, "nchw", 0.0), ("div", (4, 32, 16, 16), 5, "nhwc", 0.5),
             ("div", (2, 8, 6, 6, 6), 3, "nchw", 0.5)]
    for op, shape, size, layout, beta in forms:
        x_t = sample(shape, torch.bfloat16, layout)
        m_t = sample((1, shape[1]) + (1,) * (len(shape) - 2), torch.bfloat16) if op == "div" else None
        attrs = dict(alpha=1e-2, beta=beta, k=2.0)
        g, _, y = forward_graph(op, x_t, size, m_t, **attrs)
        g.relu(y).set_output(True)
        g.build()
        yield f"{op} forward size {size} {layout} beta {beta}", g
        g, _, _ = backward_graph(op, x_t, x_t, size, m_t, **attrs)
        g.build()
        yield f"{op} backward size {size} {layout} beta {beta}", g


def test_kernels_compile_for_sm90():
    """The interpreter skips Triton's type checks: compile every kernel form for sm_90 in a
    process without the interpreter."""
    assert "compiled 10 kernels for sm_90" in compiled_for_sm90("test_lrn:sm90_graphs", timeout=600)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_tile_walks_the_window_axis_innermost(layout):
    """A tile's neighbouring rows (or its columns, NHWC) are neighbours along the channel window,
    so the window's shifted loads fall on lines the tile itself loads."""
    from dnngraph.backends.triton.heuristics.lrn import schedule
    from dnngraph.target import H200
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor_like(sample((8, 96, 27, 27), torch.bfloat16, layout), "x")
    g.lrn(x, 5).set_output(True)
    (group,) = partition(g)
    sched = schedule(group, H200, (1,))
    assert (sched.vector_axis, sched.row_axes) == ((3, (0, 2, 1)) if layout == "nchw" else (1, (0, 2, 3)))
