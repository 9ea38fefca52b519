"""Depthwise convolution on the GPU in bf16 (the interpreter runs fp32 and fp16): MobileNetV2 3x3
(stride 1 and 2) and ConvNeXt 7x7 layers at a small batch, fprop + bias + relu in NHWC and NCHW
against the float64 reference, dgrad and wgrad against torch.autograd, wgrad bit for bit across
runs."""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check
from test_conv import stored

pytestmark = pytest.mark.gpu

LAYERS = {  # x dims, filter, padding, stride
    "mbv2 3x3": ([4, 144, 56, 56], 3, 1, 1),
    "mbv2 3x3/2": ([4, 144, 56, 56], 3, 1, 2),
    "convnext 7x7": ([2, 96, 56, 56], 7, 3, 1),
}


def _case(name):
    x_dim, size, padding, stride = LAYERS[name]
    w_dim = [x_dim[1], 1, size, size]
    return x_dim, w_dim, dict(padding=[padding] * 2, stride=[stride] * 2, dilation=[1, 1], groups=x_dim[1])


def _direct(g):
    return all("_depthwise" in launch.kernel.__name__ for launch in g.plan.launches)


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_fprop_bias_relu_bf16(name, layout):
    x_dim, w_dim, attrs = _case(name)
    x_t, w_t = stored(x_dim, layout, torch.bfloat16), stored(w_dim, layout, torch.bfloat16)
    g = dg.Graph(name="depthwise", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    bias = g.tensor(name="b", dim=[1, w_dim[0], 1, 1])
    g.relu(g.add(g.conv_fprop(x, w, **attrs), bias)).set_output(True).set_name("y")
    inputs = {"x": x_t, "w": w_t, "b": torch.randn(1, w_dim[0], 1, 1).to(torch.bfloat16)}
    check(g, {k: v.cuda() for k, v in inputs.items()}, torch.bfloat16, "cuda")
    assert len(g.plan.groups) == 1 and len(g.plan.launches) == 1 and _direct(g)


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_backward_bf16_against_autograd(name, op):
    x_dim, w_dim, attrs = _case(name)
    x64 = torch.randn(x_dim, dtype=torch.float64, device="cuda", requires_grad=True)
    w64 = torch.randn(w_dim, dtype=torch.float64, device="cuda", requires_grad=True)
    y = F.conv2d(x64, w64, **attrs)
    dy64 = torch.randn_like(y)
    dx64, dw64 = torch.autograd.grad(y, (x64, w64), dy64)
    dy_t = dy64.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    g = dg.Graph(name="depthwise", io_data_type=dg.bfloat16)
    dy = g.tensor_like(dy_t, name="dy")
    if op == "dgrad":
        w_t = w64.detach().to(torch.bfloat16)
        w = g.tensor_like(w_t, name="w")
        g.conv_dgrad(dy, w, x_dim=x_dim, **attrs).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "w": w_t}, dx64
    else:
        x_t = x64.detach().to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        x = g.tensor_like(x_t, name="x")
        g.conv_wgrad(dy, x, w_dim=w_dim, **attrs).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "x": x_t}, dw64
    out = check(g, inputs, torch.bfloat16, "cuda")["out"]
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < 1.6e-2, error
    assert _direct(g)
    if op == "wgrad":  # the splits' partials are added in a fixed order: the same bits every run
        again = check(g, inputs, torch.bfloat16, "cuda")["out"]
        assert torch.equal(out, again)
