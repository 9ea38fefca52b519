"""Normalization kernels forward and backward: layernorm, rmsnorm, batchnorm (training and
inference), instancenorm, groupnorm, genstats; NCHW and NHWC; fused prologues and epilogues; on the
GPU, bf16 at realistic and very wide rows and column splits bitwise the same on a second run."""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check, run
from rowmodes import modes_used, row_mode, row_options  # noqa: F401 (row_mode: a fixture)

DTYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}


def shifted(*shape, dtype=torch.float32):
    """Scaled and shifted so means and variances are far from 0 and 1."""
    return (torch.randn(*shape) * 2.5 + 4).to(dtype)


def layout(t, nhwc):
    return t.contiguous(memory_format=torch.channels_last) if nhwc else t


# --- layernorm / rmsnorm -------------------------------------------------------------------------
def _feature_graph(op, dtype, shape, phase="training", bias=True):
    g = dg.Graph(io_data_type=DTYPES[dtype])
    x = g.tensor(name="x", dim=list(shape))
    param = [1] * (len(shape) - 1) + [shape[-1]]
    s = g.tensor(name="scale", dim=param)
    b = g.tensor(name="bias", dim=param) if bias else None
    outs = getattr(g, op)(x, s, b, epsilon=1e-5, norm_forward_phase=phase)
    for out in outs:
        if out is not None:
            out.set_output(True)
    inputs = {x: shifted(*shape, dtype=dtype), s: shifted(*param, dtype=dtype)}
    if bias:
        inputs[b] = torch.randn(*param).to(dtype)
    return g, inputs


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("phase", ["training", "inference"])
def test_feature_norm_forward(op, dtype, phase):
    g, inputs = _feature_graph(op, dtype, (3, 5, 77), phase, bias=op == "layernorm")
    outputs = check(g, inputs, dtype)
    assert len(outputs) == (1 if phase == "inference" else 3 if op == "layernorm" else 2)


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_feature_norm_every_mode(row_mode, op):
    g, inputs = _feature_graph(op, torch.float32, (6, 130))
    check(g, inputs, options=row_options(row_mode))
    assert row_mode in modes_used(g)


def _feature_backward(op, dtype, shape):
    x_t = shifted(*shape, dtype=torch.float64)
    w_t = shifted(1, shape[-1], dtype=torch.float64)
    dy_t = torch.randn(*shape, dtype=torch.float64)
    leaf_x, leaf_w = x_t.clone().requires_grad_(True), w_t.clone().requires_grad_(True)
    leaf_b = torch.randn(1, shape[-1], dtype=torch.float64).requires_grad_(True)
    if op == "layernorm_backward":
        y = F.layer_norm(leaf_x, shape[-1:], leaf_w.view(-1), leaf_b.view(-1), 1e-5)
        mean = x_t.mean(-1, keepdim=True)
        inv = (x_t.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
        stats = [mean, inv]
    else:
        y = F.rms_norm(leaf_x, shape[-1:], leaf_w.view(-1), 1e-5) + leaf_b
        inv = (x_t.square().mean(-1, keepdim=True) + 1e-5).rsqrt()
        stats = [inv]
    expected = torch.autograd.grad(y, (leaf_x, leaf_w, leaf_b), dy_t)
    g = dg.Graph(io_data_type=DTYPES[dtype])
    dy, x = g.tensor(name="dy", dim=list(shape)), g.tensor(name="x", dim=list(shape))
    s = g.tensor(name="scale", dim=[1, shape[-1]])
    stat_handles = [g.tensor(name=f"stat{i}", dim=[shape[0], 1], data_type=dg.float32) for i in range(len(stats))]
    extra = {"has_dbias": True} if op == "rmsnorm_backward" else {}
    dx, ds, db = getattr(g, op)(dy, x, s, *stat_handles, **extra)
    for out, name in ((dx, "dx"), (ds, "dscale"), (db, "dbias")):
        out.set_output(True).set_name(name)
    inputs = {dy: dy_t.to(dtype), x: x_t.to(dtype), s: w_t.to(dtype)}
    inputs.update({h: v.float() for h, v in zip(stat_handles, stats)})
    return g, inputs, expected


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_feature_norm_backward_matches_autograd(op, dtype):
    g, inputs, expected = _feature_backward(op, dtype, (37, 83))
    outputs = check(g, inputs, dtype, tolerance=5e-5 if dtype == torch.float32 else 5e-3)
    for name, want in zip(("dx", "dscale", "dbias"), expected):
        got = outputs[name].double().reshape(want.shape)
        assert (got - want).norm() / want.norm() < (5e-5 if dtype == torch.float32 else 5e-3), name
    assert len(g.plan.launches) >= 2  # dx kernel, then the dscale/dbias column reduction


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
def test_feature_norm_backward_every_mode(row_mode, op):
    g, inputs, _ = _feature_backward(op, torch.float32, (5, 150))
    check(g, inputs, tolerance=5e-5, options=row_options(row_mode))


# --- fused dx + dscale/dbias (layernorm, rmsnorm) -----------------------------------------------
def _fused_backward(op, x_t, dy_t, scale_t, dtype=torch.float32, has_dbias=True):
    """A feature-norm backward over x_t's last axis (any strides, batch dims) with statistics of
    x_t; every output marked."""
    g = dg.Graph(io_data_type=DTYPES[dtype])
    x, dy, s = g.tensor_like(x_t, "x"), g.tensor_like(dy_t, "dy"), g.tensor_like(scale_t, "scale")
    stats_shape = list(x_t.shape[:-1]) + [1]
    inv_t = (x_t.double().var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float()
    inputs = {x: x_t, dy: dy_t, s: scale_t}
    if op == "layernorm_backward":
        m, i = (g.tensor(name=n, dim=stats_shape, data_type=dg.float32) for n in ("mean", "inv"))
        inputs.update({m: x_t.double().mean(-1, keepdim=True).float(), i: inv_t})
        outs = g.layernorm_backward(dy, x, s, m, i)
    else:
        i = g.tensor(name="inv", dim=stats_shape, data_type=dg.float32)
        inputs[i] = inv_t
        outs = g.rmsnorm_backward(dy, x, s, i, has_dbias=has_dbias)
    for out in outs:
        if out is not None:
            out.set_output(True)
    return g, inputs


def _fused_launches(g) -> list:
    return [launch.config_text.split(" ")[0] for launch in g.plan.launches]


@pytest.fixture(params=[None, 3])
def fused_programs(request):
    """The model's program count, and 3 programs (several row blocks each on the larger shapes)."""
    return request.param


def _programs(count) -> dg.BuildOptions:
    """Options forcing the fused norm backward's program count (None: the model's)."""
    return dg.BuildOptions(norm_backward_programs=count)


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("rows", [1, 3, 37, 130])
@pytest.mark.parametrize("columns", [1, 7, 33, 300, 5000])
def test_fused_norm_backward(fused_programs, op, rows, columns):
    if rows * columns > 40000 and fused_programs is None:
        pytest.skip("the interpreter's time: the forced program count covers it")
    g, inputs = _fused_backward(op, shifted(rows, columns), torch.randn(rows, columns), shifted(1, columns))
    check(g, inputs, tolerance=5e-5, options=_programs(fused_programs))
    # dx and the partials, then their sum; one element is a per-row sum of the dx kernel
    assert _fused_launches(g) == (["main"] if rows == columns == 1 else ["fused", "combine"])


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
def test_fused_norm_backward_fp16_batch_dims_and_strides(fused_programs, op):
    """fp16; batch dims stored transposed ([T, B, C] memory of a [B, T, C] tensor); dy a slice of a
    wider buffer (row stride padded); the scale a slice too."""
    x_t = shifted(9, 4, 65, dtype=torch.float16).transpose(0, 1)
    dy_t = torch.randn(4, 9, 80).to(torch.float16)[:, :, 5:70]
    scale_t = shifted(1, 1, 130, dtype=torch.float16)[:, :, ::2]
    g, inputs = _fused_backward(op, x_t, dy_t, scale_t, torch.float16)
    check(g, inputs, torch.float16, tolerance=5e-3, options=_programs(fused_programs))
    assert _fused_launches(g) == ["fused", "combine"]


def test_fused_norm_backward_columns_strided_falls_back():
    """Rows not vectorized (x stored column-major): the separate dx and dscale/dbias kernels."""
    x_t = shifted(40, 24).t()
    dy_t = torch.randn(40, 24).t()
    g, inputs = _fused_backward("layernorm_backward", x_t, dy_t, shifted(1, 40))
    check(g, inputs, tolerance=5e-5)
    assert "fused" not in _fused_launches(g)


def test_fused_norm_backward_long_rows_fall_back():
    """Rows whose column sums a fused program cannot hold (here: more chunks of 4 than it
    unrolls) keep the separate kernels."""
    g, inputs = _fused_backward("layernorm_backward", shifted(5, 100), torch.randn(5, 100), shifted(1, 100))
    check(g, inputs, tolerance=5e-5, options=dg.BuildOptions(norm_backward_max_reduced=4))
    assert "fused" not in _fused_launches(g) and len(g.plan.launches) >= 2


def test_fused_rmsnorm_backward_without_dbias(fused_programs):
    g, inputs = _fused_backward("rmsnorm_backward", shifted(37, 33), torch.randn(37, 33), shifted(1, 33),
                                has_dbias=False)
    outputs = check(g, inputs, tolerance=5e-5, options=_programs(fused_programs))
    assert len(outputs) == 2 and _fused_launches(g) == ["fused", "combine"]


def test_fused_norm_backward_multi_axis():
    """Normalized over two trailing axes: the partials' column is the parameters' row-major index."""
    x_t = shifted(6, 7, 5).permute(0, 2, 1).contiguous().permute(0, 2, 1)  # [6, 7, 5], axes 1, 2 swapped in memory
    g, inputs = _fused_backward_two_axes(x_t)
    check(g, inputs, tolerance=5e-5)


def _fused_backward_two_axes(x_t):
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, "x"), g.tensor(name="dy", dim=list(x_t.shape))
    s = g.tensor(name="scale", dim=[1, 7, 5])
    m, i = (g.tensor(name=n, dim=[6, 1, 1], data_type=dg.float32) for n in ("mean", "inv"))
    for out in g.layernorm_backward(dy, x, s, m, i):
        out.set_output(True)
    flat = x_t.reshape(6, -1).double()
    return g, {x: x_t, dy: torch.randn(6, 7, 5), s: shifted(1, 7, 5),
               m: flat.mean(-1).reshape(6, 1, 1).float(),
               i: (flat.var(-1, unbiased=False) + 1e-5).rsqrt().reshape(6, 1, 1).float()}


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
def test_fused_norm_backward_nan_row(fused_programs, op):
    """A NaN in one row of x makes that row's dx and every dscale NaN, as torch's sums do."""
    x_t = shifted(37, 33)
    x_t[5, 3] = float("nan")
    g, inputs = _fused_backward(op, x_t, torch.randn(37, 33), shifted(1, 33))
    outputs = check(g, inputs, tolerance=5e-5, options=_programs(fused_programs))
    dscale = next(v for k, v in outputs.items() if k.endswith("dscale"))
    assert torch.isnan(dscale).all()


def test_fused_norm_backward_epilogues(fused_programs):
    """dx plus another gradient, cast to bf16; dscale plus another use's gradient; dbias cast:
    the dx epilogue runs in the fused kernel, the parameter epilogues in the combine."""
    g = dg.Graph()
    shape = (37, 33)
    x, dy = g.tensor(name="x", dim=list(shape)), g.tensor(name="dy", dim=list(shape))
    residual = g.tensor(name="residual", dim=list(shape))
    s, other = g.tensor(name="scale", dim=[1, 33]), g.tensor(name="other_dscale", dim=[1, 33])
    m, i = (g.tensor(name=n, dim=[37, 1], data_type=dg.float32) for n in ("mean", "inv"))
    dx, dscale, dbias = g.layernorm_backward(dy, x, s, m, i)
    g.cast(g.add(dx, residual), dg.bfloat16).set_output(True)
    g.add(dscale, other).set_output(True)
    g.cast(dbias, dg.float16).set_output(True)
    inputs = {x: shifted(*shape), dy: torch.randn(*shape), residual: torch.randn(*shape), s: shifted(1, 33),
              other: torch.randn(1, 33), m: torch.randn(37, 1), i: torch.rand(37, 1) + 0.5}
    check(g, inputs, tolerance=2e-2, options=_programs(fused_programs))
    assert _fused_launches(g) == ["fused", "combine"]


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
def test_parameter_epilogues_without_fusion(row_mode, op):
    """The separate dscale/dbias kernel runs the parameter epilogues (every forced row mode)."""
    g = dg.Graph()
    x, dy = g.tensor(name="x", dim=[5, 13]), g.tensor(name="dy", dim=[5, 13])
    s, other = g.tensor(name="scale", dim=[1, 13]), g.tensor(name="other_dscale", dim=[1, 13])
    i = g.tensor(name="inv", dim=[5, 1], data_type=dg.float32)
    inputs = {x: shifted(5, 13), dy: torch.randn(5, 13), s: shifted(1, 13), other: torch.randn(1, 13),
              i: torch.rand(5, 1) + 0.5}
    if op == "layernorm_backward":
        m = g.tensor(name="mean", dim=[5, 1], data_type=dg.float32)
        inputs[m] = torch.randn(5, 1)
        dx, dscale, dbias = g.layernorm_backward(dy, x, s, m, i)
    else:
        dx, dscale, dbias = g.rmsnorm_backward(dy, x, s, i, has_dbias=True)
    g.relu(dx).set_output(True)
    g.mul(g.add(dscale, other), 0.5).set_output(True)
    g.neg(dbias).set_output(True)
    check(g, inputs, tolerance=5e-5, options=row_options(row_mode))
    assert "fused" not in _fused_launches(g)


# --- channel norms -------------------------------------------------------------------------------
def _channel_forward(op, shape, nhwc, dtype=torch.float32, groups=None, running=False):
    g = dg.Graph(io_data_type=DTYPES[dtype])
    x_t = layout(shifted(*shape, dtype=dtype), nhwc)
    x = g.tensor_like(x_t, "x")
    param = [1, shape[1]] + [1] * (len(shape) - 2)
    s, b = g.tensor(name="scale", dim=param), g.tensor(name="bias", dim=param)
    inputs = {x: x_t, s: shifted(*param, dtype=dtype), b: torch.randn(*param).to(dtype)}
    if op == "batchnorm":
        rm = g.tensor(name="rm", dim=param, data_type=dg.float32) if running else None
        rv = g.tensor(name="rv", dim=param, data_type=dg.float32) if running else None
        if running:
            inputs[rm], inputs[rv] = torch.randn(*param), torch.rand(*param) + 0.5
        outs = g.batchnorm(x, s, b, rm, rv, epsilon=1e-5, momentum=0.1)
    elif op == "groupnorm":
        outs = g.groupnorm(x, s, b, groups)
    else:
        outs = g.instancenorm(x, s, b)
    for out in outs:
        if out is not None:
            out.set_output(True)
    return g, inputs


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("op,groups", [("batchnorm", None), ("instancenorm", None), ("groupnorm", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_channel_norm_forward(op, groups, nhwc, dtype):
    g, inputs = _channel_forward(op, (3, 6, 5, 7), nhwc, dtype, groups, running=True)
    check(g, inputs, dtype)


@pytest.mark.parametrize("nhwc", [False, True])
def test_batchnorm_every_mode(row_mode, nhwc):
    g, inputs = _channel_forward("batchnorm", (4, 5, 6, 7), nhwc, running=True)
    check(g, inputs, options=row_options(row_mode))
    assert row_mode in modes_used(g) or row_mode == "one_pass"


def test_batchnorm_3d_and_1d():
    for shape in ((2, 3, 4, 5, 3), (4, 3, 9)):
        g, inputs = _channel_forward("batchnorm", shape, False, running=False)
        check(g, inputs)


def _channel_backward(op, shape, nhwc, dtype=torch.float32, groups=None):
    x64 = shifted(*shape, dtype=torch.float64)
    channels = shape[1]
    w64, b64 = shifted(channels, dtype=torch.float64), torch.randn(channels, dtype=torch.float64)
    dy64 = torch.randn(*shape, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x64, w64, b64)]
    if op == "batchnorm_backward":
        y = F.batch_norm(leaves[0], None, None, leaves[1], leaves[2], training=True, eps=1e-5)
        axes = (0,) + tuple(range(2, len(shape)))
        mean = x64.mean(axes, keepdim=True)
        inv = (x64.var(axes, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    else:
        g_count = channels if op == "instancenorm_backward" else groups
        y = F.group_norm(leaves[0], g_count, leaves[1], leaves[2], eps=1e-5)
        grouped = x64.reshape(shape[0], g_count, -1)
        stat_shape = (shape[0], g_count) + (1,) * (len(shape) - 2)
        mean = grouped.mean(-1).reshape(stat_shape)
        inv = (grouped.var(-1, unbiased=False) + 1e-5).rsqrt().reshape(stat_shape)
    expected = torch.autograd.grad(y, leaves, dy64)
    g = dg.Graph(io_data_type=DTYPES[dtype])
    dy_t, x_t = layout(dy64.to(dtype), nhwc), layout(x64.to(dtype), nhwc)
    dy, x = g.tensor_like(dy_t, "dy"), g.tensor_like(x_t, "x")
    param = [1, channels] + [1] * (len(shape) - 2)
    s = g.tensor(name="scale", dim=param)
    m = g.tensor(name="mean", dim=list(mean.shape), data_type=dg.float32)
    i = g.tensor(name="inv", dim=list(inv.shape), data_type=dg.float32)
    extra = (groups,) if op == "groupnorm_backward" else ()
    outs = getattr(g, op)(dy, x, s, m, i, *extra)
    for out, name in zip(outs, ("dx", "dscale", "dbias")):
        out.set_output(True).set_name(name)
    inputs = {dy: dy_t, x: x_t, s: w64.view(param).to(dtype), m: mean.float(), i: inv.float()}
    return g, inputs, expected


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("op,groups", [("batchnorm_backward", None), ("instancenorm_backward", None),
                                       ("groupnorm_backward", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_channel_norm_backward_matches_autograd(op, groups, nhwc, dtype):
    g, inputs, expected = _channel_backward(op, (3, 6, 5, 7), nhwc, dtype, groups)
    limit = 5e-5 if dtype == torch.float32 else 5e-3
    outputs = check(g, inputs, dtype, tolerance=limit)
    for name, want in zip(("dx", "dscale", "dbias"), expected):
        got = outputs[name].double().reshape(want.shape)
        assert (got - want).norm() / want.norm() < limit, name


@pytest.mark.parametrize("nhwc", [False, True])
def test_batchnorm_backward_every_mode(row_mode, nhwc):
    g, inputs, _ = _channel_backward("batchnorm_backward", (4, 5, 6, 7), nhwc)
    check(g, inputs, tolerance=5e-5, options=row_options(row_mode))


@pytest.mark.parametrize("nhwc", [False, True])
def test_batchnorm_inference_and_genstats(nhwc):
    g = dg.Graph()
    x_t = layout(shifted(3, 6, 5, 7), nhwc)
    x = g.tensor_like(x_t, "x")
    params = [g.tensor(name=n, dim=[1, 6, 1, 1]) for n in ("mean", "inv", "scale", "bias")]
    g.batchnorm_inference(x, *params).set_output(True)
    for out in g.genstats(x):
        out.set_output(True)
    values = [torch.randn(1, 6, 1, 1), torch.rand(1, 6, 1, 1) + 0.5, torch.randn(1, 6, 1, 1),
              torch.randn(1, 6, 1, 1)]
    check(g, {x: x_t, **dict(zip(params, values))})


# --- fusion ---------------------------------------------------------------------------------------
def test_residual_add_rmsnorm_scale_cast_is_one_kernel():
    g = dg.Graph(io_data_type=dg.float16)
    x, r = g.tensor(name="x", dim=[9, 200]), g.tensor(name="residual", dim=[9, 200])
    w = g.tensor(name="w", dim=[1, 200])
    h = g.add(x, r).set_output(True).set_name("h")
    y, _ = g.rmsnorm(h, w, None, norm_forward_phase="training")
    g.cast(g.mul(y, 0.5), dg.float16).set_output(True).set_name("y16")
    check(g, {x: shifted(9, 200, dtype=torch.float16), r: shifted(9, 200, dtype=torch.float16),
              w: shifted(1, 200, dtype=torch.float16)}, torch.float16)
    assert len(g.plan.launches) == 1


def test_norm_then_activation_is_one_kernel(row_mode):
    g = dg.Graph()
    x, s, b = g.tensor(name="x", dim=[7, 40]), g.tensor(name="s", dim=[1, 40]), g.tensor(name="b", dim=[1, 40])
    y, _, _ = g.layernorm(x, s, b, norm_forward_phase="training")
    g.gelu(y).set_output(True)
    check(g, {x: shifted(7, 40), s: shifted(1, 40), b: torch.randn(1, 40)}, options=row_options(row_mode))
    assert len(g.plan.launches) == (3 if row_mode == "split" else 1)


# --- validation -----------------------------------------------------------------------------------
def test_bad_inputs_are_validation_errors():
    g = dg.Graph()
    x, s, b = g.tensor(name="x", dim=[4, 8]), g.tensor(name="s", dim=[1, 8]), g.tensor(name="b", dim=[1, 8])
    with pytest.raises(dg.ValidationError):
        g.layernorm(x, s, b, epsilon=0.0)
    with pytest.raises(dg.ValidationError):
        g.layernorm(x, s, b, epsilon=-1e-5)
    dy = g.tensor(name="dy", dim=[4, 8])
    wrong_mean = g.tensor(name="mean", dim=[1, 8], data_type=dg.float32)
    inv = g.tensor(name="inv", dim=[4, 1], data_type=dg.float32)
    with pytest.raises(dg.ValidationError):
        g.layernorm_backward(dy, x, s, wrong_mean, inv)
    with pytest.raises(dg.ValidationError):
        g.groupnorm(g.tensor(name="img", dim=[2, 6, 3, 3]), g.tensor(name="gs", dim=[1, 6, 1, 1]),
                    g.tensor(name="gb", dim=[1, 6, 1, 1]), groups=4)


# --- expanded (stride-0) parameters ---------------------------------------------------------------
def _expanded_scale_backward(op, x_shape, param_shape, stats_shape):
    """A norm backward whose scale is an expanded view: every index holds a parameter, the
    strides say 0. Its dscale and dbias are per-parameter sums, as for a dense scale."""
    g = dg.Graph()
    x_t, dy_t = shifted(*x_shape), torch.randn(*x_shape)
    scale_t = shifted(*param_shape[:-1], 1).expand(*param_shape)  # stride 0 on the last axis
    x, dy, s = g.tensor(name="x", dim=list(x_shape)), g.tensor(name="dy", dim=list(x_shape)), g.tensor_like(scale_t, "scale")
    m = g.tensor(name="mean", dim=list(stats_shape), data_type=dg.float32)
    i = g.tensor(name="inv", dim=list(stats_shape), data_type=dg.float32)
    for out in getattr(g, op)(dy, x, s, m, i):
        out.set_output(True)
    inputs = {x: x_t, dy: dy_t, s: scale_t, m: torch.randn(*stats_shape), i: torch.rand(*stats_shape) + 0.5}
    return g, inputs


@pytest.mark.parametrize("op,x_shape,param_shape,stats_shape", [
    ("layernorm_backward", (5, 13), (5, 13), (1, 1)),  # scale over every axis, expanded on one
    ("instancenorm_backward", (13, 16), (1, 16), (13, 16)),  # channel scale expanded along C
])
def test_norm_backward_expanded_scale(row_mode, op, x_shape, param_shape, stats_shape):
    g, inputs = _expanded_scale_backward(op, x_shape, param_shape, stats_shape)
    check(g, inputs, tolerance=5e-5, options=row_options(row_mode))


def _norm_backward_with_epilogue(op, x_shape, param_shape):
    """A feature norm backward whose dx feeds a pointwise epilogue that also reads another input.
    dscale and dbias come from their own kernel, which computes no dx: it must run no epilogue."""
    g = dg.Graph()
    stats_shape = [1 if p > 1 else n for n, p in zip(x_shape, param_shape)]  # normalized axes: 1
    x, dy = g.tensor(name="x", dim=list(x_shape)), g.tensor(name="dy", dim=list(x_shape))
    s, shift = g.tensor(name="scale", dim=list(param_shape)), g.tensor(name="shift", dim=list(x_shape))
    i = g.tensor(name="inv", dim=stats_shape, data_type=dg.float32)
    inputs = {x: shifted(*x_shape), dy: torch.randn(*x_shape), s: shifted(*param_shape),
              shift: torch.randn(*x_shape), i: torch.rand(*stats_shape) + 0.5}
    if op == "layernorm_backward":
        m = g.tensor(name="mean", dim=stats_shape, data_type=dg.float32)
        inputs[m] = torch.randn(*stats_shape)
        dx, dscale, dbias = g.layernorm_backward(dy, x, s, m, i)
    else:
        dx, dscale, dbias = g.rmsnorm_backward(dy, x, s, i, has_dbias=True)
    picked = g.where(g.cmp_ge(i, dx), shift, dx)
    for out in (g.relu(picked), dscale, dbias):
        out.set_output(True)
    return g, inputs


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("x_shape,param_shape", [
    ((5, 13), (1, 13)),  # dscale sums over rows: dx is a tile of the parameter kernel
    ((16, 7, 5), (1, 7, 5)),
    ((6,), (6,)),  # one row: the parameter kernel reduces nothing, dx is a row there
])
def test_norm_backward_epilogue_stays_in_the_dx_kernel(row_mode, op, x_shape, param_shape):
    g, inputs = _norm_backward_with_epilogue(op, x_shape, param_shape)
    check(g, inputs, tolerance=5e-5, options=row_options(row_mode))
    assert len(g.plan.launches) >= 2


def _poison_rows(tensor, axis):
    """NaN, -inf and +inf, each in its own slice along `axis` (0, 1, 2), the rest finite."""
    for index, value in enumerate([float("nan"), float("-inf"), float("inf")]):
        position = [1] * tensor.dim()
        position[axis] = index
        tensor[tuple(position)] = value
    return tensor


def check_non_finite_feature_norm(op, phase, device, options):
    """A row holding NaN or an infinity has the reference's statistics (an infinite mean, NaN
    variance) in every row mode: the variance clamp at 0 propagates NaN (the GPU's max returns
    0), and a running mean that is already infinite adds values as a plain sum."""
    g, inputs = _feature_graph(op, torch.float32, (6, 40), phase, bias=op == "layernorm")
    x = next(t for t in inputs if t.name == "x")
    _poison_rows(inputs[x], 0)
    check(g, {k: v.to(device) for k, v in inputs.items()}, torch.float32, device=device, tolerance=1e-4,
          options=options)


def check_non_finite_channel_norm(op, groups, nhwc, device, options):
    g, inputs = _channel_forward(op, (4, 6, 5, 7), nhwc, torch.float32, groups)
    x = next(t for t in inputs if t.name == "x")
    _poison_rows(inputs[x], 1)
    check(g, {k: v.to(device) for k, v in inputs.items()}, torch.float32, device=device, tolerance=1e-4,
          options=options)


@pytest.mark.parametrize("phase", ["training", "inference"])
@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_feature_norm_stats_of_non_finite_rows(row_mode, op, phase):
    check_non_finite_feature_norm(op, phase, "cpu", row_options(row_mode))


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("op,groups", [("batchnorm", None), ("groupnorm", 2), ("instancenorm", None)])
def test_channel_norm_stats_of_non_finite_channels(row_mode, op, groups, nhwc):
    check_non_finite_channel_norm(op, groups, nhwc, "cpu", row_options(row_mode))


def test_groupnorm_backward_of_one_channel_sums_over_columns():
    """A scale constant along a reduced axis (one channel, one group): dscale sums columns too,
    so the fused form (one partial per column) does not apply."""
    g, inputs, _ = _channel_backward("groupnorm_backward", (3, 1, 5, 2), False, groups=1)
    check(g, inputs, tolerance=5e-5)
    assert "fused" not in _fused_launches(g)


# --- on the GPU: bf16, realistic and very wide rows, column splits, bound launches ---------------
CUDA = "cuda"


def _to_cuda(inputs):
    return {k: v.to(CUDA) for k, v in inputs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(257, 4096), (33, 14336), (3, 70001)])
def test_feature_norm_forward_bf16(op, shape):
    g, inputs = _feature_graph(op, torch.bfloat16, shape, bias=op == "layernorm")
    check(g, _to_cuda(inputs), torch.bfloat16, device=CUDA)
    assert g.plan.launches[0]._bound


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("shape", [(129, 4096), (5, 70001)])
def test_feature_norm_backward_gpu(op, shape):
    g, inputs, _ = _feature_backward(op, torch.float16, shape)
    check(g, _to_cuda(inputs), torch.float16, device=CUDA, tolerance=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("shape", [(4096, 8192), (1000, 4096), (77, 300)])
def test_fused_norm_backward_gpu(op, shape):
    """bf16 dx and dscale/dbias from the fused kernel and its combine; bitwise the same on a
    second run (the partials are summed in program order)."""
    g, inputs = _fused_backward(op, shifted(*shape, dtype=torch.bfloat16), torch.randn(*shape).bfloat16(),
                                shifted(1, shape[1], dtype=torch.bfloat16), torch.bfloat16)
    inputs = _to_cuda(inputs)
    first = check(g, inputs, torch.bfloat16, device=CUDA)
    assert _fused_launches(g) == ["fused", "combine"]
    again = run(g, inputs, CUDA)
    assert all(torch.equal(first[name], again[name]) for name in first)


@pytest.mark.gpu
@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("op,groups", [("batchnorm", None), ("groupnorm", 4), ("instancenorm", None)])
def test_channel_norms_gpu(op, groups, nhwc):
    g, inputs = _channel_forward(op, (8, 64, 28, 28), nhwc, torch.float16, groups, running=True)
    check(g, _to_cuda(inputs), torch.float16, device=CUDA)
    g, inputs, _ = _channel_backward(op + "_backward", (8, 64, 28, 28), nhwc, torch.float16, groups)
    check(g, _to_cuda(inputs), torch.float16, device=CUDA, tolerance=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layernorm", "groupnorm"])
def test_norm_backward_over_one_element_groups_is_exactly_zero(op):
    """dx of a one-element group is g - mean(g) = 0: with multiply-add contraction one side was
    rounded and the other not, and rsqrt(eps) amplified the difference."""
    torch.manual_seed(0)
    g = dg.Graph(name=op, io_data_type=dg.float16)
    x = g.tensor(name="x", dim=[37, 1])
    scale, bias = g.tensor(name="scale", dim=[1, 1]), g.tensor(name="bias", dim=[1, 1])
    if op == "layernorm":
        _, mean, inv = g.layernorm(x, scale, bias)
    else:
        _, mean, inv = g.groupnorm(x, scale, bias, groups=1)
    dy = g.tensor(name="dy", dim=[37, 1])
    backward = g.layernorm_backward if op == "layernorm" else \
        (lambda *args: g.groupnorm_backward(*args, groups=1))
    dx, _, _ = backward(dy, x, scale, mean, inv)
    dx.set_output(True).set_name("dx")
    inputs = {name: torch.randn(37, 1, device="cuda").half() for name in ("x", "dy")}
    inputs.update(scale=torch.randn(1, 1, device="cuda").half(), bias=torch.randn(1, 1, device="cuda").half())
    outputs = check(g, inputs, torch.float16, device="cuda")
    assert torch.count_nonzero(outputs["dx"]).item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 96, 40, 40), (8, 120, 33, 35)])
def test_batchnorm_nhwc_bf16_column_split(shape):
    """NHWC bf16 batchnorm forward and backward as column splits (partial, combine, apply):
    checked against float64, and bitwise the same on a second run (a fixed combine order)."""
    g, inputs = _channel_forward("batchnorm", shape, True, torch.bfloat16, running=True)
    inputs = _to_cuda(inputs)
    first = check(g, inputs, torch.bfloat16, device=CUDA)
    again = run(g, inputs, CUDA)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert [launch.config_text.split()[:2] for launch in g.plan.launches] == \
        [["partial", "(split)"], ["combine", "(split)"], ["apply", "(split)"]]
    g, inputs, expected = _channel_backward("batchnorm_backward", shape, True, torch.bfloat16)
    inputs = _to_cuda(inputs)
    first = check(g, inputs, torch.bfloat16, device=CUDA)
    for name, want in zip(("dx", "dscale", "dbias"), expected):
        got = first[name].double().cpu().reshape(want.shape)
        assert (got - want).norm() / want.norm() < 1.6e-2, name
    again = run(g, inputs, CUDA)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert len(g.plan.launches) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["training", "inference"])
@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_feature_norm_stats_of_non_finite_rows_gpu(row_mode, op, phase):
    """On the GPU tl.maximum drops NaN and fast paths differ from numpy: the same checks."""
    check_non_finite_feature_norm(op, phase, CUDA, row_options(row_mode))


@pytest.mark.gpu
@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("op,groups", [("batchnorm", None), ("groupnorm", 2), ("instancenorm", None)])
def test_channel_norm_stats_of_non_finite_channels_gpu(row_mode, op, groups, nhwc):
    check_non_finite_channel_norm(op, groups, nhwc, CUDA, row_options(row_mode))
