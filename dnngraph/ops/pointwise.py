"""Pointwise family: elementwise unary/binary/ternary ops, comparisons, logic, casts.

Operands broadcast numpy-style over logical dims. A Python number may stand for an operand:
it is kept in the attributes as a constant. The Triton side of each op lives in
codegen/expressions.py, keyed by the same names.
"""
from __future__ import annotations

import math

import numbers
from dataclasses import dataclass
from typing import Callable, Optional

import numpy
import torch
import torch.nn.functional as F

from .. import dtypes
from ..tensor import INT64_MAX
from .base import OpDef, OutputSpec, backward_rule, broadcast_dims, fail, freeze, integer, real, register, sequence


@dataclass(frozen=True)
class PointwiseAttrs:
    constants: tuple = ()  # ((operand position, value), ...) for scalar operands
    negative_slope: float = 0.01  # leaky_relu
    alpha: float = 1.0  # elu
    beta: float = 1.0  # softplus
    threshold: float = 20.0  # softplus: linear above beta * x > threshold
    min_val: float = -1.0  # hardtanh: the clamp's bounds
    max_val: float = 1.0
    data_type: Optional[str] = None  # cast target
    # relu and relu_backward, as the cuDNN frontend's relu(negative_slope, lower_clip,
    # upper_clip): y = upper_clip at and above it, x between the clips, and
    # lower_clip + relu_lower_clip_slope * (x - lower_clip) at and below lower_clip (the defaults
    # are torch's relu); NaN stays NaN
    relu_lower_clip: float = 0.0
    relu_upper_clip: float = math.inf
    relu_lower_clip_slope: float = 0.0
    swish_beta: float = 1.0  # swish: x * sigmoid(swish_beta * x)
    axis: int = 0  # gen_index: the axis whose index each element takes

    def __post_init__(self):
        if self.data_type is not None and not isinstance(self.data_type, str):
            fail("pointwise", f"data_type must be a data type name, got {self.data_type!r}")
        if self.data_type is not None:
            dtypes.by_name(self.data_type)
        params = {name: real("pointwise", name, getattr(self, name))
                  for name in ("negative_slope", "alpha", "beta", "threshold", "min_val", "max_val",
                               "relu_lower_clip", "relu_lower_clip_slope", "swish_beta")}
        # an infinite upper clip is the default (no clip); a -inf one would clip everything
        params["relu_upper_clip"] = real("relu", "upper_clip", self.relu_upper_clip, finite=False)
        if math.isnan(params["relu_upper_clip"]) or params["relu_upper_clip"] == -math.inf:
            fail("relu", f"upper_clip must be a number or +inf, got {params['relu_upper_clip']}")
        if params["relu_lower_clip"] > params["relu_upper_clip"]:
            fail("relu", f"lower_clip {params['relu_lower_clip']} is greater than upper_clip "
                         f"{params['relu_upper_clip']}")
        if params["beta"] == 0:
            fail("softplus", "beta must be non-zero")
        if params["min_val"] > params["max_val"]:  # torch refuses such a hardtanh too
            fail("hardtanh", f"min_val {params['min_val']} is greater than max_val {params['max_val']}")
        freeze(self, constants=_checked_constants(self.constants), axis=integer("gen_index", "axis", self.axis, minimum=0),
               **params)


def _checked_constants(constants) -> tuple:
    """((position, number), ...) with distinct positions; a number is an int or a float.

    Ints stay ints (integer operands compute exactly); non-finite floats are allowed (a -inf
    bound is a fine constant). Positions are checked against the op's operands by its infer.
    """
    pairs = []
    for pair in sequence("pointwise", "constants", constants):
        pair = sequence("pointwise", "constants entry", pair)
        if len(pair) != 2:
            fail("pointwise", f"constants entries are (position, value), got {list(pair)}")
        position = integer("pointwise", "constant position", pair[0], minimum=0, maximum=2)
        value = pair[1]
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, numpy.bool_)):
            value = integer("pointwise", "constant", value, minimum=-INT64_MAX - 1)
        else:
            value = real("pointwise", "constant", value, finite=False)
        pairs.append((position, value))
    if len({position for position, _ in pairs}) != len(pairs):
        fail("pointwise", f"constants name a position twice: {pairs}")
    return tuple(pairs)


@dataclass(frozen=True)
class PointwiseOp:
    """Catalog entry of one pointwise op."""

    arity: int
    result: str  # "float", "bool", or "cast" (type from attrs.data_type)
    reference: Callable  # (operands, attrs) -> torch.Tensor
    params: tuple[str, ...] = ()  # attribute names the op takes
    operand_names: tuple[str, ...] = ()


def as_float(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.float64) if value.dtype == torch.bool else value


def as_bool(value: torch.Tensor) -> torch.Tensor:
    return value if value.dtype == torch.bool else value != 0


def _floats(fn):
    return lambda args, attrs: fn(*[as_float(a) for a in args], attrs)


def _bools(fn):
    return lambda args, attrs: fn(*[as_bool(a) for a in args])


def _softplus(x, attrs):
    return F.softplus(x, beta=attrs.beta, threshold=attrs.threshold)


def relu_is_clipped(attrs) -> bool:
    """Whether relu's clip attributes differ from torch's relu (lower clip 0, slope 0, no upper)."""
    return (attrs.relu_lower_clip, attrs.relu_upper_clip, attrs.relu_lower_clip_slope) != (0.0, math.inf, 0.0)


def _relu(x, attrs):
    if not relu_is_clipped(attrs):
        return F.relu(x)
    lower, upper, slope = attrs.relu_lower_clip, attrs.relu_upper_clip, attrs.relu_lower_clip_slope
    # a zero slope is the constant lower clip (0 * -inf would make NaN of x = -inf)
    below = torch.full_like(x, lower) if slope == 0 else lower + slope * (x - lower)
    return torch.where(x >= upper, torch.full_like(x, upper), torch.where(x <= lower, below, x))


def _swish(x, attrs):
    if attrs.swish_beta == 1.0:
        return F.silu(x)  # torch's own activation and its backward rule
    return x * torch.sigmoid(attrs.swish_beta * x)


def _index_along(x, axis: int) -> torch.Tensor:
    """gen_index (the cuDNN frontend's GEN_INDEX): each element's index along `axis` of x, whose
    values it does not read."""
    shape = [1] * x.dim()
    shape[axis] = x.shape[axis]
    return torch.arange(x.shape[axis], dtype=torch.float64, device=x.device).reshape(shape).expand(x.shape)


def _cast(x, attrs):
    target = dtypes.by_name(attrs.data_type)
    if target.is_boolean:
        return as_bool(x)
    if dtypes.is_saturating(target):  # saturating, floats rounded to nearest even (cuDNN's int8 outputs)
        return dtypes.to_saturated(x, target)
    if not target.is_floating:  # as torch converts: floats truncate toward zero, integers wrap
        return x.to(target.torch_dtype)
    x = as_float(x)  # rounded to the target, held in float64 (or x's own float type)
    return x.to(target.torch_dtype).to(x.dtype if x.is_floating_point() else torch.float64)


FORWARD_UNARY = {
    "neg": lambda x, _: -x,
    "abs": lambda x, _: x.abs(),
    "exp": lambda x, _: x.exp(),
    "log": lambda x, _: x.log(),
    "sqrt": lambda x, _: x.sqrt(),
    "rsqrt": lambda x, _: x.rsqrt(),
    "reciprocal": lambda x, _: x.reciprocal(),
    "sin": lambda x, _: x.sin(),
    "cos": lambda x, _: x.cos(),
    "tanh": lambda x, _: x.tanh(),
    "sigmoid": lambda x, _: x.sigmoid(),
    # torch's own activations, not formulas: their backward rules (which the *_backward
    # references differentiate) define the derivative at 0, at +-inf and under an infinite dy,
    # where autograd through a formula makes NaN of 0 * inf or of an untaken where branch
    "relu": _relu,
    "leaky_relu": lambda x, a: F.leaky_relu(x, a.negative_slope),
    "elu": lambda x, a: F.elu(x, a.alpha),
    "gelu": lambda x, _: F.gelu(x),
    "gelu_tanh": lambda x, _: F.gelu(x, approximate="tanh"),
    "silu": lambda x, _: F.silu(x),
    "softplus": _softplus,
    "hardswish": lambda x, _: F.hardswish(x),
    "hardsigmoid": lambda x, _: F.hardsigmoid(x),
    "hardtanh": lambda x, a: F.hardtanh(x, a.min_val, a.max_val),
    "erf": lambda x, _: torch.erf(x),
    "floor": lambda x, _: x.floor(),
    "ceil": lambda x, _: x.ceil(),
    "swish": _swish,
    "tan": lambda x, _: x.tan(),
}
RELU_CLIPS = ("relu_lower_clip", "relu_upper_clip", "relu_lower_clip_slope")
UNARY_PARAMS = {"leaky_relu": ("negative_slope",), "elu": ("alpha",),
                "softplus": ("beta", "threshold"), "hardtanh": ("min_val", "max_val"),
                "relu": RELU_CLIPS, "swish": ("swish_beta",)}
# Ops whose backward form takes (dy, x) and returns dy * f'(x).
DIFFERENTIABLE = ("relu", "leaky_relu", "elu", "gelu", "gelu_tanh", "silu", "softplus",
                  "sigmoid", "tanh", "hardswish", "hardsigmoid", "hardtanh", "swish")


def _backward_reference(forward):
    def reference(dy, x, attrs):
        with torch.enable_grad():
            shape = torch.broadcast_shapes(dy.shape, x.shape)
            leaf = x.detach().expand(shape).clone().requires_grad_(True)
            dy = dy.expand(shape)
            (grad,) = torch.autograd.grad(forward(leaf, attrs), leaf, dy)
        return grad
    return reference


def _hardswish_backward(dy, x, _):
    inside = torch.where(x <= -3.0, torch.zeros((), dtype=dy.dtype), dy * (x / 3.0 + 0.5))
    return torch.where(x < 3.0, inside, dy)


def _hardsigmoid_backward(dy, x, _):
    return torch.where((x > -3.0) & (x < 3.0), dy / 6.0, torch.zeros((), dtype=dy.dtype))


def _hardtanh_backward(dy, x, attrs):
    return torch.where((x <= attrs.min_val) | (x >= attrs.max_val), torch.zeros((), dtype=dy.dtype), dy)


def _relu_backward(dy, x, attrs):
    """torch's relu rule by default; clipped: dy between the clips, 0 at and above the upper
    one, slope * dy at and below the lower one (0 for a zero slope, whatever dy is), and dy
    for a NaN x as relu passes it on."""
    if not relu_is_clipped(attrs):
        return _backward_reference(FORWARD_UNARY["relu"])(dy, x, attrs)
    zero = torch.zeros((), dtype=dy.dtype)
    below = zero if attrs.relu_lower_clip_slope == 0 else dy * attrs.relu_lower_clip_slope
    inside = torch.where(x <= attrs.relu_lower_clip, below, dy)
    return torch.where(x >= attrs.relu_upper_clip, zero, inside)


# The hard activations' derivatives written out: torch's scalar CPU and its CUDA kernels pass dy
# on for a NaN x (hardswish, hardtanh) while its vectorized CPU kernels give NaN or 0, so that
# autograd through torch would make the reference depend on the tensor's size. These are the
# CUDA rules, boundaries included (hardswish: 0 at -3, dy at 3; hardtanh: 0 at both bounds).
EXPLICIT_BACKWARD = {"hardswish": _hardswish_backward, "hardsigmoid": _hardsigmoid_backward,
                     "hardtanh": _hardtanh_backward, "relu": _relu_backward}


def _broadcast_backward(derivative):
    def reference(dy, x, attrs):
        dy, x = torch.broadcast_tensors(dy, x)
        return derivative(dy, x, attrs)
    return reference


POINTWISE_OPS: dict[str, PointwiseOp] = {}
for _name, _fn in FORWARD_UNARY.items():
    POINTWISE_OPS[_name] = PointwiseOp(1, "float", _floats(_fn), UNARY_PARAMS.get(_name, ()), ("x",))
for _name in DIFFERENTIABLE:
    _derivative = (_broadcast_backward(EXPLICIT_BACKWARD[_name]) if _name in EXPLICIT_BACKWARD
                   else _backward_reference(FORWARD_UNARY[_name]))
    POINTWISE_OPS[_name + "_backward"] = PointwiseOp(2, "float", _floats(_derivative),
                                                     UNARY_PARAMS.get(_name, ()), ("dy", "x"))

# torch.pow(t, 0.5) and torch.pow(t, -0.5) with a number exponent are sqrt(t) and rsqrt(t):
# (-0.0) ** 0.5 is -0.0 and (-inf) ** 0.5 NaN there, where C's pow (a tensor exponent) gives
# +0.0 and inf; a model's `x ** 0.5` expects torch's
SCALAR_ROOTS = {0.5: torch.sqrt, -0.5: torch.rsqrt}


def _fmod(a, b):
    """torch.fmod; on integers exact, and 0 where the divisor is 0 (torch raises there, and a
    kernel cannot)."""
    if a.is_floating_point() or b.is_floating_point():
        return torch.fmod(a, b)
    zero = b == 0
    return torch.where(zero, torch.zeros((), dtype=torch.promote_types(a.dtype, b.dtype)),
                       torch.fmod(a, torch.where(zero, torch.ones_like(b), b)))


def _pow(a, b, attrs):
    root = SCALAR_ROOTS.get(dict(attrs.constants).get(1))
    if root is not None and a.is_floating_point():
        return root(a)
    return torch.pow(a, b)


_BINARY = {
    "add": lambda a, b, _: a + b,
    "sub": lambda a, b, _: a - b,
    "mul": lambda a, b, _: a * b,
    "div": lambda a, b, _: a / b,
    "pow": lambda a, b, attrs: _pow(a, b, attrs),
    "maximum": lambda a, b, _: torch.maximum(a, b),
    "minimum": lambda a, b, _: torch.minimum(a, b),
    "scale": lambda a, b, _: a * b,
    # the frontend's MOD is C's fmod (cuDNN: "floating-point remainder"): the result takes the
    # dividend's sign, as torch.fmod (not Python's %, torch.remainder)
    "mod": lambda a, b, _: _fmod(a, b),
    "add_square": lambda a, b, _: a + b * b,  # the frontend's ADD_SQUARE: a + b^2
}
for _name, _fn in _BINARY.items():
    POINTWISE_OPS[_name] = PointwiseOp(2, "float", _floats(_fn), (), ("a", "b"))
_COMPARE = {"cmp_eq": torch.eq, "cmp_ne": torch.ne, "cmp_lt": torch.lt, "cmp_le": torch.le,
            "cmp_gt": torch.gt, "cmp_ge": torch.ge}
for _name, _fn in _COMPARE.items():
    POINTWISE_OPS[_name] = PointwiseOp(2, "bool", _floats(lambda a, b, _, f=_fn: f(a, b)), (), ("a", "b"))
POINTWISE_OPS["logical_and"] = PointwiseOp(2, "bool", _bools(torch.logical_and), (), ("a", "b"))
POINTWISE_OPS["logical_or"] = PointwiseOp(2, "bool", _bools(torch.logical_or), (), ("a", "b"))
POINTWISE_OPS["logical_not"] = PointwiseOp(1, "bool", _bools(torch.logical_not), (), ("x",))
POINTWISE_OPS["where"] = PointwiseOp(
    3, "float",
    lambda args, attrs: torch.where(as_bool(args[0]), as_float(args[1]), as_float(args[2])),
    (), ("condition", "a", "b"))
POINTWISE_OPS["gen_index"] = PointwiseOp(1, "float", lambda args, attrs: _index_along(args[0], attrs.axis), ("axis",),
                                         ("x",))
POINTWISE_OPS["cast"] = PointwiseOp(1, "cast", lambda args, attrs: _cast(args[0], attrs),
                                    ("data_type",), ("x",))


def operand_values(inputs, attrs: PointwiseAttrs, arity: int):
    """Merge tensor inputs and scalar constants into the operand list, by position."""
    constants = dict(attrs.constants)
    return [constants[i] if i in constants else inputs[i] for i in range(arity)]


# Ops that keep integer operands integers, as torch does (an int64 add is exact; div, exp and
# the rest compute in floating point). Kernels compute these in integers, references too.
INTEGER_CLOSED = frozenset({"add", "sub", "mul", "scale", "pow", "neg", "abs", "relu", "maximum", "minimum",
                            "where", "cmp_eq", "cmp_ne", "cmp_lt", "cmp_le", "cmp_gt", "cmp_ge",
                            "floor", "ceil", "add_square", "mod"})


def integer_closed(op_name: str, attrs) -> bool:
    """Whether node (op_name, attrs) keeps integer operands integers: INTEGER_CLOSED, but a
    clipped relu computes in floating point (its clips and slope are floats)."""
    if op_name == "relu" and relu_is_clipped(attrs):
        return False
    return op_name in INTEGER_CLOSED
INTEGER_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
# the integer type an operand's math runs in: int8 widens to int32 (kernels at load, the reference
# before each op), so a constant meeting int8 operands must fit int32
COMPUTES_AS = {"int8": "int32", "uint8": "int32"}


def _integral(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_integer_constants(op_name: str, inputs, attrs: PointwiseAttrs):
    """An integral constant meeting only integer tensors must fit their widest type (torch
    refuses an int32 tensor plus 2**40 too)."""
    # bool operands (where's condition, a predicate added in) never widen the math
    kinds = {COMPUTES_AS.get(t.data_type.name, t.data_type.name) for t in inputs
             if t is not None and t.data_type is not dtypes.bool_}
    if not integer_closed(op_name, attrs) or not kinds or not kinds <= set(INTEGER_RANGES):
        return
    widest = "int64" if "int64" in kinds else "int32"
    low, high = INTEGER_RANGES[widest]
    for position, value in attrs.constants:
        if _integral(value) and not low <= value <= high:
            fail(op_name, f"constant {value} does not fit {widest}, the type its tensor operands compute in")


def _check_operands(op_name: str, entry: PointwiseOp, inputs, attrs: PointwiseAttrs):
    """Every operand is exactly one of a tensor or a constant."""
    constant_positions = {position for position, _ in attrs.constants}
    for position, operand_name in enumerate(entry.operand_names):
        given = inputs[position] is not None
        if given and position in constant_positions:
            fail(op_name, f"operand {operand_name} is both a tensor and a constant")
        if not given and position not in constant_positions:
            fail(op_name, f"operand {operand_name} is required")
    if any(position >= entry.arity for position in constant_positions):
        fail(op_name, f"constants {list(attrs.constants)} name positions past its {entry.arity} operands")


def _infer(op_name: str):
    entry = POINTWISE_OPS[op_name]

    def infer(inputs, attrs: PointwiseAttrs):
        _check_operands(op_name, entry, inputs, attrs)
        _check_integer_constants(op_name, inputs, attrs)
        tensors = [(entry.operand_names[i], t.dim) for i, t in enumerate(inputs) if t is not None]
        if not tensors:
            fail(op_name, "needs at least one tensor operand")
        dim = broadcast_dims(op_name, tensors)
        if op_name == "gen_index" and attrs.axis >= len(dim):
            fail(op_name, f"axis {attrs.axis} is past the last axis of {list(dim)}")
        fixed = None
        if entry.result == "bool":
            fixed = dtypes.bool_
        elif entry.result == "cast":
            if attrs.data_type is None:
                fail(op_name, "needs data_type")
            fixed = dtypes.by_name(attrs.data_type)
        layout = next(i for i, t in enumerate(inputs) if t is not None and t.dim == dim) \
            if any(t is not None and t.dim == dim for t in inputs) else None
        return [OutputSpec(dim, fixed, layout_source=layout)]
    return infer


def _reference(op_name: str):
    entry = POINTWISE_OPS[op_name]

    def reference(values, attrs: PointwiseAttrs):
        integer = integer_closed(op_name, attrs)
        keeps_integers = integer or op_name == "cast"  # a cast converts integers as torch does
        operands = []
        for value in operand_values(values, attrs, entry.arity):
            if not isinstance(value, torch.Tensor):
                # an integral constant keeps an integer op exact, as a Python int does in torch
                exact = integer and _integral(value)
                value = torch.tensor(value) if exact else torch.tensor(float(value), dtype=torch.float64)
            elif not keeps_integers and not value.is_floating_point() and value.dtype != torch.bool:
                value = value.to(torch.float64)  # a float op on integers: the reference in float64
            operands.append(value)
        return [entry.reference(operands, attrs)]
    return reference


for _name, _entry in POINTWISE_OPS.items():
    register(OpDef(_name, "pointwise", "pointwise", PointwiseAttrs, _entry.operand_names, ("y",),
                   _infer(_name), _reference(_name), optional=_entry.operand_names))


# --- backward rules (autodiff.py): d.graph is the backward graph, d.value / d.operand read the
# forward values there ------------------------------------------------------------------------
def _unary_rule(derivative):
    """A rule from derivative(g, dy, x, y): x and y are read (or recomputed) only when used."""
    def rule(d, node, grads):
        x, y = (lambda: d.value(node.inputs[0])), (lambda: d.value(node.outputs[0]))
        return [derivative(d.graph, grads[0], x, y)]
    return rule


_UNARY_DERIVATIVES = {
    "neg": lambda g, dy, x, y: g.neg(dy),
    "abs": lambda g, dy, x, y: g.where(g.cmp_gt(x(), 0.0), dy, g.where(g.cmp_lt(x(), 0.0), g.neg(dy), 0.0)),
    "exp": lambda g, dy, x, y: g.mul(dy, y()),
    "log": lambda g, dy, x, y: g.div(dy, x()),
    "sqrt": lambda g, dy, x, y: g.div(dy, g.mul(y(), 2.0)),
    "rsqrt": lambda g, dy, x, y: g.mul(dy, g.mul(g.mul(y(), g.mul(y(), y())), -0.5)),
    "reciprocal": lambda g, dy, x, y: g.neg(g.mul(dy, g.mul(y(), y()))),
    "sin": lambda g, dy, x, y: g.mul(dy, g.cos(x())),
    "cos": lambda g, dy, x, y: g.neg(g.mul(dy, g.sin(x()))),
    "erf": lambda g, dy, x, y: g.mul(dy, g.mul(g.exp(g.neg(g.mul(x(), x()))), 2.0 / math.sqrt(math.pi))),
    "tan": lambda g, dy, x, y: g.mul(dy, g.add_square(1.0, y())),  # 1 + tan^2
}
for _name, _derivative in _UNARY_DERIVATIVES.items():
    backward_rule(_name)(_unary_rule(_derivative))


def _truncated_quotient(g, a, b):
    """trunc(a / b) in graph ops (floor toward zero: ceil below zero)."""
    quotient = g.div(a, b)
    return g.where(g.cmp_lt(quotient, 0.0), g.ceil(quotient), g.floor(quotient))


@backward_rule(*DIFFERENTIABLE)
def _activation_backward(d, node, grads):
    """The op's own *_backward form: dy * f'(x), with f' as torch defines it at the kinks."""
    dy, x = grads[0], d.value(node.inputs[0])
    return [d.graph._add_op(node.op + "_backward", [dy, x], node.attrs)[0]]


@backward_rule("floor", "ceil", "gen_index")  # gen_index reads no value of its input
def _piecewise_constant(d, node, grads):
    return [None]


@backward_rule("cast")
def _cast_backward(d, node, grads):
    return [grads[0] if node.inputs[0].data_type.is_floating else None]


def _binary_rule(derivatives):
    """A rule from derivative(g, dy, a, b, y) per operand; a, b and y are read (or recomputed)
    only when used, a constant operand is a number and takes no gradient."""
    def rule(d, node, grads):
        a, b = (lambda: d.operand(node, 0)), (lambda: d.operand(node, 1))
        y = lambda: d.value(node.outputs[0])
        return [None if node.inputs[i] is None or not d.needs(node.inputs[i]) else
                derivative(d.graph, grads[0], a, b, y) for i, derivative in enumerate(derivatives)]
    return rule


def _power_exponent_grad(g, dy, a, b, y):
    """dy a^b log(a), 0 where a is 0 and b >= 0 (as torch: a^b is flat there, not 0 * -inf)."""
    base, exponent = a(), b()
    if isinstance(base, (int, float)):
        if base > 0:
            return g.mul(g.mul(dy, y()), math.log(base))
        if base < 0:
            return g.mul(g.mul(dy, y()), math.nan)
        return g.where(g.cmp_ge(exponent, 0.0), 0.0, g.mul(g.mul(dy, y()), -math.inf))
    flat = g.logical_and(g.cmp_eq(base, 0.0), g.cmp_ge(exponent, 0.0))
    return g.where(flat, 0.0, g.mul(g.mul(dy, y()), g.log(base)))


def _power_base_grad(g, dy, a, b, y):
    """dy b a^(b - 1), 0 where b is 0 (as torch: a^0 is 1 everywhere, 0^-1 included)."""
    exponent = b()
    if isinstance(exponent, (int, float)):
        return None if exponent == 0 else g.mul(dy, g.mul(exponent, g.pow(a(), exponent - 1)))
    return g.where(g.cmp_eq(exponent, 0.0), 0.0, g.mul(dy, g.mul(exponent, g.pow(a(), g.sub(exponent, 1.0)))))


def _extreme_grad(g, dy, mine, other, wins):
    """dy where this operand is the extreme, half of it on ties (as torch splits it)."""
    mine, other = mine(), other()
    return g.where(wins(mine, other), dy, g.where(g.cmp_eq(mine, other), g.mul(dy, 0.5), 0.0))


for _name, _rules in {
    "add": (lambda g, dy, a, b, y: dy, lambda g, dy, a, b, y: dy),
    "sub": (lambda g, dy, a, b, y: dy, lambda g, dy, a, b, y: g.neg(dy)),
    "mul": (lambda g, dy, a, b, y: g.mul(dy, b()), lambda g, dy, a, b, y: g.mul(dy, a())),
    "scale": (lambda g, dy, a, b, y: g.mul(dy, b()), lambda g, dy, a, b, y: g.mul(dy, a())),
    "div": (lambda g, dy, a, b, y: g.div(dy, b()), lambda g, dy, a, b, y: g.neg(g.div(g.mul(dy, y()), b()))),
    "pow": (_power_base_grad, _power_exponent_grad),
    "maximum": (lambda g, dy, a, b, y: _extreme_grad(g, dy, a, b, g.cmp_gt),
                lambda g, dy, a, b, y: _extreme_grad(g, dy, b, a, g.cmp_gt)),
    "minimum": (lambda g, dy, a, b, y: _extreme_grad(g, dy, a, b, g.cmp_lt),
                lambda g, dy, a, b, y: _extreme_grad(g, dy, b, a, g.cmp_lt)),
    # fmod(a, b) = a - trunc(a / b) b (torch's rule; the quotient's steps carry no gradient)
    "mod": (lambda g, dy, a, b, y: dy, lambda g, dy, a, b, y: g.neg(g.mul(dy, _truncated_quotient(g, a(), b())))),
    "add_square": (lambda g, dy, a, b, y: dy, lambda g, dy, a, b, y: g.mul(dy, g.mul(b(), 2.0))),
}.items():
    backward_rule(_name)(_binary_rule(_rules))


@backward_rule("where")
def _where_backward(d, node, grads):
    g, dy = d.graph, grads[0]
    condition = d.value(node.inputs[0])
    a, b = node.inputs[1:]
    return [None, g.where(condition, dy, 0.0) if d.needs(a) else None,
            g.where(condition, 0.0, dy) if d.needs(b) else None]
