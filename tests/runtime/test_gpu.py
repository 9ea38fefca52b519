"""GPU-only checks: bf16, the bound-launch path, unaligned pointers, streams."""
import pytest
import torch

import dnngraph as dg
from dnngraph.ops.pointwise import POINTWISE_OPS
from helpers import check, run
from test_pointwise import REQUIRED_ATTRIBUTES, operand_shapes, sample

pytestmark = pytest.mark.gpu
CUDA = "cuda"


@pytest.mark.parametrize("op", sorted(set(POINTWISE_OPS) - {"cast", "where"}))
def test_every_op_bf16_on_gpu(op):
    entry = POINTWISE_OPS[op]
    g = dg.Graph(io_data_type=dg.bfloat16)
    handles, inputs = [], {}
    for position, shape in enumerate(operand_shapes(entry.arity)):
        handle = g.tensor(name=f"in{position}", dim=list(shape))
        handles.append(handle)
        inputs[handle] = sample(shape, torch.bfloat16, op, position).to(CUDA)
    getattr(g, op)(*handles, **REQUIRED_ATTRIBUTES.get(op, {})).set_output(True)
    check(g, inputs, torch.bfloat16, device=CUDA)


@pytest.mark.parametrize("target", [dg.bfloat16, dg.float16, dg.float8_e4m3, dg.int32, dg.bool])
def test_casts_on_gpu(target):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[33, 65])
    g.cast(x, target).set_output(True)
    tolerance = 7e-2 if target is dg.float8_e4m3 else 1e-6
    check(g, {x: torch.randn(33, 65, device=CUDA)}, device=CUDA, tolerance=tolerance)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last", "sliced"])
def test_layouts_bf16_and_bound_launch(layout):
    base = torch.randn(8, 24, 13, 11, device=CUDA, dtype=torch.bfloat16)
    x_t = {"contiguous": base, "transposed": base.transpose(1, 3),
           "channels_last": base.contiguous(memory_format=torch.channels_last),
           "sliced": base[:, 2:20:3]}[layout]
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor_like(x_t, "x")
    b = g.tensor(name="b", dim=[1, x_t.shape[1], 1, 1])
    r = g.tensor_like(torch.empty_like(x_t), "r")
    y = g.add(g.gelu(g.add(x, b)), r).set_output(True)
    inputs = {x: x_t, b: torch.randn(1, x_t.shape[1], 1, 1, device=CUDA, dtype=torch.bfloat16),
              r: torch.randn_like(x_t)}
    check(g, inputs, torch.bfloat16, device=CUDA)
    assert g.plan.launches[0]._bound, "launch went through the bound launcher"


def test_unaligned_pointers_fall_back_correctly():
    g = dg.Graph(io_data_type=dg.float16)
    x = g.tensor(name="x", dim=[1001])
    g.sigmoid(x).set_output(True)
    storage = torch.randn(1002, device=CUDA, dtype=torch.float16)
    check(g, {x: storage[1:]}, torch.float16, device=CUDA)


def test_runs_on_the_current_stream():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4096, 257])
    y = g.exp(x).set_output(True)
    g.build()
    stream = torch.cuda.Stream()
    x_t = torch.randn(4096, 257, device=CUDA)
    out = torch.full_like(x_t, float("nan"))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # a busy stream: a launch on another stream would race
        g.execute({x: x_t, y: out})
    stream.synchronize()
    assert torch.allclose(out, x_t.exp())


def test_large_tensor_uses_64_bit_indexing():
    g = dg.Graph(io_data_type=dg.float16)
    x = g.tensor(name="x", dim=[65537, 32769])  # > 2^31 elements
    y = g.neg(x).set_output(True)
    g.build()
    assert "int64-index" in g.explain()
    x_t = torch.randn(65537, 32769, device=CUDA, dtype=torch.float16)
    out = run(g, {x: x_t}, device=CUDA)[y.name]
    assert torch.equal(out[-1, -8:], -x_t[-1, -8:]) and torch.equal(out[0, :8], -x_t[0, :8])
