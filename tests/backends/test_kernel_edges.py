"""Kernel edge cases that once gave wrong numbers without an error: size-1 reduced and kept axes
in every row family (and the matmul exits and pooling), NaN through max/min/amax, and exact
integer arithmetic."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import check, run
from rowmodes import modes_used, row_mode, row_options  # noqa: F401 (row_mode: a fixture)

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
    check(g, {x: sample(*shape)}, options=row_options(row_mode))
    g = dg.Graph()
    dy, y = g.tensor(name="dy", dim=shape), g.tensor(name="y", dim=shape)
    g.relu(g.softmax_backward(dy, y, axis=axis, log=log)).set_output(True)
    check(g, {dy: sample(*shape), y: positive(*shape)}, options=row_options(row_mode))


@pytest.mark.parametrize("shape,axes", [([6, 1], [1]), ([1, 1], [0, 1]), ([4, 1, 3], [1]),
                                        ([4, 1, 3], [1, 2]), ([1, 5], [0]), ([1, 9], [1])])
def test_reduction_over_size_one_axes(row_mode, shape, axes):
    g = dg.Graph()
    x = g.tensor(name="x", dim=shape)
    for mode in REDUCTION_MODES:
        r = g.reduction(x, mode, axes).set_output(True).set_name(mode)
        g.add(r, 1.0).set_output(True).set_name(mode + "_shifted")
    check(g, {x: sample(*shape)}, options=row_options(row_mode))


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
        check(g, {x: sample(*shape), s: sample(*param), b: sample(*param)}, options=row_options(row_mode))


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
        check(g, values, tolerance=1e-4, options=row_options(row_mode))


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
        check(g, values, tolerance=1e-4, options=row_options(row_mode))


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
                  m: sample(*stat), i: positive(*stat)}, tolerance=1e-4, options=row_options(row_mode))


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
    check(g, values, tolerance=1e-4, options=row_options(row_mode))


def test_decode_attention_written_as_ops():
    """One new token against a one-entry cache: softmax over Skv = 1 between two matmuls."""
    g = dg.Graph()
    q = g.tensor(name="q", dim=[2, 3, 1, 8])
    k_t = g.tensor(name="k_t", dim=[2, 3, 8, 1])
    v = g.tensor(name="v", dim=[2, 3, 1, 8])
    scores = g.mul(g.matmul(q, k_t), 8 ** -0.5)
    g.matmul(g.softmax(scores, axis=3), v).set_output(True).set_name("o")
    check(g, {q: sample(2, 3, 1, 8), k_t: sample(2, 3, 8, 1), v: sample(2, 3, 1, 8)}, tolerance=1e-4)


@pytest.mark.parametrize("m,n,k,variant", [(9, 1, 5, "tiled"), (9, 6, 1, "split_k"), (1, 1, 1, "tiled")])
def test_matmul_row_exits_with_size_one_axes(variant, m, n, k):
    configs = {"tiled": mm.MatmulConfig("tiled", 16, 16, 16, 4, 2),
               "split_k": mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=2)}
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[m, k]), g.tensor(name="b", dim=[k, n])
    y = g.matmul(a, b).set_output(True).set_name("y")
    for mode in ("sum", "max", "norm2"):
        g.reduction(y, mode, [1]).set_output(True).set_name(mode)
    check(g, {a: sample(m, k), b: sample(k, n)}, tolerance=1e-4,
          options=dg.BuildOptions(matmul_config=configs[variant]))


@pytest.mark.parametrize("mode", ["max", "avg_include_pad", "avg_exclude_pad"])
def test_pooling_window_one(mode):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 3, 5, 1])
    g.pooling(x, mode, window=[1, 1], stride=[2, 1], padding=[0, 0]).set_output(True)
    check(g, {x: sample(2, 3, 5, 1)})


# --- NaN and inf through max, min and amax --------------------------------------------------------
# --- one-element operands ---------------------------------------------------------------------------
@pytest.mark.parametrize("anchor", ["pointwise", "softmax", "matmul"])
def test_one_element_operands_in_logic_and_pow(anchor):
    """A [1, 1] operand loads as one element: compared, combined with `&` / `|` against a tile,
    and as pow's exponent (whose parity test uses `&`) it must act like any broadcast value.
    Once it was a 0-d value, and the interpreter failed on the bool of its comparison."""
    g = dg.Graph()
    x, s, t = (g.tensor(name="x", dim=[6, 9]), g.tensor(name="s", dim=[1, 1]),
               g.tensor(name="t", dim=[1, 1]))
    inputs = {x: sample(6, 9), s: torch.tensor([[0.3]]), t: torch.tensor([[3.0]])}
    if anchor == "softmax":
        x = g.softmax(x, axis=1)
    elif anchor == "matmul":
        w = g.tensor(name="w", dim=[9, 9])
        inputs[w] = sample(9, 9)
        x = g.matmul(x, w)
    both = g.logical_and(g.cmp_lt(s, t), g.cmp_gt(x, 0.0))
    g.where(both, g.pow(x, t), s).set_output(True)
    g.logical_or(g.cmp_gt(s, t), g.cmp_lt(x, 0.0)).set_output(True)
    check(g, inputs, tolerance=1e-5)


def compare_specials(graph, inputs, tolerance=1e-5, options=None):
    """Execute (built with `options` where given) with poisoned outputs; NaN where the reference
    has NaN, equal infinities."""
    outputs = run(graph, inputs, options=options)
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
    for mode in ("max", "min", "amax", "mean"):
        g.reduction(x, mode, [axis]).set_output(True).set_name(mode)
    outputs = compare_specials(g, {x: x_t}, options=row_options(row_mode))
    assert torch.isnan(outputs["max"].flatten()[[0, 1, 5]]).all()
    assert row_mode in modes_used(g) or axis == 0  # columns of a row-major x never run one-pass


def test_softmax_and_norms_propagate_nan(row_mode):
    x_t = special_rows()
    g = dg.Graph()
    x = g.tensor(name="x", dim=[7, 37])
    g.softmax(x, axis=1).set_output(True).set_name("softmax")
    g.softmax(x, axis=1, log=True).set_output(True).set_name("log_softmax")
    g.rmsnorm(x, g.tensor(name="s", dim=[1, 37]), None)[0].set_output(True).set_name("rms")
    compare_specials(g, {x: x_t, "s": sample(1, 37)}, options=row_options(row_mode))


@pytest.mark.parametrize("variant", ["tiled", "split_k", "persistent"])
def test_matmul_row_exits_propagate_nan(variant):
    configs = {"tiled": mm.MatmulConfig("tiled", 16, 16, 16, 4, 2),
               "split_k": mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=2),
               "persistent": mm.MatmulConfig("persistent", 16, 16, 16, 4, 2)}
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[7, 9]), g.tensor(name="b", dim=[9, 37])
    e = g.tensor(name="e", dim=[7, 37])
    y = g.add(g.matmul(a, b), e)  # the specials come in through the epilogue operand
    for mode in ("max", "min", "amax"):
        g.reduction(y, mode, [1]).set_output(True).set_name(mode)
    g.build(options=dg.BuildOptions(matmul_config=configs[variant]))
    assert len(g.plan.groups) == 1 and g.plan.groups[0].exits
    outputs = compare_specials(g, {a: sample(7, 9), b: sample(9, 37), e: special_rows()}, tolerance=1e-4)
    assert torch.isnan(outputs["max"][1]).all() and torch.isnan(outputs["amax"][0]).all()


# --- exact integer arithmetic ---------------------------------------------------------------------
def big_ints(n, dtype, low, high):
    return torch.randint(low, high, (n,), dtype=dtype)


def test_int64_add_past_float_precision():
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=[3])
    g.add(x, 0).set_output(True).set_name("y")
    x_t = torch.tensor([2**40 + 1, 2**62 - 1, -(2**53) - 3])
    assert torch.equal(run(g, {x: x_t})["y"], x_t)


@pytest.mark.parametrize("dtype", [dg.int32, dg.int64])
def test_integer_ops_are_exact(dtype):
    """Every op closed over the integers, on values whose results float32 would round."""
    torch_dtype = dtype.torch_dtype
    limit = 2**15 if dtype is dg.int32 else 2**31
    g = dg.Graph(io_data_type=dtype)
    a, b = g.tensor(name="a", dim=[5, 13]), g.tensor(name="b", dim=[1, 13])
    keep = g.tensor(name="keep", dim=[5, 13], data_type=dg.bool)
    results = {
        "mul": g.mul(a, b), "add": g.add(a, 16777217), "sub": g.sub(b, a), "neg": g.neg(a),
        "abs": g.abs(g.sub(a, 3)), "max": g.maximum(a, b), "min": g.minimum(a, b),
        "where": g.where(keep, a, g.scale(b, 3)), "floor": g.floor(g.mul(a, 7)), "ceil": g.ceil(a),
        "lt": g.cmp_lt(g.mul(a, 3), g.add(b, 1)), "eq": g.cmp_eq(g.add(a, 1), g.add(a, 1)),
    }
    for name, tensor in results.items():
        tensor.set_output(True).set_name(name)
    a_t = torch.randint(-limit, limit, (5, 13), dtype=torch_dtype)
    b_t = torch.randint(-limit, limit, (1, 13), dtype=torch_dtype)
    keep_t = torch.rand(5, 13) < 0.5
    expected = {"mul": a_t * b_t, "add": a_t + 16777217, "sub": b_t - a_t, "neg": -a_t,
                "abs": (a_t - 3).abs(), "max": torch.maximum(a_t, b_t), "min": torch.minimum(a_t, b_t),
                "where": torch.where(keep_t, a_t, b_t * 3), "floor": a_t * 7, "ceil": a_t,
                "lt": a_t * 3 < b_t + 1, "eq": torch.ones(5, 13, dtype=torch.bool)}
    outputs = run(g, {a: a_t, b: b_t, keep: keep_t})
    for name, want in expected.items():
        assert torch.equal(outputs[name], want.to(outputs[name].dtype)), name


def test_integer_promotion_division_and_casts():
    """int32 with int64 computes in int64; division and float constants go to the float;
    floats stored to integers truncate toward zero; integers stored to floats convert once."""
    g = dg.Graph(io_data_type=dg.int64)
    small = g.tensor(name="small", dim=[6], data_type=dg.int32)
    wide = g.tensor(name="wide", dim=[6], data_type=dg.int64)
    real = g.tensor(name="real", dim=[6], data_type=dg.float32)
    g.add(small, wide).set_output(True).set_name("sum")
    g.div(small, 4).set_output(True).set_name("quotient").set_data_type(dg.float32)
    g.mul(small, 0.5).set_output(True).set_name("half").set_data_type(dg.float32)
    g.add(real, 0.0).set_output(True).set_name("truncated").set_data_type(dg.int32)
    g.cast(wide, dg.int32).set_output(True).set_name("narrowed")
    g.cast(small, dg.float32).set_output(True).set_name("as_float")
    small_t = torch.tensor([7, -7, 2**30, -(2**31), 5, 0], dtype=torch.int32)
    wide_t = torch.tensor([2**40, 3, 2**35 + 1, -1, -(2**50), 9])
    real_t = torch.tensor([2.9, -2.9, 0.5, -0.5, 1e6 + 0.75, -3.0])
    out = run(g, {small: small_t, wide: wide_t, real: real_t})
    assert torch.equal(out["sum"], small_t.long() + wide_t)
    assert torch.equal(out["quotient"], small_t / 4)
    assert torch.equal(out["half"], small_t * 0.5)
    assert torch.equal(out["truncated"], real_t.to(torch.int32))
    assert torch.equal(out["narrowed"], wide_t.to(torch.int32))
    assert torch.equal(out["as_float"], small_t.float())


def test_integer_constants_survive_json():
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=[4])
    g.add(x, 2**40 + 3).set_output(True).set_name("y")
    g2 = dg.Graph.from_json(g.to_json())
    x_t = torch.tensor([1, -1, 2**50, 0])
    assert torch.equal(run(g2, {"x": x_t})["y"], x_t + 2**40 + 3)


def test_integer_epilogues_of_row_and_matmul_kernels():
    """Integer operands of fused epilogues stay integers; the anchor's float value converts."""
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 9])
    offset = g.tensor(name="offset", dim=[4, 1], data_type=dg.int64)
    total = g.reduction(x, "sum", [1])
    picked = g.where(g.cmp_gt(total, 0.0), offset, 7)
    g.add(picked, 1).set_output(True).set_name("row").set_data_type(dg.int64)
    a, b = g.tensor(name="a", dim=[5, 3]), g.tensor(name="b", dim=[3, 6])
    bias = g.tensor(name="bias", dim=[1, 6], data_type=dg.int64)
    g.add(g.matmul(a, b), g.mul(bias, bias)).set_output(True).set_name("mm")
    x_t, offset_t = sample(4, 9), torch.tensor([[2**40], [1], [-(2**41) - 1], [3]])
    x_t[:2] = x_t[:2].abs()  # both sides of the comparison
    a_t, b_t, bias_t = sample(5, 3), sample(3, 6), torch.randint(-3000, 3000, (1, 6))
    out = run(g, {x: x_t, offset: offset_t, a: a_t, b: b_t, bias: bias_t})
    assert torch.equal(out["row"], torch.where(x_t.sum(1, keepdim=True) > 0, offset_t, 7) + 1)
    torch.testing.assert_close(out["mm"], a_t @ b_t + (bias_t * bias_t).float())


@pytest.mark.parametrize("build", [
    lambda g, x: g.reduction(x, "mean", [3]),
    lambda g, x: g.softmax(x, axis=2),
    lambda g, x: g.layernorm(x, g.tensor(name="s", dim=[1, 1, 4, 9], data_type=dg.float32),
                             g.tensor(name="b", dim=[1, 1, 4, 9], data_type=dg.float32))[0],
    lambda g, x: g.pooling(x, "max", window=[2, 2]),
])
def test_row_and_pooling_kernels_reject_integers(build):
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=[1, 1, 4, 9])
    build(g, x).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="int64"):
        g.build()


@pytest.mark.parametrize("dtype", [dg.int32, dg.int64])
def test_integer_relu_stays_exact(dtype):
    g = dg.Graph(io_data_type=dtype)
    x = g.tensor(name="x", dim=[4])
    g.relu(x).set_output(True).set_name("y")
    top = torch.iinfo(dtype.torch_dtype).max
    x_t = torch.tensor([2**24 + 1, top, -5, 0], dtype=dtype.torch_dtype)
    assert torch.equal(run(g, {x: x_t})["y"], x_t.clamp_min(0))


def test_reference_keeps_integral_constants_exact():
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=[3])
    g.add(x, 0).set_output(True).set_name("y")
    g.cmp_eq(x, 2**53).set_output(True).set_name("same")
    x_t = torch.tensor([2**53 + 1, 2**63 - 1, -(2**62) - 7])
    refs = g.reference({x: x_t})
    assert torch.equal(refs["y"], x_t) and not refs["same"].any()
    outputs = run(g, {x: x_t})
    assert torch.equal(outputs["y"], x_t) and torch.equal(outputs["same"], refs["same"])


def test_integer_constant_must_fit_its_tensor_type():
    g = dg.Graph(io_data_type=dg.int32)
    x = g.tensor(name="x", dim=[3])
    with pytest.raises(dg.ValidationError, match="does not fit int32"):
        g.add(x, 2**40)
    assert len(g.nodes) == 0
    g.add(x, 2**31 - 1).set_output(True)  # the largest int32 is fine


@pytest.mark.parametrize("exponent", [3.0, 2.0, 0.5, -1.0, 0.0, 3])
def test_pow_with_a_constant_exponent(exponent):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 7])
    g.pow(x, exponent).set_output(True)
    g.pow(2.0, x).set_output(True)
    x_t = torch.randn(2, 7) * 3
    x_t[0, :3] = torch.tensor([0.0, float("nan"), float("inf")])
    check(g, {x: x_t})
