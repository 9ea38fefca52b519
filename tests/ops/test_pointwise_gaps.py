"""The cuDNN frontend's pointwise ops dnngraph lacked: relu with clips, swish with beta, tan,
mod and add_square, forward, backward and autodiff, against torch written independently of
g.reference (and against g.reference), special values, integers, errors, serialization."""
import math

import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check, run

SPECIAL = [float("-inf"), float("inf"), float("nan"), -7.0, -0.5, -0.25, 0.0, 0.3, 1.0, 1.5, 6.0, 9.0]


def _torch_clipped_relu(x, lower, upper, slope):
    """The frontend's relu written with torch's clamp: the clipped line below, clamp above."""
    line = lower + slope * (x - lower) if slope else torch.full_like(x, lower)
    return torch.where(x <= lower, line, torch.clamp(x, max=upper))


@pytest.mark.parametrize("clips", [dict(lower_clip=0.0, upper_clip=6.0), dict(negative_slope=0.1),
                                   dict(negative_slope=0.2, lower_clip=-0.5, upper_clip=1.5),
                                   dict(lower_clip=-0.25)])
def test_relu_clips_forward_and_backward_at_special_values(clips):
    x_t = torch.tensor(SPECIAL * 3).view(3, len(SPECIAL)).t()  # transposed strides
    dy_t = torch.randn(x_t.shape) + 2.0
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, name="x"), g.tensor_like(dy_t, name="dy")
    y = g.relu(x, **clips).set_output(True)
    dx = g.relu_backward(dy, x, **clips).set_output(True)
    outs, refs = run(g, {x: x_t, dy: dy_t}), g.reference({x: x_t, dy: dy_t})
    lower, upper = clips.get("lower_clip", 0.0), clips.get("upper_clip", math.inf)
    slope = clips.get("negative_slope", 0.0)
    want = _torch_clipped_relu(x_t.double(), lower, upper, slope)
    if clips == dict(lower_clip=0.0, upper_clip=6.0):
        torch.testing.assert_close(want, F.relu6(x_t.double()), equal_nan=True)
    if clips == dict(negative_slope=0.1):
        torch.testing.assert_close(want, F.leaky_relu(x_t.double(), 0.1), equal_nan=True)
    torch.testing.assert_close(refs[y.name], want, equal_nan=True)
    torch.testing.assert_close(outs[y.name].double(), want, equal_nan=True, rtol=1e-6, atol=1e-7)
    # the derivative: 1 strictly between the clips (and for NaN), slope at and below the lower
    # clip, 0 at and above the upper one
    derivative = torch.where(x_t >= upper, 0.0, torch.where(x_t <= lower, slope, 1.0)).double()
    want_dx = dy_t.double() * derivative
    torch.testing.assert_close(refs[dx.name], want_dx, equal_nan=True)
    torch.testing.assert_close(outs[dx.name].double(), want_dx, equal_nan=True, rtol=1e-6, atol=1e-7)


def test_relu_without_clips_is_unchanged_and_keeps_integers():
    g = dg.Graph(io_data_type=dg.int32)
    x = g.tensor(name="x", dim=[9], data_type=dg.int32)
    plain = g.relu(x, negative_slope=None, lower_clip=None, upper_clip=None).set_output(True)
    clipped = g.relu(x, lower_clip=-2.5, upper_clip=3.0).set_output(True).set_data_type(dg.float32)
    x_t = torch.arange(-4, 5, dtype=torch.int32)
    outs = run(g, {x: x_t})
    assert outs[plain.name].dtype == torch.int32 and torch.equal(outs[plain.name], F.relu(x_t))
    # clips are floats: the clipped relu of integers computes in floating point
    torch.testing.assert_close(outs[clipped.name], x_t.float().clamp(-2.5, 3.0))
    assert g.reference({x: x_t})[clipped.name].dtype == torch.float64


@pytest.mark.parametrize("bad, match", [(dict(lower_clip=2.0, upper_clip=1.0), "lower_clip"),
                                        (dict(upper_clip=float("-inf")), "upper_clip"),
                                        (dict(lower_clip=float("nan")), "relu_lower_clip"),
                                        (dict(negative_slope="0.1"), "relu_lower_clip_slope")])
def test_relu_clip_errors_add_nothing(bad, match):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3])
    with pytest.raises(dg.ValidationError, match=match):
        g.relu(x, **bad)
    with pytest.raises(dg.ValidationError, match=match):
        g.relu_backward(x, x, **bad)
    assert len(g.nodes) == 0


@pytest.mark.parametrize("beta", [1.0, 1.7, -0.5, None])
def test_swish_with_beta_against_torch(beta):
    x_t = torch.randn(13, 7) * 3
    x_t[0, :4] = torch.tensor([float("nan"), 0.0, 30.0, -30.0])
    dy_t = torch.randn(13, 7)
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, name="x"), g.tensor_like(dy_t, name="dy")
    y = g.swish(x, swish_beta=beta).set_output(True)
    dx = g.swish_backward(dy, x, swish_beta=beta).set_output(True)
    outs = run(g, {x: x_t, dy: dy_t})
    b = 1.0 if beta is None else beta
    leaf = x_t.double().requires_grad_(True)
    want = leaf * torch.sigmoid(b * leaf)
    (want_dx,) = torch.autograd.grad(want, leaf, dy_t.double())
    torch.testing.assert_close(outs[y.name].double(), want.detach(), equal_nan=True, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[dx.name].double(), want_dx, equal_nan=True, rtol=1e-5, atol=1e-6)
    check(g, {x: x_t, dy: dy_t})


def test_mod_is_fmod_the_dividends_sign():
    a_t = torch.tensor([7.0, -7.0, 7.0, -7.0, 5.5, -0.0, float("inf"), 3.0, float("nan"), 1e30])
    b_t = torch.tensor([3.0, 3.0, -3.0, -3.0, 2.0, 3.0, 2.0, 0.0, 1.0, 7.0])
    g = dg.Graph()
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    y = g.mod(a, b).set_output(True)
    by_constant = g.mod(a, -4.0).set_output(True)
    outs = run(g, {a: a_t, b: b_t})
    torch.testing.assert_close(outs[y.name], torch.fmod(a_t, b_t), equal_nan=True, rtol=0, atol=0)
    assert outs[y.name][1] == -1.0 and outs[y.name][2] == 1.0, "fmod, not Python's %"
    torch.testing.assert_close(outs[by_constant.name], torch.fmod(a_t, -4.0), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(g.reference({a: a_t, b: b_t})[y.name], torch.fmod(a_t, b_t).double(),
                               equal_nan=True)


@pytest.mark.parametrize("dtype", [dg.int32, dg.int64])
def test_integer_mod_is_exact_and_zero_for_a_zero_divisor(dtype):
    big = 2**31 - 5 if dtype is dg.int32 else 2**62 + 7
    a_t = torch.tensor([7, -7, 7, -7, big, -big, 5, 0, -(2**31) if dtype is dg.int32 else -(2**63)],
                       dtype=dtype.torch_dtype)
    b_t = torch.tensor([3, 3, -3, -3, 1000003, 97, 0, 4, -1], dtype=dtype.torch_dtype)
    g = dg.Graph(io_data_type=dtype)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    y = g.mod(a, b).set_output(True)
    by_constant = g.mod(a, 10).set_output(True)
    outs = run(g, {a: a_t, b: b_t})
    safe = torch.where(b_t == 0, torch.ones_like(b_t), b_t)
    want = torch.where(b_t == 0, torch.zeros_like(a_t), torch.fmod(a_t, safe))
    assert outs[y.name].dtype == dtype.torch_dtype and torch.equal(outs[y.name], want)
    assert torch.equal(outs[by_constant.name], torch.fmod(a_t, 10))
    assert torch.equal(g.reference({a: a_t, b: b_t})[y.name], want)


def test_add_square_floats_broadcast_and_exact_integers():
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[11, 1]), g.tensor(name="b", dim=[1, 6])
    y = g.add_square(a, b).set_output(True)
    check(g, {a: torch.randn(11, 1), b: torch.randn(1, 6)})
    gi = dg.Graph(io_data_type=dg.int64)
    ai, bi = gi.tensor(name="a", dim=[4], data_type=dg.int64), gi.tensor(name="b", dim=[4], data_type=dg.int64)
    yi = gi.add_square(ai, bi).set_output(True)
    a_t = torch.tensor([2**53 + 1, -5, 0, 7], dtype=torch.int64)
    b_t = torch.tensor([3, 2**20 + 1, -4, 0], dtype=torch.int64)
    out = run(gi, {ai: a_t, bi: b_t})[yi.name]
    assert out.dtype == torch.int64 and torch.equal(out, a_t + b_t * b_t)
    assert y.data_type is dg.float32


def test_tan_and_its_gradient():
    x_t = (torch.rand(9, 5) * 2.6 - 1.3)
    g = dg.Graph()
    x = g.tensor_like(x_t, name="x")
    y = g.tan(x).set_output(True)
    out = run(g, {x: x_t})[y.name]
    torch.testing.assert_close(out.double(), torch.tan(x_t.double()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", [
    lambda g, a, b: g.relu(a, negative_slope=0.1, lower_clip=-0.3, upper_clip=0.8),
    lambda g, a, b: g.swish(a, swish_beta=1.5),
    lambda g, a, b: g.tan(a),
    lambda g, a, b: g.mod(a, b),
    lambda g, a, b: g.add_square(a, b),
], ids=["relu_clipped", "swish", "tan", "mod", "add_square"])
def test_autodiff_matches_torch(build):
    """as_function's gradients come from the ops' backward rules, compiled like any graph."""
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[6, 5]), g.tensor(name="b", dim=[6, 5])
    y = build(g, a, b)
    out = g.mul(y, b).set_output(True)  # b is used either way
    fn = g.as_function([a, b], [out])
    a_t = (torch.rand(6, 5) * 2.4 - 1.2).requires_grad_(True)
    b_t = (torch.rand(6, 5) + 0.5).requires_grad_(True)
    dy_t = torch.randn(6, 5)
    got = torch.autograd.grad(fn(a_t, b_t), (a_t, b_t), dy_t)
    a64, b64 = (t.detach().double().requires_grad_(True) for t in (a_t, b_t))
    torch_forward = {
        "relu": lambda: _torch_clipped_relu(a64, -0.3, 0.8, 0.1), "swish": lambda: a64 * torch.sigmoid(1.5 * a64),
        "tan": lambda: torch.tan(a64), "mod": lambda: torch.fmod(a64, b64), "add_square": lambda: a64 + b64 * b64}
    op = y.producer.op
    want = torch.autograd.grad(torch_forward[op]() * b64, (a64, b64), dy_t.double())
    for got_grad, want_grad in zip(got, want):
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-5)


def test_new_attributes_round_trip_through_json():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 3])
    g.relu(x, negative_slope=0.25, lower_clip=-1.0).set_output(True)
    g.swish(x, swish_beta=2.0).set_output(True)
    g2 = dg.Graph.from_json(g.to_json())
    x_t = torch.randn(4, 3) * 3
    for name, value in g2.reference({"x": x_t}).items():
        torch.testing.assert_close(value, g.reference({x: x_t})[name], equal_nan=True)
    attrs = [n.attrs for n in g2.nodes]
    assert attrs[0].relu_upper_clip == math.inf and attrs[0].relu_lower_clip_slope == 0.25
    assert attrs[1].swish_beta == 2.0


def test_clipped_relu_as_a_matmul_epilogue():
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[2, 19, 13]), g.tensor(name="b", dim=[2, 13, 11])
    y = g.relu(g.matmul(a, b), negative_slope=0.05, lower_clip=-0.5, upper_clip=2.0).set_output(True)
    check(g, {a: torch.randn(2, 19, 13), b: torch.randn(2, 13, 11)})
    assert len(g.plan.groups) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [dg.bfloat16, dg.float16])
def test_clipped_relu_epilogue_on_gpu(dtype):
    """The matmul epilogue on the GPU (Gluon on Hopper takes relu's clips too)."""
    g = dg.Graph(io_data_type=dtype)
    a, b = g.tensor(name="a", dim=[256, 192]), g.tensor(name="b", dim=[192, 320])
    y = g.relu(g.matmul(a, b), negative_slope=0.05, lower_clip=-0.5, upper_clip=2.0)
    z = g.swish(g.add_square(y, 0.5), swish_beta=1.3).set_output(True)
    torch_type = dtype.torch_dtype
    check(g, {a: torch.randn(256, 192, dtype=torch_type, device="cuda"),
              b: torch.randn(192, 320, dtype=torch_type, device="cuda") / 8}, torch_type, device="cuda")
    assert z.data_type is dtype


def test_clipped_relu_gluon_epilogue_compiles_for_sm90():
    """The Gluon matmul's epilogue takes relu's clips (not plain relu's text): each clip setting
    lowered for the H100 and compiled for sm_90a."""
    from gluon_gap_cases import CLIPS, clipped_relu_cases
    from helpers import compiled_for_sm90

    sources = [open(launch.source_path).read() for _, launches, _ in clipped_relu_cases() for launch in launches]
    relu_lines = [line for text in sources for line in text.splitlines() if line.rstrip().endswith("# relu")]
    assert len(relu_lines) == len(CLIPS) and all(" >= " in line for line in relu_lines)  # the clipped form
    output = compiled_for_sm90("gluon_gap_cases:clipped_relu_cases", timeout=900)
    assert f"compiled {len(CLIPS)} kernels for sm_90" in output


@pytest.mark.gpu
def test_clipped_relu_gluon_epilogue_on_gpu():
    from gluon_gap_cases import CLIPS, clipped_relu_graph

    for clips in CLIPS:
        g = clipped_relu_graph(clips)
        a, b = g.tensor_by_name("a"), g.tensor_by_name("b")
        check(g, {a: torch.randn(200, 72, dtype=torch.bfloat16, device="cuda"),
                  b: torch.randn(72, 136, dtype=torch.bfloat16, device="cuda") / 4}, torch.bfloat16, device="cuda",
              options=dg.BuildOptions(backends=("gluon", "triton")))
        assert {launch.backend for launch in g.plan.launches} == {"gluon"}
