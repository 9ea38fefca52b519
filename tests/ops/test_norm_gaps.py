"""adalayernorm (the cuDNN frontend's adaptive layernorm: layernorm whose scale and bias hold one
row per sample) forward and backward, and the frontend's rule for the normalized axes."""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check, run


IO_TYPES = {torch.float32: dg.float32, torch.bfloat16: dg.bfloat16, torch.float16: dg.float16}


def _torch_adalayernorm(x, scale, bias, eps, normalized):
    """torch's layer_norm over the trailing `normalized` dims, then the per-sample affine."""
    y = F.layer_norm(x, x.shape[-normalized:], eps=eps) * scale
    return y if bias is None else y + bias


@pytest.mark.parametrize("dims, param_dims, dtype", [
    ([3, 5, 19], [3, 1, 19], torch.float32),
    ([2, 7, 33], [2, 1, 33], torch.bfloat16),
    ([4, 1, 9], [4, 1, 9], torch.float32),  # size-1 sequence
    ([2, 3, 4, 6], [2, 1, 4, 6], torch.float32),  # two normalized axes
    ([3, 5, 19], [1, 1, 19], torch.float16),  # one scale for every sample: a layernorm
])
@pytest.mark.parametrize("with_bias", [True, False])
def test_adalayernorm_forward_against_torch(dims, param_dims, dtype, with_bias):
    g = dg.Graph(io_data_type=IO_TYPES[dtype])
    x_t = torch.randn(dims[::-1]).permute(*reversed(range(len(dims)))).to(dtype)  # transposed strides
    scale_t, bias_t = torch.randn(param_dims).to(dtype), torch.randn(param_dims).to(dtype)
    x, scale = g.tensor_like(x_t, name="x"), g.tensor_like(scale_t, name="scale")
    bias = g.tensor_like(bias_t, name="bias") if with_bias else None
    y, mean, inv_variance = g.adalayernorm(x, scale, bias, epsilon=1e-3)
    for t in (y, mean, inv_variance):
        t.set_output(True)
    normalized = sum(1 for size in param_dims[1:] if size != 1)
    assert list(mean.dim) == list(dims[:len(dims) - normalized]) + [1] * normalized
    inputs = {x: x_t, scale: scale_t, **({bias: bias_t} if with_bias else {})}
    outs = check(g, inputs, dtype)
    want = _torch_adalayernorm(x_t.double(), scale_t.double(), bias_t.double() if with_bias else None, 1e-3,
                               normalized)
    tolerance = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(outs[y.name].double(), want, rtol=tolerance, atol=tolerance)


def test_adalayernorm_inference_phase_has_no_statistics():
    g = dg.Graph()
    x, scale = g.tensor(name="x", dim=[2, 3, 8]), g.tensor(name="scale", dim=[2, 1, 8])
    y, mean, inv_variance = g.adalayernorm(x, scale, norm_forward_phase="inference")
    assert mean is None and inv_variance is None
    y.set_output(True)
    x_t, scale_t = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    torch.testing.assert_close(run(g, {x: x_t, scale: scale_t})[y.name].double(),
                               _torch_adalayernorm(x_t.double(), scale_t.double(), None, 1e-5, 1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("param_dims", [[3, 1, 19], [1, 1, 19]])
def test_adalayernorm_backward_and_autodiff_against_torch(param_dims):
    B, S, D = 3, 5, 19
    x_t = torch.randn(B, S, D, requires_grad=True)
    scale_t, bias_t = torch.randn(param_dims, requires_grad=True), torch.randn(param_dims, requires_grad=True)
    dy_t = torch.randn(B, S, D)
    g = dg.Graph()
    x, scale, bias = g.tensor_like(x_t, "x"), g.tensor_like(scale_t, "scale"), g.tensor_like(bias_t, "bias")
    y = g.adalayernorm(x, scale, bias)[0].set_output(True)
    fn = g.as_function([x, scale, bias], [y])
    got = torch.autograd.grad(fn(x_t, scale_t, bias_t), (x_t, scale_t, bias_t), dy_t)
    leaves = [t.detach().double().requires_grad_(True) for t in (x_t, scale_t, bias_t)]
    want = torch.autograd.grad(_torch_adalayernorm(*leaves, 1e-5, 1), leaves, dy_t.double())
    for got_grad, want_grad in zip(got, want):
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-4, atol=1e-4)

    # the backward op on its own, with the forward's statistics, against the reference
    gb = dg.Graph()
    stats = [B, S, 1]
    dy, xb = gb.tensor(name="dy", dim=[B, S, D]), gb.tensor(name="x", dim=[B, S, D])
    sb = gb.tensor(name="scale", dim=param_dims)
    mean, inv = gb.tensor(name="mean", dim=stats), gb.tensor(name="inv", dim=stats)
    dx, dscale, dbias = gb.adalayernorm_backward(dy, xb, sb, mean, inv)
    for t in (dx, dscale, dbias):
        t.set_output(True)
    assert list(dscale.dim) == param_dims
    x64 = x_t.detach().double()
    mean_t = x64.mean(-1, keepdim=True)
    inv_t = (x64.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    outs = check(gb, {dy: dy_t, xb: x_t.detach(), sb: scale_t.detach(), mean: mean_t.float(), inv: inv_t.float()})
    torch.testing.assert_close(outs[dscale.name].double(), want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[dbias.name].double(), want[2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("call, match", [
    (lambda g, x: g.adalayernorm(x, g.tensor(name="s", dim=[2, 1, 7])), "does not match"),
    (lambda g, x: g.adalayernorm(x, g.tensor(name="s", dim=[3, 8])), "rank"),
    (lambda g, x: g.adalayernorm(x, g.tensor(name="s", dim=[2, 1, 8]), g.tensor(name="b", dim=[1, 3, 8])),
     "bias"),
    (lambda g, x: g.adalayernorm(x, g.tensor(name="s", dim=[2, 1, 8]), epsilon=0.0), "epsilon"),
])
def test_adalayernorm_errors_add_nothing(call, match):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 3, 8])
    with pytest.raises(dg.ValidationError, match=match):
        call(g, x)
    assert len(g.nodes) == 0


def test_layernorm_normalizes_the_axes_where_scale_is_not_one():
    """The frontend's rule, which the trailing-axes rule was a case of: a scale of 1 on an inner
    axis keeps that axis in the statistics."""
    g = dg.Graph()
    x, scale = g.tensor(name="x", dim=[2, 4, 3, 6]), g.tensor(name="scale", dim=[1, 4, 1, 6])
    y, mean, inv_variance = g.layernorm(x, scale, None)
    for t in (y, mean, inv_variance):
        t.set_output(True)
    assert list(mean.dim) == [2, 1, 3, 1]
    x_t, scale_t = torch.randn(2, 4, 3, 6), torch.randn(1, 4, 1, 6)
    outs = check(g, {x: x_t, scale: scale_t})
    x64 = x_t.double()
    centered = x64 - x64.mean((1, 3), keepdim=True)
    want = centered * (centered.square().mean((1, 3), keepdim=True) + 1e-5).rsqrt() * scale_t.double()
    torch.testing.assert_close(outs[y.name].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adalayernorm_on_gpu(dtype):
    B, S, D = 4, 77, 1024
    g = dg.Graph(io_data_type=IO_TYPES[dtype])
    x, scale, bias = (g.tensor(name=n, dim=d) for n, d in (("x", [B, S, D]), ("scale", [B, 1, D]), ("bias", [B, 1, D])))
    y = g.adalayernorm(x, scale, bias)[0].set_output(True)
    fn = g.as_function([x, scale, bias], [y])
    x_t = torch.randn(B, S, D, device="cuda", dtype=dtype, requires_grad=True)
    scale_t = torch.randn(B, 1, D, device="cuda", dtype=dtype, requires_grad=True)
    bias_t = torch.randn(B, 1, D, device="cuda", dtype=dtype, requires_grad=True)
    dy_t = torch.randn(B, S, D, device="cuda", dtype=dtype)
    got = torch.autograd.grad(fn(x_t, scale_t, bias_t), (x_t, scale_t, bias_t), dy_t)
    leaves = [t.detach().double().requires_grad_(True) for t in (x_t, scale_t, bias_t)]
    want = torch.autograd.grad(_torch_adalayernorm(*leaves, 1e-5, 1), leaves, dy_t.double())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for got_grad, want_grad in zip(got, want):
        error = (got_grad.double() - want_grad).norm() / want_grad.norm()
        assert error < tolerance
