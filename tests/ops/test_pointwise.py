"""Pointwise family on CPU (interpreter): every op, dtypes, layouts, broadcasting, random DAGs."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dnngraph as dg
from dnngraph.ops.pointwise import DIFFERENTIABLE, EXPLICIT_BACKWARD, FORWARD_UNARY, POINTWISE_OPS
from helpers import check, run

POSITIVE_ONLY = {"log", "sqrt", "rsqrt"}
REQUIRED_ATTRIBUTES = {"gen_index": {"axis": 1}}  # ops with an attribute that has no default
DTYPES = [torch.float32, torch.float16]


def sample(shape, dtype, op=None, position=0):
    """Random inputs suited to the op's domain (never zeros)."""
    x = torch.randn(shape, dtype=torch.float32) * 2 + 0.1
    if op in POSITIVE_ONLY or (op == "pow" and position == 0):
        x = x.abs() + 0.2
    if op == "pow" and position == 1:
        x = torch.randint(-3, 4, shape).float() + (torch.rand(shape) > 0.5) * 0.5
    if op == "tan":  # away from the poles at +-pi/2, where fp16 rounding of x swamps everything
        x = x.clamp(-1.3, 1.3)
    if op in ("reciprocal", "div", "mod") and position == (0 if op == "reciprocal" else 1):
        x = torch.where(x.abs() < 0.3, x.sign() * 0.3 + 0.05, x)
    return x.to(dtype)


def operand_shapes(arity):
    return [(37, 19), (1, 19), (37, 1)][:arity]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(set(POINTWISE_OPS) - {"cast", "where"}))
def test_every_op_against_float64_reference(op, dtype):
    entry = POINTWISE_OPS[op]
    io = dg.float32 if dtype == torch.float32 else dg.float16
    g = dg.Graph(name=op, io_data_type=io)
    handles, inputs = [], {}
    for position, shape in enumerate(operand_shapes(entry.arity)):
        value = sample(shape, dtype, op, position)
        handle = g.tensor(name=f"in{position}", dim=list(shape), data_type=io)
        handles.append(handle)
        inputs[handle] = value
    y = getattr(g, op)(*handles, **REQUIRED_ATTRIBUTES.get(op, {}))
    y.set_output(True)
    check(g, inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_where_and_comparisons_with_bool_values(dtype):
    g = dg.Graph(io_data_type=dg.float32 if dtype == torch.float32 else dg.float16)
    a, b = g.tensor(name="a", dim=[23, 9]), g.tensor(name="b", dim=[23, 9])
    mask = g.logical_and(g.cmp_gt(a, b), g.logical_not(g.cmp_lt(a, -1.0)))
    mask.set_output(True)
    y = g.where(mask, g.exp(a), g.neg(b)).set_output(True)
    inputs = {a: sample((23, 9), dtype), b: sample((23, 9), dtype)}
    outs = check(g, inputs, dtype)
    assert outs[mask.name].dtype == torch.bool
    assert outs[y.name].dtype == dtype


@pytest.mark.parametrize("target", [dg.float16, dg.bfloat16, dg.int32, dg.bool, dg.float32])
def test_cast_rounds_like_the_target(target):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[13, 11])
    y = g.cast(g.mul(x, 3.0), target).set_output(True)
    assert y.data_type is target
    # conversions are torch's on every path (the interpreter's bf16 once truncated: 8e-3 here)
    check(g, {x: torch.randn(13, 11)}, tolerance=1e-6)


def test_cast_from_int_is_a_float_rounded_to_the_target():
    """The op reference of an int -> float cast holds floats (a following mean is defined) with
    the target's rounding (2049 is 2048 in float16)."""
    g = dg.Graph(io_data_type=dg.float16)
    n = g.tensor(name="n", dim=[5, 4], data_type=dg.int32)
    as_half = g.cast(n, dg.float16)
    values = torch.tensor([[2049, -3, 7, 65519]], dtype=torch.int32)
    held = POINTWISE_OPS["cast"].reference([values], as_half.producer.attrs)
    assert held.is_floating_point() and held.tolist() == [[2048.0, -3.0, 7.0, 65504.0]]
    g.reduction(as_half, "mean", [0, 1]).set_output(True)
    check(g, {n: torch.randint(-3000, 3000, (5, 4), dtype=torch.int32)}, torch.float16)


@pytest.mark.parametrize("constant", [float("-inf"), 2.5])
def test_scalar_constants_including_infinities(constant):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[7, 5])
    y = g.where(g.cmp_gt(x, 0.0), x, constant).set_output(True)
    x_t = torch.randn(7, 5)
    out = run(g, {x: x_t})[y.name]
    assert torch.equal(out, torch.where(x_t > 0, x_t, torch.tensor(constant)))


def test_mixed_input_dtypes_and_int_inputs():
    g = dg.Graph(io_data_type=dg.float16)
    a = g.tensor(name="a", dim=[31, 17], data_type=dg.float32)
    b = g.tensor(name="b", dim=[31, 17], data_type=dg.bfloat16)
    n = g.tensor(name="n", dim=[1, 17], data_type=dg.int32)
    y = g.add(g.mul(a, b), n).set_output(True)
    assert y.data_type is dg.float16
    inputs = {a: torch.randn(31, 17), b: torch.randn(31, 17).bfloat16(), n: torch.randint(-5, 5, (1, 17), dtype=torch.int32)}
    check(g, inputs, torch.float16)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "channels_last", "rank3_broadcast"])
def test_strided_inputs_and_outputs(layout):
    base = torch.randn(6, 10, 7, 5)
    if layout == "transposed":
        x_t = torch.randn(29, 41).t()
    elif layout == "sliced":
        x_t = torch.randn(31, 50)[3:28:2, 1:40]
    elif layout == "expanded":
        x_t = torch.randn(1, 33).expand(19, 33)
    elif layout == "channels_last":
        x_t = base.contiguous(memory_format=torch.channels_last)
    else:
        x_t = torch.randn(5, 1, 9)
    g = dg.Graph()
    x = g.tensor_like(x_t, name="x")
    assert list(x.stride) == list(x_t.stride())
    bias_dim = [1] * (x_t.dim() - 1) + [x_t.shape[-1]]
    if layout == "rank3_broadcast":
        bias_dim = [4, 1]
    b = g.tensor(name="b", dim=bias_dim)
    y = g.silu(g.add(x, b)).set_output(True)
    if layout in ("transposed", "channels_last"):
        assert list(y.stride) == list(torch.empty_like(x_t).stride()), "output follows the input layout"
    check(g, {x: x_t, b: torch.randn(bias_dim)})


def test_diamond_with_two_outputs_is_one_kernel():
    g = dg.Graph()
    x, r = g.tensor(name="x", dim=[17, 33]), g.tensor(name="r", dim=[17, 33])
    a = g.add(x, 1.0)
    b = g.mul(x, r)
    c = g.add(a, b).set_output(True)
    d = g.sub(g.tanh(c), a).set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    check(g, {x: torch.randn(17, 33), r: torch.randn(17, 33)})


def test_smaller_output_inside_a_broadcast_group():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[9, 14])
    b = g.tensor(name="b", dim=[1, 14])
    eb = g.exp(b).set_output(True)  # [1, 14], stored once from the [9, 14] kernel
    y = g.mul(x, eb).set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    check(g, {x: torch.randn(9, 14), b: torch.randn(1, 14)})


def test_one_dimensional_and_large_odd_sizes():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[10007])
    y = g.sigmoid(x).set_output(True)
    check(g, {x: torch.randn(10007)})


VALUE_OPS_1 = ["relu", "sigmoid", "tanh", "gelu", "silu", "abs", "neg", "sin", "cos", "gelu_tanh"]
VALUE_OPS_2 = ["add", "sub", "mul", "maximum", "minimum"]
SHAPES = [(6, 11), (1, 11), (6, 1)]


@st.composite
def random_graphs(draw):
    count = draw(st.integers(1, 7))
    steps = []
    for i in range(count):
        kind = draw(st.sampled_from(["unary", "binary", "where"]))
        picks = [draw(st.integers(0, 10**6)) for _ in range(3)]
        op = draw(st.sampled_from(VALUE_OPS_1 if kind == "unary" else VALUE_OPS_2))
        steps.append((kind, op, picks, draw(st.booleans())))
    inputs = [draw(st.sampled_from(SHAPES)) for _ in range(draw(st.integers(1, 3)))]
    return inputs, steps


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs(), st.sampled_from(DTYPES))
def test_random_pointwise_graphs_match_reference(spec, dtype):
    input_shapes, steps = spec
    io = dg.float32 if dtype == torch.float32 else dg.float16
    g = dg.Graph(io_data_type=io)
    values, inputs = [], {}
    for i, shape in enumerate(input_shapes):
        handle = g.tensor(name=f"x{i}", dim=list(shape))
        values.append(handle)
        inputs[handle] = sample(shape, dtype)
    for kind, op, picks, mark in steps:
        operands = [values[p % len(values)] for p in picks]
        if kind == "unary":
            out = getattr(g, op)(operands[0])
        elif kind == "binary":
            out = getattr(g, op)(operands[0], operands[1])
        else:
            # compare graph inputs only: computed values differ from the float64 reference by
            # rounding, and a near tie would flip the branch
            first, second = (values[p % len(input_shapes)] for p in picks[:2])
            out = g.where(g.cmp_gt(first, second), operands[1], operands[2])
        if mark:
            out.set_output(True)
        values.append(out)
    values[-1].set_output(True)
    for t in g.tensors:  # every op output must be used or stored
        if t.producer is not None and not g.consumers(t):
            t.set_output(True)
    check(g, inputs, dtype)


TORCH_ACTIVATIONS = {
    "relu": torch.nn.functional.relu, "leaky_relu": torch.nn.functional.leaky_relu,
    "elu": torch.nn.functional.elu, "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu, "softplus": torch.nn.functional.softplus,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid, "hardtanh": torch.nn.functional.hardtanh,
    "swish": torch.nn.functional.silu}  # swish_beta 1


def _torch_gradient_per_element(forward, x_t, dy_t):
    """torch's gradient element by element: its scalar CPU kernels, whose rules are its CUDA
    kernels' (the vectorized CPU ones give hardswish and hardtanh another answer at a NaN x)."""
    grads = []
    for x_value, dy_value in zip(x_t.view(-1, 1), dy_t.view(-1, 1)):
        leaf = x_value.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(forward(leaf), leaf, dy_value)[0])
    return torch.cat(grads).view(x_t.shape)


@pytest.mark.parametrize("op", DIFFERENTIABLE)
def test_backward_at_special_values_is_torch(op):
    """dy * f'(x) at 0, +-inf, NaN, far tails and an infinite dy, as torch's own backward gives
    it (a reference differentiated through a formula made NaN of 0 * inf: elu at +inf)."""
    # -3, 3, -1 and 1: the hard activations' kinks, where torch picks a side
    x_values = [float("-inf"), float("inf"), float("nan"), -30.0, -3.0, -1.5, -1.0, 0.0, 0.7, 1.0, 3.0, 30.0,
                100.0]
    pairs = [(x, dy) for x in x_values for dy in (1.5, float("nan"))]
    pairs += [(x, float("inf")) for x in (-1.5, 0.0, 0.7, 30.0)]
    x_t, dy_t = torch.tensor(pairs).T.contiguous()
    g = dg.Graph()
    dy, x = g.tensor(name="dy", dim=[len(pairs)]), g.tensor(name="x", dim=[len(pairs)])
    y = getattr(g, op + "_backward")(dy, x).set_output(True)
    out = run(g, {dy: dy_t, x: x_t})[y.name].double()
    ref = g.reference({dy: dy_t, x: x_t})[y.name]
    if op in EXPLICIT_BACKWARD:
        want = _torch_gradient_per_element(TORCH_ACTIVATIONS[op], x_t.double(), dy_t.double())
    else:
        leaf = x_t.double().requires_grad_(True)
        (want,) = torch.autograd.grad(TORCH_ACTIVATIONS[op](leaf), leaf, dy_t.double())
    torch.testing.assert_close(ref, want, equal_nan=True)
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_tanh_keeps_relative_precision_near_zero():
    # (1 - e) / (1 + e) cancels near 0: Gemma-2's soft-cap 30 * tanh(logits / 30) showed it
    magnitudes = torch.logspace(-12, 1.3, 4001, dtype=torch.float64)
    values = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, -0.0])]).float()
    g = dg.Graph(name="tanh")
    x = g.tensor(name="x", dim=[values.numel()])
    y = g.tanh(x).set_output(True)
    g.build()
    out = torch.full_like(values, float("nan"))
    g.execute({x: values, y: out})
    reference = g.reference({x: values})[y.name]
    relative = ((out.double() - reference) / reference.abs().clamp_min(1e-300)).abs()
    assert relative.max() <= 4 * 2.0 ** -23, f"worst relative error {relative.max():.3g}"
    assert torch.equal(out.view(torch.int32)[-2:], values.view(torch.int32)[-2:]), "tanh(+-0) keeps its sign"


HARD_SPECIAL = [float("-inf"), float("inf"), float("nan"), -7.0, -3.0, -2.999, -1.0, -0.5, 0.0, 0.25, 1.0,
                2.999, 3.0, 6.0, 40.0]


@pytest.mark.parametrize("op, params, torch_forward, torch_backward", [
    ("hardswish", {}, torch.ops.aten.hardswish, lambda dy, x: torch.ops.aten.hardswish_backward(dy, x)),
    ("hardsigmoid", {}, torch.ops.aten.hardsigmoid, lambda dy, x: torch.ops.aten.hardsigmoid_backward(dy, x)),
    ("hardtanh", {}, torch.ops.aten.hardtanh, lambda dy, x: torch.ops.aten.hardtanh_backward(dy, x, -1.0, 1.0)),
    ("hardtanh", {"min_val": 0.0, "max_val": 6.0}, lambda x: torch.ops.aten.hardtanh(x, 0.0, 6.0),
     lambda dy, x: torch.ops.aten.hardtanh_backward(dy, x, 0.0, 6.0)),
])
def test_hard_activations_are_torchs_at_their_boundaries(op, params, torch_forward, torch_backward):
    """The forward and the backward kernels at the kinks (torch's hardswish backward is 0 at
    x = -3 and dy at x = 3), NaN and inf, against torch's own fp32 kernels element by element
    (its scalar kernels, whose NaN rule is its CUDA kernels'); a transposed x."""
    x_t = torch.tensor(HARD_SPECIAL * 3).view(3, len(HARD_SPECIAL)).t()  # [15, 3], transposed strides
    dy_t = torch.randn(x_t.shape) + 2.0
    g = dg.Graph()
    x, dy = g.tensor_like(x_t, name="x"), g.tensor_like(dy_t, name="dy")
    y = getattr(g, op)(x, **params).set_output(True)
    dx = getattr(g, op + "_backward")(dy, x, **params).set_output(True)
    outs = run(g, {x: x_t, dy: dy_t})
    refs = g.reference({x: x_t, dy: dy_t})
    per_element = lambda fn, *tensors: torch.stack([fn(*(t.reshape(1)[0:1] for t in values))[0]
                                                    for values in zip(*(t.reshape(-1) for t in tensors))]).view(x_t.shape)
    torch.testing.assert_close(outs[y.name], per_element(torch_forward, x_t), equal_nan=True, rtol=1e-6, atol=0)
    torch.testing.assert_close(outs[dx.name], per_element(torch_backward, dy_t, x_t), equal_nan=True, rtol=1e-6, atol=0)
    torch.testing.assert_close(refs[y.name], per_element(torch_forward, x_t.double()), equal_nan=True)
    torch.testing.assert_close(refs[dx.name], per_element(torch_backward, dy_t.double(), x_t.double()),
                               equal_nan=True)


def test_hardtanh_bounds_are_validated():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3])
    with pytest.raises(dg.ValidationError, match="min_val"):
        g.hardtanh(x, min_val=2.0, max_val=1.0)
    with pytest.raises(dg.ValidationError, match="max_val"):
        g.hardtanh(x, max_val=float("nan"))
    assert len(g.nodes) == 0


def test_hard_activations_autodiff_through_their_backward_ops():
    """The backward graph of hardswish / hardsigmoid / hardtanh is their *_backward ops (one
    fused kernel), and as_function's gradient is torch's."""
    g = dg.Graph()
    x = g.tensor(name="x", dim=[7, 5])
    y = g.hardtanh(g.hardsigmoid(g.hardswish(x)), min_val=0.1, max_val=0.6).set_output(True)
    fn = g.as_function([x], [y])
    x_t = (torch.randn(7, 5) * 4).requires_grad_(True)
    dy_t = torch.randn(7, 5)
    (got,) = torch.autograd.grad(fn(x_t), x_t, dy_t)
    leaf = x_t.detach().requires_grad_(True)
    want = torch.nn.functional.hardtanh(torch.nn.functional.hardsigmoid(torch.nn.functional.hardswish(leaf)), 0.1, 0.6)
    (expected,) = torch.autograd.grad(want, leaf, dy_t)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_neg_and_pow_keep_the_sign_of_zero():
    """-(+0.0) is -0.0 and (-0.0) ** 3 is -0.0, as in torch (Triton's -x is 0 - x)."""
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[4])
    negated = g.neg(x).set_output(True)
    cubed = g.pow(x, 3.0).set_output(True)
    g.build()
    xt = torch.tensor([0.0, -0.0, 1.5, -2.0])
    outs = {negated: torch.full((4,), float("nan")), cubed: torch.full((4,), float("nan"))}
    g.execute({x: xt, **outs})
    assert torch.equal(outs[negated].view(torch.int32), torch.neg(xt).view(torch.int32))
    assert torch.equal(outs[cubed].view(torch.int32), torch.pow(xt, 3.0).view(torch.int32))


def test_integer_neg_stays_integer():
    g = dg.Graph(io_data_type=dg.int64)
    n = g.tensor(name="n", dim=[3], data_type=dg.int64)
    y = g.neg(n).set_output(True)
    g.build()
    out = torch.zeros(3, dtype=torch.int64)
    g.execute({n: torch.tensor([2 ** 62 + 1, -5, 0]), y: out})
    assert out.tolist() == [-(2 ** 62 + 1), 5, 0]


def test_pow_at_special_bases_is_torchs():
    """C's pow at every base class against every exponent class: (-inf) ** 1.5 is inf and
    (-inf) ** -1.5 is 0 (not NaN: -inf is no finite negative base), (-2) ** 1.5 is NaN."""
    bases = [float("-inf"), -2.0, -0.0, 0.0, 0.5, 2.0, float("inf"), float("nan")]
    exponents = [-2.5, -2.0, -1.0, 0.0, 0.5, 1.0, 1.5, 3.0, float("inf"), float("-inf"), float("nan")]
    a_t, b_t = torch.tensor([(a, b) for a in bases for b in exponents]).T.contiguous()
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[len(a_t)]), g.tensor(name="b", dim=[len(b_t)])
    y = g.pow(a, b).set_output(True)
    out = run(g, {a: a_t, b: b_t})[y.name]
    torch.testing.assert_close(out, torch.pow(a_t, b_t), equal_nan=True, rtol=1e-6, atol=0)
