"""Op -> Triton expression: the one table every family's prologues and epilogues render from.

Operands are `{0}`, `{1}`, `{2}`; attributes by name (`{negative_slope}`). Each entry says the
kinds it takes and gives: "f" (a value in the compute type) or "b" (a predicate, int1); an op
with several outputs gives one kind per output (dropout: its value and its keep-mask).
Besides literal fields, an entry may read runtime kernel integers (`scalars`: dropout's seed and
offset, so a new seed reuses the compiled kernel) and `{counter}`, the element's logical
row-major index, which only the pointwise kernel provides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .... import dtypes
from ....ops.dropout import keep_threshold
from .conversions import converted_to
from ....ops.pointwise import INTEGER_CLOSED  # noqa: F401 - the emitter reads it from this table


def _pointwise_fields(attrs) -> dict:
    return {name: getattr(attrs, name) for name in ("negative_slope", "alpha", "beta", "threshold", "min_val",
                                                  "max_val", "swish_beta")}


def _relu_clip_fields(attrs) -> dict:
    return {name: getattr(attrs, name) for name in ("relu_lower_clip", "relu_upper_clip", "relu_lower_clip_slope")}


def _no_fields(attrs) -> dict:
    return {}


@dataclass(frozen=True)
class Expression:
    template: str
    inputs: str  # one kind letter per operand
    result: str  # one kind letter per output
    fields: Callable = _pointwise_fields  # attrs -> {name: int, float or DataType}
    scalars: Optional[Callable] = None  # attrs -> {name: int} passed as runtime kernel ints
    counter: bool = False  # the template reads {counter}


def _unary(template):
    return Expression(template, "f", "f")


def _binary(template):
    return Expression(template, "ff", "f")


def _compare(symbol):
    return Expression("{0} %s {1}" % symbol, "ff", "b")


EXPRESSIONS: dict[str, Expression] = {
    "neg": _unary("{0} * -1.0"),  # Triton's -x is 0 - x, which makes -(0.0) +0.0 (torch: -0.0)
    "abs": _unary("tl.abs({0})"),
    "exp": _unary("tl.exp({0})"),
    "log": _unary("tl.log({0})"),
    # correctly rounded, as torch's sqrt (tl.sqrt is an approximation on the GPU); rsqrt as
    # torch's CPU kernel computes it, 1 / sqrt (CUDA's rsqrtf lies within 2 ulp of it)
    "sqrt": _unary("tl.sqrt_rn({0})"),
    "rsqrt": _unary("tl.div_rn(1.0, tl.sqrt_rn({0}))"),
    "reciprocal": _unary("1.0 / {0}"),
    "sin": _unary("tl.sin({0})"),
    "cos": _unary("tl.cos({0})"),
    "tanh": _unary("tm.tanh({0})"),
    "sigmoid": _unary("tl.sigmoid({0})"),
    "relu": _unary("tl.where({0} < 0, 0.0, {0})"),  # keeps NaN, as torch does
    "leaky_relu": _unary("tl.where({0} > 0, {0}, {0} * {negative_slope})"),
    "elu": _unary("tl.where({0} > 0, {0}, {alpha} * (tl.exp({0}) - 1.0))"),
    "gelu": _unary("tm.gelu({0})"),
    "gelu_tanh": _unary("tm.gelu_tanh({0})"),
    "silu": _unary("{0} * tl.sigmoid({0})"),
    "softplus": _unary("tm.softplus({0}, {beta}, {threshold})"),
    "hardswish": _unary("tm.hardswish({0})"),
    "hardsigmoid": _unary("tm.hardsigmoid({0})"),
    "hardtanh": _unary("tm.clamp_keeping_nan({0}, {min_val}, {max_val})"),
    "erf": _unary("tl.erf({0})"),
    "floor": _unary("tl.floor({0})"),
    "ceil": _unary("tl.ceil({0})"),
    "swish": _unary("{0} * tl.sigmoid({swish_beta} * {0})"),
    "tan": _unary("tl.sin({0}) / tl.cos({0})"),
    "add": _binary("{0} + {1}"),
    "sub": _binary("{0} - {1}"),
    "mul": _binary("{0} * {1}"),
    "scale": _binary("{0} * {1}"),
    "mod": _binary("{0} % {1}"),  # frem: C's fmod, the dividend's sign (torch.fmod), in the interpreter too
    "add_square": _binary("{0} + {1} * {1}"),
    "div": _binary("{0} / {1}"),
    "pow": _binary("tm.pow_({0}, {1})"),  # a number exponent of +-0.5: SCALAR_ROOTS
    "maximum": _binary("tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"),
    "minimum": _binary("tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"),
    "cmp_eq": _compare("=="),
    "cmp_ne": _compare("!="),
    "cmp_lt": _compare("<"),
    "cmp_le": _compare("<="),
    "cmp_gt": _compare(">"),
    "cmp_ge": _compare(">="),
    "logical_and": Expression("{0} & {1}", "bb", "b"),
    "logical_or": Expression("{0} | {1}", "bb", "b"),
    "logical_not": Expression("{0} == 0", "b", "b"),
    "where": Expression("tl.where({0}, {1}, {2})", "bff", "f"),
    "relu_backward": _binary("tm.relu_backward({0}, {1})"),
    "leaky_relu_backward": _binary("tm.leaky_relu_backward({0}, {1}, {negative_slope})"),
    "elu_backward": _binary("tm.elu_backward({0}, {1}, {alpha})"),
    "gelu_backward": _binary("tm.gelu_backward({0}, {1})"),
    "gelu_tanh_backward": _binary("tm.gelu_tanh_backward({0}, {1})"),
    "silu_backward": _binary("tm.silu_backward({0}, {1})"),
    "softplus_backward": _binary("tm.softplus_backward({0}, {1}, {beta}, {threshold})"),
    "sigmoid_backward": _binary("tm.sigmoid_backward({0}, {1})"),
    "tanh_backward": _binary("tm.tanh_backward({0}, {1})"),
    "hardswish_backward": _binary("tm.hardswish_backward({0}, {1})"),
    "hardsigmoid_backward": _binary("tm.hardsigmoid_backward({0}, {1})"),
    "hardtanh_backward": _binary("tm.hardtanh_backward({0}, {1}, {min_val}, {max_val})"),
    "swish_backward": _binary("tm.swish_backward({0}, {1}, {swish_beta})"),
    "dropout": Expression(
        "tm.dropout({0}, {seed}, {offset}, {counter}, {keep_threshold}, {keep_scale})", "f", "fb",
        fields=lambda attrs: {"keep_threshold": keep_threshold(attrs.p), "keep_scale": 1.0 / (1.0 - attrs.p)},
        scalars=lambda attrs: {"seed": attrs.seed, "offset": attrs.offset}, counter=True),
}

# the forms of outputs stored in a 16-bit float type (problems/base.py fast_math_outputs decides which)
FAST_MATH = {
    "gelu": _unary("tm.gelu_fast({0})"),
    "gelu_tanh": _unary("tm.gelu_tanh_fast({0})"),
}

# relu and relu_backward whose clip attributes are not torch's relu (ops/pointwise.py relu_is_clipped)
CLIPPED_RELU = {
    "relu": Expression("tm.clipped_relu({0}, {relu_lower_clip}, {relu_upper_clip}, {relu_lower_clip_slope})",
                       "f", "f", _relu_clip_fields),
    "relu_backward": Expression(
        "tm.clipped_relu_backward({0}, {1}, {relu_lower_clip}, {relu_upper_clip}, {relu_lower_clip_slope})",
        "ff", "f", _relu_clip_fields),
}


def index_along_expression(dims, axis: int) -> Expression:
    """gen_index over a tensor of `dims`: the element's row-major index {counter} divided by the
    elements of the axes after `axis`, modulo its extent (x is not read)."""
    inner = math.prod(dims[axis + 1:])
    return Expression("(({counter} // {inner}) % {extent}).to(tl.float32)", "-", "f",
                      fields=lambda attrs: {"inner": inner, "extent": dims[axis]}, counter=True)


def dropout_from_tensors(node) -> Expression:
    """dropout whose seed and/or offset are int64 tensor inputs (loaded as int64 values, every
    element the same) rather than attributes passed as kernel integers."""
    attrs = node.attrs
    seed = "{1}" if node.inputs[1] is not None else "{seed}"
    offset = "{2}" if node.inputs[2] is not None else "{offset}"
    kinds = "f" + ("l" if node.inputs[1] is not None else "-") + ("l" if node.inputs[2] is not None else "-")
    scalars = {name: value for name, value in (("seed", attrs.seed), ("offset", attrs.offset)) if value is not None}
    return Expression(f"tm.dropout({{0}}, {seed}, {offset}, {{counter}}, {{keep_threshold}}, {{keep_scale}})",
                      kinds, "fb", fields=EXPRESSIONS["dropout"].fields,
                      scalars=(lambda _: scalars) if scalars else None, counter=True)


CAST_TO_BOOL = Expression("{0} != 0", "f", "b")


def cast_expression(target, source_kind: str) -> Expression:
    """cast to DataType `target` from a value of `source_kind` ("f", "i" or "l": integers are
    cast as they are, no float on the way); the conversion is a store's (conversions.py), and a
    float result computes on in the compute type."""
    if target.is_boolean:
        return CAST_TO_BOOL
    text = converted_to("{0}", source_kind, target)
    if target.is_floating:
        return Expression(text + ".to({compute})", "f", "f", _no_fields)
    return Expression(text, "f", "l" if target is dtypes.int64 else "i", _no_fields)


# Ops closed over the integers: when every numeric operand is an integer value or an integral
# constant, they compute in the wider integer type (int64 if any operand is), as torch does;
# every other op takes integers converted to the compute float (div is true division).
# integers are their own floor and ceiling; relu keeps its integer zero; pow squares exactly
INTEGER_TEMPLATES = {"floor": "{0}", "ceil": "{0}", "relu": "tl.where({0} < 0, 0, {0})",
                     "pow": "tm.ipow({0}, {1})", "neg": "-{0}",
                     # C's remainder (torch.fmod on integers); 0 for a zero divisor, never divided by
                     "mod": "tl.where({1} == 0, 0, {0} % tl.where({1} == 0, 1, {1}))"}

# pow with a number exponent of 0.5 or -0.5 is torch's sqrt or rsqrt (ops/pointwise.py SCALAR_ROOTS)
SCALAR_ROOTS = {0.5: _binary("tl.sqrt_rn({0})"), -0.5: _binary("tl.div_rn(1.0, tl.sqrt_rn({0}))")}

# Value kinds: "f" compute float, "b" predicate, "i" int32, "l" int64.
INTEGER_TYPES = {"i": "tl.int32", "l": "tl.int64"}

# kind conversions the emitter inserts between producer and consumer
CONVERT = {("b", "f"): "{0}.to({compute})", ("f", "b"): "({0} != 0)",
           ("i", "f"): "{0}.to({compute})", ("l", "f"): "{0}.to({compute})",
           ("i", "b"): "({0} != 0)", ("l", "b"): "({0} != 0)",
           ("b", "i"): "{0}.to(tl.int32)", ("b", "l"): "{0}.to(tl.int64)",
           ("i", "l"): "{0}.to(tl.int64)", ("l", "i"): "{0}.to(tl.int32)"}
