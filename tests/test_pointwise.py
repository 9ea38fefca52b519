"""Pointwise family on CPU (interpreter): every op, dtypes, layouts, broadcasting, random DAGs."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dnngraph as dg
from dnngraph.ops.pointwise import DIFFERENTIABLE, FORWARD_UNARY, POINTWISE_OPS
from helpers import check, run

POSITIVE_ONLY = {"log", "sqrt", "rsqrt"}
DTYPES = [torch.float32, torch.float16]


def sample(shape, dtype, op=None, position=0):
    """Random inputs suited to the op's domain (never zeros)."""
    x = torch.randn(shape, dtype=torch.float32) * 2 + 0.1
    if op in POSITIVE_ONLY or (op == "pow" and position == 0):
        x = x.abs() + 0.2
    if op == "pow" and position == 1:
        x = torch.randint(-3, 4, shape).float() + (torch.rand(shape) > 0.5) * 0.5
    if op in ("reciprocal", "div") and position == (0 if op == "reciprocal" else 1):
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
    y = getattr(g, op)(*handles)
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
    # the interpreter truncates to bf16 (numpy has no bf16): one bf16 ulp; exact on the GPU test
    check(g, {x: torch.randn(13, 11)}, tolerance=8e-3 if target is dg.bfloat16 else 1e-6)


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
    "sigmoid": torch.sigmoid, "tanh": torch.tanh}


@pytest.mark.parametrize("op", DIFFERENTIABLE)
def test_backward_at_special_values_is_torch(op):
    """dy * f'(x) at 0, +-inf, NaN, far tails and an infinite dy, as torch's own backward gives
    it (a reference differentiated through a formula made NaN of 0 * inf: elu at +inf)."""
    x_values = [float("-inf"), float("inf"), float("nan"), -30.0, -1.5, 0.0, 0.7, 30.0, 100.0]
    pairs = [(x, dy) for x in x_values for dy in (1.5, float("nan"))]
    pairs += [(x, float("inf")) for x in (-1.5, 0.0, 0.7, 30.0)]
    x_t, dy_t = torch.tensor(pairs).T.contiguous()
    g = dg.Graph()
    dy, x = g.tensor(name="dy", dim=[len(pairs)]), g.tensor(name="x", dim=[len(pairs)])
    y = getattr(g, op + "_backward")(dy, x).set_output(True)
    out = run(g, {dy: dy_t, x: x_t})[y.name].double()
    ref = g.reference({dy: dy_t, x: x_t})[y.name]
    leaf = x_t.double().requires_grad_(True)
    (want,) = torch.autograd.grad(TORCH_ACTIVATIONS[op](leaf), leaf, dy_t.double())
    torch.testing.assert_close(ref, want, equal_nan=True)
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-5, atol=1e-6)


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
