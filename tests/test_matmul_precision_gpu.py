"""Matmul precision on the GPU: mixed fp32 x bf16 pairs on bf16 tensor cores, tf32 in every
layout and IEEE fp32 on FMA units,
each against the float64 reference with the tolerance its rule implies."""
import pytest
import torch

import dnngraph as dg
from dnngraph.heuristics import matmul as mm
from helpers import check
from test_matmul import _storage

pytestmark = pytest.mark.gpu

TF32_TOLERANCE = 2e-3  # 10 mantissa bits: near 3e-4 on these sizes
IEEE_TOLERANCE = 2e-5


@pytest.mark.parametrize("a_type,b_type", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("layouts", [("row", "row"), ("col", "padded_col"), ("sliced", "row")])
def test_mixed_fp32_bf16_rounds_to_bf16(a_type, b_type, layouts):
    m, n, k = 1000, 777, 1003
    a_t, b_t = _storage([m, k], layouts[0], a_type, "cuda"), _storage([k, n], layouts[1], b_type, "cuda")
    g = dg.Graph(name="mixed", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    bias = g.tensor(name="bias", dim=[1, n], data_type=dg.float32)
    g.silu(g.add(g.matmul(a, b), bias)).set_output(True).set_name("y")
    g.build()
    assert "tl.dot(" in g.plan.launches[0].source_path.read_text() and "input_precision" not in \
        g.plan.launches[0].source_path.read_text()
    check(g, {"a": a_t, "b": b_t, "bias": torch.randn(1, n, device="cuda")}, torch.bfloat16, "cuda")


def test_fp32_virtual_tensor_feeding_a_bf16_weight():
    """The Llama-MLP pattern: a norm's fp32 output (a virtual tensor) times a bf16 weight."""
    g = dg.Graph(name="mlp", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    x, scale = g.tensor(name="x", dim=[513, 384]), g.tensor(name="scale", dim=[1, 384])
    w = g.tensor(name="w", dim=[384, 1000])
    normed = g.rmsnorm(x, scale, epsilon=1e-5, norm_forward_phase="inference")[0]
    assert normed.data_type is dg.float32
    g.matmul(normed, w).set_output(True).set_name("y")
    inputs = {"x": torch.randn(513, 384).bfloat16(), "scale": torch.rand(1, 384).bfloat16(),
              "w": (torch.randn(384, 1000) / 20).bfloat16()}
    check(g, {k: v.cuda() for k, v in inputs.items()}, torch.bfloat16, "cuda")


@pytest.mark.parametrize("layouts", [("row", "row"), ("row", "col"), ("col", "row"), ("padded_col", "sliced")])
def test_tf32_every_layout(layouts):
    m, n, k = 1031, 999, 1017
    a_t, b_t = _storage([m, k], layouts[0], torch.float32, "cuda"), _storage([k, n], layouts[1], torch.float32, "cuda")
    g = dg.Graph(name="tf32", io_data_type=dg.float32, allow_tf32=True)
    g.relu(g.matmul(g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b"))).set_output(True).set_name("y")
    check(g, {"a": a_t, "b": b_t}, tolerance=TF32_TOLERANCE, device="cuda")


@pytest.mark.parametrize("shape", [(1031, 999, 1017), (7, 4096, 2048), (2, 300, 301, 257)])
def test_ieee_fp32_is_fp32_accurate(shape):
    *batch, m, n, k = shape
    a_t = torch.randn(*batch, m, k, device="cuda")
    b_t = _storage([k, n], "col", torch.float32, "cuda")
    g = dg.Graph(name="ieee", io_data_type=dg.float32)
    g.matmul(g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")).set_output(True).set_name("c")
    check(g, {"a": a_t, "b": b_t}, tolerance=IEEE_TOLERANCE, device="cuda")
