"""Render a block-scale kernel (block_scale_quantize or block_scale_dequantize).

Each program owns BLOCK_G quantization blocks of BLOCK elements: a [BLOCK_G // RUN, RUN, BLOCK]
tile, RUN consecutive blocks whole inside each thread. Memory is read and written as
[BLOCK_G // RUN, RUN, N // W, W] tiles of W-element vectors (16 bytes where the block allows):
given those offsets Triton's coalescing gives each thread W-wide accesses and keeps the axes
above whole in the thread, so a block's amax, its fp4 pair packing and a run of scales need no
shuffle and no shared memory. (A [BLOCK_G, BLOCK] tile is split across threads at 16 bytes: its
reductions shuffle, and the pair split and scale stores went through shared memory.) A block index runs over the scale tensor's dims in row-major order (the last
axis fastest, so neighbouring rows of the tile are neighbours in memory when the blocks run
along x's last axis); the generated text decomposes it into one index per axis and forms each
tensor's offsets from its strides (any layout, broadcast included). The rules themselves live
in the device library (`block_scale_library`, imported as `bsq`). Packed fp4 is addressed in
bytes: its pairs lie along the block axis, which has stride 1 (checked by the lowering).
"""
from __future__ import annotations

import math

from .... import dtypes
from ....ops.block_scale import largest
from ...contract import KernelSource
from ..heuristics.layout import operand_strides
from .conversions import converted_to, float8_rule
from .emitter import ExpressionEmitter, kind_of
from .names import NameAllocator
from .pointwise import KernelArgument, kernel_module

INDENT = "    "
# identifiers the kernel writes itself; idx_<axis> and every `<stem>_*` name are its own too
FIXED_NAMES = ("runs", "blocks", "live", "rest", "amax", "finite", "elements", "scale_bits", "scale_values",
               "codes", "pairs", "halves", "stored", "values", "scales", "result", "BLOCKS", "BLOCK", "BLOCK_G", "RUN")
FIXED_STEMS = ("idx", "x", "y", "scale")
# a block's elements as 4-D offsets: [RUNS, RUN] per block, [N // W, W] per element
PER_BLOCK = "[:, :, None, None]"
PER_ELEMENT = "[None, None, :, :]"
MASK = f"live{PER_BLOCK}"
VECTOR_BYTES = 16  # the widest global access a thread makes


def vector_width(torch_dtype, elements: int) -> int:
    """Elements of one access of a tensor of `torch_dtype` over a block's `elements` (powers of two)."""
    return max(1, min(elements, VECTOR_BYTES // torch_dtype.itemsize))


def _width(tensor, elements: int) -> int:
    return vector_width(dtypes.kernel_torch_dtype(tensor.data_type), elements)


def _strides(stem: str, tensor) -> list:
    return [KernelArgument("int", f"{stem}_stride_{axis}", int(s)) for axis, s in enumerate(tensor.stride)]


def _decomposition(scale_dims) -> list:
    """Lines giving idx_<axis> of every block of the tile from its block index `blocks`."""
    lines = ["rest = blocks"]
    for axis in reversed(range(len(scale_dims))):
        lines.append(f"idx_{axis} = rest % {int(scale_dims[axis])}")
        lines.append(f"rest = rest // {int(scale_dims[axis])}")
    return lines


def _dense(dims, strides, axis: int) -> bool:
    """Do the blocks lie one after another in memory, in block index order? (row-major strides
    over the axes of size > 1, and the block axis the last of them): then a tile's elements are
    `blocks * BLOCK + lanes`, offsets the compiler sees are contiguous (vector loads)."""
    if any(size > 1 for size in dims[axis + 1:]):
        return False
    expected = 1
    for size, stride in reversed(list(zip(dims, strides))):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _block_offset(stem: str, rank: int, axis: int, block: int) -> str:
    """The element offset of each block's first element in tensor `stem` ([BLOCK_G])."""
    terms = [f"idx_{a} * {stem}_stride_{a}" + (f" * {block}" if a == axis else "") for a in range(rank)]
    return " + ".join(terms)


def _elements_at(stem: str, dims, strides, axis: int, block: int, width: int) -> str:
    """[RUNS, RUN, BLOCK // width, width] element offsets of a tensor with `strides` over x's
    `dims` (0: broadcast; [RUNS, RUN, 1, 1] where the block axis is broadcast)."""
    lanes = f"bsq.vector_lanes(BLOCK, {width}){PER_ELEMENT}"
    if _dense(dims, strides, axis) and strides[axis]:
        return f"blocks{PER_BLOCK} * BLOCK + {lanes}"
    terms = [f"idx_{a}{PER_BLOCK} * {stem}_stride_{a}" for a, s in enumerate(strides) if s and a != axis]
    if strides[axis]:
        terms.append(f"(idx_{axis}{PER_BLOCK} * {block} + {lanes}) * {stem}_stride_{axis}")
    return " + ".join(terms) or "0"


def _pairs_at(stem: str, tensor, axis: int, block: int, width: int) -> str:
    """[RUNS, RUN, BLOCK // 2 // width, width] byte offsets of a packed fp4 tensor's pairs
    (packed along `axis`)."""
    lanes = f"bsq.vector_lanes(BLOCK // 2, {width}){PER_ELEMENT}"
    if _dense(tensor.dim, tensor.stride, axis):
        return f"blocks{PER_BLOCK} * (BLOCK // 2) + {lanes}"
    return f"(({_block_offset(stem, len(tensor.dim), axis, block)}) // 2){PER_BLOCK} + {lanes}"


def _scale_at(scale) -> str:
    """[RUNS, RUN] element offsets of each block's scale."""
    if _dense(scale.dim, scale.stride, len(scale.dim) - 1):
        return "blocks"
    return " + ".join(f"idx_{a} * scale_stride_{a}" for a in range(len(scale.dim)))


def _prelude(scale_dims, rank: int, index_64: bool) -> list:
    first = "tl.program_id(0).to(tl.int64)" if index_64 else "tl.program_id(0)"
    return [f"runs = {first} * (BLOCK_G // RUN) + tl.arange(0, BLOCK_G // RUN)",
            "blocks = runs[:, None] * RUN + tl.arange(0, RUN)[None, :]", "live = blocks < BLOCKS"] + _decomposition(scale_dims)


def _vmax_fields(vmax: float) -> tuple:
    """(unbiased exponent, mantissa bits) of float32 vmax."""
    mantissa, exponent = math.frexp(vmax)  # vmax = mantissa * 2^exponent, mantissa in [0.5, 1)
    return exponent - 1, int(round((mantissa * 2 - 1) * (1 << 23)))


def _prologue_lines(group, x, axis: int, block: int, names: NameAllocator) -> tuple:
    """(lines making `x_tile`, arguments, emitter) of x computed by the group's pointwise
    prologue from its leaf inputs, each loaded at the tile's elements (broadcast axes once)."""
    emitter = ExpressionEmitter("tl.float32", hint="pv", names=names)
    lines, args = [], []
    for leaf in group.inputs:
        ident = names.prefix("in")
        strides = operand_strides(tuple(x.dim), tuple(leaf.dim), tuple(leaf.stride))
        args += [KernelArgument("tensor", f"{ident}_ptr", leaf.uid)]
        args += [KernelArgument("int", f"{ident}_stride_{a}", int(st)) for a, st in enumerate(strides) if st]
        offsets = _elements_at(ident, tuple(x.dim), strides, axis, block, _width(leaf, block))
        # one element (a global scale): a scalar load, broadcast by the expressions
        load = (f"tl.load({ident}_ptr)" if offsets == "0"
                else f"bsq.as_blocks(tl.load({ident}_ptr + {offsets}, mask={MASK}))")
        lines.append(f"{ident} = {emitter.loaded(load, leaf.data_type)}")
        emitter.bind(leaf.uid, ident, kind_of(leaf.data_type))
    for node in group.prologue:
        emitter.emit(node)
    lines += emitter.lines
    lines.append(f"x_tile = tl.broadcast_to(({emitter.consumed(x, 'f')}).to(tl.float32), (BLOCK_G // RUN, RUN, BLOCK))")
    return lines, args, emitter


def _quantize_lines(x, y, scale, axis: int, block: int, x_lines: list, round_up: bool) -> list:
    rank = len(x.dim)
    vmax = largest(y.data_type)
    lines = x_lines + ["amax, finite = bsq.block_amax(x_tile)"]
    fp4 = y.data_type is dtypes.float4_e2m1
    if scale.data_type is dtypes.float8_e8m0:
        exponent, mantissa = _vmax_fields(vmax)
        # fp4 codes saturate by themselves; scales rounded up keep every element within vmax
        clamp = not fp4 and not round_up
        lines += [f"elements, scale_bits = bsq.normalized_e8m0(x_tile, amax, {vmax!r}, {exponent}, {mantissa}, "
                  f"{round_up}, {clamp})",
                  "scale_bits = bsq.nan_scale_bits(finite, scale_bits, 255)"]
    else:
        rule = float8_rule(scale.data_type)
        lines += [f"elements, scale_values = bsq.normalized_e4m3(x_tile, amax, {vmax!r}, {not fp4})",
                  f"scale_bits = bsq.e4m3_bits(scale_values, {rule.first_overflow!r}, {rule.overflow_bits}, "
                  f"{rule.infinity_bits}, {rule.nan_bits})",
                  f"scale_bits = bsq.nan_scale_bits(finite, scale_bits, {rule.nan_bits})"]
    lines.append(f"tl.store(scale_ptr + {_scale_at(scale)}, scale_bits.to(scale_ptr.dtype.element_ty, "
                 f"bitcast=True), mask=live)")
    # a block that is not finite stores zeros (one select per element, before any conversion)
    lines.append("elements = tl.where(finite[:, :, None], elements, 0.0)")
    if fp4:
        width = _width(y, block // 2)
        lines += ["pairs = bsq.packed_pairs(bsq.fp4_codes(elements))",
                  f"tl.store(y_ptr + {_pairs_at('y', y, axis, block, width)}, bsq.as_vectors(pairs, {width}), "
                  f"mask={MASK})"]
    else:
        width = _width(y, block)
        # the elements are finite and within [-vmax, vmax] (clamped or scaled there): Triton's own
        # conversion (nearest even) is torch's, without tm.to_float8's overflow and NaN rules
        lines += [f"stored = elements.to({y.data_type.triton_type})",
                  f"stored = bsq.as_vectors(stored.to(y_ptr.dtype.element_ty, bitcast=True), {width})",
                  f"tl.store(y_ptr + {_elements_at('y', y.dim, y.stride, axis, block, width)}, stored, mask={MASK})"]
    return lines


def _dequantize_lines(x, scale, y, axis: int, block: int) -> list:
    if x.data_type is dtypes.float4_e2m1:
        width = _width(x, block // 2)
        lines = [f"pairs = bsq.as_blocks(tl.load(x_ptr + {_pairs_at('x', x, axis, block, width)}, mask={MASK}, other=0))",
                 "values = bsq.fp4_values(bsq.unpacked_pairs(pairs))"]
    else:
        lines = [f"values = bsq.as_blocks(tl.load(x_ptr + {_elements_at('x', x.dim, x.stride, axis, block, _width(x, block))}, "
                 f"mask={MASK})).to(tl.float32)"]
    lines.append(f"scale_raw = tl.load(scale_ptr + {_scale_at(scale)}, mask=live)")
    if scale.data_type is dtypes.float8_e8m0:
        lines.append("scales = bsq.e8m0_values(scale_raw)")
    else:
        lines.append("scales = scale_raw.to(tl.float32)")
    width = _width(y, block)
    lines += ["result = values * scales[:, :, None]", f"stored = bsq.as_vectors({converted_to('result', 'f', y.data_type)}, {width})",
              f"tl.store(y_ptr + {_elements_at('y', y.dim, y.stride, axis, block, width)}, stored, mask={MASK})"]
    return lines


def _x_lines(group, x, axis: int, block: int) -> tuple:
    """(lines making `x_tile` [BLOCK_G // RUN, RUN, BLOCK] in float32, arguments, module globals)."""
    if not group.prologue:
        # no `other`: rows past the last block are never stored (and fp8 takes no float literal)
        load = f"tl.load(x_ptr + {_elements_at('x', x.dim, x.stride, axis, block, _width(x, block))}, mask={MASK})"
        return [f"x_tile = bsq.as_blocks({load}).to(tl.float32)"], [KernelArgument("tensor", "x_ptr", x.uid)] + _strides("x", x), []
    names = NameAllocator(FIXED_NAMES + tuple(f"idx_{a}" for a in range(len(x.dim))))
    names.reserve_stems(*FIXED_STEMS)
    lines, args, emitter = _prologue_lines(group, x, axis, block, names)
    return lines, args + [KernelArgument("int", name, value) for name, value in emitter.scalars], emitter.globals


def render(kernel_name: str, group, config, description: str, index_64: bool = True) -> KernelSource:
    """The kernel of a block-scale group under `config` (block_g, num_warps, run); `index_64`: offsets
    past int32 need 64-bit index math."""
    node = group.anchor
    constants = []
    if node.op == "block_scale_quantize":
        (x,), (y, scale) = node.inputs, node.outputs
        axis, block = node.attrs.axis, node.attrs.block_size
        x_lines, args, constants = _x_lines(group, x, axis, block)
        body = _quantize_lines(x, y, scale, axis, block, x_lines, node.attrs.scale_rounding == "up")
    else:
        (x, scale), (y,) = node.inputs, node.outputs
        axis, block = node.attrs.axis, node.attrs.size
        body = _dequantize_lines(x, scale, y, axis, block)
        args = [KernelArgument("tensor", "x_ptr", x.uid)] + _strides("x", x)
    rank = len(x.dim)
    args += [KernelArgument("tensor", "scale_ptr", scale.uid), KernelArgument("tensor", "y_ptr", y.uid)]
    args += _strides("scale", scale) + _strides("y", y)
    args += [KernelArgument("int", "BLOCKS", math.prod(scale.dim)),
             KernelArgument("constexpr", "BLOCK", block), KernelArgument("constexpr", "BLOCK_G", config.block_g),
             KernelArgument("constexpr", "RUN", config.run)]
    text = "\n".join(INDENT + line for line in _prelude(scale.dim, rank, index_64) + body) + "\n"
    return KernelSource(kernel_name, kernel_module(description, constants, kernel_name, args, text,
                                                   libraries=("bsq",)), args)
