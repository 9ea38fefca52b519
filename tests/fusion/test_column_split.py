"""Column splits: row kernels whose kept axis K is the contiguous one (NHWC batchnorm: K = channels,
R = N*H*W pixels), run as a partial kernel (per-chunk statistics), a combine kernel and an apply
kernel. Small odd shapes in the interpreter, with configs forced so that programs walk several
tiles (prefetch chains, the peeled first tile, ragged and empty chunks, the reverse apply walk)."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import rows
from helpers import check
from test_norms import DTYPES, _channel_backward, _channel_forward, layout, shifted


@pytest.fixture(params=[(1, True), (0, False), (1, False), (2, True)],
                ids=["prefetch-stream", "plain", "prefetch", "prefetch2-stream"])
def knobs(request):
    """The two kernel-shape switches of column splits (tiles prefetched, streaming apply), in
    the combinations worth telling apart."""
    return request.param


def force(knobs, block_k, block_r, splits, **others) -> dg.BuildOptions:
    """Options forcing a split config of one warp, with the column-split switches `knobs`
    ((prefetched tiles, streaming apply); None: the defaults)."""
    config = rows.RowConfig("split", block_k, block_r, 1, splits, 0.0)
    if knobs is not None:
        others.update(column_prefetch_tiles=knobs[0], column_stream_apply=knobs[1])
    return dg.BuildOptions(row_config=config, **others)


def kernels(graph) -> list:
    """(shape, source text) of each launch: shape is partial / combine / apply / main."""
    found = []
    for launch in graph.plan.launches:
        shape = launch.config_text.split()[0]
        found.append((shape, launch.source_path.read_text()))
    return found


def assert_column_split(graph, prefetch, stream, apply=True):
    shapes = [shape for shape, _ in kernels(graph)]
    assert shapes == ["partial", "combine"] + (["apply"] if apply else []), shapes
    sources = dict(kernels(graph))
    for shape in ("partial", "apply") if apply else ("partial",):
        assert ("_next = tl.load" in sources[shape]) == (prefetch > 0)
        assert ("_next2 = tl.load" in sources[shape]) == (prefetch > 1)
    if apply:
        assert ("tl.num_programs(0) - 1 -" in sources["apply"]) == stream
        assert ('eviction_policy="evict_first"' in sources["apply"]) == stream


# --- forward --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,block_k,block_r,splits", [
    ((3, 6, 5, 7), 8, 4, 5),  # 105 pixels over 5 chunks of 24: 6 tiles each, the last ragged
    ((2, 13, 3, 11), 8, 8, 3),  # two channel blocks, the second partial
    ((5, 3, 1, 1), 4, 2, 3),  # one pixel per image
    ((2, 6, 1, 1), 8, 1, 3),  # two pixels in all: the third chunk is empty
])
def test_batchnorm_forward_nhwc(knobs, dtype, shape, block_k, block_r, splits):
    options = force(knobs, block_k, block_r, splits)
    g, inputs = _channel_forward("batchnorm", shape, True, dtype, running=True)
    check(g, inputs, dtype, options=options)
    assert_column_split(g, *knobs)


def test_batchnorm_forward_nchw_keeps_its_split():
    """NCHW: R (pixels) is the contiguous side, so its split is not a column split."""
    g, inputs = _channel_forward("batchnorm", (3, 6, 5, 7), False, running=True)
    check(g, inputs, options=dg.BuildOptions(row_mode="split", row_loop_tile=16, row_split_min_reduced=8))
    sources = dict(kernels(g))
    assert list(sources) == ["partial", "combine", "apply"]
    assert "_next = tl.load" not in sources["partial"] + sources["apply"]
    assert "evict_first" not in sources["apply"]


def test_batchnorm_forward_large_mean():
    """A mean 100 times the spread: sums of squares less the squared mean would lose the
    variance to cancellation (about 6e-4 here); the shifted sums keep it (float32)."""
    options = force(None, 8, 4, 4)
    g = dg.Graph()
    x_t = layout(torch.randn(4, 5, 6, 3) * 0.1 + 10.0, True)
    x = g.tensor_like(x_t, "x")
    s, b = g.tensor(name="s", dim=[1, 5, 1, 1]), g.tensor(name="b", dim=[1, 5, 1, 1])
    for out in g.batchnorm(x, s, b):
        if out is not None:
            out.set_output(True)
    check(g, {x: x_t, s: shifted(1, 5, 1, 1), b: torch.randn(1, 5, 1, 1)}, options=options)


@pytest.mark.parametrize("layout_kind", ["padded_channels", "cropped_width"])
def test_batchnorm_forward_odd_strides(knobs, layout_kind):
    """Channels contiguous but pixels strided: a channel-padded view (R merges into one strided
    axis) and a width-cropped view (R stays [N, H, W]: digits decomposed per tile)."""
    options = force(knobs, 8, 4, 3)
    if layout_kind == "padded_channels":
        x_t = layout(shifted(3, 9, 5, 7), True)[:, :6]
    else:
        x_t = layout(shifted(3, 6, 5, 7), True)[..., :5]
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    s, b = g.tensor(name="s", dim=[1, 6, 1, 1]), g.tensor(name="b", dim=[1, 6, 1, 1])
    y, mean, inv = g.batchnorm(x, s, b)[:3]
    for out in (y, mean, inv):
        out.set_output(True)
    check(g, {x: x_t, s: shifted(1, 6, 1, 1), b: torch.randn(1, 6, 1, 1)}, options=options)
    assert_column_split(g, *knobs)


def test_batchnorm_forward_with_prologue_and_epilogue(knobs):
    """x = a * 2 + r (a fused prologue), y -> relu (an epilogue): still three kernels."""
    options = force(knobs, 8, 4, 4)
    g = dg.Graph()
    a_t, r_t = layout(shifted(3, 6, 5, 7), True), layout(torch.randn(3, 6, 5, 7), True)
    a, r = g.tensor_like(a_t, "a"), g.tensor_like(r_t, "r")
    s, b = g.tensor(name="s", dim=[1, 6, 1, 1]), g.tensor(name="b", dim=[1, 6, 1, 1])
    y, mean, inv = g.batchnorm(g.add(g.mul(a, 2.0), r), s, b)[:3]
    g.relu(y).set_output(True).set_name("act")
    mean.set_output(True)
    check(g, {a: a_t, r: r_t, s: shifted(1, 6, 1, 1), b: torch.randn(1, 6, 1, 1)}, options=options)
    assert_column_split(g, *knobs)


def test_combine_folds_many_splits():
    """More splits than the combine folds per trip: partials merged over several trips."""
    options = force(None, 8, 2, 13, row_combine_values=16)
    g, inputs = _channel_forward("batchnorm", (2, 6, 4, 6), True, running=True)
    check(g, inputs, options=options)
    assert "SPLITS=13" in g.plan.launches[1].config_text


def test_model_picks_a_column_split():
    """Unforced: 8 channels x 16384 pixels NHWC splits (looped, it would be one program)."""
    g, inputs = _channel_forward("batchnorm", (16, 8, 32, 32), True, running=True)
    check(g, inputs)
    assert_column_split(g, dg.BuildOptions().column_prefetch_tiles, dg.BuildOptions().column_stream_apply)
    assert "(split)" in g.plan.launches[0].config_text


# --- backward -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,shape,block_k,block_r,splits", [
    (torch.float32, (3, 6, 5, 7), 8, 4, 5),
    (torch.float16, (3, 6, 5, 7), 8, 4, 5),
    (torch.float32, (2, 13, 3, 11), 8, 8, 3),
    (torch.float16, (2, 13, 3, 11), 8, 8, 3),
    # three pixels per channel, the fourth chunk empty (float32: with three values, fp16 rounding
    # of x against float64 statistics moves dx past any useful tolerance)
    (torch.float32, (3, 6, 1, 1), 8, 1, 4),
])
def test_batchnorm_backward_nhwc(knobs, dtype, shape, block_k, block_r, splits):
    options = force(knobs, block_k, block_r, splits)
    g, inputs, expected = _channel_backward("batchnorm_backward", shape, True, dtype)
    limit = 5e-5 if dtype == torch.float32 else 5e-3
    outputs = check(g, inputs, dtype, tolerance=limit, options=options)
    for name, want in zip(("dx", "dscale", "dbias"), expected):
        got = outputs[name].double().reshape(want.shape)
        assert (got - want).norm() / want.norm() < limit, name
    assert_column_split(g, *knobs)


def test_batchnorm_backward_with_drelu_epilogue(knobs):
    """dx feeding a relu backward (an epilogue reading another input) stays in the apply kernel."""
    options = force(knobs, 8, 4, 3)
    g, inputs, _ = _channel_backward("batchnorm_backward", (3, 6, 5, 7), True)
    dx = next(t for t in g.outputs() if t.name == "dx")
    dx.set_output(False)
    gate_t = layout(torch.randn(3, 6, 5, 7), True)
    gate = g.tensor_like(gate_t, "gate")
    g.relu_backward(dx, gate).set_output(True).set_name("dgate")
    check(g, {**inputs, gate: gate_t}, tolerance=5e-5, options=options)
    assert_column_split(g, *knobs)


# --- other column reductions ----------------------------------------------------------------------
@pytest.mark.parametrize("mode,dtype", [("sum", torch.float32), ("max", torch.float32), ("sum", torch.int32)])
def test_column_reduction(knobs, mode, dtype):
    """A reduction over the rows of a row-major matrix (K contiguous): plain accumulators
    through the prefetched partial; max propagates NaN, integers stay exact."""
    options = force(knobs, 8, 4, 4)
    g = dg.Graph(io_data_type=DTYPES.get(dtype, dg.int32))
    x = g.tensor(name="x", dim=[37, 11])
    g.reduction(x, mode, [0]).set_output(True)
    if dtype == torch.int32:
        values = torch.randint(-1000, 1000, (37, 11), dtype=torch.int32)
    else:
        values = torch.randn(37, 11)
        values[5, 3] = float("nan")
    check(g, {x: values}, options=options)
    assert_column_split(g, knobs[0], knobs[1], apply=False)


def test_genstats_nhwc(knobs):
    options = force(knobs, 8, 4, 4)
    g = dg.Graph()
    x_t = layout(shifted(3, 6, 5, 7), True)
    x = g.tensor_like(x_t, "x")
    for out in g.genstats(x):
        out.set_output(True)
    check(g, {x: x_t}, options=options)
    assert_column_split(g, knobs[0], knobs[1], apply=False)


def test_an_infinite_element_makes_the_channel_mean_infinite_in_split_mode():
    """Shifted sums with a shift of inf were inf - inf = NaN (found in review): the shift falls
    back to 0 and the Welford merge adds infinite means as a plain sum would."""
    options = force(None, 4, 4, 3)
    x_t = torch.randn(3, 5, 4, 3).contiguous(memory_format=torch.channels_last)
    x_t[0, 1, 0, 0] = float("inf")
    g = dg.Graph(name="bn_inf", io_data_type=dg.float32)
    x = g.tensor_like(x_t, name="x")
    p = [1, 5, 1, 1]
    s, b = g.tensor(name="s", dim=p), g.tensor(name="b", dim=p)
    y, mean, inv = g.batchnorm(x, s, b)[:3]
    mean.set_output(True).set_name("mean")
    inv.set_output(True).set_name("inv")
    y.set_output(True).set_name("y")
    check(g, {"x": x_t, "s": torch.ones(p), "b": torch.zeros(p)}, options=options)


def test_variance_of_a_large_mean_with_a_small_spread():
    """mean 1e4, spread 1e-2 in fp32: the second pass takes the rounded mean's residue back out
    (the plain two-pass variance was 5e-3 off; found in review)."""
    x_t = (1e4 + 1e-2 * torch.randn(4, 3, 9, 7)).contiguous(memory_format=torch.channels_last)
    g = dg.Graph(name="bn_big", io_data_type=dg.float32)
    x = g.tensor_like(x_t, name="x")
    p = [1, 3, 1, 1]
    s, b = g.tensor(name="s", dim=p), g.tensor(name="b", dim=p)
    _, _, inv = g.batchnorm(x, s, b)[:3]
    inv.set_output(True).set_name("inv")
    check(g, {"x": x_t, "s": torch.ones(p), "b": torch.zeros(p)}, tolerance=1e-6)
