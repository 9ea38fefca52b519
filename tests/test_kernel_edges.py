"""Kernel edge cases that once gave wrong numbers without an error: size-1 reduced and kept axes
in every row family (and the matmul exits and pooling), NaN through max/min/amax, and exact
integer arithmetic."""
import pytest
import torch

import dnngraph as dg
from dnngraph.heuristics import matmul as mm
from helpers import check, run
from rowmodes import modes_used, row_mode  # noqa: F401 (fixture)

REDUCTION_MODES = ("sum", "mean", "max", "min", "amax", "prod", "norm1", "norm2")


def sample(*shape):
    return torch.randn(*shape) * 2 + 0.5


def positive(*shape):
    return torch.rand(*shape) + 0.5


# --- size-1 axes in row kernels -------------------------------------------------------------------
# (shape, axis): a reduced axis of size 1 between, after and before other axes, and all of size 1
SIZE_ONE_SOFTMAX = [([5, 1], 1), ([3, 1, 4], 1), ([1, 1], 1), ([1], 0), ([1, 7], 0), ([2, 3, 1], -1)]


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("shape,axis", SIZE_ONE_SOFTMAX)
def test_softmax_over_size_one_axis(row_mode, shape, axis, log):
    g = dg.Graph()
    x = g.tensor(name="x", dim=shape)
    y = g.softmax(x, axis=axis, log=log).set_output(True).set_name("y")
    g.mul(y, 3.0).set_output(True).set_name("scaled")  # a fused epilogue on the element output
    check(g, {x: sample(*shape)})
    g = dg.Graph()
    dy, y = g.tensor(name="dy", dim=shape), g.tensor(name="y", dim=shape)
    g.relu(g.softmax_backward(dy, y, axis=axis, log=log)).set_output(True)
    check(g, {dy: sample(*shape), y: positive(*shape)})


@pytest.mark.parametrize("shape,axes", [([6, 1], [1]), ([1, 1], [0, 1]), ([4, 1, 3], [1]),
                                        ([4, 1, 3], [1, 2]), ([1, 5], [0]), ([1, 9], [1])])
def test_reduction_over_size_one_axes(row_mode, shape, axes):
    g = dg.Graph()
    x = g.tensor(name="x", dim=shape)
    for mode in REDUCTION_MODES:
        r = g.reduction(x, mode, axes).set_output(True).set_name(mode)
        g.add(r, 1.0).set_output(True).set_name(mode + "_shifted")
    check(g, {x: sample(*shape)})


@pytest.mark.parametrize("shape", [[7, 1], [1, 1], [1, 1, 9], [3, 2, 1]])
def test_feature_norms_over_size_one_axes(row_mode, shape):
    """Per-token norms: hidden size 1 (the statistics of one element), single tokens."""
    param = [1] * (len(shape) - 1) + [shape[-1]]
    for op in ("layernorm", "rmsnorm"):
        g = dg.Graph()
        x, s, b = (g.tensor(name=n, dim=d) for n, d in (("x", shape), ("s", param), ("b", param)))
        outs = getattr(g, op)(x, s, b, epsilon=1e-3)
        for out in outs:
            out.set_output(True)
        g.silu(outs[0]).set_output(True).set_name("act")
        check(g, {x: sample(*shape), s: sample(*param), b: sample(*param)})


@pytest.mark.parametrize("shape", [[7, 1], [1, 5], [1, 1]])
def test_feature_norm_backward_over_size_one_axes(row_mode, shape):
    stat = shape[:-1] + [1]
    for op in ("layernorm_backward", "rmsnorm_backward"):
        g = dg.Graph()
        dy, x = g.tensor(name="dy", dim=shape), g.tensor(name="x", dim=shape)
        s = g.tensor(name="s", dim=[1, shape[-1]])
        stats = [g.tensor(name=n, dim=stat) for n in (("mean", "inv") if op == "layernorm_backward" else ("inv",))]
        for out in getattr(g, op)(dy, x, s, *stats):
            if out is not None:
                out.set_output(True)
        values = {dy: sample(*shape), x: sample(*shape), s: sample(1, shape[-1])}
        values.update({h: positive(*stat) for h in stats})
        check(g, values, tolerance=1e-4)


@pytest.mark.parametrize("shape", [[1, 6, 1, 1], [5, 3, 1, 1], [1, 4, 3, 1], [2, 1, 3, 2]])
def test_channel_norms_over_size_one_axes(row_mode, shape):
    channels, param = shape[1], [1, shape[1], 1, 1]
    graphs = []
    for op, extra in (("batchnorm", ()), ("instancenorm", ()), ("groupnorm", (channels,))):
        g = dg.Graph()
        x, s, b = (g.tensor(name=n, dim=d) for n, d in (("x", shape), ("s", param), ("b", param)))
        for out in getattr(g, op)(x, s, b, *extra):
            if out is not None:
                out.set_output(True)
        graphs.append((g, {x: sample(*shape), s: sample(*param), b: sample(*param)}))
    g = dg.Graph()
    x = g.tensor(name="x", dim=shape)
    for out in g.genstats(x):
        out.set_output(True)
    graphs.append((g, {x: sample(*shape)}))
    for g, values in graphs:
        check(g, values, tolerance=1e-4)


@pytest.mark.parametrize("shape", [[1, 6, 1, 1], [2, 3, 1, 1], [1, 4, 3, 1]])
def test_channel_norm_backward_over_size_one_axes(row_mode, shape):
    channels = shape[1]
    for op, extra, stat in (("batchnorm_backward", (), [1, channels, 1, 1]),
                            ("groupnorm_backward", (channels,), [shape[0], channels, 1, 1])):
        g = dg.Graph()
        dy, x = g.tensor(name="dy", dim=shape), g.tensor(name="x", dim=shape)
        s = g.tensor(name="s", dim=[1, channels, 1, 1])
        m, i = g.tensor(name="m", dim=stat), g.tensor(name="i", dim=stat)
        for out in getattr(g, op)(dy, x, s, m, i, *extra):
            out.set_output(True)
        check(g, {dy: sample(*shape), x: sample(*shape), s: sample(1, channels, 1, 1),
                  m: sample(*stat), i: positive(*stat)}, tolerance=1e-4)


def test_broadcast_inputs_of_row_kernels(row_mode):
    """Inputs expanded (stride 0) along the reduced or the kept axis."""
    g = dg.Graph()
    x = g.tensor(name="x", dim=[5, 11], stride=[1, 0])  # constant along each row
    col = g.tensor(name="col", dim=[5, 11], stride=[0, 1])  # the same row repeated
    g.softmax(x, axis=1).set_output(True)
    g.reduction(x, "max", [1]).set_output(True)
    g.layernorm(g.add(col, 0.0), g.tensor(name="s", dim=[1, 11]), None)[0].set_output(True)
    g.softmax(col, axis=1, log=True).set_output(True)
    values = {x: sample(5, 1).expand(5, 11), col: sample(1, 11).expand(5, 11), "s": sample(1, 11)}
    check(g, values, tolerance=1e-4)


def test_decode_attention_written_as_ops():
    """One new token against a one-entry cache: softmax over Skv = 1 between two matmuls."""
    g = dg.Graph()
    q = g.tensor(name="q", dim=[2, 3, 1, 8])
    k_t = g.tensor(name="k_t", dim=[2, 3, 8, 1])
    v = g.tensor(name="v", dim=[2, 3, 1, 8])
    scores = g.mul(g.matmul(q, k_t), 8 ** -0.5)
    g.matmul(g.softmax(scores, axis=3), v).set_output(True).set_name("o")
    check(g, {q: sample(2, 3, 1, 8), k_t: sample(2, 3, 8, 1), v: sample(2, 3, 1, 8)}, tolerance=1e-4)


@pytest.mark.parametrize("variant", ["tiled", "split_k"])
@pytest.mark.parametrize("m,n,k", [(9, 1, 5), (9, 6, 1), (1, 1, 1)])
def test_matmul_row_exits_with_size_one_axes(monkeypatch, variant, m, n, k):
    configs = {"tiled": mm.MatmulConfig("tiled", 16, 16, 16, 4, 2),
               "split_k": mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=2)}
    monkeypatch.setattr(mm, "FORCE_CONFIG", configs[variant])
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[m, k]), g.tensor(name="b", dim=[k, n])
    y = g.matmul(a, b).set_output(True).set_name("y")
    for mode in ("sum", "max", "min", "amax", "norm2"):
        g.reduction(y, mode, [1]).set_output(True).set_name(mode)
    check(g, {a: sample(m, k), b: sample(k, n)}, tolerance=1e-4)


@pytest.mark.parametrize("mode", ["max", "avg_include_pad", "avg_exclude_pad"])
def test_pooling_window_one(mode):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 3, 5, 1])
    g.pooling(x, mode, window=[1, 1], stride=[2, 1], padding=[0, 0]).set_output(True)
    check(g, {x: sample(2, 3, 5, 1)})


# --- NaN and inf through max, min and amax --------------------------------------------------------
def compare_specials(graph, inputs, tolerance=1e-5):
    """Execute with poisoned outputs; NaN where the reference has NaN, equal infinities."""
    outputs = run(graph, inputs)
    refs = graph.reference(inputs)
    for name, out in outputs.items():
        torch.testing.assert_close(out.double(), refs[name].double(), rtol=tolerance, atol=tolerance,
                                   equal_nan=True, msg=lambda text: f"{name}: {text}")
    return outputs


def special_rows(rows=7, cols=37):
    """Rows partly NaN, wholly NaN, with +inf, -inf, all -inf, NaN next to inf, and plain."""
    x = sample(rows, cols)
    nan, inf = float("nan"), float("inf")
    x[0, 5] = nan
    x[1, :] = nan
    x[2, 3] = inf
    x[3, 30] = -inf
    x[4, :] = -inf
    x[5, 0], x[5, 36] = inf, nan
    return x


@pytest.mark.parametrize("axis", [0, 1])
def test_reductions_propagate_nan(row_mode, axis):
    x_t = special_rows()
    x_t = x_t if axis == 1 else x_t.t().contiguous()
    g = dg.Graph()
    x = g.tensor(name="x", dim=list(x_t.shape))
    for mode in REDUCTION_MODES:
        g.reduction(x, mode, [axis]).set_output(True).set_name(mode)
    outputs = compare_specials(g, {x: x_t})
    assert torch.isnan(outputs["max"].flatten()[[0, 1, 5]]).all()
    assert row_mode in modes_used(g) or axis == 0  # columns of a row-major x never run one-pass


def test_softmax_and_norms_propagate_nan(row_mode):
    x_t = special_rows()
    g = dg.Graph()
    x = g.tensor(name="x", dim=[7, 37])
    g.softmax(x, axis=1).set_output(True).set_name("softmax")
    g.softmax(x, axis=1, log=True).set_output(True).set_name("log_softmax")
    g.rmsnorm(x, g.tensor(name="s", dim=[1, 37]), None)[0].set_output(True).set_name("rms")
    compare_specials(g, {x: x_t, "s": sample(1, 37)})


@pytest.mark.parametrize("variant", ["tiled", "split_k", "persistent"])
def test_matmul_row_exits_propagate_nan(monkeypatch, variant):
    configs = {"tiled": mm.MatmulConfig("tiled", 16, 16, 16, 4, 2),
               "split_k": mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=2),
               "persistent": mm.MatmulConfig("persistent", 16, 16, 16, 4, 2)}
    monkeypatch.setattr(mm, "FORCE_CONFIG", configs[variant])
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[7, 9]), g.tensor(name="b", dim=[9, 37])
    e = g.tensor(name="e", dim=[7, 37])
    y = g.add(g.matmul(a, b), e)  # the specials come in through the epilogue operand
    for mode in ("max", "min", "amax", "sum"):
        g.reduction(y, mode, [1]).set_output(True).set_name(mode)
    g.build()
    assert len(g.plan.groups) == 1 and g.plan.groups[0].exits
    outputs = compare_specials(g, {a: sample(7, 9), b: sample(9, 37), e: special_rows()}, tolerance=1e-4)
    assert torch.isnan(outputs["max"][1]).all() and torch.isnan(outputs["amax"][0]).all()
