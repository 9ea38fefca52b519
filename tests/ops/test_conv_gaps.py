"""Convolution as the cuDNN frontend declares it: asymmetric padding (pre_padding before the first
element of each spatial axis, post_padding after the last) through the fprop, dgrad and wgrad
kernels, and the group count inferred from the shapes."""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

# (x dims, w dims, pre, post, stride, dilation, channels_last)
CASES = [
    ([2, 4, 9], [5, 4, 3], [2], [0], [2], [1], False),
    ([2, 4, 7, 6], [6, 4, 3, 2], [2, 0], [0, 1], [1, 1], [1, 1], False),
    ([1, 6, 7, 5], [4, 3, 3, 3], [0, 1], [2, 0], [2, 1], [1, 2], True),  # groups 2
    ([2, 4, 6, 7], [4, 1, 3, 3], [1, 2], [0, 1], [2, 2], [1, 1], True),  # depthwise
    ([2, 3, 5, 4], [5, 3, 1, 1], [0, 0], [1, 2], [1, 1], [1, 1], False),  # 1x1: post padding only
    ([1, 2, 4, 5, 3], [3, 2, 2, 3, 1], [1, 0, 2], [0, 2, 1], [1, 2, 1], [1, 1, 1], False),
]


def _torch_forward(x, w, pre, post, stride, dilation, groups):
    """torch's convolution of x padded asymmetrically by F.pad, written independently of dnngraph."""
    widths = [width for p, q in reversed(list(zip(pre, post))) for width in (p, q)]
    return CONV[len(pre)](F.pad(x, widths), w, stride=stride, dilation=dilation, groups=groups)


def _strided(t, channels_last):
    if not channels_last:
        return t
    return t.permute(0, *range(2, t.dim()), 1).contiguous().permute(0, t.dim() - 1, *range(1, t.dim() - 1))


@pytest.mark.parametrize("case", CASES, ids=[f"{len(c[0]) - 2}d_{i}" for i, c in enumerate(CASES)])
def test_asymmetric_padding_fprop_dgrad_wgrad(case, device="cpu"):
    x_dim, w_dim, pre, post, stride, dilation, channels_last = case
    groups = x_dim[1] // w_dim[1]
    x_t = _strided(torch.randn(x_dim, device=device), channels_last)
    w_t = torch.randn(w_dim, device=device)
    want = _torch_forward(x_t.double(), w_t.double(), pre, post, stride, dilation, groups)
    g = dg.Graph(name="fprop")
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.conv_fprop(x, w, stride=stride, dilation=dilation, pre_padding=pre, post_padding=post).set_output(True)
    assert list(y.dim) == list(want.shape) and y.producer.attrs.groups == groups  # inferred
    outs = check(g, {x: x_t, w: w_t}, device=device)
    torch.testing.assert_close(outs[y.name].double().cpu(), want.cpu(), rtol=1e-4, atol=1e-4)

    # the gradients of the padded convolution, by torch's autograd
    dy_t = _strided(torch.randn(want.shape, device=device), channels_last)
    x64, w64 = x_t.double().requires_grad_(True), w_t.double().requires_grad_(True)
    want_dx, want_dw = torch.autograd.grad(_torch_forward(x64, w64, pre, post, stride, dilation, groups),
                                           (x64, w64), dy_t.double())
    g2 = dg.Graph(name="backward")
    dy, w2, x2 = g2.tensor_like(dy_t, name="dy"), g2.tensor_like(w_t, name="w"), g2.tensor_like(x_t, name="x")
    common = dict(stride=stride, dilation=dilation, pre_padding=pre, post_padding=post)
    dx = g2.conv_dgrad(dy, w2, x_dim, **common).set_output(True)
    dw = g2.conv_wgrad(dy, x2, w_dim, **common).set_output(True)
    outs = check(g2, {dy: dy_t, w2: w_t, x2: x_t}, device=device)
    torch.testing.assert_close(outs[dx.name].double().cpu(), want_dx.cpu(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[dw.name].double().cpu(), want_dw.cpu(), rtol=1e-4, atol=1e-4)


def test_padding_is_the_default_of_pre_and_post():
    g = dg.Graph()
    x, w = g.tensor(name="x", dim=[1, 2, 6, 6]), g.tensor(name="w", dim=[3, 2, 3, 3])
    symmetric = g.conv_fprop(x, w, padding=1)
    only_post = g.conv_fprop(x, w, padding=1, post_padding=[0, 2])
    both = g.conv_fprop(x, w, pre_padding=[1, 1], post_padding=[1, 1])
    assert symmetric.producer.attrs == both.producer.attrs and symmetric.producer.attrs.post_padding == ()
    assert only_post.producer.attrs.padding == (1, 1) and only_post.producer.attrs.post_padding == (0, 2)
    assert list(only_post.dim) == [1, 3, 5, 7]


def test_autodiff_of_asymmetric_padding():
    g = dg.Graph()
    x, w = g.tensor(name="x", dim=[2, 3, 6, 5]), g.tensor(name="w", dim=[4, 3, 3, 2])
    y = g.conv_fprop(x, w, stride=[2, 1], pre_padding=[0, 2], post_padding=[2, 0]).set_output(True)
    fn = g.as_function([x, w], [y])
    x_t, w_t = torch.randn(2, 3, 6, 5, requires_grad=True), torch.randn(4, 3, 3, 2, requires_grad=True)
    out = fn(x_t, w_t)
    dy_t = torch.randn(out.shape)
    got = torch.autograd.grad(out, (x_t, w_t), dy_t)
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x_t, w_t))
    want = torch.autograd.grad(_torch_forward(x64, w64, [0, 2], [2, 0], [2, 1], [1, 1], 1), (x64, w64), dy_t.double())
    for got_grad, want_grad in zip(got, want):
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-4, atol=1e-4)


def test_post_padding_round_trips_through_json():
    g = dg.Graph()
    x, w = g.tensor(name="x", dim=[1, 2, 5, 5]), g.tensor(name="w", dim=[2, 1, 2, 2])
    g.conv_fprop(x, w, pre_padding=[1, 0], post_padding=[0, 1]).set_output(True)
    g2 = dg.Graph.from_json(g.to_json())
    assert g2.nodes[0].attrs == g.nodes[0].attrs and g2.nodes[0].attrs.groups == 2
    x_t, w_t = torch.randn(1, 2, 5, 5), torch.randn(2, 1, 2, 2)
    check(g2, {"x": x_t, "w": w_t})


@pytest.mark.parametrize("call, match", [
    (lambda g, x, w: g.conv_fprop(x, w, post_padding=[1]), "post_padding"),
    (lambda g, x, w: g.conv_fprop(x, w, pre_padding=[1, -1]), "pre_padding"),
    (lambda g, x, w: g.conv_fprop(x, w, groups=3), "groups"),
    (lambda g, x, w: g.conv_fprop(x, g.tensor(name="w4", dim=[4, 4, 3, 3])), "channels"),
    (lambda g, x, w: g.conv_fprop(x, g.tensor(name="w5", dim=[4, 6, 3])), "rank|spatial"),
    (lambda g, x, w: g.conv_dgrad(x, w, [1, 5, 6, 6]), "channels"),
    (lambda g, x, w: g.conv_wgrad(x, x, [4, 4, 3, 3]), "channels"),
])
def test_bad_padding_and_shapes_are_refused_and_add_nothing(call, match):
    g = dg.Graph()
    x, w = g.tensor(name="x", dim=[1, 6, 6, 6]), g.tensor(name="w", dim=[4, 3, 3, 3])
    tensors = len(g.tensors)
    with pytest.raises(dg.ValidationError, match=match):
        call(g, x, w)
    assert len(g.nodes) == 0 and len([t for t in g.tensors if t.producer is not None]) == 0
    assert len(g.tensors) >= tensors


def test_groups_inferred_for_dgrad_and_wgrad():
    g = dg.Graph()
    dy, w, x = g.tensor(name="dy", dim=[2, 6, 5, 5]), g.tensor(name="w", dim=[6, 2, 3, 3]), \
        g.tensor(name="x", dim=[2, 4, 5, 5])
    dx = g.conv_dgrad(dy, w, [2, 4, 5, 5], padding=1)
    dw = g.conv_wgrad(dy, x, [6, 2, 3, 3], padding=1)
    assert dx.producer.attrs.groups == 2 and dw.producer.attrs.groups == 2


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[f"{len(c[0]) - 2}d_{i}" for i, c in enumerate(CASES)])
def test_asymmetric_padding_on_gpu(case):
    test_asymmetric_padding_fprop_dgrad_wgrad(case, device="cuda")
