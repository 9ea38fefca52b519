"""Convolution on the GPU: bf16 (the interpreter's bf16 dot is wrong), fp16 and tf32/IEEE fp32 at
real tile sizes, ResNet-like layers in NHWC and NCHW, 3D, grouped, both backward ops against
torch.autograd, split-K wgrad bitwise reproducible, and the 1x1 matmul path through TMA."""
import pytest
import torch

import dnngraph as dg
from dnngraph.heuristics import matmul as mm
from helpers import check
from test_conv import geometry, stored

pytestmark = pytest.mark.gpu

LAYERS = {  # x, w, padding, stride, dilation, groups
    "3x3": ([4, 64, 28, 28], [64, 64, 3, 3], [1, 1], [1, 1], [1, 1], 1),
    "3x3s2": ([4, 128, 29, 27], [96, 128, 3, 3], [1, 1], [2, 2], [1, 1], 1),
    "stem": ([2, 3, 67, 61], [64, 3, 7, 7], [3, 3], [2, 2], [1, 1], 1),
    "1x1": ([4, 256, 14, 14], [128, 256, 1, 1], [0, 0], [1, 1], [1, 1], 1),
    "1x1s2": ([4, 256, 14, 14], [512, 256, 1, 1], [0, 0], [2, 2], [1, 1], 1),
    "grouped": ([4, 64, 15, 15], [64, 8, 3, 3], [2, 2], [1, 1], [2, 2], 8),
    "3d": ([2, 32, 7, 12, 12], [32, 32, 3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1),
    "1d": ([4, 64, 301], [96, 64, 5], [2], [1], [1], 1),
}


def _case(name):
    x, w, padding, stride, dilation, groups = LAYERS[name]
    return dict(x=x, w=w, padding=padding, stride=stride, dilation=dilation), groups


def _cuda(inputs):
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_fprop_bias_relu_bf16(name, layout):
    """("stem" (C 3) and "grouped" (C 8 per group) fold the taps into K; the rest not.)"""
    case, groups = _case(name)
    x_t, w_t = stored(case["x"], layout, torch.bfloat16), stored(case["w"], layout, torch.bfloat16)
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    bias = g.tensor(name="b", dim=[1, case["w"][0]] + [1] * (len(case["x"]) - 2))
    g.relu(g.add(g.conv_fprop(x, w, groups=groups, **geometry(case)), bias)).set_output(True).set_name("y")
    inputs = {"x": x_t, "w": w_t, "b": torch.randn(bias.dim).to(torch.bfloat16)}
    check(g, _cuda(inputs), torch.bfloat16, "cuda")
    assert {l.group.kind for l in g.plan.launches} == {"conv"} and len(g.plan.groups) == 1
    folded = ["filter taps folded into K" in l.reason for l in g.plan.launches]
    assert folded == [name in ("stem", "grouped")] * len(folded)


def test_fprop_stem_folded_bf16_with_statistics():
    """The ResNet-50 stem at a real tile size: 7x7/2 over 3 channels, folded K = 147, bias and the
    BatchNorm statistics in the epilogue, NHWC bf16."""
    x_t = stored([8, 3, 224, 224], "nhwc", torch.bfloat16)
    w_t = stored([64, 3, 7, 7], "nhwc", torch.bfloat16)
    g = dg.Graph(name="stem", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    y = g.add(g.conv_fprop(x, w, padding=[3, 3], stride=[2, 2], dilation=[1, 1]), g.tensor(name="b", dim=[1, 64, 1, 1]))
    y.set_output(True).set_name("y")
    total, squares = g.genstats(y)
    total.set_output(True).set_name("sum").set_data_type(dg.float32)
    squares.set_output(True).set_name("sq_sum").set_data_type(dg.float32)
    inputs = {"x": x_t, "w": w_t, "b": torch.randn(1, 64, 1, 1).to(torch.bfloat16)}
    check(g, _cuda(inputs), torch.bfloat16, "cuda")
    assert "filter taps folded into K" in g.plan.launches[0].reason


@pytest.mark.parametrize("name", ["3x3", "3x3s2", "grouped", "3d", "1x1s2", "stem"])
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_backward_bf16_against_autograd(name, op):
    """(wgrad of "stem" (C 3) and "grouped" (C 8 per group) folds the taps into N; the rest not.)"""
    case, groups = _case(name)
    x64 = torch.randn(case["x"], dtype=torch.float64, device="cuda", requires_grad=True)
    w64 = torch.randn(case["w"], dtype=torch.float64, device="cuda", requires_grad=True)
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[len(case["x"]) - 3]
    y = conv(x64, w64, groups=groups, **geometry(case))
    dy64 = torch.randn_like(y)
    dx64, dw64 = torch.autograd.grad(y, (x64, w64), dy64)
    channels_last = torch.channels_last if len(case["x"]) == 4 else torch.contiguous_format
    dy_t = dy64.to(torch.bfloat16).contiguous(memory_format=channels_last)
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16)
    dy = g.tensor_like(dy_t, name="dy")
    if op == "dgrad":
        w_t = w64.detach().to(torch.bfloat16)
        w = g.tensor_like(w_t, name="w")
        g.conv_dgrad(dy, w, x_dim=case["x"], groups=groups, **geometry(case)).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "w": w_t}, dx64
    else:
        x_t = x64.detach().to(torch.bfloat16).contiguous(memory_format=channels_last)
        x = g.tensor_like(x_t, name="x")
        g.conv_wgrad(dy, x, w_dim=case["w"], groups=groups, **geometry(case)).set_output(True).set_name("out")
        inputs, expected = {"dy": dy_t, "x": x_t}, dw64
    out = check(g, inputs, torch.bfloat16, "cuda")["out"]
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < 1.6e-2, error


def test_wgrad_split_k_bitwise_reproducible():
    options = dg.BuildOptions(conv_config=mm.MatmulConfig("split_k", 64, 64, 64, 4, 4, split_k=16))
    case, _ = _case("3x3")
    dy_t = stored([4, 64, 28, 28], "nhwc", torch.bfloat16).cuda()
    x_t = stored(case["x"], "nhwc", torch.bfloat16).cuda()
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    dy, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(x_t, name="x")
    g.conv_wgrad(dy, x, w_dim=case["w"], **geometry(case)).set_output(True).set_name("dw")
    g.build(options=options)
    outs = []
    for _ in range(2):
        (handle,) = g.outputs()
        dw = torch.empty_strided(handle.dim, handle.stride, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
        g.execute({"dy": dy_t, "x": x_t, "dw": dw})
        outs.append(dw)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("tf32", [False, True])
def test_fp32_conv_precision(tf32):
    case, _ = _case("3x3")
    x_t, w_t = stored(case["x"], "nhwc").cuda(), stored(case["w"], "nhwc").cuda()
    g = dg.Graph(name="conv", io_data_type=dg.float32, allow_tf32=tf32)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, **geometry(case)).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t}, torch.float32, "cuda", tolerance=2e-3 if tf32 else 2e-5)


def test_pointwise_conv_runs_on_tma():
    x_t = stored([8, 256, 28, 28], "nhwc", torch.bfloat16).cuda()
    w_t = stored([512, 256, 1, 1], "nhwc", torch.bfloat16).cuda()
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16)
    x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
    g.conv_fprop(x, w, padding=[0, 0]).set_output(True).set_name("y")
    check(g, {"x": x_t, "w": w_t}, torch.bfloat16, "cuda")
    assert g.plan.launches[0].config_text.startswith("persistent")
