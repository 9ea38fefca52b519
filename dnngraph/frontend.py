"""The cuDNN frontend's Python spellings, so that code written for `cudnn.pygraph` runs on dnngraph
with its import changed (`import dnngraph as cudnn`).

One table, FRONTEND_KEYWORDS, holds per op method the frontend's keyword names and the dnngraph
keyword each stands for; `frontend_keywords` wraps a method so that it takes them besides its own
(a call naming both spellings of one argument, or a keyword neither spelling has, is a
ValidationError naming the accepted names). Every wrapped method also takes the frontend's
`compute_data_type` (float32 or unset: the one type kernels compute in); names stay dnngraph's
(non-empty strings, or None for a generated one).
FRONTEND_METHODS names the frontend's methods dnngraph spells otherwise, each as the dnngraph
method it calls and how its arguments map. The enum namespaces (`data_type`, `heur_mode`, ...)
hold dnngraph's own values under the frontend's names.

This module holds names only: graph.py applies the tables to Graph.
"""
from __future__ import annotations

import enum
import functools
import inspect

from . import dtypes
from .errors import ValidationError

# --- keyword aliases: op method -> {frontend keyword: dnngraph keyword} ---------------------------
_UNARY = {"input": "x"}
_ACTIVATION_BACKWARD = {"loss": "dy", "input": "x"}
_OPERANDS_01 = {"input0": "a", "input1": "b"}
_COMPARISON = {"input": "a", "comparison": "b"}
_NORM_BACKWARD = {"grad": "dy", "input": "x"}

_UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tan", "tanh",
              "sigmoid", "relu", "leaky_relu", "elu", "gelu", "gelu_tanh", "silu", "softplus", "swish", "erf",
              "floor", "ceil", "logical_not")
_ACTIVATION_BACKWARD_OPS = ("relu_backward", "leaky_relu_backward", "elu_backward", "gelu_backward",
                            "gelu_tanh_backward", "silu_backward", "softplus_backward", "sigmoid_backward",
                            "tanh_backward", "swish_backward")
_SAME_NAMES = ("add", "sub", "mul", "div", "add_square", "logical_and", "logical_or", "sdpa", "sdpa_backward")

FRONTEND_KEYWORDS: dict[str, dict[str, str]] = {
    **{op: _UNARY for op in _UNARY_OPS},
    **{op: _ACTIVATION_BACKWARD for op in _ACTIVATION_BACKWARD_OPS},
    **{op: {} for op in _SAME_NAMES},
    "pow": _OPERANDS_01, "mod": _OPERANDS_01,
    "scale": {"input": "a", "scale": "b"},
    **{op: _COMPARISON for op in ("cmp_eq", "cmp_ne", "cmp_lt", "cmp_le", "cmp_gt", "cmp_ge")},
    "matmul": {"A": "a", "B": "b"},
    "conv_fprop": {"image": "x", "weight": "w", "convolution_mode": "mode"},
    "conv_dgrad": {"loss": "dy", "filter": "w", "convolution_mode": "mode"},
    "conv_wgrad": {"loss": "dy", "image": "x", "convolution_mode": "mode"},
    "reduction": {"input": "x"},
    **{op: _UNARY for op in ("layernorm", "adalayernorm", "rmsnorm", "batchnorm", "batchnorm_inference",
                             "instancenorm", "genstats")},
    **{op: _NORM_BACKWARD for op in ("layernorm_backward", "adalayernorm_backward", "rmsnorm_backward",
                                     "batchnorm_backward", "instancenorm_backward")},
    **{op: _UNARY for op in ("reshape", "transpose", "slice", "identity", "gen_index")},
    "concatenate": {"inputs": "tensors"},
    "tensor_like": {"input": "like"},
    "block_scale_quantize": {"input": "x"},
    "block_scale_dequantize": {"input": "x", "descale": "scale"},
}

# --- methods the frontend names otherwise: name -> (dnngraph method, its parameters, ours) -------
FRONTEND_METHODS: dict[str, tuple[str, tuple, tuple]] = {
    "max": ("maximum", ("input0", "input1"), ("a", "b")),
    "min": ("minimum", ("input0", "input1"), ("a", "b")),
    "bias": ("add", ("input", "bias"), ("a", "b")),
    "cmp_neq": ("cmp_ne", ("input", "comparison"), ("a", "b")),
    "gelu_approx_tanh": ("gelu_tanh", ("input",), ("x",)),
    "gelu_approx_tanh_backward": ("gelu_tanh_backward", ("loss", "input"), ("dy", "x")),
    # the frontend's select: input0 where mask is true, else input1
    "binary_select": ("where", ("input0", "input1", "mask"), ("a", "b", "condition")),
}


def _compute_type(op: str, value):
    """The frontend's compute_data_type: kernels compute in float32 only, so float32 or unset
    (gen_index's integer types too: its indices are exact in float32 below 2^24)."""
    if value is None:  # data_type.NOT_SET
        return
    if op == "gen_index" and dtypes.resolve(value) in (dtypes.int32, dtypes.int64):
        return
    if dtypes.resolve(value) is not dtypes.float32:
        raise ValidationError(f"{op}: compute_data_type must be float32 (or unset), the type kernels "
                              f"compute in; got {dtypes.resolve(value).name}")


def _positional_names(signature: inspect.Signature) -> list:
    return [p.name for p in signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def _renamed(op: str, aliases: dict, signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """kwargs with the frontend's spellings renamed to dnngraph's: ValidationError for a keyword
    neither spelling has, or for one argument given both ways (by keyword or position)."""
    accepted = set(signature.parameters) - {"self"}
    takes_compute_type = "compute_data_type" in accepted
    given_positionally = set(_positional_names(signature)[:len(args)])
    renamed = {}
    for keyword, value in kwargs.items():
        if keyword == "compute_data_type" and not takes_compute_type:
            _compute_type(op, value)
            continue
        own = aliases.get(keyword, keyword)
        if own not in accepted:
            names = sorted(accepted | set(aliases) | {"compute_data_type"})
            raise ValidationError(f"{op}: unknown keyword {keyword!r}; it takes {', '.join(names)}")
        if own in renamed or own in given_positionally:
            raise ValidationError(f"{op}: {own} given twice (as {own!r} and as the frontend's "
                                  f"{keyword if keyword != own else _alias_of(aliases, own)!r}); give one")
        renamed[own] = value
    return renamed


def _alias_of(aliases: dict, own: str) -> str:
    return next((alias for alias, target in aliases.items() if target == own), own)


def frontend_keywords(method, op: str, aliases: dict):
    """`method` taking the frontend's keyword spellings `aliases` (frontend -> dnngraph) too."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def taking_frontend_keywords(*args, **kwargs):
        return method(*args, **_renamed(op, aliases, signature, args, kwargs))

    taking_frontend_keywords.frontend_keywords = dict(aliases)
    return taking_frontend_keywords


def frontend_method(name: str, target: str, parameters: tuple, own: tuple):
    """The frontend's method `name`: its `parameters` (then compute_data_type and name) passed to
    Graph method `target` as the keywords `own`."""
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in parameters]
        + [inspect.Parameter("compute_data_type", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
           inspect.Parameter("name", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)])

    def method(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise ValidationError(f"{name}: {error}; it takes {', '.join(parameters)}, compute_data_type, "
                                  f"name") from None
        arguments = bound.arguments
        _compute_type(name, arguments.get("compute_data_type"))
        call = {mine: arguments[theirs] for theirs, mine in zip(parameters, own) if theirs in arguments}
        return getattr(arguments["self"], target)(**call, name=arguments.get("name"))

    method.__name__ = name
    method.__signature__ = signature
    method.__doc__ = (f"The cuDNN frontend's {name}({', '.join(parameters)}): Graph.{target} with "
                      + ", ".join(f"{theirs} as {mine}" for theirs, mine in zip(parameters, own)) + ".")
    return method


# --- the frontend's enum namespaces, holding dnngraph's values ---------------------------------
class data_type:  # noqa: N801  (the frontend's spelling)
    """cudnn.data_type's members as dnngraph DataTypes (NOT_SET: unset, None)."""

    FLOAT = dtypes.float32
    HALF = dtypes.float16
    BFLOAT16 = dtypes.bfloat16
    FP8_E4M3 = dtypes.float8_e4m3
    FP8_E5M2 = dtypes.float8_e5m2
    FP8_E8M0 = dtypes.float8_e8m0
    FP4_E2M1 = dtypes.float4_e2m1
    INT8 = dtypes.int8
    UINT8 = dtypes.uint8
    INT32 = dtypes.int32
    INT64 = dtypes.int64
    BOOLEAN = dtypes.bool_
    NOT_SET = None


class norm_forward_phase:  # noqa: N801
    """The norms' norm_forward_phase values."""

    TRAINING = "training"
    INFERENCE = "inference"


class reduction_mode:  # noqa: N801
    """reduction()'s modes under the frontend's names."""

    ADD = "sum"
    MUL = "prod"
    MIN = "min"
    MAX = "max"
    AMAX = "amax"
    AVG = "mean"
    NORM1 = "norm1"
    NORM2 = "norm2"


class convolution_mode:  # noqa: N801
    """The convolutions' mode values."""

    CROSS_CORRELATION = "cross_correlation"
    CONVOLUTION = "convolution"


class diagonal_alignment:  # noqa: N801
    """sdpa's diagonal_alignment values."""

    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"


class heur_mode(enum.Enum):  # noqa: N801
    """create_execution_plans' modes: every mode ranks dnngraph's candidates by its cost models."""

    A = "a"
    B = "b"
    FALLBACK = "fallback"
    OPENSOURCE = "opensource"


class build_plan_policy(enum.Enum):  # noqa: N801
    """build_plans' policies: the heuristics' first plan, or every plan."""

    HEURISTICS_CHOICE = "heuristics_choice"
    ALL = "all"


def heur_modes(op: str, modes) -> tuple:
    """`modes` (a list of heur_mode members; None: [A]) checked."""
    modes = [heur_mode.A] if modes is None else modes
    if not isinstance(modes, (list, tuple)) or not modes or not all(isinstance(m, heur_mode) for m in modes):
        raise ValidationError(f"{op}: heur_modes must be a non-empty list of dnngraph.heur_mode members, "
                              f"got {modes!r}")
    return tuple(modes)


def plan_policy(op: str, policy) -> build_plan_policy:
    if not isinstance(policy, build_plan_policy):
        raise ValidationError(f"{op}: policy must be a dnngraph.build_plan_policy member, got {policy!r}")
    return policy
