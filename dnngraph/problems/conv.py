"""Convolution geometry: N, C, K, spatial sizes, filter, stride, padding, dilation, groups and
the direction."""
from __future__ import annotations

from dataclasses import dataclass

from .base import as_tuple, problem

DIRECTIONS = {"conv_fprop": "fprop", "conv_dgrad": "dgrad", "conv_wgrad": "wgrad"}


@dataclass(frozen=True)
class ConvGeometry:
    """x [N, C, *input], w [K, C / groups, *filter], y [N, K, *output] whatever the direction
    (fprop computes y, dgrad x from dy, wgrad w from dy and x)."""

    direction: str
    n: int
    c: int
    k: int
    input_spatial: tuple
    output_spatial: tuple
    filter: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int


def conv_problem(graph, group):
    node = group.anchor
    direction = DIRECTIONS[node.op]
    if direction == "fprop":
        (x, w), y = node.inputs[:2], node.outputs[0]
    elif direction == "dgrad":
        (y, w), x = node.inputs[:2], node.outputs[0]
    else:
        (y, x), w = node.inputs[:2], node.outputs[0]
    attrs = node.attrs
    geometry = ConvGeometry(direction, int(x.dim[0]), int(x.dim[1]), int(w.dim[0]),
                            tuple(int(d) for d in x.dim[2:]), tuple(int(d) for d in y.dim[2:]),
                            tuple(int(d) for d in w.dim[2:]), as_tuple(attrs.stride), as_tuple(attrs.padding),
                            as_tuple(attrs.dilation), int(attrs.groups))
    return problem(graph, group, geometry)


# -- the plain forward: what BENCHMARKS.md measures each backend's conv forward on ----------------
# Fewer filters than one 128-channel output tile: the Gluon kernel's channel blocks run half
# empty (128 wide) or at half the intensity (64 wide), where Triton's 256x64 tile fits exactly.
NARROW_FILTERS_BELOW = 128
PLAIN_FORWARD_TYPES = frozenset({"float16", "bfloat16"})
PLAIN_FORWARD_EPILOGUE = frozenset({"add", "relu"})  # bias + relu, as measured (or a part of it)
PLAIN_FORWARD_FILTERS = frozenset({(1, 1), (3, 3)})
PLAIN_FORWARD_STRIDES = frozenset({(1, 1), (2, 2)})


def _channels_last(operand) -> bool:
    """C (dims[1]) contiguous, as NHWC x and y and KRSC w are."""
    return operand.dims[1] == 1 or operand.strides[1] == 1


def forward_shape_class(problem):
    """"narrow" (fewer than NARROW_FILTERS_BELOW filters) or "wide" for a plain conv forward: 2D,
    groups 1, a 1x1 or 3x3 filter at stride 1 or 2 without dilation, x, w and the one output of
    one 16-bit type, channels last, no prologue or exits, an epilogue of bias (a per-channel
    vector) and relu at most. What BENCHMARKS.md measures each backend's conv forward on, so the
    classes their rates are measured for (backends/triton/heuristics/conv_measured.py, which
    also bounds the sizes); None for any other problem."""
    g = problem.geometry
    if problem.family != "conv" or g.direction != "fprop" or problem.prologue or problem.exits:
        return None
    if g.groups != 1 or tuple(g.filter) not in PLAIN_FORWARD_FILTERS or tuple(g.stride) not in PLAIN_FORWARD_STRIDES:
        return None
    if any(d != 1 for d in g.dilation) or not set(problem.epilogue) <= PLAIN_FORWARD_EPILOGUE:
        return None
    x, w = problem.operand("x"), problem.operand("w")
    if x is None or w is None or len(problem.outputs) != 1:
        return None
    tensors = (x, w, problem.outputs[0])
    if {t.data_type.name for t in tensors} - PLAIN_FORWARD_TYPES or len({t.data_type.name for t in tensors}) != 1:
        return None
    if not all(_channels_last(t) for t in tensors):
        return None
    if any(o.role not in ("x", "w") and o.numel != g.k for o in problem.operands):
        return None  # only a per-channel bias was measured
    return "narrow" if g.k < NARROW_FILTERS_BELOW else "wide"


def forward_work(problem) -> tuple:
    """(flops, bytes, dot) of a plain forward (forward_shape_class): 2 * N*P*Q * K * C*R*S, every
    operand and output moved once, the operands' 16-bit type ("bf16" or "fp16")."""
    g = problem.geometry
    flops = 2.0 * g.n * g.k * (g.c // g.groups)
    for size in tuple(g.output_spatial) + tuple(g.filter):
        flops *= size
    moved = sum(o.numel * o.data_type.itemsize for o in problem.operands + problem.outputs)
    dot = "bf16" if problem.operand("x").data_type.name == "bfloat16" else "fp16"
    return flops, moved, dot
