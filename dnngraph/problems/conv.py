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


# -- the plain convolutions: what BENCHMARKS.md measures each backend's conv on -----------------
# Fewer filters than one 128-channel output tile: the Gluon kernel's channel blocks run half
# empty (128 wide) or at half the intensity (64 wide), where Triton's 256x64 tile fits exactly.
NARROW_FILTERS_BELOW = 128
PLAIN_TYPES = frozenset({"float16", "bfloat16"})
PLAIN_EPILOGUE = frozenset({"add", "relu"})  # the forward's bias + relu, as measured (or a part of it)
PLAIN_FILTERS = frozenset({(1, 1), (3, 3)})
PLAIN_STRIDES = frozenset({(1, 1), (2, 2)})
# the two operands each direction reads (conv_problem's roles)
OPERAND_ROLES = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}


def _channels_last(operand) -> bool:
    """C (dims[1]) contiguous, as NHWC x and y and KRSC w are."""
    return operand.dims[1] == 1 or operand.strides[1] == 1


def shape_class_of(direction: str, k: int, filter_: tuple, stride: tuple) -> str:
    """The measured class of a plain conv of `direction` (measured_shape_class):
    fprop: "narrow" (fewer than NARROW_FILTERS_BELOW filters) or "wide";
    dgrad: "unit-stride" or "strided" (a strided dgrad writes dx in phases);
    wgrad: "pointwise" (1x1 filter at stride 1: one tap, a plain GEMM over pixels),
    "pointwise-strided" (a 1x1 filter reading every other pixel: Gluon's through phase views) or
    "spatial"."""
    if direction == "fprop":
        return "narrow" if k < NARROW_FILTERS_BELOW else "wide"
    if direction == "dgrad":
        return "unit-stride" if all(s == 1 for s in stride) else "strided"
    if any(f != 1 for f in filter_):
        return "spatial"
    return "pointwise" if all(s == 1 for s in stride) else "pointwise-strided"


def _plain(problem) -> bool:
    """2D, groups 1, a 1x1 or 3x3 filter at stride 1 or 2 without dilation, the two operands and
    the one output of one 16-bit type, channels last, no prologue or exits, an epilogue of a
    per-channel bias and relu at most (the forward's; the gradients were measured bare)."""
    g = problem.geometry
    if problem.prologue or problem.exits or g.groups != 1:
        return False
    if tuple(g.filter) not in PLAIN_FILTERS or tuple(g.stride) not in PLAIN_STRIDES or any(d != 1 for d in g.dilation):
        return False
    if not set(problem.epilogue) <= (PLAIN_EPILOGUE if g.direction == "fprop" else frozenset()):
        return False
    roles = OPERAND_ROLES[g.direction]
    first, second = (problem.operand(role) for role in roles)
    if first is None or second is None or len(problem.outputs) != 1:
        return False
    tensors = (first, second, problem.outputs[0])
    if {t.data_type.name for t in tensors} - PLAIN_TYPES or len({t.data_type.name for t in tensors}) != 1:
        return False
    if not all(_channels_last(t) for t in tensors):
        return False
    return all(o.role in roles or o.numel == g.k for o in problem.operands)  # only a per-channel bias was measured


def measured_shape_class(problem):
    """The class (shape_class_of) of a plain conv (_plain) of any direction: what BENCHMARKS.md
    measures each backend's convs on, so the classes their rates are measured for
    (backends/triton/heuristics/conv_measured.py, which also bounds the sizes); None for any other
    problem."""
    if problem.family != "conv" or not _plain(problem):
        return None
    g = problem.geometry
    return shape_class_of(g.direction, g.k, tuple(g.filter), tuple(g.stride))


def plain_work(problem) -> tuple:
    """(flops, bytes, dot) of a plain conv (measured_shape_class), any direction: 2 * N*P*Q * K *
    C*R*S, every operand and output moved once, the operands' 16-bit type ("bf16" or "fp16")."""
    g = problem.geometry
    flops = 2.0 * g.n * g.k * (g.c // g.groups)
    for size in tuple(g.output_spatial) + tuple(g.filter):
        flops *= size
    moved = sum(o.numel * o.data_type.itemsize for o in problem.operands + problem.outputs)
    first = problem.operand(OPERAND_ROLES[g.direction][0])
    dot = "bf16" if first.data_type.name == "bfloat16" else "fp16"
    return flops, moved, dot
