"""Render the Gluon convolution kernel (forward, or dgrad: conv_library.py says how one kernel
runs both) of one group: only what fusion changes (the epilogue, through codegen.py's
EpilogueRenderer and expression table, and the signature); the fixed structure is
conv_library.py's.

The implicit GEMM's output is [pixels, K]: the epilogue sees a channel vector ([1, K, 1, 1] or
any shape that broadcasts as one) as a row vector over the GEMM's columns, read with the
vector's own stride along K, and a one-element operand as a scalar.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...errors import UnsupportedError
from ..contract import KernelSource
from ..triton.codegen.names import NameAllocator, comment_text
from ..triton.codegen.pointwise import KernelArgument
from .codegen import FIXED, EpilogueRenderer

# the kernel's own parameters (conv_library.implicit_gemm's), written literally
SIZES = ("images", "x_rows", "x_cols", "channels", "x_stride_n", "x_stride_h", "x_stride_w", "filters", "taps_h",
         "taps_w", "w_stride_k", "w_stride_r", "w_stride_s", "out_h", "out_w", "y_stride_n", "y_stride_h",
         "y_stride_w", "pad_h", "pad_w", "dil_h", "dil_w", "y_rows", "y_cols")
CONSTEXPRS = ("BLOCK_H", "BLOCK_W", "BLOCK_N", "BLOCK_K", "STAGES", "GROUP_M", "CONSUMERS", "EPILOGUE_N",
              "PRODUCER_REGS", "CONSUMER_REGS", "FLIP", "EPILOGUE_LOOP", "STRIDE_H", "STRIDE_W", "PHASED_H", "PHASED_W",
              "B_K_MAJOR", "OUT_STRIDE_H", "OUT_STRIDE_W")
CONV_FIXED = FIXED + ("conv_lib", "x_ptr", "w_ptr", "y_ptr") + SIZES + CONSTEXPRS


def channel_axis(dims: tuple, out_dims: tuple) -> Optional[int]:
    """The axis of `dims` that runs over the output's channels (out_dims[1]) where `dims`
    broadcasts to the output as a per-channel vector (right-aligned: [1, K, 1, 1], [K, 1, 1]),
    else None."""
    dims, out_dims = tuple(dims), tuple(out_dims)
    offset = len(out_dims) - len(dims)
    if offset < 0 or offset > 1:
        return None
    aligned = (1, ) * offset + dims
    if aligned[1] != out_dims[1] or any(size != 1 for axis, size in enumerate(aligned) if axis != 1):
        return None
    return 1 - offset


def operand_form(dims: tuple, out_dims: tuple) -> Optional[str]:
    """"scalar" (one element), "channel" (a per-channel vector) or None: what the conv epilogue reads."""
    count = 1
    for size in dims:
        count *= size
    if count == 1:
        return "scalar"
    return "channel" if channel_axis(dims, out_dims) is not None else None


@dataclass(frozen=True)
class _AsRow:
    """A per-channel epilogue operand as the matmul renderer reads a row vector: [K] with the
    operand's stride along K."""

    uid: int
    dim: tuple
    stride: tuple


class ConvEpilogueRenderer(EpilogueRenderer):
    """codegen.EpilogueRenderer over the implicit GEMM's [pixels, K] output."""

    def __init__(self, names: NameAllocator, anchor_output, conv_out_dims: tuple, fast_math=frozenset()):
        pixels = conv_out_dims[0] * conv_out_dims[2] * conv_out_dims[3]
        super().__init__(names, anchor_output, (pixels, conv_out_dims[1]), False, fast_math)
        self.conv_out_dims = tuple(conv_out_dims)

    def _operand(self, tensor):
        if tensor.uid in self.values or tensor.uid in self.loaded:
            return super()._operand(tensor)
        form = operand_form(tuple(tensor.dim), self.conv_out_dims)
        if form is None:
            raise UnsupportedError(f"a gluon conv epilogue operand of shape {list(tensor.dim)} is not a scalar or a "
                                   f"per-channel vector")
        if form == "scalar":
            return super()._operand(_AsRow(tensor.uid, (1, ), (1, )))
        axis = channel_axis(tuple(tensor.dim), self.conv_out_dims)
        return super()._operand(_AsRow(tensor.uid, (self.conv_out_dims[1], ), (int(tensor.stride[axis]), )))


def signature(names: NameAllocator, tensors: tuple, sizes: dict, epilogue_arguments: list, constexprs: dict) -> tuple:
    """(def-line parameter text, [KernelArgument]): x, w, y (uids in `tensors`), the epilogue
    operands, the SIZES, the CONSTEXPRS, in that order."""
    arguments = [KernelArgument("tensor", name, uid) for name, uid in zip(("x_ptr", "w_ptr", "y_ptr"), tensors)]
    arguments += epilogue_arguments
    arguments += [KernelArgument("int", name, int(sizes[name])) for name in SIZES]
    arguments += [KernelArgument("constexpr", name, constexprs[name]) for name in CONSTEXPRS]
    for argument in arguments:
        if not names.owns(argument.name):
            raise UnsupportedError(f"internal error: kernel parameter {argument.name!r} has no allocated name")
    text = ", ".join(a.name + (": gl.constexpr" if a.kind == "constexpr" else "") for a in arguments)
    return text, arguments


def render(stem: str, description: str, tensors: tuple, sizes: dict, anchor_output, epilogue_nodes,
           conv_out_dims: tuple, constexprs: dict, fast_math=frozenset()) -> KernelSource:
    """The source of one conv group's kernel, defined as `stem`. tensors: the uids of the kernel's
    x (fprop's x, dgrad's dy), w and the stored output; sizes: the SIZES (elements);
    conv_out_dims: the output's logical dims (fprop's y [N, K, P, Q], dgrad's dx [N, C, H, W])."""
    names = NameAllocator(CONV_FIXED)
    names.reserve(stem)
    renderer = ConvEpilogueRenderer(names, anchor_output, conv_out_dims, fast_math)
    result = "acc"
    for node in epilogue_nodes:
        result = renderer.emit(node)
    parameters, arguments = signature(names, tensors, sizes, renderer.arguments, constexprs)
    operand_names = [a.name for a in renderer.arguments]
    args_tuple = "(" + "".join(f"{name}, " for name in operand_names) + ")" if operand_names else "(0, )"
    body = "\n".join("    " + line for line in renderer.lines + [f"return {result}"])
    size_text = ", ".join(SIZES)
    text = f'''"""{comment_text(description)}"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dnngraph.backends.gluon import conv_library as conv_lib
from dnngraph.backends.gluon import library as lib


@gluon.jit
def epilogue(acc, rows, cols, batch, M, N, args):
{body}


@gluon.jit
def {stem}({parameters}):
    conv_lib.implicit_gemm(x_ptr, w_ptr, y_ptr, {size_text}, epilogue, {args_tuple},
                           BLOCK_H, BLOCK_W, BLOCK_N, BLOCK_K, STAGES, GROUP_M, CONSUMERS, EPILOGUE_N, PRODUCER_REGS,
                           CONSUMER_REGS, FLIP, EPILOGUE_LOOP, STRIDE_H, STRIDE_W, PHASED_H, PHASED_W, B_K_MAJOR,
                           OUT_STRIDE_H, OUT_STRIDE_W)
'''
    return KernelSource(stem, text, list(arguments))


# -- wgrad: two kernels (conv_wgrad_library.wgrad_partials, then wgrad_combine with the epilogue) ---
WGRAD_SIZES = ("images", "x_rows", "x_cols", "channels", "x_stride_n", "x_stride_h", "x_stride_w", "filters",
               "dy_stride_n", "dy_stride_h", "dy_stride_w", "taps_h", "taps_w", "out_h", "out_w", "pad_h", "pad_w",
               "dil_h", "dil_w", "splits", "per_split")
WGRAD_CONSTEXPRS = ("BLOCK_H", "BLOCK_W", "BLOCK_M", "BLOCK_N", "STAGES", "CONSUMERS", "EPILOGUE_N", "PRODUCER_REGS",
                    "CONSUMER_REGS", "STRIDE_H", "STRIDE_W", "PHASED_H", "PHASED_W")
COMBINE_SIZES = ("filters", "channels", "taps_h", "taps_w", "splits", "dw_stride_k", "dw_stride_c", "dw_stride_r",
                 "dw_stride_s")
COMBINE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "FLIP")
WGRAD_FIXED = (FIXED + ("wgrad_lib", "dy_ptr", "x_ptr", "partial_ptr", "dw_ptr") + WGRAD_SIZES + WGRAD_CONSTEXPRS
               + COMBINE_SIZES + COMBINE_CONSTEXPRS)


def _parameters(names: NameAllocator, arguments: list) -> str:
    """The def line's parameter text of `arguments` (each name the allocator's)."""
    for argument in arguments:
        if not names.owns(argument.name):
            raise UnsupportedError(f"internal error: kernel parameter {argument.name!r} has no allocated name")
    return ", ".join(a.name + (": gl.constexpr" if a.kind == "constexpr" else "") for a in arguments)


def _fixed_arguments(pointers: tuple, names: tuple, values: dict, constexpr_names: tuple) -> list:
    """KernelArguments: (name, uid) pointers, then the int `names` and the constexprs, from `values`."""
    arguments = [KernelArgument("tensor", name, uid) for name, uid in pointers]
    arguments += [KernelArgument("int", name, int(values[name])) for name in names]
    return arguments + [KernelArgument("constexpr", name, values[name]) for name in constexpr_names]


def render_wgrad_partials(stem: str, description: str, tensors: tuple, sizes: dict, constexprs: dict) -> KernelSource:
    """The wgrad's partials kernel, defined as `stem` (nothing of it is fused: a signature over
    conv_wgrad_library.wgrad_partials). tensors: the uids of dy, x and the fp32 workspace of partials."""
    names = NameAllocator(WGRAD_FIXED)
    names.reserve(stem)
    arguments = _fixed_arguments(tuple(zip(("dy_ptr", "x_ptr", "partial_ptr"), tensors)), WGRAD_SIZES,
                                 {**sizes, **constexprs}, WGRAD_CONSTEXPRS)
    text = f'''"""{comment_text(description)}"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dnngraph.backends.gluon import conv_wgrad_library as wgrad_lib


@gluon.jit
def {stem}({_parameters(names, arguments)}):
    wgrad_lib.wgrad_partials(dy_ptr, x_ptr, partial_ptr, {", ".join(WGRAD_SIZES)},
                             {", ".join(WGRAD_CONSTEXPRS)})
'''
    return KernelSource(stem, text, arguments)


def render_wgrad_combine(stem: str, description: str, tensors: tuple, sizes: dict, anchor_output, epilogue_nodes,
                         dw_dims: tuple, constexprs: dict, fast_math=frozenset()) -> KernelSource:
    """The wgrad's combine kernel (conv_wgrad_library.wgrad_combine), defined as `stem`: the
    splits' partials added, the fused epilogue (rendered here: scalars and vectors over dw's C), dw stored. tensors: the uids of the
    workspace and the stored output; dw_dims: its logical [K, C, R, S]."""
    names = NameAllocator(WGRAD_FIXED)
    names.reserve(stem)
    renderer = ConvEpilogueRenderer(names, anchor_output, dw_dims, fast_math)
    result = "acc"
    for node in epilogue_nodes:
        result = renderer.emit(node)
    arguments = _fixed_arguments(tuple(zip(("partial_ptr", "dw_ptr"), tensors)), (), {}, ())
    arguments += renderer.arguments
    arguments += _fixed_arguments((), COMBINE_SIZES, {**sizes, **constexprs}, COMBINE_CONSTEXPRS)
    operand_names = [a.name for a in renderer.arguments]
    args_tuple = "(" + "".join(f"{name}, " for name in operand_names) + ")" if operand_names else "(0, )"
    body = "\n".join("    " + line for line in renderer.lines + [f"return {result}"])
    text = f'''"""{comment_text(description)}"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dnngraph.backends.gluon import conv_wgrad_library as wgrad_lib
from dnngraph.backends.gluon import library as lib


@gluon.jit
def epilogue(acc, rows, cols, batch, M, N, args):
{body}


@gluon.jit
def {stem}({_parameters(names, arguments)}):
    wgrad_lib.wgrad_combine(partial_ptr, dw_ptr, {", ".join(COMBINE_SIZES)}, epilogue, {args_tuple},
                            {", ".join(COMBINE_CONSTEXPRS)})
'''
    return KernelSource(stem, text, arguments)
