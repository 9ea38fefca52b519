"""Windowed normalization family (LRN, divisive normalization): kernels on CPU (interpreter)
against the float64 reference, the reference against torch, autograd, fusion, validation; GPU."""
import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from dnngraph.fusion import partition
from helpers import check, compiled_for_sm90, rel_err, run
from dnngraph.backends.triton.heuristics.pointwise import pow2_at_least

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


# wide windows, every rank: each program loads x and dy once over its halo tile and forms the
# window sums by shifted copies in registers (tl.gather), however wide the window
WIDE_CASES = [("lrn", (1, 19, 3, 3), 17), ("div", (1, 2, 6, 7), 5), ("div", (1, 2, 4, 3, 5), 3)]


def launched_source(g) -> str:
    return g.plan.launches[-1].source_path.read_text()


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op,shape,size", WIDE_CASES)
def test_wide_windows_load_each_operand_once(op, shape, size, layout):
    """NaN and infinities in x and dy reach the same elements as in torch; the source holds
    one load per operand (x, means, dy) whatever the window: no load per window offset."""
    x_t, dy_t = sample(shape, layout=layout), sample(shape, layout=layout)
    x_t[(0, 1) + (1,) * (len(shape) - 2)] = float("nan")
    x_t[(0, 0) + (2,) * (len(shape) - 2)] = float("inf")
    dy_t[(-1, -1) + (0,) * (len(shape) - 2)] = float("inf")
    m_t = sample((1, shape[1]) + (1,) * (len(shape) - 2)) if op == "div" else None
    operands = 1 + (m_t is not None)
    g, inputs = forward_graph(op, x_t, size, m_t, **LRN_ATTRS)[:2]
    check(g, inputs)
    source = launched_source(g)
    assert source.count("tl.load(") == operands and "tl.gather(" in source
    g, inputs = backward_graph(op, x_t, dy_t, size, m_t, **LRN_ATTRS)[:2]
    check(g, inputs)
    assert launched_source(g).count("tl.load(") == operands + 1


def test_covering_positions_outside_x_add_nothing_where_their_scale_is_zero():
    """k = 0 and zeros along a border: the 5x5 window's centres outside x (S = 0) add nothing."""
    x_t, dy_t = sample((1, 2, 6, 7)), sample((1, 2, 6, 7))
    x_t[:, :, :, :2] = 0.0
    g, inputs = backward_graph("div", x_t, dy_t, 5, alpha=1.0, beta=0.75, k=0.0)[:2]
    dx = next(iter(check(g, inputs).values()))
    assert torch.isfinite(dx[0, 0, 3, 0])


# small tiles force several programs along every windowed axis: the seams between their halos.
# (op, shape, size, most tile elements): C not a multiple of the owned chunk, C < size, even
# and odd sizes, spatial extents that several tiles cover unevenly
SEAM_CASES = [("lrn", (2, 37, 3, 2), 5, 32), ("lrn", (1, 23, 2, 3), 4, 16), ("lrn", (2, 3, 2, 2), 7, 16),
              ("lrn", (1, 45, 3), 9, 32), ("div", (1, 2, 19, 13), 3, 64), ("div", (2, 3, 11, 10), 4, 128),
              ("div", (1, 2, 13, 11), 5, 256), ("div", (1, 1, 5, 6, 7), 3, 512), ("div", (2, 2, 37), 6, 16)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op,shape,size,tile", SEAM_CASES)
def test_halo_seams_between_programs(op, shape, size, tile, layout):
    options = dg.BuildOptions(lrn_tile_elements=tile)
    x_t, dy_t = sample(shape, layout=layout), sample(shape, layout=layout)
    m_t = sample((1, shape[1]) + (1,) * (len(shape) - 2)) if op == "div" else None
    for g, inputs in (forward_graph(op, x_t, size, m_t, **LRN_ATTRS)[:2],
                      backward_graph(op, x_t, dy_t, size, m_t, **LRN_ATTRS)[:2]):
        check(g, inputs, options=options)
        tiles = re.search(r"tiles=([0-9x]+)", g.plan.launches[-1].config_text).group(1)
        before, after = size // 2, (size - 1) // 2
        halo = (2 if g.nodes[-1].op.endswith("_backward") else 1) * (before + after)
        extents = [shape[1]] if op == "lrn" else shape[2:]
        if math.prod(pow2_at_least(e + halo) for e in extents) > tile:  # no one tile holds the window axes
            assert max(int(t) for t in tiles.split("x")) > 1, tiles


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op", ["lrn", "div"])
def test_large_dynamic_range_keeps_every_window_sum_accurate(op, layout):
    """Squares of 1e3 beside squares of 1e-2: a window sum formed as a difference of running
    sums would lose the small windows past the large values to fp32 cancellation (an absolute
    error of eps * 1e7 against sums of 1e-4). With k tiny, y and dx depend on those sums
    directly: each element far from the large values must match float64 (the forward to its
    own magnitude; dx, a difference of two terms, to the magnitude of that region), not only
    the whole tile's norm, which the large values dominate."""
    shape = (1, 64, 3, 3) if op == "lrn" else (1, 2, 24, 24)
    x_t = sample(shape) * 1e-2
    big = (slice(None), slice(0, 10)) if op == "lrn" else (slice(None), slice(None), slice(0, 5))
    x_t[big] *= 1e5
    x_t, dy_t = (channels_last(x_t), sample(shape, layout=layout)) if layout == "nhwc" else (x_t, sample(shape))
    far = (slice(None), slice(30, None)) if op == "lrn" else (slice(None), slice(None), slice(15, None))
    attrs = dict(alpha=1.0, beta=0.75, k=1e-12)
    for g, inputs in (forward_graph(op, x_t, 5, **attrs)[:2], backward_graph(op, x_t, dy_t, 5, **attrs)[:2]):
        out = next(iter(check(g, inputs).values())).double()[far]
        ref = next(iter(g.reference({k: v.double() for k, v in inputs.items()}).values()))[far]
        scale = ref.abs() if g.nodes[-1].op in ("lrn", "divisive_normalization") else ref.abs().max()
        assert ((out - ref).abs() / scale).max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["lrn", "div"])
def test_narrow_types_across_seams_with_sliced_inputs(op, dtype):
    """Narrow storage, x sliced (odd strides) and dy in the other layout, several tiles along
    the window axes: every program converts at load and rounds once at its owned stores."""
    shape, size = ((2, 21, 3, 4), 5) if op == "lrn" else ((1, 2, 13, 11), 3)
    big = sample((shape[0], shape[1] * 2, shape[2], shape[3] + 2), dtype)
    x_t = big[:, ::2, :, 1:-1]
    dy_t = sample(shape, dtype, "nhwc")
    assert not x_t.is_contiguous()
    m_t = sample((1, shape[1], 1, 1), dtype) if op == "div" else None
    options = dg.BuildOptions(lrn_tile_elements=64)
    check(*forward_graph(op, x_t, size, m_t, **LRN_ATTRS)[:2], dtype=dtype, options=options)
    check(*backward_graph(op, x_t, dy_t, size, m_t, **LRN_ATTRS)[:2], dtype=dtype, options=options)


@pytest.mark.parametrize("op", ["lrn", "div"])
def test_a_refused_binding_writes_nothing(op):
    """dy bound with the wrong dtype: a typed ExecutionError before any launch, dx untouched."""
    x_t, dy_t = sample((2, 6, 4, 5)), sample((2, 6, 4, 5))
    g, inputs, dx = backward_graph(op, x_t, dy_t, 3, **LRN_ATTRS)
    g.build()
    out = torch.full((2, 6, 4, 5), float("nan"))
    with pytest.raises(dg.ExecutionError):
        g.execute({"x": x_t, "dy": dy_t.double(), dx: out})
    assert torch.isnan(out).all()


def test_loaded_positions_count_each_programs_clipped_halo():
    """The model's halo re-reads against a count position by position."""
    from dnngraph.backends.triton.heuristics.lrn import loaded_positions
    for extent, block, before, after in itertools.product(range(1, 40), (4, 8, 16, 32), range(6), range(6)):
        owned = block - before - after
        if owned < 1:
            continue
        starts = [tile * owned - before for tile in range(-(-extent // owned))]
        expected = sum(len(set(range(start, start + block)) & set(range(extent))) for start in starts)
        assert loaded_positions(extent, block, owned, before) == expected, (extent, block, before, after)


def test_box_plans_sum_exactly_their_window():
    """Every window offset range up to 70 wide: the plan's doublings and pieces add each
    offset exactly once (integers, so any double count shows), with few shifts."""
    from dnngraph.backends.triton.heuristics.lrn import box_plan
    values = torch.randint(-1000, 1000, (200,), generator=GEN, dtype=torch.int64)
    padded = torch.cat([torch.zeros(100, dtype=torch.int64), values, torch.zeros(100, dtype=torch.int64)])

    def shift(tensor, offset):  # each lane reads the one `offset` after it, zero past the ends
        out = torch.zeros_like(tensor)
        if offset >= 0:
            out[:len(tensor) - offset] = tensor[offset:]
        else:
            out[-offset:] = tensor[:offset]
        return out

    for size in range(1, 71):
        for lo, hi in ((-(size // 2), (size - 1) // 2), (-((size - 1) // 2), size // 2), (-size + 1, 0)):
            plan = box_plan(lo, hi)
            powers = [padded]
            for level, sign in enumerate(plan.doublings):
                powers.append(powers[-1] + shift(powers[-1], sign * (1 << level)))
            total = sum(shift(powers[e], s) for e, s in plan.pieces)
            expected = sum(shift(padded, t) for t in range(lo, hi + 1))
            assert torch.equal(total, expected), (lo, hi, plan)
            assert plan.gathers <= 2 * size.bit_length(), (size, plan)


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


def test_window_whose_halo_tile_is_too_large_is_unsupported_at_build():
    g = dg.Graph(io_data_type=dg.float32)
    x, dy = g.tensor(name="x", dim=[1, 2, 9, 9, 9]), g.tensor(name="dy", dim=[1, 2, 9, 9, 9])
    g.divisive_normalization_backward(dy, x, 12).set_output(True)
    before = g.to_json()
    with pytest.raises(dg.UnsupportedError, match="too large"):
        g.build()
    assert g.to_json() == before and g.plan is None


# --- GPU -----------------------------------------------------------------------------------------
GPU_SHAPES = [((32, 96, 55, 55), 5), ((32, 256, 27, 27), 5), ((8, 64, 56, 56), 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape,size", GPU_SHAPES)
def test_gpu_lrn_bf16_at_alexnet_sizes(shape, size, layout):
    x_t = sample(shape, torch.bfloat16, layout).cuda()
    dy_t = sample(shape, torch.bfloat16, layout).cuda()
    on_gpu = dict(device="cuda", reference_device="cuda")  # 9M-element float64 references
    g, inputs, y = forward_graph("lrn", x_t, size, alpha=1e-4, beta=0.75, k=2.0)
    check(g, inputs, torch.bfloat16, **on_gpu)
    g, inputs, dx = backward_graph("lrn", x_t, dy_t, size, alpha=1e-4, beta=0.75, k=2.0)
    check(g, inputs, torch.bfloat16, **on_gpu)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_halo_tiles_at_model_sizes(dtype):
    """The halo tiles' seams on the GPU compiler's layouts (gathers along columns and rows):
    an even LRN window over 200 NHWC channels (several chunks), a 5x5 NCHW divisive window,
    x with a large dynamic range (squares of 1e3 beside 1e-2 for fp32, where prefix sums would
    cancel). bf16 and the other layouts run in the tests above."""
    on_gpu = dict(dtype=dtype, device="cuda", reference_device="cuda")
    scale = 1e3 if dtype == torch.float32 else 1.0
    for op, shape, size, layout in [("lrn", (16, 200, 14, 14), 4, "nhwc"), ("div", (8, 24, 37, 45), 5, "nchw")]:
        x_t = sample(shape, torch.float32) * 1e-2
        x_t[:, : shape[1] // 8] *= scale * 100
        x_t = (channels_last(x_t) if layout == "nhwc" else x_t).to(dtype).cuda()
        dy_t = sample(shape, dtype, layout).cuda()
        attrs = dict(alpha=1.0, beta=0.75, k=1e-3)
        check(*forward_graph(op, x_t, size, **attrs)[:2], **on_gpu)
        check(*backward_graph(op, x_t, dy_t, size, **attrs)[:2], **on_gpu)


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
    """Every config the windowed kernel may take has power-of-two warps and blocks (Triton
    needs them), owns at least one position past its halo and fits the tile cap."""
    from dnngraph.backends.triton.heuristics.lrn import MAX_TILE_ELEMENTS, schedule
    from dnngraph.target import H200
    dims = [4, 96, 9, 9, 9][:2 + len(axes) if axes != (1,) else 4]
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=dims)
    op = "lrn" if axes == (1,) else "divisive_normalization"
    if backward:
        getattr(g, op + "_backward")(g.tensor(name="dy", dim=dims), x, size).set_output(True)
    else:
        getattr(g, op)(x, size).set_output(True)
    (group,) = partition(g)
    try:
        sched = schedule(group, H200, axes)
    except dg.UnsupportedError:
        assert len(axes) == 3 and backward and size >= 9  # 3D halos of 16 a side pass 4096 elements
        return
    config = sched.config
    for value in (config.num_warps, config.batch_block) + config.window_blocks:
        assert value & (value - 1) == 0, config
    assert min(sched.owned) >= 1 and math.prod(config.window_blocks) * config.batch_block <= MAX_TILE_ELEMENTS


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
@pytest.mark.parametrize("op", ["lrn", "div"])
def test_tile_columns_hold_the_smallest_stride_axis(op, layout):
    """The tile's columns are the side holding x's contiguous axis, so loads are contiguous
    runs: NHWC LRN and NCHW divisive windows lie along it, the others batch along it."""
    from dnngraph.backends.triton.heuristics.lrn import schedule
    from dnngraph.target import H200
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor_like(sample((8, 96, 27, 27), torch.bfloat16, layout), "x")
    (g.lrn(x, 5) if op == "lrn" else g.divisive_normalization(x, 5)).set_output(True)
    (group,) = partition(g)
    sched = schedule(group, H200, (1,) if op == "lrn" else (2, 3))
    assert sched.window_on_cols == ((op == "lrn") == (layout == "nhwc"))
    innermost = (sched.axes if sched.window_on_cols else sched.batch_axes)[-1]
    assert innermost == (1 if layout == "nhwc" else 3)


# --- batch-side tiling and the gather's cost (issue 32: 7% NCHW LRN, 0.01 TB/s LCN 3x3 NCHW) ---
def _schedule_of(g, axes):
    from dnngraph.backends.triton.heuristics.lrn import schedule
    from dnngraph.target import H200
    (group,) = partition(g)
    return schedule(group, H200, axes)


@pytest.mark.parametrize("layout,inner", [("nchw", "hw"), ("nhwc", "nhw")])
def test_batch_block_tiles_the_axes_every_operand_merges(layout, inner):
    """The batch block tiles the trailing batch axes every operand walks as one axis: NCHW LRN's
    H x W (N apart: C lies between), NHWC's N x H x W; a dy sliced along W keeps only what both
    merge (W alone), and the kernel stays exact across the tiles' seams either way."""
    from dnngraph.backends.triton.codegen.pooling import AXIS_NAMES
    shape, options = (3, 7, 5, 9), dg.BuildOptions(lrn_tile_elements=64)
    x_t = sample(shape, layout=layout)
    sliced = sample(shape[:3] + (12,))[..., 2:11]  # H's stride is 12 W positions, not 9
    for dy_t, expected in ((sample(shape, layout=layout), inner), (sliced, "w")):
        g, inputs, _ = backward_graph("lrn", x_t, dy_t, 3, **LRN_ATTRS)
        sched = _schedule_of(g, (1,))
        assert "".join(AXIS_NAMES[4][a] for a in sched.inner_axes) == expected
        check(g, inputs, options=options)
        assert f"[{expected}]" in g.plan.launches[-1].config_text


def test_batch_tiles_of_a_size_one_inner_axis_walk_the_axis_that_has_positions():
    """N x C merges with C of one position innermost: the merged index walks N's stride."""
    x_t, dy_t = sample((5, 1, 4, 6)), sample((5, 1, 4, 6))
    g, inputs, _ = backward_graph("div", x_t, dy_t, 3, **DIV_ATTRS)
    assert _schedule_of(g, (2, 3)).inner_axes == (0, 1)
    check(g, inputs, options=dg.BuildOptions(lrn_tile_elements=128))


# the bench's model sizes (benchmarks/bench_lrn.py): op, shape, size, layout
MODEL_FORMS = [("lrn", (128, 96, 55, 55), 5, "nchw"), ("lrn", (128, 96, 55, 55), 5, "nhwc"),
               ("lrn", (64, 128, 56, 56), 4, "nchw"), ("div", (64, 64, 56, 56), 3, "nchw"),
               ("div", (64, 64, 56, 56), 3, "nhwc"), ("div", (32, 32, 64, 64), 5, "nchw"),
               ("div", (32, 32, 64, 64), 5, "nhwc")]


def _model_graph(op, shape, size, layout, backward):
    """A built bf16 graph over the dims and strides of a model-size x (no values are made)."""
    x_t = torch.empty(shape, dtype=torch.bfloat16)
    if layout == "nhwc":
        x_t = x_t.contiguous(memory_format=torch.channels_last)
    g = dg.Graph(io_data_type=dg.bfloat16)
    name = ("lrn" if op == "lrn" else "divisive_normalization") + ("_backward" if backward else "")
    operands = [g.tensor_like(x_t, "dy")] if backward else []
    getattr(g, name)(*operands, g.tensor_like(x_t, "x"), size=size, alpha=1e-4, beta=0.75, k=2.0).set_output(True)
    return g


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("op,shape,size,layout", MODEL_FORMS)
def test_model_size_tiles_keep_the_gather_within_registers(op, shape, size, layout, backward):
    """Triton 3.6 keeps a tl.gather within a warp (lanes along the gathered axis, warps along the
    others) at a shuffle per register a thread holds along that axis: a tile whose warps
    outnumber the lanes off that axis replicates (the LCN 3x3 NCHW tile gathered along its
    flattened 64x64 window side on one batch row: 255 registers, spills, 65536 shuffles), and an
    axis past 32 lanes multiplies the shuffles. At model sizes the chosen tile's warps fit
    beside every windowed axis (codegen gathers along one at a time), a thread holds at most
    MAX_ELEMENTS_PER_THREAD values of it, and the NCHW batch side walks H x W as one axis."""
    from dnngraph.backends.triton.heuristics.lrn import LANES_PER_WARP, MAX_ELEMENTS_PER_THREAD
    g = _model_graph(op, shape, size, layout, backward)
    sched = _schedule_of(g, (1,) if op == "lrn" else (2, 3))
    config = sched.config
    tile = math.prod(config.window_blocks) * config.batch_block
    if config.window_by == "gather":
        for block in config.window_blocks:
            assert config.num_warps <= max(1, tile // block * min(block, LANES_PER_WARP) // LANES_PER_WARP), config
            assert block <= 8 * LANES_PER_WARP, config  # at most 8 shuffles a value a shift
    assert tile <= LANES_PER_WARP * config.num_warps * MAX_ELEMENTS_PER_THREAD, config
    if op == "lrn" and layout == "nchw":
        assert sched.inner_axes == (2, 3), sched.config_text


def sm90_model_graphs():
    """Built graphs of the bench's model sizes, forward and backward, for the sm_90 compile check."""
    for op, shape, size, layout in MODEL_FORMS:
        for backward in (False, True):
            label = f"{op} {'backward' if backward else 'forward'} {shape} size {size} {layout}"
            g = _model_graph(op, shape, size, layout, backward)
            g.build()
            yield label, g


def test_model_size_kernels_compile_fast_for_sm90_without_spills():
    """At the bench's sizes every kernel compiles for sm_90 in seconds (the 5x5 LCN backward did
    not finish in the lead's 110 s run) and spills nothing (the LCN 3x3 NCHW backward spilled 12 KB
    and ran at 0.01 TB/s)."""
    # one kernel at a time (SM90_JOBS=1): a kernel's seconds then carry no sibling's load
    output = compiled_for_sm90("test_lrn:sm90_model_graphs", timeout=600,
                               env={"SM90_SPILLS": "1", "SM90_JOBS": "1", "SM90_LOOP_LOADS": "1"})
    assert f"compiled {2 * len(MODEL_FORMS)} kernels for sm_90" in output
    spills = re.findall(r"^spills (.+): (\d+)$", output, re.M)
    assert len(spills) == 2 * len(MODEL_FORMS) and all(int(n) == 0 for _, n in spills), spills
    # the persistent kernels among them (the model's choice) keep every tile load in flight
    loop_loads = re.findall(r"^loop_loads (.+): (\d+)$", output, re.M)
    assert len(loop_loads) == 2 * len(MODEL_FORMS) and all(int(n) == 0 for _, n in loop_loads), loop_loads
    seconds = re.findall(r"^compile_seconds ([\d.]+) (.+)$", output, re.M)
    assert seconds and all(float(s) < 10 for s, _ in seconds), seconds


# (op, shape, size, means dims or None, most tile elements): seams along C and W, means that vary
# along the window, a prologue-free 1-D divisive window, NaN and infinities set below
BOTH_WAYS_CASES = [("lrn", (2, 37, 3, 5), 5, None, 32), ("lrn", (1, 23, 2, 3), 4, None, 16),
                   ("div", (2, 3, 29), 5, (1, 3, 29), 32), ("div", (1, 2, 9), 3, (1, 2, 1), 16)]


@pytest.mark.parametrize("window_by", ["gather", "loads"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op,shape,size,means_dims,tile", BOTH_WAYS_CASES)
def test_forward_window_sums_both_ways(op, shape, size, means_dims, tile, layout, window_by, monkeypatch, request):
    """A small forward window may take a load per offset (no halo) instead of shifted copies of
    a halo tile: each way alone (the other taken from the model's candidates) gives the
    reference across seams, with NaN and infinities where torch has them."""
    from dnngraph.backends.triton.heuristics import lrn as heuristics
    from dnngraph.runtime import plan_cache
    candidates = heuristics._candidates
    monkeypatch.setattr(heuristics, "_candidates",
                        lambda layout: [c for c in candidates(layout) if c[0] == window_by])
    plan_cache.clear()  # a plan of the same graph built under the other way must not answer,
    request.addfinalizer(plan_cache.clear)  # nor one built here answer a later test
    x_t = sample(shape, layout=layout)
    x_t[(0, 1) + (1,) * (len(shape) - 2)] = float("nan")
    x_t[(-1, -1) + (0,) * (len(shape) - 2)] = float("inf")
    m_t = sample(means_dims) if means_dims else None
    g, inputs = forward_graph(op, x_t, size, m_t, **LRN_ATTRS)[:2]
    check(g, inputs, options=dg.BuildOptions(lrn_tile_elements=tile))
    config = g.plan.launches[-1].config_text
    assert f"sums={window_by}" in config and int(re.search(r"tiles=(\d+)", config).group(1)) > 1, config
    source = launched_source(g)
    if window_by == "loads":  # one load of x per offset, its means with it, no shifted copies
        assert source.count("tl.load(") == size * (1 + (m_t is not None)) and "tl.gather(" not in source
        assert re.search(r"owned=(\d+)", config).group(1) == re.search(r"window=\w(\d+)", config).group(1)


@pytest.mark.gpu
@pytest.mark.parametrize("window_by", ["gather", "loads"])
def test_gpu_per_axis_gathers_and_both_forward_ways(window_by, monkeypatch, request):
    """On the GPU compiler's layouts: windows over several axes gathered one axis at a time on a
    reshaped view (2-D NCHW at the LCN bench's tile, 2-D NHWC, 3-D 5x5x5), and an LRN forward
    over 55 x 55 NCHW (H x W merged into the batch block) each way."""
    from dnngraph.backends.triton.heuristics import lrn as heuristics
    from dnngraph.runtime import plan_cache
    candidates = heuristics._candidates
    monkeypatch.setattr(heuristics, "_candidates",
                        lambda layout: [c for c in candidates(layout) if c[0] == window_by] or candidates(layout))
    plan_cache.clear()
    request.addfinalizer(plan_cache.clear)
    forms = [("lrn", (8, 96, 55, 55), 5, "nchw", torch.bfloat16), ("div", (8, 16, 56, 56), 3, "nchw", torch.bfloat16),
             ("div", (4, 32, 64, 64), 5, "nhwc", torch.bfloat16), ("div", (2, 8, 7, 9, 11), 5, "nchw", torch.float32)]
    for op, shape, size, layout, dtype in forms:
        x_t, dy_t = sample(shape, dtype, layout).cuda(), sample(shape, dtype, layout).cuda()
        on_gpu = dict(dtype=dtype, device="cuda", reference_device="cuda")
        check(*forward_graph(op, x_t, size, **LRN_ATTRS)[:2], **on_gpu)
        check(*backward_graph(op, x_t, dy_t, size, **LRN_ATTRS)[:2], **on_gpu)


# --- the persistent schedule (issue 32: programs walk tiles in a pipelined loop) ----------------
# (op, shape, size, means dims or None, most tile elements, programs, dtype): tile counts no
# multiple of the grid, a grid past the tiles (one tile: one program), size-1 axes (N, C, H),
# means that vary along the window, bf16 storage, a prologue-free 3-D window
PERSISTENT_CASES = [("lrn", (2, 37, 3, 5), 5, None, 32, 3, torch.float32),
                    ("lrn", (3, 11, 1, 5), 4, None, 16, 5, torch.bfloat16),
                    ("lrn", (1, 1, 3, 3), 3, None, 4096, 7, torch.float32),
                    ("div", (1, 3, 13, 11), 3, (1, 3, 13, 11), 64, 4, torch.float32),
                    ("div", (2, 1, 9, 7), 5, (1, 1, 1, 1), 256, 3, torch.bfloat16),
                    ("div", (1, 2, 5, 6, 7), 3, None, 512, 2, torch.float32)]


def _tiles_and_grid(g) -> tuple:
    config = g.plan.launches[-1].config_text
    found = re.search(r"persistent=(\d+)/(\d+)", config)
    assert found and f"grid={found.group(2)} " in config, config
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op,shape,size,means_dims,tile,programs,dtype", PERSISTENT_CASES)
def test_persistent_programs_walk_every_tile_once(op, shape, size, means_dims, tile, programs, dtype, layout):
    """Forced persistent grids at odd sizes against float64: every tile stored (outputs
    poisoned with NaN first), none twice, NaN and infinities where torch has them, the loop in
    the source; a grid larger than the tile count launches one program a tile."""
    x_t, dy_t = sample(shape, layout=layout), sample(shape, layout=layout)
    x_t[(0, 0) + tuple(min(1, d - 1) for d in shape[2:])] = float("nan")
    dy_t[(-1, -1) + (0,) * (len(shape) - 2)] = float("inf")
    x_t, dy_t = x_t.to(dtype), dy_t.to(dtype)
    m_t = sample(means_dims, dtype) if means_dims else None
    options = dg.BuildOptions(lrn_tile_elements=tile, lrn_programs=programs)
    for g, inputs in (forward_graph(op, x_t, size, m_t, **LRN_ATTRS)[:2],
                      backward_graph(op, x_t, dy_t, size, m_t, **LRN_ATTRS)[:2]):
        check(g, inputs, dtype, options=options)
        tiles, grid = _tiles_and_grid(g)
        assert grid == min(tiles, programs) and "tl.range(" in launched_source(g)


@pytest.mark.parametrize("op", ["lrn", "div"])
def test_persistent_programs_over_strided_and_broadcast_inputs(op):
    """Sliced x (odd strides), dy broadcast along H (stride 0), means as [1, C, 1, 1], a grid
    of 3 over more tiles; the same kernels the model's grid on the interpreter target runs."""
    x_t = sample((2, 10, 5, 7))[:, 1::2, :, 1:6]
    dy_t = sample((2, 5, 1, 5)).expand(2, 5, 5, 5)
    m_t = sample((1, 5, 1, 1)) if op == "div" else None
    for options in (dg.BuildOptions(lrn_tile_elements=64, lrn_programs=3),
                    dg.BuildOptions(lrn_tile_elements=64, lrn_schedule="persistent")):
        for g, inputs in (forward_graph(op, x_t, 3, m_t, **LRN_ATTRS)[:2],
                          backward_graph(op, x_t, dy_t, 3, m_t, **LRN_ATTRS)[:2]):
            check(g, inputs, options=options)
            tiles, grid = _tiles_and_grid(g)
            assert tiles > 1 and (grid == min(tiles, 3) if options.lrn_programs else grid == tiles)


def test_forced_tile_schedule_and_bad_schedule_options():
    x_t = sample((2, 9, 3, 4))
    g, inputs = forward_graph("lrn", x_t, 5, **LRN_ATTRS)[:2]
    check(g, inputs, options=dg.BuildOptions(lrn_schedule="tile", lrn_programs=2, lrn_tile_elements=32))
    config = g.plan.launches[-1].config_text
    assert "schedule=tile" in config and "tl.range(" not in launched_source(g)
    for bad in (dict(lrn_schedule="loop"), dict(lrn_programs=0), dict(lrn_programs=2.0)):
        with pytest.raises(dg.ValidationError):
            dg.BuildOptions(**bad)


def _form_of(op, shape, size, layout, backward, dtype):
    x_t = torch.empty(shape, dtype=dtype)
    if layout == "nhwc":
        x_t = x_t.contiguous(memory_format=torch.channels_last)
    g = dg.Graph(io_data_type=IO_TYPES[dtype])
    name = ("lrn" if op == "lrn" else "divisive_normalization") + ("_backward" if backward else "")
    operands = [g.tensor_like(x_t, "dy")] if backward else []
    getattr(g, name)(*operands, g.tensor_like(x_t, "x"), size=size).set_output(True)
    return _schedule_of(g, (1,) if op == "lrn" else (2, 3))


def test_the_model_keeps_one_tile_a_program_as_measured():
    """The persistent loop measured slower on the H200 (heuristics/lrn.py PERSISTENT_BY_MODEL):
    no model size walks tiles unless a build forces it."""
    for op, shape, size, layout in MODEL_FORMS:
        for backward in (False, True):
            for dtype in (torch.bfloat16, torch.float32):
                sched = _form_of(op, shape, size, layout, backward, dtype)
                assert not sched.persistent and "measured slower" in sched.reason, sched.reason


@pytest.fixture
def persistence_by_model(monkeypatch):
    """The model's persistence rule switched on (it is off by default, as measured)."""
    from dnngraph.backends.triton.heuristics import lrn as heuristics
    monkeypatch.setattr(heuristics, "PERSISTENT_BY_MODEL", True)


def test_model_keeps_one_tile_a_program_where_persistence_cannot_help(persistence_by_model):
    """Few tiles (fewer than PERSISTENT_MIN_TILES a resident program), and bf16 loads whose
    4-byte alignment the compiler cannot prove (cp.async impossible: nothing would be in flight;
    NCHW LRN over 55 x 55, channel stride 3025; LCN 3x3 over 56 x 56, H stride 56), keep the
    tile form; aligned bf16 and every fp32 model size walk tiles, with a grid of whole SMs."""
    from dnngraph.target import H200
    small = _form_of("lrn", (2, 16, 7, 7), 5, "nhwc", True, torch.bfloat16)
    assert not small.persistent and "fewer than" in small.reason
    for op, shape, size, layout in [("lrn", (128, 96, 55, 55), 5, "nchw"), ("div", (64, 64, 56, 56), 3, "nchw")]:
        for backward in (False, True):
            sched = _form_of(op, shape, size, layout, backward, torch.bfloat16)
            assert not sched.persistent and "cp.async" in sched.reason, sched.reason
            assert _form_of(op, shape, size, layout, backward, torch.float32).persistent
    for op, shape, size, layout in [("lrn", (128, 96, 55, 55), 5, "nhwc"), ("div", (32, 32, 64, 64), 5, "nchw")]:
        sched = _form_of(op, shape, size, layout, True, torch.bfloat16)
        assert sched.persistent and sched.grid % H200.sms == 0 and sched.tiles >= 4 * sched.grid, sched.config_text
        assert 2 <= sched.stages <= 4


def sm90_persistent_graphs():
    """The bench's model sizes in fp32 (the bf16 ones: sm90_model_graphs), as the model's
    persistence rule (switched on here: it is off by default) schedules them: most walk tiles."""
    from dnngraph.backends.triton.heuristics import lrn as heuristics
    heuristics.PERSISTENT_BY_MODEL = True  # this runs in tests/sm90_compile.py's own process
    for op, shape, size, layout in MODEL_FORMS:
        for backward in (False, True):
            x_t = torch.empty(shape)
            if layout == "nhwc":
                x_t = x_t.contiguous(memory_format=torch.channels_last)
            g = dg.Graph(io_data_type=dg.float32)
            name = ("lrn" if op == "lrn" else "divisive_normalization") + ("_backward" if backward else "")
            operands = [g.tensor_like(x_t, "dy")] if backward else []
            getattr(g, name)(*operands, g.tensor_like(x_t, "x"), size=size, beta=0.75, k=2.0).set_output(True)
            g.build()
            yield f"fp32 {op} {'backward' if backward else 'forward'} {shape} size {size} {layout}", g
    # past int32 offsets (2^31 elements, never allocated): the loop's tile index widens to int64
    g = dg.Graph(io_data_type=dg.bfloat16)
    dy, x = (g.tensor(name=name, dim=[32, 64, 1024, 1024], stride=[2**26, 1, 2**16, 64]) for name in ("dy", "x"))
    g.lrn_backward(dy, x, size=5).set_output(True)
    g.build()
    config = g.plan.launches[-1].config_text
    assert "persistent=" in config and "int64-index" in config, config
    yield "bf16 lrn backward int64 nhwc", g


def test_persistent_kernels_keep_every_load_in_flight_on_sm90():
    """Where the model walks tiles, Triton's pipeliner must turn every tile load of the loop into
    a cp.async copy (a tt.load left in the loop: nothing in flight, the grid's occupancy lost for
    nothing), without spills: fp32 here (and a bf16 LRN past int32 offsets), bf16 in the model-size
    test above."""
    output = compiled_for_sm90("test_lrn:sm90_persistent_graphs", timeout=600,
                               env={"SM90_SPILLS": "1", "SM90_LOOP_LOADS": "1"})
    assert f"compiled {2 * len(MODEL_FORMS) + 1} kernels for sm_90" in output
    loop_loads = re.findall(r"^loop_loads (.+): (\d+)$", output, re.M)
    spills = re.findall(r"^spills (.+): (\d+)$", output, re.M)
    assert len(loop_loads) == len(spills) == 2 * len(MODEL_FORMS) + 1
    assert all(int(n) == 0 for _, n in loop_loads + spills), (loop_loads, spills)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["tile", "persistent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_persistent_and_tile_schedules_at_model_sizes(schedule, dtype):
    """Both schedules forced on the GPU compiler's pipelined loops: LRN NCHW and NHWC, LCN 5x5
    NCHW and 3x3 NHWC, forward and backward, against float64; a grid of 7 programs too."""
    forms = [("lrn", (8, 96, 27, 27), 5, "nchw"), ("lrn", (8, 64, 28, 28), 4, "nhwc"),
             ("div", (4, 16, 64, 64), 5, "nchw"), ("div", (4, 32, 30, 30), 3, "nhwc")]
    for programs in (None, 7):
        options = dg.BuildOptions(lrn_schedule=schedule, lrn_programs=programs)
        for op, shape, size, layout in forms:
            x_t, dy_t = sample(shape, dtype, layout).cuda(), sample(shape, dtype, layout).cuda()
            on_gpu = dict(dtype=dtype, device="cuda", reference_device="cuda", options=options)
            for g, inputs in (forward_graph(op, x_t, size, **LRN_ATTRS)[:2],
                              backward_graph(op, x_t, dy_t, size, **LRN_ATTRS)[:2]):
                check(g, inputs, **on_gpu)
                assert ("persistent=" in g.plan.launches[-1].config_text) == (schedule == "persistent")


@pytest.mark.parametrize("schedule", ["tile", "persistent"])
def test_int64_indexing_in_both_schedules(schedule, monkeypatch, request):
    """Tensors past int32 offsets index in int64 (forced here by a limit of 0): the persistent
    loop's tile index widens too, in the interpreter (whose loop variable is a Python int) and
    on sm_90 (the model-size compile tests)."""
    from dnngraph.backends.triton.heuristics import lrn as heuristics
    from dnngraph.runtime import plan_cache
    monkeypatch.setattr(heuristics, "INT32_LIMIT", 0)
    plan_cache.clear()
    request.addfinalizer(plan_cache.clear)
    options = dg.BuildOptions(lrn_schedule=schedule, lrn_programs=2, lrn_tile_elements=32)
    x_t, dy_t = sample((2, 9, 3, 5), layout="nhwc"), sample((2, 9, 3, 5))
    for g, inputs in (forward_graph("lrn", x_t, 3, **LRN_ATTRS)[:2],
                      backward_graph("lrn", x_t, dy_t, 3, **LRN_ATTRS)[:2]):
        check(g, inputs, options=options)
        config = g.plan.launches[-1].config_text
        assert "int64-index" in config and ("persistent=" in config) == (schedule == "persistent"), config


def test_persistent_loop_runs_fused_prologues_epilogues_and_extra_outputs():
    """Inside the loop: a producer chain, a consumer with a broadcast operand, a prologue value
    that is also a graph output (stored once a tile, only where owned), the LCN's mean."""
    options = dg.BuildOptions(lrn_programs=3, lrn_tile_elements=64)
    x_t, b_t, dy_t = sample((2, 7, 3, 5), layout="nhwc"), sample((1, 7, 1, 1)), sample((2, 7, 3, 5))
    g = dg.Graph(io_data_type=dg.float32)
    x, b, dy = g.tensor_like(x_t, "x"), g.tensor_like(b_t, "b"), g.tensor_like(dy_t, "dy")
    h = g.exp(g.scale(x, 0.5)).set_output(True)
    g.add(g.lrn(h, 5, **LRN_ATTRS), b).set_output(True)
    g.lrn_backward(g.neg(dy), h, 3, **LRN_ATTRS).set_output(True)
    check(g, {x: x_t, b: b_t, dy: dy_t}, options=options)
    windowed = [launch.config_text for launch in g.plan.launches if launch.group.kind == "lrn"]
    assert len(windowed) == 2 and all("persistent=" in config for config in windowed), windowed
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor_like(x_t, "x")
    g.local_contrast_normalization(x, 3, **DIV_ATTRS).set_output(True)
    check(g, {x: x_t}, options=options)
