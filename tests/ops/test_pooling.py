"""Pooling family: forward and backward kernels on CPU (interpreter), fusion, validation; GPU bf16."""
import json
import math

import pytest
import torch

import dnngraph as dg
from helpers import check, rel_err, run

MODES = ["max", "avg_include_pad", "avg_exclude_pad"]
# (shape, window, stride, padding) per spatial rank: odd sizes, stride != window, some padding
PROBLEMS = {
    1: ((2, 5, 13), [3], [2], [1]),
    2: ((2, 5, 13, 11), [3, 2], [2, 1], [1, 1]),
    3: ((2, 3, 5, 7, 6), [3, 2, 2], [2, 1, 2], [1, 0, 1]),
}
IO_TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}


def channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with channels innermost in memory (NWC, NHWC, NDHWC)."""
    order = [0] + list(range(2, tensor.dim())) + [1]
    return tensor.permute(order).contiguous().permute(
        [0, tensor.dim() - 1] + list(range(1, tensor.dim() - 1)))


def sample(shape, dtype, layout="nchw", device="cpu") -> torch.Tensor:
    """Fresh random values (never zeros) in the requested layout."""
    value = (torch.randn(shape) + 0.1).to(device=device, dtype=dtype)
    return channels_last(value) if layout == "nhwc" else value


def output_dims(shape, window, stride, padding):
    spatial = [(s + 2 * p - w) // st + 1 for s, w, st, p in zip(shape[2:], window, stride, padding)]
    return tuple(shape[:2]) + tuple(spatial)


def forward_graph(x_value, mode, window, stride, padding):
    g = dg.Graph(io_data_type=IO_TYPES[x_value.dtype])
    x = g.tensor_like(x_value, "x")
    y = g.pooling(x, mode, window, stride, padding).set_output(True)
    return g, x, y


def backward_graph(x_value, dy_value, mode, window, stride, padding):
    g = dg.Graph(io_data_type=IO_TYPES[x_value.dtype])
    x, dy = g.tensor_like(x_value, "x"), g.tensor_like(dy_value, "dy")
    dx = g.pooling_backward(dy, x, mode, window, stride, padding).set_output(True)
    return g, x, dy, dx


# --- forward -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("spatial", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_forward_every_mode_rank_and_layout(mode, spatial, layout):
    shape, window, stride, padding = PROBLEMS[spatial]
    x_t = sample(shape, torch.float32, layout)
    g, x, y = forward_graph(x_t, mode, window, stride, padding)
    check(g, {x: x_t})
    assert len(g.plan.launches) == 1
    if layout == "nhwc":
        assert "vector=c" in g.plan.launches[0].config_text, "channels are the vectorized axis"


@pytest.mark.parametrize("mode", MODES)
def test_forward_float16_nhwc(mode):
    shape, window, stride, padding = PROBLEMS[2]
    x_t = sample(shape, torch.float16, "nhwc")
    g, x, y = forward_graph(x_t, mode, window, stride, padding)
    assert y.data_type is dg.float16
    check(g, {x: x_t}, torch.float16)


def test_forward_sliced_input_and_window_equal_to_padded_input():
    base = torch.randn(3, 9, 15, 14)
    x_t = base[1:, 2:7, 1::2, 3:]  # non-contiguous on every axis but the last
    g, x, y = forward_graph(x_t, "avg_exclude_pad", [3, 3], [3, 2], [1, 0])
    check(g, {x: x_t})
    g, x, y = forward_graph(x_t, "max", [9, 11], [1, 1], [1, 0])  # one window per plane
    assert list(y.dim) == [2, 5, 1, 1]
    check(g, {x: x_t})


def test_max_ties_and_nan_follow_torch():
    x_t = torch.randint(0, 3, (2, 4, 9, 8)).float()  # many ties: the first maximum wins
    x_t[0, 1, 4, 4] = float("nan")
    g, x, y = forward_graph(x_t, "max", [3, 3], [2, 2], [1, 1])
    out = check(g, {x: x_t})[y.name]
    assert torch.isnan(out[0, 1, 2, 2]) and not torch.isnan(out[1]).any()
    dy_t = torch.randn(2, 4, 5, 4)
    g, x, dy, dx = backward_graph(x_t, dy_t, "max", [3, 3], [2, 2], [1, 1])
    check(g, {x: x_t, dy: dy_t})


def adversarial(shape, dtype, layout, seed=0):
    """Integer values (ties everywhere), zeros of both signs, several NaNs in some windows, inf,
    and whole windows of -inf."""
    generator = torch.Generator().manual_seed(seed)
    x_t = torch.randint(-2, 3, shape, generator=generator).float()
    flat = x_t.view(-1)
    picks = torch.randperm(flat.numel(), generator=generator)
    flat[picks[:6]] = float("nan")
    flat[picks[6:10]] = float("inf")
    flat[picks[10:30]] = -0.0
    corner = (0, 1) + (slice(0, 3),) * (len(shape) - 2)
    x_t[corner] = float("-inf")  # a whole window (and the padding beside it) below every number
    x_t[(1, 0) + (slice(2, 4),) * (len(shape) - 2)] = float("nan")  # neighbouring NaNs share windows
    x_t = x_t.to(dtype)
    return channels_last(x_t) if layout == "nhwc" else x_t


def indices_graph(x_value, window, stride, padding):
    g = dg.Graph(io_data_type=IO_TYPES[x_value.dtype])
    x = g.tensor_like(x_value, "x")
    y, indices = g.pooling(x, "max", window, stride, padding, return_indices=True)
    return g, x, y.set_output(True), indices.set_output(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_max_indices_are_torchs_with_ties_nan_and_infinities(spatial, layout, dtype):
    """torch's argmax exactly: first maximum in window order, a NaN over any number (the last
    NaN of a window wins), a window of -inf keeps its first in-range element; values too."""
    shape, window, stride, padding = {1: ((2, 5, 13), [3], [2], [1]), 2: ((2, 5, 9, 7), [3, 3], [2, 2], [1, 1]),
                                      3: ((2, 3, 5, 7, 6), [3, 2, 3], [2, 1, 2], [1, 1, 1])}[spatial]
    x_t = adversarial(shape, dtype, layout)
    g, x, y, indices = indices_graph(x_t, window, stride, padding)
    assert indices.data_type is dg.int64 and y.data_type is IO_TYPES[dtype]
    outputs = check(g, {x: x_t}, dtype)  # against the float64 reference, outputs poisoned first
    fn = (torch.nn.functional.max_pool1d, torch.nn.functional.max_pool2d, torch.nn.functional.max_pool3d)[spatial - 1]
    want_y, want_indices = fn(x_t.float(), window, stride, padding, return_indices=True)
    assert torch.equal(outputs[indices.name], want_indices)
    assert torch.equal(outputs[y.name].float().nan_to_num(), want_y.nan_to_num())
    assert outputs[indices.name].stride() == outputs[y.name].stride(), "indices take y's layout"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_max_backward_routes_exactly_where_torchs_indices_do(layout, dtype):
    """The recomputed argmax of the backward is torch's: integer gradients summed exactly, so the
    gradients must be equal, with ties, NaN (last NaN wins), inf and -inf windows."""
    shape, window, stride, padding = (2, 5, 9, 7), [3, 3], [2, 2], [1, 1]
    x_t = adversarial(shape, dtype, layout, seed=1)
    dy_t = torch.randint(1, 5, output_dims(shape, window, stride, padding)).to(dtype)
    dy_t = channels_last(dy_t) if layout == "nhwc" else dy_t
    g, x, dy, dx = backward_graph(x_t, dy_t, "max", window, stride, padding)
    got = check(g, {x: x_t, dy: dy_t}, dtype)[dx.name]
    leaf = x_t.float().requires_grad_(True)
    torch.nn.functional.max_pool2d(leaf, window, stride, padding).backward(dy_t.float())
    assert torch.equal(got.float(), leaf.grad)


def test_return_indices_is_max_only_and_forward_only():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 3, 5, 5])
    with pytest.raises(dg.ValidationError, match="return_indices"):
        g.pooling(x, "avg_include_pad", [3, 3], [2, 2], [1, 1], return_indices=True)
    dy = g.tensor(name="dy", dim=[2, 3, 3, 3])
    with pytest.raises(dg.ValidationError, match="return_indices"):
        g._add_op("pooling_backward", [dy, x, None], dg.graph._attrs_of(
            "pooling_backward", "max", (3, 3), (2, 2), (1, 1), True))
    y = g.pooling(x, "max", [3, 3], [2, 2], [1, 1], return_indices=False)
    assert isinstance(y, dg.Tensor)


def test_indices_survive_json_and_autograd_ignores_them():
    x_t = adversarial((2, 3, 7, 6), torch.float32, "nchw")
    g, x, y, indices = indices_graph(x_t, [3, 3], [2, 2], [1, 1])
    g2 = dg.Graph.from_json(g.to_json())
    outputs = run(g2, {"x": x_t})
    assert torch.equal(outputs[indices.name], torch.nn.functional.max_pool2d(x_t, 3, 2, 1, return_indices=True)[1])
    x_t = torch.randint(-2, 3, (2, 3, 7, 6)).float().requires_grad_(True)
    g, x, y, indices = indices_graph(x_t, [3, 3], [2, 2], [1, 1])
    pooled, _ = g.as_function()(x_t)
    grad = torch.randint(1, 4, pooled.shape).float()
    pooled.backward(grad)
    leaf = x_t.detach().clone().requires_grad_(True)
    torch.nn.functional.max_pool2d(leaf, 3, 2, 1).backward(grad)
    assert torch.equal(x_t.grad, leaf.grad)


# --- backward ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spatial,layout", [(1, "nchw"), (2, "nhwc"), (3, "nhwc"), (2, "nchw")])
@pytest.mark.parametrize("mode", MODES)
def test_backward_every_mode_against_autograd(mode, spatial, layout):
    shape, window, stride, padding = PROBLEMS[spatial]
    x_t = sample(shape, torch.float32, layout)
    dy_t = sample(output_dims(shape, window, stride, padding), torch.float32, layout)
    g, x, dy, dx = backward_graph(x_t, dy_t, mode, window, stride, padding)
    check(g, {x: x_t, dy: dy_t})


@pytest.mark.parametrize("mode", MODES)
def test_backward_float16_overlapping_windows(mode):
    shape, window, stride, padding = (2, 3, 7, 9), [3, 3], [1, 2], [1, 1]
    x_t, dy_t = sample(shape, torch.float16, "nhwc"), sample((2, 3, 7, 5), torch.float16, "nhwc")
    g, x, dy, dx = backward_graph(x_t, dy_t, mode, window, stride, padding)
    check(g, {x: x_t, dy: dy_t}, torch.float16)


@pytest.mark.parametrize("mode", MODES)
def test_backward_stride_larger_than_window_leaves_gaps(mode):
    x_t = sample((2, 3, 11, 10), torch.float32, "nhwc")
    dy_t = sample(output_dims(x_t.shape, [2, 3], [3, 4], [1, 0]), torch.float32, "nhwc")
    g, x, dy, dx = backward_graph(x_t, dy_t, mode, [2, 3], [3, 4], [1, 0])
    out = check(g, {x: x_t, dy: dy_t})[dx.name]
    assert (out[:, :, 1::3] == 0).all(), "rows no window covers (1, 4, 7, 10) get zero gradient"


def test_backward_is_deterministic():
    shape, window, stride, padding = PROBLEMS[2]
    x_t = sample(shape, torch.float32)
    dy_t = sample(output_dims(shape, window, stride, padding), torch.float32)
    g, x, dy, dx = backward_graph(x_t, dy_t, "avg_include_pad", window, stride, padding)
    first, second = run(g, {x: x_t, dy: dy_t})[dx.name], run(g, {x: x_t, dy: dy_t})[dx.name]
    assert torch.equal(first, second)
    assert "atomic" not in g.plan.launches[0].source_path.read_text()


# --- backward from the forward's indices ---------------------------------------------------------
MAX_POOLS = (torch.nn.functional.max_pool1d, torch.nn.functional.max_pool2d, torch.nn.functional.max_pool3d)
# overlapping windows with padding (3x3 stride 2 padding 1, ResNet's stem) and odd sizes per rank
INDEXED_PROBLEMS = {1: ((2, 5, 13), [3], [2], [1]), 2: ((2, 5, 9, 7), [3, 3], [2, 2], [1, 1]),
                    3: ((2, 3, 5, 7, 6), [3, 2, 3], [2, 1, 2], [1, 1, 1])}


def torch_indices(x_value, window, stride, padding):
    """torch's max pool values and int64 indices of x_value (computed in float32)."""
    return MAX_POOLS[len(window) - 1](x_value.float(), window, stride, padding, return_indices=True)


def indexed_backward_graph(x_value, dy_value, indices_value, window, stride, padding):
    g = dg.Graph(io_data_type=IO_TYPES[x_value.dtype])
    x, dy = g.tensor_like(x_value, "x"), g.tensor_like(dy_value, "dy")
    indices = g.tensor_like(indices_value, "indices")
    dx = g.pooling_backward(dy, x, "max", window, stride, padding, indices=indices).set_output(True)
    return g, (x, dy, indices), dx


def torch_grad(x_value, dy_value, window, stride, padding):
    leaf = x_value.float().requires_grad_(True)
    MAX_POOLS[len(window) - 1](leaf, window, stride, padding).backward(dy_value.float())
    return leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_indexed_backward_equals_torchs_with_ties_nan_and_infinities(spatial, layout, dtype):
    """Indices torch's forward made of x full of ties, NaN, inf and -inf windows: integer
    gradients summed exactly, so dx equals torch's; the float64 reference agrees."""
    shape, window, stride, padding = INDEXED_PROBLEMS[spatial]
    x_t = adversarial(shape, dtype, layout, seed=spatial)
    _, indices_t = torch_indices(x_t, window, stride, padding)
    dy_t = torch.randint(1, 5, output_dims(shape, window, stride, padding)).to(dtype)
    dy_t, indices_t = (channels_last(t) if layout == "nhwc" else t for t in (dy_t, indices_t))
    g, (x, dy, indices), dx = indexed_backward_graph(x_t, dy_t, indices_t, window, stride, padding)
    got = check(g, {x: x_t, dy: dy_t, indices: indices_t}, dtype)[dx.name]
    assert torch.equal(got.float(), torch_grad(x_t, dy_t, window, stride, padding))
    assert "argmax=indices" in g.plan.launches[0].config_text


@pytest.mark.parametrize("spatial,layout", [(1, "nhwc"), (2, "nchw"), (2, "nhwc"), (3, "nchw")])
def test_indexed_backward_of_random_values_against_the_reference(spatial, layout):
    shape, window, stride, padding = INDEXED_PROBLEMS[spatial]
    x_t = sample(shape, torch.float32, layout)
    _, indices_t = torch_indices(x_t, window, stride, padding)
    dy_t = sample(output_dims(shape, window, stride, padding), torch.float32, layout)
    g, (x, dy, indices), dx = indexed_backward_graph(x_t, dy_t, indices_t, window, stride, padding)
    got = check(g, {x: x_t, dy: dy_t, indices: indices_t})[dx.name]
    assert rel_err(got, torch_grad(x_t, dy_t, window, stride, padding)) < 1e-6


def test_indexed_backward_of_sliced_tensors_and_size_one_axes():
    """Non-contiguous x, dy and indices (each a slice of a larger tensor), then a plane of one
    row and a window covering it whole (size-1 axes, one window along the other)."""
    base = torch.randn(3, 9, 15, 14)
    x_t = base[1:, 2:7, 1::2, 3:]  # [2, 5, 8, 11]
    _, indices_t = torch_indices(x_t, [3, 3], [2, 2], [1, 1])
    dy_t = torch.randn(2, 5, 4, 6, 3)[..., 1]
    indices_t = torch.cat([indices_t, indices_t], dim=3)[:, :, :, ::2]
    assert not dy_t.is_contiguous() and not indices_t.is_contiguous()
    g, (x, dy, indices), dx = indexed_backward_graph(x_t, dy_t, indices_t, [3, 3], [2, 2], [1, 1])
    check(g, {x: x_t, dy: dy_t, indices: indices_t})
    x_t = sample((1, 1, 1, 5), torch.float32)
    _, indices_t = torch_indices(x_t, [1, 5], [1, 1], [0, 2])
    dy_t = sample(tuple(indices_t.shape), torch.float32)
    g, (x, dy, indices), dx = indexed_backward_graph(x_t, dy_t, indices_t, [1, 5], [1, 1], [0, 2])
    got = check(g, {x: x_t, dy: dy_t, indices: indices_t})[dx.name]
    assert rel_err(got, torch_grad(x_t, dy_t, [1, 5], [1, 1], [0, 2])) < 1e-6


def test_indices_outside_their_window_route_nothing():
    """The semantics: dy goes to the element its index names only when that element is in the
    window (every index 0 here: only windows covering element 0 route their gradient)."""
    x_t = sample((2, 3, 7, 6), torch.float32, "nhwc")
    dy_t = sample((2, 3, 4, 3), torch.float32, "nhwc")
    indices_t = torch.zeros(2, 3, 4, 3, dtype=torch.int64)
    g, (x, dy, indices), dx = indexed_backward_graph(x_t, dy_t, indices_t, [3, 3], [2, 2], [1, 1])
    got = check(g, {x: x_t, dy: dy_t, indices: indices_t})[dx.name]
    assert torch.equal(got[:, :, 0, 0], dy_t[:, :, 0, 0]) and (got.flatten(2)[:, :, 1:] == 0).all()


def test_forward_indices_feed_the_backward_in_one_graph():
    """pooling(return_indices=True) then pooling_backward(indices=...) in one graph: the same
    routing as torch, NaN and ties included; the graph survives JSON."""
    x_t = adversarial((2, 5, 9, 7), torch.float32, "nhwc", seed=3)
    dy_t = channels_last(torch.randint(1, 5, (2, 5, 5, 4)).float())
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy")
    y, indices = g.pooling(x, "max", [3, 3], [2, 2], [1, 1], return_indices=True)
    y.set_output(True)
    dx = g.pooling_backward(dy, x, "max", [3, 3], [2, 2], [1, 1], indices=indices).set_output(True)
    got = check(g, {x: x_t, dy: dy_t})[dx.name]
    assert torch.equal(got, torch_grad(x_t, dy_t, [3, 3], [2, 2], [1, 1]))
    again = run(dg.Graph.from_json(g.to_json()), {"x": x_t, "dy": dy_t})[dx.name]
    assert torch.equal(again, got)


@pytest.mark.parametrize("mask_from", ["input", "cmp_le"])
def test_relu_backward_epilogue_fuses_into_the_indexed_backward(mask_from):
    """ResNet's stem backward: the pool's input is a ReLU's output, whose mask selects dx in a
    where epilogue. The backward and its where are one kernel, which reads the mask once and dy
    and the indices once per covering window (never x for windows). The mask's compare, where
    the graph computes it from x (as the torch backend writes aten's threshold_backward), rides
    the epilogue too: x is read once, in place of the mask."""
    x_t = torch.relu(sample((2, 8, 11, 9), torch.bfloat16, "nhwc"))
    _, indices_t = torch_indices(x_t, [3, 3], [2, 2], [1, 1])
    indices_t = channels_last(indices_t)
    dy_t = sample(tuple(indices_t.shape), torch.bfloat16, "nhwc")
    g = dg.Graph(io_data_type=dg.bfloat16)
    x, dy, indices = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy"), g.tensor_like(indices_t, "indices")
    inputs = {x: x_t, dy: dy_t, indices: indices_t}
    if mask_from == "input":
        mask_t = channels_last(x_t <= 0)
        mask = g.tensor_like(mask_t, "mask")
        inputs[mask] = mask_t
    else:
        mask = g.cmp_le(x, 0.0)
    dx = g.pooling_backward(dy, x, "max", [3, 3], [2, 2], [1, 1], indices=indices)
    masked = g.where(mask, 0.0, dx).set_output(True)
    got = check(g, inputs, torch.bfloat16)[masked.name]
    want = torch_grad(x_t, dy_t, [3, 3], [2, 2], [1, 1]) * (x_t > 0)
    assert rel_err(got, want) < 1.6e-2
    pooling = [launch for launch in g.plan.launches if launch.group.kind == "pooling"]
    fused = ["pooling_backward", "where"] if mask_from == "input" else ["cmp_le", "pooling_backward", "where"]
    assert len(pooling) == 1 and sorted(n.op for n in pooling[0].group.nodes) == sorted(fused)
    assert len(g.plan.launches) == 1
    source = pooling[0].source_path.read_text()
    # the covering-window loop is unrolled by Triton: its loads appear once in the source; each
    # program position owns a 2x2 block of dx (stride 2), whose epilogue reads 4 mask elements
    assert source.count("tl.load(") == 2 + 4, "dy and the indices in the loop, then the mask (or x) per owned dx"
    assert source.count("_ptr,\n") == 4, "dy, the indices, the mask (or x) and dx"


def test_indexed_backward_with_prologue_on_dy_and_epilogue_on_dx():
    x_t = sample((2, 4, 9, 10), torch.float32, "nhwc")
    _, indices_t = torch_indices(x_t, [3, 2], [2, 2], [1, 0])
    dy_t, r_t = sample(tuple(indices_t.shape), torch.float32, "nhwc"), sample((2, 4, 9, 10), torch.float32)
    g = dg.Graph()
    x, dy, r = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy"), g.tensor_like(r_t, "r")
    indices = g.tensor_like(indices_t, "indices")
    dx = g.pooling_backward(g.mul(dy, 3.0), x, "max", [3, 2], [2, 2], [1, 0], indices=indices)
    g.add(dx, r).set_output(True)
    check(g, {x: x_t, dy: dy_t, r: r_t, indices: indices_t})
    assert len(g.plan.launches) == 1


def test_bad_indices_raise_at_the_op_call_and_change_nothing():
    g = dg.Graph()
    x, dy = g.tensor(name="x", dim=[2, 3, 7, 7]), g.tensor(name="dy", dim=[2, 3, 4, 4])
    good = g.tensor(name="good", dim=[2, 3, 4, 4], data_type=dg.int64)
    cases = [(g.tensor(name="i32", dim=[2, 3, 4, 4], data_type=dg.int32), "max", "int64"),
             (g.tensor(name="floats", dim=[2, 3, 4, 4], data_type=dg.float32), "max", "int64"),
             (g.tensor(name="short", dim=[2, 3, 4, 3], data_type=dg.int64), "max", "dims"),
             (g.tensor(name="flat", dim=[2, 3, 16], data_type=dg.int64), "max", "dims"),
             (good, "avg_include_pad", "mode"), (good, "avg_exclude_pad", "mode")]
    nodes = len(g.to_json())
    for indices, mode, message in cases:
        with pytest.raises(dg.ValidationError, match=message):
            g.pooling_backward(dy, x, mode, [3, 3], [2, 2], [1, 1], indices=indices)
    assert len(g.to_json()) == nodes, "a failed call adds nothing"
    with pytest.raises(dg.ValidationError):
        g.pooling_backward(dy, x, "max", [3, 3], [2, 2], [1, 1], indices=torch.zeros(2, 3, 4, 4))


def test_json_without_the_indices_input_still_loads():
    """A document written before pooling_backward took indices lists two inputs."""
    x_t = sample((2, 3, 7, 6), torch.float32)
    dy_t = sample((2, 3, 4, 3), torch.float32)
    g, x, dy, dx = backward_graph(x_t, dy_t, "max", [3, 3], [2, 2], [1, 1])
    document = json.loads(g.to_json())
    assert all(len(record["inputs"]) == 2 for record in document["nodes"])  # written as before
    outputs = run(dg.Graph.from_json(json.dumps(document)), {"x": x_t, "dy": dy_t})
    assert torch.equal(outputs[dx.name], run(g, {x: x_t, dy: dy_t})[dx.name])


# --- fusion --------------------------------------------------------------------------------------
def test_prologue_bias_relu_then_max_pool_is_one_kernel():
    x_t = sample((2, 5, 13, 11), torch.float32, "nhwc")
    b_t = torch.randn(1, 5, 1, 1)
    g = dg.Graph()
    x, b = g.tensor_like(x_t, "x"), g.tensor_like(b_t, "b")
    y = g.pooling(g.relu(g.add(x, b)), "max", [3, 3], [2, 2], [1, 1]).set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    check(g, {x: x_t, b: b_t})


def test_epilogue_scale_and_cast_with_pooled_output_stored():
    x_t = sample((2, 4, 11, 13), torch.float32)
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    pooled = g.pooling(x, "avg_exclude_pad", [2, 3], [2, 2], [1, 1]).set_output(True)
    scaled = g.cast(g.mul(pooled, 0.5), dg.float16).set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    outputs = check(g, {x: x_t}, torch.float16)
    assert outputs[scaled.name].dtype == torch.float16


def test_prologue_value_that_is_an_output_gets_its_own_kernel():
    x_t = sample((2, 3, 9, 9), torch.float32, "nhwc")
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    activated = g.relu(x).set_output(True)  # stride > window: the pool never reads some of it
    g.pooling(activated, "max", [2, 2], [3, 3], [0, 0]).set_output(True)
    check(g, {x: x_t})
    assert [launch.group.kind for launch in g.plan.launches] == ["pointwise", "pooling"]


def test_backward_with_prologue_on_dy_and_epilogue_on_dx():
    x_t = sample((2, 4, 9, 10), torch.float32, "nhwc")
    dy_t, r_t = sample((2, 4, 5, 5), torch.float32, "nhwc"), sample((2, 4, 9, 10), torch.float32, "nhwc")
    g = dg.Graph()
    x, dy, r = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy"), g.tensor_like(r_t, "r")
    dx = g.pooling_backward(g.mul(dy, 3.0), x, "max", [3, 2], [2, 2], [1, 0])
    g.add(dx, r).set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    check(g, {x: x_t, dy: dy_t, r: r_t})


# --- validation and schedule ---------------------------------------------------------------------
def test_window_larger_than_padded_input_fails_at_the_op_call():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 3, 4, 6])
    with pytest.raises(dg.ValidationError, match="larger than the padded input"):
        g.pooling(x, "max", [7, 3], [1, 1], [1, 1])
    with pytest.raises(dg.ValidationError, match="larger than the padded input"):
        dy = g.tensor(name="dy", dim=[2, 3, 1, 1])
        g.pooling_backward(dy, x, "avg_include_pad", [3, 9], [1, 1], [0, 1])


def test_offsets_past_two_to_the_31_use_int64_indexing():
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[64, 64, 768, 768])  # 2.4e9 elements: built, never run
    g.pooling(x, "max", [3, 3], [2, 2], [1, 1]).set_output(True)
    g.build()
    launch = g.plan.launches[0]
    assert "int64-index" in launch.config_text
    assert "tl.program_id(0).to(tl.int64)" in launch.source_path.read_text()


# --- GPU (bf16, benchmark-like layouts) ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_bf16_nhwc_2d_forward_and_backward(mode):
    shape, window, stride, padding = (8, 32, 57, 57), [3, 3], [2, 2], [1, 1]
    x_t = sample(shape, torch.bfloat16, "nhwc", "cuda")
    g, x, y = forward_graph(x_t, mode, window, stride, padding)
    check(g, {x: x_t}, torch.bfloat16, device="cuda")
    assert g.plan.launches[0]._bound, "went through the bound launcher"
    dy_t = sample(output_dims(shape, window, stride, padding), torch.bfloat16, "nhwc", "cuda")
    g, x, dy, dx = backward_graph(x_t, dy_t, mode, window, stride, padding)
    check(g, {x: x_t, dy: dy_t}, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["max", "avg_exclude_pad"])
def test_gpu_bf16_3d_forward_and_backward(mode):
    shape, window, stride, padding = (2, 16, 9, 17, 15), [3, 3, 3], [2, 2, 1], [1, 1, 1]
    x_t = sample(shape, torch.bfloat16, "nhwc", "cuda")
    g, x, y = forward_graph(x_t, mode, window, stride, padding)
    check(g, {x: x_t}, torch.bfloat16, device="cuda")
    dy_t = sample(output_dims(shape, window, stride, padding), torch.bfloat16, "nhwc", "cuda")
    g, x, dy, dx = backward_graph(x_t, dy_t, mode, window, stride, padding)
    check(g, {x: x_t, dy: dy_t}, torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_gpu_bf16_nhwc_indexed_backward_equals_the_recompute():
    """ResNet's stem pool backward (3x3 stride 2 padding 1, channels-last bf16): the indexed
    kernel and the recomputing one give torch's gradient."""
    shape, window, stride, padding = (4, 64, 57, 57), [3, 3], [2, 2], [1, 1]
    x_t = sample(shape, torch.bfloat16, "nhwc", "cuda")
    _, indices_t = torch.nn.functional.max_pool2d(x_t, window, stride, padding, return_indices=True)
    dy_t = sample(tuple(indices_t.shape), torch.bfloat16, "nhwc", "cuda")
    g, (x, dy, indices), dx = indexed_backward_graph(x_t, dy_t, indices_t, window, stride, padding)
    indexed = check(g, {x: x_t, dy: dy_t, indices: indices_t}, torch.bfloat16, device="cuda")[dx.name]
    g, x, dy, dx = backward_graph(x_t, dy_t, "max", window, stride, padding)
    recomputed = check(g, {x: x_t, dy: dy_t}, torch.bfloat16, device="cuda")[dx.name]
    assert torch.equal(indexed, recomputed)


# --- windows past the unroll budget (codegen/unrolling.py) ------------------------------------------
# 75 window positions: the forward's depth loop is a runtime loop around unrolled rows; stride 1
# makes 75 covering windows, so the averages' backward and the one from the forward's indices
# roll their depth loop too
WIDE = ((2, 2, 7, 6, 5), [5, 5, 3], [1, 1, 1], [2, 2, 1])
# a backward recomputing the argmax: 27 covering windows of 27 loads each, the covering loops
# rolled around an unrolled window (WIDE's 75 x 75 would take the interpreter minutes)
CUBE = ((2, 2, 5, 6, 4), [3, 3, 3], [1, 1, 1], [1, 1, 1])


def test_unrolled_loops_are_the_innermost_within_the_budget():
    from dnngraph.backends.triton.codegen.unrolling import unrolled_loops
    assert unrolled_loops([3, 3, 3], 64) == [True, True, True]
    assert unrolled_loops([2, 2, 3, 3, 3, 3], 64) == [False, False, False, True, True, True]
    assert unrolled_loops([5, 5, 3], 64) == [False, True, True]
    assert unrolled_loops([100], 64) == [False]
    assert unrolled_loops([1, 1, 80, 1], 64) == [False, False, False, True]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("mode", MODES)
def test_windows_past_the_unroll_budget_roll_their_outer_loops(mode, layout):
    """Runtime loops carry the max, its argmax and the sums across iterations as the unrolled
    ones did: torch's values exactly with ties, NaN, inf and -inf windows for max (integer dy
    summed exactly), the float64 reference for averages."""
    shape, window, stride, padding = WIDE
    x_t = adversarial(shape, torch.float32, layout) if mode == "max" else sample(shape, torch.float32, layout)
    g, x, y = forward_graph(x_t, mode, window, stride, padding)
    check(g, {x: x_t})
    source = g.plan.launches[0].source_path.read_text()
    assert "for kd in tl.range(WINDOW_D):" in source and "for kh in tl.static_range(WINDOW_H):" in source
    if mode == "max":
        shape, window, stride, padding = CUBE
        x_t = adversarial(shape, torch.float32, layout, seed=2)
    dy_t = torch.randint(1, 5, output_dims(shape, window, stride, padding)).float()
    dy_t = channels_last(dy_t) if layout == "nhwc" else dy_t
    g, x, dy, dx = backward_graph(x_t, dy_t, mode, window, stride, padding)
    got = check(g, {x: x_t, dy: dy_t})[dx.name]
    source = g.plan.launches[0].source_path.read_text()
    if mode == "max":
        assert "for jw in tl.range(COVER_W):" in source and "for kd in tl.static_range(WINDOW_D):" in source
        assert torch.equal(got, torch_grad(x_t, dy_t, window, stride, padding))
    else:
        assert "for jd in tl.range(COVER_D):" in source and "for jh in tl.static_range(COVER_H):" in source


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_indices_and_indexed_backward_past_the_unroll_budget(layout):
    shape, window, stride, padding = WIDE
    x_t = adversarial(shape, torch.float32, layout, seed=3)
    g, x, y, indices = indices_graph(x_t, window, stride, padding)
    outputs = check(g, {x: x_t})
    want_y, want_indices = torch_indices(x_t, window, stride, padding)
    assert torch.equal(outputs[indices.name], want_indices)
    assert torch.equal(outputs[y.name].nan_to_num(), want_y.nan_to_num())
    dy_t = torch.randint(1, 5, tuple(want_indices.shape)).float()
    dy_t = channels_last(dy_t) if layout == "nhwc" else dy_t
    indices_t = outputs[indices.name]
    g, (x, dy, indices), dx = indexed_backward_graph(x_t, dy_t, indices_t, window, stride, padding)
    got = check(g, {x: x_t, dy: dy_t, indices: indices_t})[dx.name]
    assert torch.equal(got, torch_grad(x_t, dy_t, window, stride, padding))
    assert "for jd in tl.range(COVER_D):" in g.plan.launches[0].source_path.read_text()


@pytest.mark.parametrize("indexed", [False, True])
def test_backward_whose_dy_is_x_itself(indexed):
    """dy and x one tensor (a same-size pool): the indexed kernel, which reads no x for its
    windows, still binds it as dy."""
    x_t = torch.randn(2, 3, 6, 5)
    _, idx_t = torch.nn.functional.max_pool2d(x_t, 3, 1, 1, return_indices=True)
    g = dg.Graph()
    x, idx = g.tensor_like(x_t, "x"), g.tensor_like(idx_t, "idx")
    dx = g.pooling_backward(x, x, "max", [3, 3], [1, 1], [1, 1], indices=idx if indexed else None).set_output(True)
    check(g, {x: x_t, idx: idx_t} if indexed else {x: x_t})


def test_backward_without_indices_is_written_as_before_indices_existed():
    """A pooling_backward with no indices keeps its two-input record (readers of the same schema
    version from before the indices load it); one with indices lists three."""
    g = dg.Graph()
    x = g.tensor(name="x", dim=[1, 2, 5, 5], data_type=dg.float32)
    dy = g.tensor(name="dy", dim=[1, 2, 3, 3], data_type=dg.float32)
    idx = g.tensor(name="idx", dim=[1, 2, 3, 3], data_type=dg.int64)
    g.pooling_backward(dy, x, "max", [3, 3], [2, 2], [1, 1]).set_output(True)
    g.pooling_backward(dy, x, "max", [3, 3], [2, 2], [1, 1], indices=idx).set_output(True)
    records = [n for n in json.loads(g.to_json())["nodes"] if n["op"] == "pooling_backward"]
    assert [len(n["inputs"]) for n in records] == [2, 3]


# --- ceil mode (partial last windows) and a fixed divisor, as torch's ------------------------------
AVG_POOLS = (torch.nn.functional.avg_pool1d, torch.nn.functional.avg_pool2d, torch.nn.functional.avg_pool3d)
# per problem, (shape, window, stride, padding): every one has a ceil-mode last window running past
# the padded input; the 1D one also meets torch's rule that drops a window starting in the right
# padding (5 + 2 - 2 over stride 2 rounds up to 4 windows, the 4th would start at 5 + 1 - 1 = 5)
CEIL_PROBLEMS = {
    "1d_dropped_window": ((2, 3, 5), [2], [2], [1]),
    "2d": ((2, 3, 8, 7), [3, 2], [2, 2], [1, 0]),
    "2d_size_one_axis": ((1, 3, 1, 5), [1, 3], [1, 2], [0, 1]),
    "3d": ((2, 2, 5, 6, 4), [2, 3, 2], [2, 2, 3], [1, 1, 0]),
}


def torch_pool(x_value, mode, window, stride, padding, divisor=None):
    """torch's own pooling in ceil mode (mode as dnngraph names it)."""
    if mode == "max":
        return MAX_POOLS[len(window) - 1](x_value, window, stride, padding, ceil_mode=True)
    keywords = dict(ceil_mode=True, count_include_pad=mode == "avg_include_pad")
    if divisor is not None:
        keywords["divisor_override"] = divisor
        if len(window) == 1:  # avg_pool1d takes no divisor_override: a 2D pool of height 1
            return torch.nn.functional.avg_pool2d(x_value.unsqueeze(2), [1] + window, [1] + stride, [0] + padding,
                                                  **keywords).squeeze(2)
    return AVG_POOLS[len(window) - 1](x_value, window, stride, padding, **keywords)


def ceil_graphs(x_value, dy_value, mode, window, stride, padding, divisor=None):
    """A forward and a backward graph in ceil mode: (g, x, dy, y, dx)."""
    g = dg.Graph(io_data_type=IO_TYPES[x_value.dtype])
    x, dy = g.tensor_like(x_value, "x"), g.tensor_like(dy_value, "dy")
    options = dict(ceil_mode=True, divisor=divisor)
    y = g.pooling(x, mode, window, stride, padding, **options).set_output(True)
    dx = g.pooling_backward(dy, x, mode, window, stride, padding, **options).set_output(True)
    return g, x, dy, y, dx


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("problem", sorted(CEIL_PROBLEMS))
@pytest.mark.parametrize("mode,divisor", [("max", None), ("avg_include_pad", None), ("avg_exclude_pad", None),
                                          ("avg_include_pad", 5), ("avg_exclude_pad", -2)])
def test_ceil_mode_and_divisor_forward_and_backward_are_torchs(mode, divisor, problem, layout):
    """The output size, the partial windows' divisors (the part inside the padded input, or the
    input) and the backward through them: kernels against the float64 reference, the
    reference against torch's own pooling and its autograd."""
    shape, window, stride, padding = CEIL_PROBLEMS[problem]
    if layout == "nhwc" and len(shape) == 3:
        pytest.skip("channels-last of a 1D pool is the nchw case transposed; covered by 2D/3D")
    x_t = sample(shape, torch.float32, layout)
    pooled = torch_pool(x_t.double(), mode, window, stride, padding, divisor)
    dy_t = sample(tuple(pooled.shape), torch.float32, layout)
    g, x, dy, y, dx = ceil_graphs(x_t, dy_t, mode, window, stride, padding, divisor)
    assert tuple(y.dim) == tuple(pooled.shape)
    check(g, {x: x_t, dy: dy_t})
    refs = g.reference({x: x_t, dy: dy_t})
    torch.testing.assert_close(refs[y.name], pooled)
    leaf = x_t.double().requires_grad_(True)
    (want_dx,) = torch.autograd.grad(torch_pool(leaf, mode, window, stride, padding, divisor), leaf, dy_t.double())
    torch.testing.assert_close(refs[dx.name], want_dx)


@pytest.mark.parametrize("mode", MODES)
def test_ceil_mode_with_nan_and_infinities_propagates_as_torch(mode):
    x_t = adversarial((2, 3, 8, 7), torch.float32, "nchw", seed=3)
    x_t[0, 0, 7, 6] = float("nan")  # alone in the last, partial window
    pooled = torch_pool(x_t, mode, [3, 2], [2, 2], [1, 0])
    dy_t = torch.randint(1, 4, pooled.shape).float()
    g, x, dy, y, dx = ceil_graphs(x_t, dy_t, mode, [3, 2], [2, 2], [1, 0])
    outs = run(g, {x: x_t, dy: dy_t})
    torch.testing.assert_close(outs[y.name], pooled, equal_nan=True)
    leaf = x_t.clone().requires_grad_(True)
    (want_dx,) = torch.autograd.grad(torch_pool(leaf, mode, [3, 2], [2, 2], [1, 0]), leaf, dy_t)
    torch.testing.assert_close(outs[dx.name], want_dx, equal_nan=True)


def test_ceil_mode_max_indices_and_the_indexed_backward_are_torchs():
    x_t = adversarial((2, 3, 8, 7), torch.float32, "nhwc", seed=4)
    want, want_indices = torch.nn.functional.max_pool2d(x_t, [3, 2], [2, 2], [1, 0], ceil_mode=True,
                                                        return_indices=True)
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    y, indices = g.pooling(x, "max", [3, 2], [2, 2], [1, 0], return_indices=True, ceil_mode=True)
    dy = g.tensor(name="dy", dim=list(want.shape))
    dx = g.pooling_backward(dy, x, "max", [3, 2], [2, 2], [1, 0], indices=indices, ceil_mode=True)
    for t in (y, indices, dx):
        t.set_output(True)
    dy_t = torch.randint(1, 5, want.shape).float()
    outs = run(g, {x: x_t, dy: dy_t})
    assert torch.equal(outs[indices.name], want_indices)
    torch.testing.assert_close(outs[y.name], want, equal_nan=True)
    leaf = x_t.clone().requires_grad_(True)
    torch.nn.functional.max_pool2d(leaf, [3, 2], [2, 2], [1, 0], ceil_mode=True).backward(dy_t)
    assert torch.equal(outs[dx.name], leaf.grad)


def test_ceil_mode_and_divisor_survive_json():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[1, 2, 8, 7])
    g.pooling(x, "avg_exclude_pad", [3, 2], [2, 2], [1, 0], ceil_mode=True, divisor=7).set_output(True)
    again = dg.Graph.from_json(g.to_json())
    (node,) = again.nodes
    assert node.attrs.ceil_mode is True and node.attrs.divisor == 7 and node.outputs[0].dim == (1, 2, 5, 4)


@pytest.mark.parametrize("keywords,message", [
    (dict(mode="avg_include_pad", divisor=0), "divisor"),
    (dict(mode="max", divisor=2), "divisor"),
    (dict(mode="avg_exclude_pad", divisor=2.5), "divisor"),
    (dict(mode="avg_include_pad", divisor=True), "divisor"),
    (dict(mode="max", ceil_mode=1), "ceil_mode"),
])
def test_bad_ceil_mode_or_divisor_raise_at_the_op_call_and_change_nothing(keywords, message):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[1, 2, 8, 7])
    mode = keywords.pop("mode")
    with pytest.raises(dg.ValidationError, match=message):
        g.pooling(x, mode, [3, 2], [2, 2], [1, 0], **keywords)
    assert len(g.nodes) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode,divisor", [("max", None), ("avg_include_pad", None), ("avg_exclude_pad", None),
                                          ("avg_include_pad", 7)])
def test_gpu_bf16_ceil_mode_forward_and_backward(mode, divisor):
    shape, window, stride, padding = (4, 32, 28, 27), [3, 3], [2, 2], [1, 1]
    x_t = sample(shape, torch.bfloat16, "nhwc", "cuda")
    pooled = torch_pool(x_t.float(), mode, window, stride, padding, divisor)
    dy_t = sample(tuple(pooled.shape), torch.bfloat16, "nhwc", "cuda")
    g, x, dy, y, dx = ceil_graphs(x_t, dy_t, mode, window, stride, padding, divisor)
    check(g, {x: x_t, dy: dy_t}, torch.bfloat16, device="cuda")


# --- the owned-block backward over the geometries that shape it -----------------------------------
# (shape, window, stride, padding, layout, dtype): strides 1 to 3 with every padding up to window // 2,
# strides past the window (gaps), windows covering the whole input, windows larger than the input
# with padding, 1x1 windows, 1D and 3D; layouts "nchw", "nhwc" and "sliced" (a non-contiguous view)
OWNED_GEOMETRIES = [
    ((3, 5, 13, 11), [3, 3], [1, 1], [0, 1], "nhwc", torch.float32),
    ((3, 5, 13, 11), [3, 3], [2, 2], [0, 0], "nchw", torch.bfloat16),
    ((3, 5, 13, 11), [3, 3], [2, 2], [1, 1], "sliced", torch.float32),
    ((3, 5, 13, 11), [3, 3], [3, 3], [1, 0], "nhwc", torch.float16),
    ((3, 5, 13, 11), [3, 2], [3, 2], [1, 1], "nchw", torch.float32),
    ((2, 3, 11, 10), [2, 3], [3, 4], [1, 1], "nhwc", torch.float32),
    ((2, 3, 7, 6), [1, 1], [2, 3], [0, 0], "sliced", torch.float16),
    ((2, 3, 4, 5), [4, 5], [2, 3], [0, 0], "nchw", torch.float32),
    ((1, 2, 2, 3), [5, 5], [2, 3], [2, 2], "nhwc", torch.float32),
    ((1, 1, 1, 1), [1, 1], [2, 2], [0, 0], "nchw", torch.float32),
    ((2, 4, 17), [5], [3], [2], "nhwc", torch.bfloat16),
    ((2, 3, 7, 5, 6), [3, 3, 3], [2, 2, 2], [1, 0, 1], "nhwc", torch.float32),
    ((1, 3, 13, 12), [7, 7], [4, 4], [3, 2], "nhwc", torch.float32),  # 16 owned: the window's rows roll
    ((2, 3, 9, 8), [5, 3], [1, 2], [2, 1], "nchw", torch.float32),  # a stride-1 axis with padding
]


def in_layout(value: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as NCHW, NHWC or a non-contiguous slice of a wider tensor."""
    if layout == "nhwc":
        return channels_last(value)
    if layout == "sliced":
        wide = torch.zeros(value.shape[:-1] + (2 * value.shape[-1],), dtype=value.dtype)
        wide[..., 1::2] = torch.nan if value.is_floating_point() else -1  # poison between the elements
        wide[..., ::2] = value
        return wide[..., ::2]
    return value


def owned_inputs(geometry, mode, seed):
    """x (ties, NaN, inf and -inf windows for max; random for averages), dy (integers for max,
    so torch's sums are exact) and torch's indices, all in the geometry's layout and dtype."""
    shape, window, stride, padding, layout, dtype = geometry
    if mode.startswith("max") and min(shape) > 1 and len(shape) > 3:
        x_t = adversarial(shape, dtype, "nchw", seed=seed)
    else:
        x_t = sample(shape, dtype)
    dims = output_dims(shape, window, stride, padding)
    dy_t = torch.randint(1, 5, dims).to(dtype) if mode.startswith("max") else sample(dims, dtype)
    _, indices_t = torch_indices(x_t, window, stride, padding)
    return tuple(in_layout(t, layout) for t in (x_t, dy_t, indices_t))


@pytest.mark.parametrize("mode", ["max", "max indexed", "avg_include_pad", "avg_exclude_pad"])
@pytest.mark.parametrize("geometry", OWNED_GEOMETRIES, ids=lambda g: f"{g[0]}-w{g[1]}-s{g[2]}-p{g[3]}-{g[4]}")
def test_backward_of_every_stride_padding_and_layout(geometry, mode):
    """Every backward (argmax recomputed, routed by indices, both averages) against the float64
    reference on poisoned outputs; the max ones equal torch's gradient exactly (integer dy),
    ties, NaN and infinities included. Strides above 1 own a block of dx per tile position."""
    shape, window, stride, padding, _, dtype = geometry
    x_t, dy_t, indices_t = owned_inputs(geometry, mode, seed=len(shape) + sum(stride))
    g, inputs, dx = _backward_graph(x_t, dy_t, indices_t, mode, (window, stride, padding), IO_TYPES[dtype])
    got = check(g, inputs, dtype)[dx.name]
    if mode.startswith("max"):
        assert torch.equal(got.float(), torch_grad(x_t, dy_t, window, stride, padding))
    owned = "x".join(map(str, stride))
    assert (f"owned={owned}" in g.plan.launches[0].config_text) == (1 < math.prod(stride) <= 16)


def test_owned_block_is_the_stride_within_the_accumulator_budget():
    from dnngraph.backends.triton.heuristics.pooling import OWNED_POSITIONS_MAX, owned_block, owner_dims
    assert owned_block((2, 2)) == (2, 2) and owned_block((2, 2, 2)) == (2, 2, 2) and owned_block((3,)) == (3,)
    assert owned_block((1, 1)) == () and owned_block((5, 4)) == ()  # nothing to share; too many accumulators
    assert math.prod(owned_block((4, 4))) == OWNED_POSITIONS_MAX
    # blocks [o * s - p % s, (o + 1) * s - p % s) cover every position of the axis exactly once,
    # and each owns at least one of them (no program with nothing to write)
    for size, s, p in [(13, 2, 1), (13, 3, 0), (1, 2, 0), (11, 4, 1), (112, 2, 1), (9, 1, 3), (7, 2, 3), (5, 4, 4)]:
        (blocks,) = owner_dims((size,), (s,), (p,))
        owned = [[o * s - p % s + r for r in range(s)] for o in range(blocks)]
        assert sorted(h for block in owned for h in block if 0 <= h < size) == list(range(size))
        assert all(any(0 <= h < size for h in block) for block in owned), (size, s, p)


# --- GPU at the benchmark shapes (benchmarks/bench_memory_bound.py, benchmarks/sweep_pooling.py) -----
BENCH_FORWARD, BENCH_BACKWARD = (32, 64, 112, 112), (64, 64, 112, 112)
# The tile the H200 sweep measured best, or within 3% of it, per kernel kind at these shapes
# (3x3 stride 2 padding 1 bf16; BENCHMARKS.md "Pooling", 2026-11-29): the model's first choice
MEASURED_TILES = {
    ("max", "forward", "nhwc"): "BLOCK_R=8 BLOCK_C=64 num_warps=2",  # 32.3 us (64x64 w8: 35.1)
    ("max", "forward", "nchw"): "BLOCK_R=8 BLOCK_C=64 num_warps=2",  # 70.8 us (64x64 w8: 146.3)
    ("avg_include_pad", "forward", "nhwc"): "BLOCK_R=8 BLOCK_C=64 num_warps=2",  # 27.4 us (best 26.6)
    ("max indexed", "backward", "nhwc"): "BLOCK_R=32 BLOCK_C=64 num_warps=4",  # 105.3 us (8x64 w8: 117.8)
    ("max", "backward", "nhwc"): "BLOCK_R=8 BLOCK_C=64 num_warps=4",  # 302.8 us (16x64 w8: 303.9)
    ("max", "backward", "nchw"): "BLOCK_R=8 BLOCK_C=64 num_warps=4",  # 613.5 us (16x64 w8: 1158.0)
    ("avg_include_pad", "backward", "nhwc"): "BLOCK_R=32 BLOCK_C=64 num_warps=4",  # 37.2 us (best 36.4)
}


@pytest.mark.parametrize("kind", list(MEASURED_TILES), ids=" ".join)
def test_the_model_picks_the_measured_tiles_at_the_benchmark_shapes(kind):
    """Built for the H200 (no kernel runs: shapes only, on the meta device)."""
    mode, direction, layout = kind
    window, stride, padding = [3, 3], [2, 2], [1, 1]
    shape = BENCH_FORWARD if direction == "forward" else BENCH_BACKWARD

    def meta(dims, dtype=torch.bfloat16):
        value = torch.empty(dims, dtype=dtype, device="meta")
        return value.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else value

    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor_like(meta(shape), "x")
    if direction == "forward":
        g.pooling(x, mode, window, stride, padding).set_output(True)
    else:
        dims = output_dims(shape, window, stride, padding)
        dy = g.tensor_like(meta(dims), "dy")
        indices = g.tensor_like(meta(dims, torch.int64), "indices") if mode == "max indexed" else None
        g.pooling_backward(dy, x, mode.split()[0], window, stride, padding, indices=indices).set_output(True)
    g.build(options=dg.BuildOptions(target=dg.target.H200))
    assert g.plan.launches[0].config_text.startswith(MEASURED_TILES[kind] + " ")



@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("mode", ["max", "avg_include_pad"])
def test_gpu_bf16_forward_at_the_benchmark_shape(mode, layout):
    x_t = sample(BENCH_FORWARD, torch.bfloat16, layout, "cuda")
    g, x, y = forward_graph(x_t, mode, [3, 3], [2, 2], [1, 1])
    check(g, {x: x_t}, torch.bfloat16, device="cuda", reference_device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("mode", ["max", "max indexed", "avg_include_pad"])
def test_gpu_bf16_backward_at_the_benchmark_shape(mode, layout):
    """ResNet-50's stem pool backward, each path: the max ones equal torch's gradient exactly
    (integer dy), the average against the float64 reference."""
    window, stride, padding = [3, 3], [2, 2], [1, 1]
    x_t = sample(BENCH_BACKWARD, torch.bfloat16, layout, "cuda")
    _, indices_t = torch.nn.functional.max_pool2d(x_t, window, stride, padding, return_indices=True)
    dims = tuple(indices_t.shape)
    dy_t = torch.randint(1, 5, dims, device="cuda").to(torch.bfloat16) if mode.startswith("max") else \
        sample(dims, torch.bfloat16, "nchw", "cuda")
    dy_t, indices_t = (channels_last(t) if layout == "nhwc" else t.contiguous() for t in (dy_t, indices_t))
    g = _gpu_backward_against_torch(x_t, dy_t, indices_t, mode, (window, stride, padding),
                                    torch.nn.functional.max_pool2d)
    assert "owned=2x2" in g.plan.launches[0].config_text


def _backward_graph(x_t, dy_t, indices_t, mode: str, geometry, io_type):
    """(graph, bindings, dx) of the pooling backward of `mode` ("max", "max indexed", an average
    mode) over x_t and dy_t, routed by indices_t in the indexed mode."""
    window, stride, padding = geometry
    g = dg.Graph(io_data_type=io_type)
    x, dy = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy")
    inputs = {x: x_t, dy: dy_t}
    indices = None
    if mode == "max indexed":
        indices = g.tensor_like(indices_t, "indices")
        inputs[indices] = indices_t
    dx = g.pooling_backward(dy, x, mode.split()[0], window, stride, padding, indices=indices).set_output(True)
    return g, inputs, dx


def _gpu_backward_against_torch(x_t, dy_t, indices_t, mode: str, geometry, max_pool):
    """The pooling backward of `mode` ("max", "max indexed", an average mode) on the GPU against
    the float64 reference, and a max mode's gradient equal to torch's (`max_pool`); the graph."""
    window, stride, padding = geometry
    g, inputs, dx = _backward_graph(x_t, dy_t, indices_t, mode, geometry, dg.bfloat16)
    got = check(g, inputs, torch.bfloat16, device="cuda", reference_device="cuda")[dx.name]
    if mode.startswith("max"):
        leaf = x_t.float().requires_grad_(True)
        max_pool(leaf, window, stride, padding).backward(dy_t.float())
        assert torch.equal(got.float(), leaf.grad)
    return g


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("mode", ["max", "avg_exclude_pad"])
def test_owned_block_backward_with_broadcast_prologue_and_epilogue(mode, layout):
    """dy scaled by a per-channel tensor at each covering window's load (hoisted out of the
    loops), dx plus a per-channel broadcast tensor in the epilogue of every owned position, x
    made by a pointwise kernel before: the backward and its chains are one kernel, against the
    float64 reference."""
    a_t = sample((2, 5, 11, 9), torch.float32, layout)
    bias_t, scale_t = sample((1, 5, 1, 1), torch.float32), sample((1, 5, 1, 1), torch.float32)
    dy_t = sample(output_dims(a_t.shape, [3, 3], [2, 2], [1, 1]), torch.float32, layout)
    g = dg.Graph()
    a, bias, scale, dy = (g.tensor_like(t, n) for t, n in ((a_t, "a"), (bias_t, "bias"), (scale_t, "scale"), (dy_t, "dy")))
    x = g.relu(g.add(a, bias))
    dx = g.pooling_backward(g.mul(dy, scale), x, mode, [3, 3], [2, 2], [1, 1])
    g.add(dx, bias).set_output(True)
    check(g, {a: a_t, bias: bias_t, scale: scale_t, dy: dy_t})
    pooling = [launch for launch in g.plan.launches if launch.group.kind == "pooling"]
    assert len(pooling) == 1 and "owned=2x2" in pooling[0].config_text
    assert sorted(n.op for n in pooling[0].group.nodes) == ["add", "mul", "pooling_backward"]
    # a per-channel operand is one load a program, not one per covering window or owned position
    source = pooling[0].source_path.read_text()
    for tensor in (bias, scale):
        assert source.count(f"tl.load({pointer_name(pooling[0], tensor)}") == 1, tensor.name


def pointer_name(launch, tensor) -> str:
    """The kernel parameter through which `launch` reads or writes `tensor`."""
    (name,) = [a.name for a in launch.arguments if a.kind == "tensor" and a.value == tensor.uid]
    return name


# --- the unrolling budget of every pooling kernel, read from its source ----------------------------
def unrolled_bodies(launch) -> int:
    """The most loads and owned-position accumulations the launch's kernel source copies out by static
    (unrolled) loops into one stretch of code without a runtime loop: each such line counts the
    product of the static loop extents around it, up to its nearest runtime loop."""
    import re
    constants = {a.name: a.value for a in launch.arguments if a.kind == "constexpr"}
    counted = re.compile(r"tl\.load\(|\bacc_[\d_]+ \+=")  # loads; an owned position's accumulation
    loop = re.compile(r"for \w+ in tl\.(static_range|range)\((\w+)\):")
    stack, stretches = [], {}  # stack: (indent, static extent or None for a runtime loop, line)
    for number, text in enumerate(launch.source_path.read_text().splitlines()):
        indent = len(text) - len(text.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        found = loop.search(text)
        if found:
            extent = constants.get(found.group(2), found.group(2))
            stack.append((indent, int(extent) if found.group(1) == "static_range" else None, number))
        elif stack and counted.search(text):
            copies, stretch = 1, None
            for _, extent, line in reversed(stack):
                if extent is None:
                    stretch = line
                    break
                copies *= extent
            stretches[stretch] = stretches.get(stretch, 0) + copies
    return max(stretches.values(), default=0)


# (shape, window, stride, padding): windows and strides whose owned blocks, covering windows and
# argmax windows together pass the budget one way or another (7x7 stride 4: 49 loads and 16 owned)
BUDGET_GEOMETRIES = [
    ((1, 2, 23, 23), [7, 7], [4, 4], [3, 3]),
    ((1, 2, 23, 23), [8, 8], [4, 4], [4, 4]),
    ((1, 2, 23, 23), [7, 7], [3, 3], [3, 3]),
    ((1, 2, 23, 23), [7, 7], [2, 2], [3, 3]),
    ((1, 2, 23, 23), [5, 5], [4, 4], [2, 2]),
    ((1, 2, 23, 23), [3, 3], [2, 2], [1, 1]),
    ((1, 2, 9, 9, 9), [3, 3, 3], [2, 2, 2], [1, 1, 1]),
    ((1, 2, 9, 9, 9), [5, 5, 5], [2, 2, 2], [2, 2, 2]),
    ((1, 2, 9, 9, 9), [4, 4, 4], [2, 2, 4], [2, 2, 2]),
    ((1, 2, 40), [16], [4], [8]),
    ((1, 2, 23, 23), [7, 7], [5, 5], [3, 3]),  # 25 positions: the gather per dx element
    ((1, 2, 9, 9, 9), [5, 5, 5], [1, 1, 1], [2, 2, 2]),
]


@pytest.mark.parametrize("direction", ["forward", "max", "max indexed", "avg_include_pad"])
@pytest.mark.parametrize("geometry", BUDGET_GEOMETRIES, ids=lambda g: f"w{g[1]}-s{g[2]}")
def test_every_pooling_kernel_unrolls_within_the_budget(geometry, direction):
    """A kernel's source grows, and ptxas's time with it, with the loads and accumulations its
    static loops copy out: none may pass UNROLLED_BODIES_MAX in one stretch of code, however
    the owned blocks, covering windows and argmax windows nest (built only, not run)."""
    from dnngraph.backends.triton.codegen.unrolling import UNROLLED_BODIES_MAX
    shape, window, stride, padding = geometry
    x_t = sample(shape, torch.float32, "nhwc")
    if direction == "forward":
        g = forward_graph(x_t, "max", window, stride, padding)[0]
    else:
        dy_t = sample(output_dims(shape, window, stride, padding), torch.float32, "nhwc")
        g = dg.Graph()
        x, dy = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy")
        indices = g.tensor(name="indices", dim=dy.dim, stride=dy.stride, data_type=dg.int64) \
            if direction == "max indexed" else None
        g.pooling_backward(dy, x, direction.split()[0], window, stride, padding, indices=indices).set_output(True)
    g.build()
    (launch,) = g.plan.launches
    assert 0 < unrolled_bodies(launch) <= UNROLLED_BODIES_MAX, launch.config_text


# --- random geometries: every backward path against torch ----------------------------------------
def random_backward_case(seed: int):
    """A seeded random backward: rank 1-3, window, stride (gaps and owned blocks of every size,
    past OWNED_POSITIONS_MAX too), padding up to half the window, ceil mode, a divisor, layout,
    and for max indices torch's forward made or arbitrary ones (outside their window, the
    plane, negative)."""
    import random
    rng = random.Random(seed)
    rank = rng.choice([1, 2, 2, 3])
    window = [rng.randint(1, 6 if rank < 3 else 4) for _ in range(rank)]
    stride = [rng.randint(1, 5) for _ in range(rank)]
    padding = [rng.randint(0, w // 2) for w in window]
    spatial = [max(w - 2 * p, 1) + rng.randint(0, 8 if rank < 3 else 3) for w, p in zip(window, padding)]
    shape = [rng.randint(1, 3), rng.randint(1, 4)] + spatial
    mode = ["max", "max indexed", "max arbitrary indices", "avg_include_pad", "avg_exclude_pad"][seed % 5]
    divisor = rng.choice([None, 3, -2]) if mode.startswith("avg") else None
    return shape, window, stride, padding, rng.random() < 0.4, mode, divisor, rng.choice(["nchw", "nhwc"])


@pytest.mark.parametrize("seed", range(20))
def test_random_backward_geometries_against_torch(seed):
    """dx written once at every position (poisoned first) for random geometries: the max ones
    equal torch's gradient exactly (integer dy; ties, NaN and -inf in x), arbitrary indices
    and averages the float64 reference."""
    shape, window, stride, padding, ceil, mode, divisor, layout = random_backward_case(seed)
    generator = torch.Generator().manual_seed(seed)
    x_t = torch.randint(-2, 3, shape, generator=generator).float()
    picks = torch.randperm(x_t.numel(), generator=generator)
    x_t.view(-1)[picks[:2]], x_t.view(-1)[picks[2:4]] = float("nan"), float("-inf")
    _, indices_t = MAX_POOLS[len(window) - 1](x_t, window, stride, padding, ceil_mode=ceil, return_indices=True)
    if mode == "max arbitrary indices":
        indices_t = torch.randint(-2, math.prod(shape[2:]) + 2, indices_t.shape, generator=generator)
    dy_t = torch.randint(1, 5, indices_t.shape, generator=generator).float()
    x_t, dy_t, indices_t = (in_layout(t, layout) for t in (x_t, dy_t, indices_t))
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy")
    inputs = {x: x_t, dy: dy_t}
    indices = None
    if "indic" in mode:
        indices = g.tensor_like(indices_t, "indices")
        inputs[indices] = indices_t
    dx = g.pooling_backward(dy, x, mode.split()[0], window, stride, padding, indices=indices, ceil_mode=ceil,
                            divisor=divisor).set_output(True)
    got = check(g, inputs)[dx.name]
    if mode in ("max", "max indexed"):
        leaf = x_t.clone().requires_grad_(True)
        MAX_POOLS[len(window) - 1](leaf, window, stride, padding, ceil_mode=ceil).backward(dy_t)
        assert torch.equal(got, leaf.grad)


@pytest.mark.parametrize("mode", ["max", "avg_exclude_pad"])
def test_owned_block_backward_blends_each_position_with_its_prior(mode):
    """dx stored as alpha * dx + beta * prior (alpha a graph tensor): each owned position reads
    and writes its own prior, none twice."""
    x_t = sample((2, 5, 11, 9), torch.float32, "nhwc")
    dy_t = sample(output_dims(x_t.shape, [3, 3], [2, 2], [1, 1]), torch.float32, "nhwc")
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy")
    alpha = g.tensor(name="alpha", dim=[1], data_type=dg.float32)
    dx = g.pooling_backward(dy, x, mode, [3, 3], [2, 2], [1, 1]).set_output(True).set_blend(alpha, 0.5)
    g.build()
    prior = sample(tuple(x_t.shape), torch.float32, "nhwc")
    got, alpha_t = prior.clone(), torch.tensor([1.5])
    g.execute({x: x_t, dy: dy_t, alpha: alpha_t, dx: got})
    expected = 1.5 * g.reference({x: x_t, dy: dy_t, alpha: alpha_t})[dx.name] + 0.5 * prior.double()
    assert rel_err(got, expected) < 1e-6
    assert "owned=2x2" in g.plan.launches[0].config_text


def test_owned_block_backward_past_two_to_the_31_uses_int64_indexing():
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[64, 64, 768, 768])  # 2.4e9 elements: built, never run
    dy = g.tensor(name="dy", dim=[64, 64, 384, 384])
    g.pooling_backward(dy, x, "max", [3, 3], [2, 2], [1, 1]).set_output(True)
    g.build()
    launch = g.plan.launches[0]
    assert "int64-index" in launch.config_text and "owned=2x2" in launch.config_text
    assert "tl.program_id(0).to(tl.int64)" in launch.source_path.read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["max", "max indexed", "avg_exclude_pad"])
@pytest.mark.parametrize("geometry", [((8, 64, 57, 57), [7, 7], [4, 4], [3, 3]),  # the window's rows roll
                                      ((8, 64, 56, 56), [5, 5], [2, 2], [2, 2]),  # no block wholly in padding
                                      ((4, 32, 17, 19, 15), [3, 3, 3], [2, 2, 2], [1, 1, 1])],
                         ids=["7x7s4", "5x5s2", "3x3x3s2"])
def test_gpu_bf16_owned_backward_geometries(geometry, mode):
    """The owned-block backwards whose unrolling or block count this branch changed, compiled
    for the GPU: the max ones equal torch's gradient exactly (integer dy)."""
    shape, window, stride, padding = geometry
    x_t = sample(shape, torch.bfloat16, "nhwc", "cuda")
    _, indices_t = MAX_POOLS[len(window) - 1](x_t, window, stride, padding, return_indices=True)
    dy_t = torch.randint(1, 5, indices_t.shape, device="cuda").to(torch.bfloat16) if mode.startswith("max") else \
        sample(tuple(indices_t.shape), torch.bfloat16, "nchw", "cuda")
    dy_t, indices_t = channels_last(dy_t), channels_last(indices_t)
    g = _gpu_backward_against_torch(x_t, dy_t, indices_t, mode, (window, stride, padding), MAX_POOLS[len(window) - 1])
    assert "owned=" in g.plan.launches[0].config_text


@pytest.mark.parametrize("mode", ["max indexed", "avg_include_pad"])
def test_owned_backward_with_operands_in_different_layouts(mode):
    """x NCHW, dy NHWC, the forward's indices NCHW, dx stored NHWC: every operand read and
    written with its own strides; the index is the plane's, whatever the layout."""
    window, stride, padding = [3, 3], [2, 2], [1, 1]
    x_t = adversarial((2, 5, 11, 9), torch.float32, "nchw", seed=5)
    _, indices_t = torch_indices(x_t, window, stride, padding)
    dy_t = channels_last(torch.randint(1, 5, indices_t.shape).float())
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy")
    inputs = {x: x_t, dy: dy_t}
    indices = None
    if mode == "max indexed":
        indices = g.tensor_like(indices_t, "indices")
        inputs[indices] = indices_t
    dx = g.pooling_backward(dy, x, mode.split()[0], window, stride, padding, indices=indices)
    dx.set_output(True).set_stride(list(channels_last(x_t).stride()))
    got = check(g, inputs)[dx.name]
    if mode == "max indexed":
        assert torch.equal(got, torch_grad(x_t, dy_t, window, stride, padding))
    assert "owned=2x2" in g.plan.launches[0].config_text


def test_windows_past_int32_tap_numbers_gather_per_element():
    """An owned block numbers each window's taps in int32: a window of more than 2^31 elements
    (a plane past 2^31, built never run) gathers per dx element, comparing coordinates."""
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[1, 1, 2048, 2048, 1025])
    dy = g.tensor(name="dy", dim=[1, 1, 1, 1, 1])
    g.pooling_backward(dy, x, "max", [2048, 2048, 1024], [2, 2, 2], [0, 0, 0]).set_output(True)
    g.build()
    launch = g.plan.launches[0]
    assert "owned=" not in launch.config_text and "int64-index" in launch.config_text


# --- row segments (NCHW forward) and the shared argmax (recompute backward) -----------------------
@pytest.fixture
def tile(request, monkeypatch):
    """Each pooling schedule at the model's tile, or forced to a tiny BLOCK_R x BLOCK_C one so a
    small problem spans many programs: row segments cross tile edges, and the shared argmax's
    neighbours fall outside the program (its halo) along every line."""
    from dnngraph.backends.triton.heuristics import pooling as heuristics
    from dnngraph.runtime import plan_cache
    if request.param != "model":  # (indirect parametrization)
        rows, cols = map(int, request.param.split("x"))
        monkeypatch.setattr(heuristics, "rank", lambda *args, **kwargs: [heuristics.PoolingConfig(rows, cols, 1, 0.0)])
    plan_cache.clear()
    yield request.param
    plan_cache.clear()


# (shape, window, stride, padding, dtype): odd sizes, padding at half the window, strides 1 to 4
# along the width (2 and 4 read row segments), window below, at and above the stride
SEGMENT_PROBLEMS = [
    ((2, 3, 9, 13), [3, 3], [2, 2], [1, 1], torch.bfloat16),
    ((2, 2, 7, 17), [2, 4], [1, 2], [1, 2], torch.float16),
    ((2, 2, 5, 19), [3, 5], [3, 4], [1, 2], torch.float32),
    ((2, 2, 5, 16), [2, 1], [2, 4], [0, 0], torch.float32),  # gaps: window 1 at stride 4
    ((2, 3, 6, 11), [2, 3], [2, 3], [1, 1], torch.bfloat16),  # stride 3: one load a tap
    ((2, 3, 23), [3], [2], [1], torch.float32),
    ((2, 2, 3, 5, 9), [2, 3, 3], [1, 2, 2], [1, 1, 1], torch.bfloat16),
]


def _problem_id(problem):
    shape, window, stride, padding, dtype = problem
    return f"{'x'.join(map(str, shape))}-w{window}-s{stride}-p{padding}-{str(dtype)[6:]}"


@pytest.mark.parametrize("layout,tile", [("nchw", "4x2"), ("sliced", "model")], indirect=["tile"])
@pytest.mark.parametrize("problem", SEGMENT_PROBLEMS, ids=_problem_id)
def test_max_forward_of_row_segments_is_torchs_with_ties_nan_and_infinities(problem, layout, tile):
    """A width strided by 2 or 4 is read as contiguous segments split into taps: values and
    indices equal torch's (first maximum wins, NaN propagates), at every tile, on a
    non-contiguous input too; other strides keep a load a tap."""
    _row_segments_against_torch(problem, layout, "cpu")


def _row_segments_against_torch(problem, layout: str, device: str):
    """The max forward with indices of `problem` on `device` against torch's, values and
    indices exactly; whether its kernel read row segments."""
    shape, window, stride, padding, dtype = problem
    x_t = in_layout(adversarial(shape, dtype, "nchw", seed=len(shape) + stride[-1]), layout)
    g, x, y, indices = indices_graph(x_t, window, stride, padding)
    outputs = check(g, {x: x_t.to(device)}, dtype, device=device)
    want_y, want_indices = torch_indices(x_t, window, stride, padding)
    assert torch.equal(outputs[indices.name].cpu(), want_indices)
    assert torch.equal(outputs[y.name].cpu().float().nan_to_num(), want_y.nan_to_num())
    segmented = stride[-1] in (2, 4) and output_dims(shape, window, stride, padding)[-1] > 1
    assert ("row-segments" in g.plan.launches[0].config_text) == (segmented and layout != "nhwc")


@pytest.mark.parametrize("tile", ["4x2"], indirect=True)
@pytest.mark.parametrize("mode", ["avg_include_pad", "avg_exclude_pad"])
@pytest.mark.parametrize("problem", SEGMENT_PROBLEMS[1:3], ids=_problem_id)
def test_average_forward_of_row_segments_against_the_reference(problem, mode, tile):
    shape, window, stride, padding, dtype = problem
    x_t = sample(shape, dtype)
    g, x, y = forward_graph(x_t, mode, window, stride, padding)
    got = check(g, {x: x_t}, dtype)[y.name]
    want = AVG_POOLS[len(window) - 1](x_t.float(), window, stride, padding, count_include_pad=mode == "avg_include_pad")
    assert rel_err(got.float(), want) < 1e-2
    assert "row-segments" in g.plan.launches[0].config_text


def test_row_segments_apply_the_prologue_to_every_element_once():
    """A prologue (x * scale + bias per channel, then a ReLU) is applied on the segment before
    the split: the fused kernel equals the reference, padding never wins."""
    x_t, scale_t, bias_t = sample((2, 3, 7, 15), torch.float32), sample((1, 3, 1, 1), torch.float32), \
        sample((1, 3, 1, 1), torch.float32) - 2.0
    g = dg.Graph(io_data_type=dg.float32)
    x, scale, bias = g.tensor_like(x_t, "x"), g.tensor_like(scale_t, "scale"), g.tensor_like(bias_t, "bias")
    y = g.pooling(g.relu(g.add(g.mul(x, scale), bias)), "max", [3, 3], [2, 2], [1, 1]).set_output(True)
    check(g, {x: x_t, scale: scale_t, bias: bias_t})
    assert len(g.plan.launches) == 1 and "row-segments/2" in g.plan.launches[0].config_text


# (shape, window, stride, padding, dtype) of the max backward recomputing its argmax
SHARED_ARGMAX_PROBLEMS = [
    ((2, 3, 9, 13), [3, 3], [2, 2], [1, 1], torch.bfloat16),
    ((2, 2, 11, 10), [5, 5], [2, 2], [2, 2], torch.float32),  # three windows cover an element
    ((2, 2, 7, 9), [3, 3], [1, 2], [1, 1], torch.float16),  # stride 1 with padding: windows before the first block
    ((2, 2, 9, 7), [3, 3], [2, 1], [1, 1], torch.float32),  # stride 1 along the shift axis
    ((2, 3, 8, 8), [2, 2], [2, 2], [0, 0], torch.bfloat16),  # one window covers an element
    ((2, 2, 10, 11), [4, 4], [3, 3], [2, 2], torch.float32),  # 3x3 owned
    ((2, 3, 21), [3], [2], [1], torch.float32),
    ((2, 2, 5, 6, 7), [2, 3, 3], [2, 2, 2], [1, 1, 1], torch.float32),
]


# the tiny tiles put the neighbour outside the program along the shift axis: a column (NCHW,
# sliced: BLOCK_C 2) or a row (NHWC: BLOCK_R 2) away
@pytest.mark.parametrize("layout,tile", [("nchw", "4x2"), ("nhwc", "2x4")], indirect=["tile"])
@pytest.mark.parametrize("problem", SHARED_ARGMAX_PROBLEMS, ids=_problem_id)
def test_shared_argmax_backward_is_torchs_with_ties_nan_and_infinities(problem, layout, tile):
    """The recompute backward finding each window's argmax once a program (its neighbours'
    through a gather, the halo recomputed): dx equals torch's gradient exactly (integer dy,
    ties, NaN, inf, -inf windows) at every tile, and the float64 reference on poisoned outputs."""
    _shared_argmax_against_torch(problem, layout, "cpu")


def _shared_argmax_against_torch(problem, layout: str, device: str):
    """The recompute max backward of `problem` on `device`: dx equal to torch's gradient (and
    the float64 reference), its argmax shared."""
    shape, window, stride, padding, dtype = problem
    geometry = (shape, window, stride, padding, layout, dtype)
    x_t, dy_t, indices_t = owned_inputs(geometry, "max", seed=sum(stride) + len(shape))
    if len(shape) == 5 and layout == "nhwc":
        # torch's channels-last CPU max_pool3d routes a window of -inf whose start is clamped to
        # element 0 of the plane (its NCDHW kernel to the first in-range element, as dnngraph):
        # the reference follows it, so these windows get a finite floor here
        x_t = torch.where(x_t == float("-inf"), torch.full_like(x_t, -5.0), x_t)
    g, inputs, dx = _backward_graph(x_t.to(device), dy_t.to(device), indices_t, "max", (window, stride, padding),
                                    IO_TYPES[dtype])
    got = check(g, inputs, dtype, device=device)[dx.name]
    assert torch.equal(got.cpu().float(), torch_grad(x_t, dy_t, window, stride, padding))
    assert "argmax=shared" in g.plan.launches[0].config_text


@pytest.mark.gpu
@pytest.mark.parametrize("layout,tile", [("nchw", "4x2"), ("nchw", "model")], indirect=["tile"])
@pytest.mark.parametrize("problem", SEGMENT_PROBLEMS, ids=_problem_id)
def test_gpu_max_forward_of_row_segments_is_torchs(problem, layout, tile):
    """The row segments' split compiled for the GPU (a layout change the interpreter never
    makes): values and indices torch's, ties, NaN and infinities included."""
    _row_segments_against_torch(problem, layout, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout,tile", [("nchw", "4x2"), ("nhwc", "2x4"), ("nhwc", "model")], indirect=["tile"])
@pytest.mark.parametrize("problem", SHARED_ARGMAX_PROBLEMS, ids=_problem_id)
def test_gpu_shared_argmax_backward_is_torchs(problem, layout, tile):
    """The shared argmax's tl.gather compiled for the GPU (shuffles or shared memory), its halo
    at tiny tiles and none at the model's: dx torch's exactly."""
    _shared_argmax_against_torch(problem, layout, "cuda")


@pytest.mark.parametrize("tile", ["4x2"], indirect=True)
def test_shared_argmax_backward_of_a_sliced_input_with_fusion(tile):
    """A non-contiguous x and dy, dy scaled per channel at its loads and a ReLU backward mask
    read from x in the epilogue: one kernel, against the float64 reference."""
    shape, window, stride, padding = (2, 3, 9, 11), [3, 3], [2, 2], [1, 1]
    x_t = in_layout(sample(shape, torch.float32), "sliced")
    dy_t = in_layout(sample(output_dims(shape, window, stride, padding), torch.float32), "sliced")
    scale_t = sample((1, 3, 1, 1), torch.float32)
    g = dg.Graph(io_data_type=dg.float32)
    x, dy, scale = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy"), g.tensor_like(scale_t, "scale")
    dx = g.pooling_backward(g.mul(dy, scale), x, "max", window, stride, padding)
    masked = g.where(g.cmp_le(x, 0.0), 0.0, dx).set_output(True)
    check(g, {x: x_t, dy: dy_t, scale: scale_t})
    assert len(g.plan.launches) == 1 and "argmax=shared" in g.plan.launches[0].config_text
    assert masked.name in g.reference({x: x_t, dy: dy_t, scale: scale_t})


def test_shared_argmax_axis_is_the_tile_neighbour_within_the_unroll_budget():
    from dnngraph.backends.triton.heuristics.pooling import shared_argmax_axis
    assert shared_argmax_axis((2, 2), (3, 3), (2, 2), 3, (0, 1, 2)) == 3  # NCHW: the width, a column
    assert shared_argmax_axis((2, 2), (3, 3), (2, 2), 1, (0, 2, 3)) == 3  # NHWC: the width, the next row
    assert shared_argmax_axis((), (3, 3), (1, 1), 3, (0, 1, 2)) == -1  # no owned blocks
    assert shared_argmax_axis((2, 2), (3, 3), (2, 2), 1, (0, 3, 2)) == 2  # rows end in the height
    assert shared_argmax_axis((2, 2, 2), (3, 3, 3), (2, 2, 2), 4, (0, 1, 2, 3)) == -1  # 5x5x3 loads: past 64


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_row_segments_of_an_input_broadcast_along_the_width(direction):
    """x of stride 0 along a strided width (and a plane of one element): the segment is one
    value a row, broadcast before its split; against the float64 reference."""
    for shape, window, stride, padding in [((2, 3, 7, 12), [3, 3], [2, 2], [1, 1]), ((1, 1, 1, 1), [1, 1], [2, 2], [0, 0])]:
        x_t = torch.randn(shape[:-1] + (1,)).expand(shape)
        if direction == "forward":
            g, x, y = forward_graph(x_t, "max", window, stride, padding)
            check(g, {x: x_t})
            continue
        dy_t = torch.randint(1, 5, output_dims(shape, window, stride, padding)).float()
        g, x, dy, dx = backward_graph(x_t, dy_t, "max", window, stride, padding)
        got = check(g, {x: x_t, dy: dy_t})[dx.name]
        assert torch.equal(got, torch_grad(x_t.contiguous(), dy_t, window, stride, padding))


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_padding_past_half_the_window_raises_at_the_op_call_and_changes_nothing(direction):
    """torch's rule: a padding above half the window (here 2 for a window of 3) is refused by
    the op call itself, naming the padding; the graph keeps what it had."""
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[2, 3, 9, 9])
    dy = g.tensor(name="dy", dim=[2, 3, 5, 5])
    before = g.to_json()
    with pytest.raises(dg.ValidationError, match="padding"):
        if direction == "forward":
            g.pooling(x, "max", [3, 3], [2, 2], [1, 2])
        else:
            g.pooling_backward(dy, x, "max", [3, 3], [2, 2], [2, 1])
    assert g.to_json() == before
