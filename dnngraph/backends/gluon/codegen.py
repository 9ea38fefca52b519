"""Render the Gluon matmul kernel of one group: only what fusion changes.

The fixed structure (persistent tile loop, TMA producer, wgmma consumers, stores) is library.py's.
A generated source holds two functions:

- `epilogue(acc, rows, cols, batch, M, N, args)`: the group's pointwise epilogue ops on the fp32
  accumulator, from EPILOGUE below (this backend's own table; its math calls the Triton
  backend's device functions, backends/triton/codegen/triton_math.py, through library.py, so both
  backends round alike), with the operands they read loaded as a row vector, a scalar or a whole tile;
- the kernel, whose signature comes from signature() (the one builder of it and of its launch
  arguments), calling library.matmul.

Identifiers come from the kernel's NameAllocator (user tensor and node names never reach the
source; the description in its docstring passes through comment_text).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ... import dtypes
from ...errors import UnsupportedError
from ...ops.pointwise import relu_is_clipped
from ..contract import KernelSource
from ..triton.codegen.names import NameAllocator, comment_text
from ..triton.codegen.pointwise import KernelArgument

# op -> template over operands {0}, {1} (fp32 values); every op computes in fp32 (the compute type)
EPILOGUE = {
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / {1}",
    "relu": "gl.where({0} < 0, 0.0, {0})",  # keeps NaN, as torch does
    "gelu": "lib.gelu({0})",
    "gelu_tanh": "lib.gelu_tanh({0})",
    "silu": "{0} * lib.sigmoid({0})",
    "sigmoid": "lib.sigmoid({0})",
    "tanh": "lib.tanh({0})",
    "cast": None,  # to a float type: rounded to it, computed on in fp32 (cast_text)
}
# the forms of outputs stored in a 16-bit float type (problems/base.py fast_math_outputs decides which)
FAST_MATH = {"gelu": "lib.gelu_fast({0})", "gelu_tanh": "lib.gelu_tanh_fast({0})"}
BINARY = frozenset({"add", "sub", "mul", "div"})
FLOAT_TYPES = {"float16": "gl.float16", "bfloat16": "gl.bfloat16", "float32": "gl.float32"}

# the names every kernel writes literally (its parameters and the module's)
FIXED = ("gl", "gluon", "lib", "epilogue", "acc", "rows", "cols", "batch", "args", "a_ptr", "b_ptr", "c_ptr",
         "M", "N", "K", "batch_count", "a_stride_batch", "a_stride_row", "b_stride_batch", "b_stride_row",
         "c_stride_batch", "c_stride_row", "c_stride_col", "BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "GROUP_M",
         "CONSUMERS", "BATCHED_A", "BATCHED_B", "BATCHED_C", "TMA_STORE", "EPILOGUE_N", "PRODUCER_REGS", "CONSUMER_REGS",
         "scale_a_ptr", "scale_b_ptr", "B_K_MAJOR", "SCALE_A", "SCALE_B", "PINGPONG", "EPILOGUE_LOOP")
CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "GROUP_M", "CONSUMERS", "BATCHED_A", "BATCHED_B",
              "BATCHED_C", "TMA_STORE", "EPILOGUE_N", "PRODUCER_REGS", "CONSUMER_REGS", "B_K_MAJOR", "SCALE_A", "SCALE_B",
              "PINGPONG", "EPILOGUE_LOOP")


def broadcast_form(dims: tuple, out_dims: tuple) -> Optional[str]:
    """How an epilogue operand of `dims` meets the output of `out_dims`: "scalar" (one element),
    "row" (a row vector over N: [N], [1, N], [1, 1, N]), "tile" (the output's shape), else None."""
    dims, out_dims = tuple(dims), tuple(out_dims)
    count = 1
    for size in dims:
        count *= size
    if count == 1:
        return "scalar"
    if dims == out_dims:
        return "tile"
    if len(dims) <= len(out_dims) and dims and dims[-1] == out_dims[-1] and all(d == 1 for d in dims[:-1]):
        return "row"
    return None


def cast_text(value: str, type_name: str) -> Optional[str]:
    """`value` cast to float type `type_name` (rounded once, as a store would), held in fp32."""
    if type_name not in FLOAT_TYPES:
        return None
    if type_name == "float32":
        return value
    return f"{value}.to({FLOAT_TYPES[type_name]}).to(gl.float32)"


def literal(value) -> str:
    """A constant operand as source text: a finite float (-0.0 kept), or an infinity."""
    value = float(value)
    if math.isnan(value):
        raise UnsupportedError("a NaN constant in a Gluon epilogue: no kernel renders it")
    if math.isinf(value):
        return "1e999" if value > 0 else "-1e999"
    return repr(value)


def clipped_relu_text(value: str, attrs) -> str:
    """relu with the frontend's clips (ops/pointwise.py _relu, triton_math.clipped_relu): the
    upper clip at and above it, the lower line at and below the lower clip, NaN kept."""
    lower, upper = literal(attrs.relu_lower_clip), literal(attrs.relu_upper_clip)
    slope = attrs.relu_lower_clip_slope
    below = lower if slope == 0 else f"({lower} + {literal(slope)} * ({value} - {lower}))"
    return f"gl.where({value} >= {upper}, {upper}, gl.where({value} <= {lower}, {below}, {value}))"


@dataclass(frozen=True)
class GemmArguments:
    """The kernel's sizes and strides (elements) besides its epilogue operands."""

    a_uid: int
    b_uid: int
    c_uid: int
    m: int
    n: int
    k: int
    batch: int
    a_strides: tuple  # (batch, row)
    b_strides: tuple  # (batch, row) of the view loaded: [K, N], or [N, K] where B is K-major
    c_strides: tuple  # (batch, row, col)
    scale_a_uid: Optional[int] = None  # per-tensor scales (one element), where the matmul has them
    scale_b_uid: Optional[int] = None


def signature(names: NameAllocator, gemm: GemmArguments, epilogue_arguments: list, constexprs: dict) -> tuple:
    """(def-line parameter text, [KernelArgument]) of the kernel, in one order: A, B, C, the
    scales' pointers (those the matmul has), the epilogue operands' pointers and strides, sizes,
    strides, then the constexprs."""
    arguments = [KernelArgument("tensor", "a_ptr", gemm.a_uid), KernelArgument("tensor", "b_ptr", gemm.b_uid),
                 KernelArgument("tensor", "c_ptr", gemm.c_uid)]
    for name, uid in (("scale_a_ptr", gemm.scale_a_uid), ("scale_b_ptr", gemm.scale_b_uid)):
        if uid is not None:
            arguments.append(KernelArgument("tensor", name, uid))
    arguments += epilogue_arguments
    sizes = (("M", gemm.m), ("N", gemm.n), ("K", gemm.k), ("batch_count", gemm.batch),
             ("a_stride_batch", gemm.a_strides[0]), ("a_stride_row", gemm.a_strides[1]),
             ("b_stride_batch", gemm.b_strides[0]), ("b_stride_row", gemm.b_strides[1]),
             ("c_stride_batch", gemm.c_strides[0]), ("c_stride_row", gemm.c_strides[1]),
             ("c_stride_col", gemm.c_strides[2]))
    arguments += [KernelArgument("int", name, int(value)) for name, value in sizes]
    for name in CONSTEXPRS:
        arguments.append(KernelArgument("constexpr", name, constexprs[name]))
    for argument in arguments:
        if not names.owns(argument.name):
            raise UnsupportedError(f"internal error: kernel parameter {argument.name!r} has no allocated name")
    text = ", ".join(a.name + (": gl.constexpr" if a.kind == "constexpr" else "") for a in arguments)
    return text, arguments


class EpilogueRenderer:
    """The epilogue function's lines for one group's epilogue nodes."""

    def __init__(self, names: NameAllocator, anchor_output, out_dims: tuple, batched: bool, fast_math=frozenset()):
        self.names = names
        self.fast_math = frozenset(fast_math)  # output uids whose op takes its FAST_MATH form
        self.out_dims = tuple(out_dims)
        self.batched = batched
        self.lines: list = []
        self.values = {anchor_output.uid: "acc"}
        self.arguments: list = []  # KernelArgument of the operands, in order
        self.loaded: dict = {}  # uid -> variable

    def _argument(self, name: str, kind: str, value) -> str:
        """A kernel parameter `name` (inside a stem this renderer owns) passed in `args`."""
        self.arguments.append(KernelArgument(kind, name, value))
        return name

    def _operand(self, tensor) -> str:
        if tensor.uid in self.values:
            return self.values[tensor.uid]
        if tensor.uid in self.loaded:
            return self.loaded[tensor.uid]
        form = broadcast_form(tuple(tensor.dim), self.out_dims)
        if form is None:
            raise UnsupportedError(f"an epilogue operand of shape {list(tensor.dim)} is not a scalar, a row vector or "
                                   f"the output's shape")
        stem = self.names.prefix("x")
        pointer = self._argument(f"{stem}_ptr", "tensor", tensor.uid)
        variable = self.names.fresh("operand")
        strides = tuple(int(s) for s in tensor.stride)
        position = len(self.arguments) - 1
        load = f"args[{position}]"
        self.lines.append(f"{pointer} = {load}")
        if form == "scalar":
            self.lines.append(f"{variable} = gl.load({pointer}).to(gl.float32)")
        elif form == "row":
            col = self._argument(f"{stem}_stride_col", "int", strides[-1])
            self.lines.append(f"{col} = args[{len(self.arguments) - 1}]")
            self.lines.append(f"{variable} = gl.expand_dims(gl.load({pointer} + cols.to(gl.int64) * {col}, "
                              f"mask=cols < N, other=0.0).to(gl.float32), 0)")
        else:
            batch_stride = strides[0] if len(strides) == 3 else 0
            terms = []
            for hint, value in (("batch", batch_stride), ("row", strides[-2]), ("col", strides[-1])):
                name = self._argument(f"{stem}_stride_{hint}", "int", value)
                self.lines.append(f"{name} = args[{len(self.arguments) - 1}]")
                terms.append(name)
            offset = (f"batch.to(gl.int64) * {terms[0]} + gl.expand_dims(rows.to(gl.int64) * {terms[1]}, 1) + "
                      f"gl.expand_dims(cols.to(gl.int64) * {terms[2]}, 0)")
            mask = "gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)"
            self.lines.append(f"{variable} = gl.load({pointer} + {offset}, mask={mask}, other=0.0).to(gl.float32)")
        self.loaded[tensor.uid] = variable
        return variable

    def emit(self, node):
        if node.op not in EPILOGUE:
            raise UnsupportedError(f"op {node.op} has no Gluon epilogue expression")
        constants = dict(getattr(node.attrs, "constants", ()) or ())
        count = 2 if node.op in BINARY else 1
        operands = []
        for position in range(count):
            if position in constants:
                operands.append(literal(constants[position]))
            else:
                operands.append(self._operand(node.inputs[position]))
        if node.op == "cast":
            text = cast_text(operands[0], node.attrs.data_type if isinstance(node.attrs.data_type, str)
                             else node.attrs.data_type.name)
            if text is None:
                raise UnsupportedError(f"cast to {node.attrs.data_type}: the Gluon epilogue casts to float types only")
        elif node.op == "relu" and relu_is_clipped(node.attrs):
            text = clipped_relu_text(operands[0], node.attrs)
        elif node.op in FAST_MATH and node.outputs[0].uid in self.fast_math:
            text = FAST_MATH[node.op].format(*operands)
        else:
            text = EPILOGUE[node.op].format(*operands)
        variable = self.names.fresh("v")
        self.lines.append(f"{variable} = {text}  # {node.op}")
        self.values[node.outputs[0].uid] = variable
        return variable


def render(stem: str, description: str, gemm: GemmArguments, anchor_output, epilogue_nodes, out_dims: tuple,
           constexprs: dict, fast_math=frozenset()) -> KernelSource:
    """The source of one matmul group's kernel, defined as `stem` (load_kernel names it);
    `fast_math`: the outputs whose op takes its 16-bit form (Problem.fast_math)."""
    names = NameAllocator(FIXED)
    names.reserve(stem)
    renderer = EpilogueRenderer(names, anchor_output, out_dims, gemm.batch > 1, fast_math)
    result = "acc"
    for node in epilogue_nodes:
        result = renderer.emit(node)
    parameters, arguments = signature(names, gemm, renderer.arguments, constexprs)
    operand_names = [a.name for a in renderer.arguments]
    args_tuple = "(" + "".join(f"{name}, " for name in operand_names) + ")" if operand_names else "(0, )"
    body = "\n".join("    " + line for line in renderer.lines + [f"return {result}"])
    # an absent scale is a 0 the kernel never reads (SCALE_A / SCALE_B say which are present)
    scale_a = "scale_a_ptr" if gemm.scale_a_uid is not None else "0"
    scale_b = "scale_b_ptr" if gemm.scale_b_uid is not None else "0"
    text = f'''"""{comment_text(description)}"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dnngraph.backends.gluon import library as lib


@gluon.jit
def epilogue(acc, rows, cols, batch, M, N, args):
{body}


@gluon.jit
def {stem}({parameters}):
    lib.matmul(a_ptr, b_ptr, c_ptr, M, N, K, batch_count, a_stride_batch, a_stride_row, b_stride_batch, b_stride_row,
               c_stride_batch, c_stride_row, c_stride_col, epilogue, {args_tuple},
               BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, CONSUMERS, BATCHED_A, BATCHED_B, BATCHED_C, TMA_STORE,
               EPILOGUE_N, PRODUCER_REGS, CONSUMER_REGS, {scale_a}, {scale_b}, B_K_MAJOR, SCALE_A, SCALE_B, PINGPONG,
               EPILOGUE_LOOP)
'''
    return KernelSource(stem, text, list(arguments))
