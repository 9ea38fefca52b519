"""Row kernels on the GPU: bf16, realistic and very wide rows, split reductions, bound launches."""
import pytest
import torch

import dnngraph as dg
from helpers import check
from rowmodes import modes_used, row_mode, row_options  # noqa: F401 (row_mode: a fixture)
from test_norms import (_channel_backward, _channel_forward, _feature_backward, _feature_graph, _fused_backward,
                        _fused_launches, check_non_finite_channel_norm, check_non_finite_feature_norm, shifted)

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _to_cuda(inputs):
    return {k: v.to(CUDA) for k, v in inputs.items()}


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(257, 4096), (33, 14336), (3, 70001)])
def test_feature_norm_forward_bf16(op, shape):
    g, inputs = _feature_graph(op, torch.bfloat16, shape, bias=op == "layernorm")
    check(g, _to_cuda(inputs), torch.bfloat16, device=CUDA)
    assert g.plan.launches[0]._bound


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("shape", [(129, 4096), (5, 70001)])
def test_feature_norm_backward_gpu(op, shape):
    g, inputs, _ = _feature_backward(op, torch.float16, shape)
    check(g, _to_cuda(inputs), torch.float16, device=CUDA, tolerance=5e-3)


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("shape", [(4096, 8192), (1000, 4096), (77, 300)])
def test_fused_norm_backward_gpu(op, shape):
    """bf16 dx and dscale/dbias from the fused kernel and its combine; bitwise the same on a
    second run (the partials are summed in program order)."""
    from helpers import run
    g, inputs = _fused_backward(op, shifted(*shape, dtype=torch.bfloat16), torch.randn(*shape).bfloat16(),
                                shifted(1, shape[1], dtype=torch.bfloat16), torch.bfloat16)
    inputs = _to_cuda(inputs)
    first = check(g, inputs, torch.bfloat16, device=CUDA)
    assert _fused_launches(g) == ["fused", "combine"]
    again = run(g, inputs, CUDA)
    assert all(torch.equal(first[name], again[name]) for name in first)


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("op,groups", [("batchnorm", None), ("groupnorm", 4), ("instancenorm", None)])
def test_channel_norms_gpu(op, groups, nhwc):
    g, inputs = _channel_forward(op, (8, 64, 28, 28), nhwc, torch.float16, groups, running=True)
    check(g, _to_cuda(inputs), torch.float16, device=CUDA)
    g, inputs, _ = _channel_backward(op + "_backward", (8, 64, 28, 28), nhwc, torch.float16, groups)
    check(g, _to_cuda(inputs), torch.float16, device=CUDA, tolerance=5e-3)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("cols", [1000, 8192, 50001])
def test_softmax_bf16(log, cols):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[37, cols])
    g.softmax(x, axis=1, log=log).set_output(True)
    check(g, {x: (torch.randn(37, cols) * 3).to(CUDA, torch.bfloat16)}, torch.bfloat16, device=CUDA)
    g = dg.Graph(io_data_type=dg.bfloat16)
    dy, y = g.tensor(name="dy", dim=[37, cols]), g.tensor(name="y", dim=[37, cols])
    g.softmax_backward(dy, y, axis=1, log=log).set_output(True)
    y_t = torch.softmax(torch.randn(37, cols, device=CUDA), 1)
    check(g, {dy: torch.randn(37, cols, device=CUDA).bfloat16(),
              y: (y_t.log() if log else y_t).bfloat16()}, torch.bfloat16, device=CUDA)


@pytest.mark.parametrize("mode", ["sum", "max", "norm2", "mean"])
@pytest.mark.parametrize("shape,axes", [((3, 1000003), [1]), ((8192, 777), [0]), ((16, 4096, 9), [0, 2])])
def test_reductions_gpu(mode, shape, axes):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=list(shape))
    g.reduction(x, mode, axes).set_output(True).set_data_type(dg.float32)
    check(g, {x: (torch.randn(*shape) + 1).to(CUDA, torch.bfloat16)}, torch.bfloat16, device=CUDA)
    if shape == (3, 1000003):
        assert "split" in modes_used(g)


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


@pytest.mark.parametrize("shape", [(16, 96, 40, 40), (8, 120, 33, 35)])
def test_batchnorm_nhwc_bf16_column_split(shape):
    """NHWC bf16 batchnorm forward and backward as column splits (partial, combine, apply):
    checked against float64, and bitwise the same on a second run (a fixed combine order)."""
    from helpers import run
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



@pytest.mark.parametrize("phase", ["training", "inference"])
@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_feature_norm_stats_of_non_finite_rows_gpu(row_mode, op, phase):
    """On the GPU tl.maximum drops NaN and fast paths differ from numpy: the same checks."""
    check_non_finite_feature_norm(op, phase, CUDA, row_options(row_mode))


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("op,groups", [("batchnorm", None), ("groupnorm", 2), ("instancenorm", None)])
def test_channel_norm_stats_of_non_finite_channels_gpu(row_mode, op, groups, nhwc):
    check_non_finite_channel_norm(op, groups, nhwc, CUDA, row_options(row_mode))
