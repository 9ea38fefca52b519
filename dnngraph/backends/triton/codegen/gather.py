"""Render a gather group as one Triton kernel: the gather (or its gradient, the scatter-add) and
its pointwise epilogue.

Each program owns BLOCK consecutive elements of y in row-major order, splits their flat index
into one coordinate per axis, loads the ids at those coordinates and then the table at the
coordinates with the id on the gathered axis. An id outside [0, size) masks its load (nothing
outside the table is ever read) and gives NaN (0 for integer tables). The epilogue's other
operands load at y's coordinates with their own (broadcast) strides.

The scatter-add is written as a gather too, so it needs no atomics and is deterministic: each
program owns elements of y and walks every position k along the axis of src in order, adding
src where the id at k names its own coordinate (an id outside y names none). Its cost is y's
size times src's extent along the axis: fine for a loss's one id per row, a scan of every id per
row block for an embedding's table (the torch backend claims only small ones).
"""
from __future__ import annotations

from ..heuristics.layout import operand_strides
from .emitter import ExpressionEmitter, kind_of, masked_epilogue
from .names import NameAllocator
from ...contract import KernelSource
from .pointwise import KernelArgument, kernel_module

INDENT = "    "
FIXED_NAMES = ("pid", "offsets", "mask", "rest", "ids", "valid", "picked", "total", "AXIS_SIZE", "BLOCK", "acc",
               "hit", "k", "value", "PICKS")


class _GatherWriter:
    """The body of one gather kernel; one method per part of it."""

    def __init__(self, kernel_name, schedule, group, compute_type):
        self.schedule, self.group, self.anchor = schedule, group, group.anchor
        self.dims = schedule.y_dims
        self.rank = len(self.dims)
        self.compute = compute_type.triton_type
        self.names = NameAllocator(FIXED_NAMES + tuple(f"{stem}_{k}" for k in range(self.rank)
                                                       for stem in ("idx", "size")) + (kernel_name,))
        self.emitter = ExpressionEmitter(self.compute, names=self.names)
        self.outputs = list(group.outputs)
        x, index = self.anchor.inputs
        self.operands = {}  # uid -> (identifier, strides over y's axes)
        for tensor, hint in [(x, "table" if self.anchor.op == "gather" else "src"), (index, "index")] + [(t, "x") for t in group.inputs
                                                                 if t.uid not in (x.uid, index.uid)] \
                + [(t, "y") for t in self.outputs]:
            if tensor.uid not in self.operands:
                # over y's axes, 0 where the operand has size 1 (the table's gathered axis too:
                # its only valid id is 0)
                strides = operand_strides(self.dims, tensor.dim, tensor.stride)
                self.operands[tensor.uid] = (self.names.prefix(hint), strides)
        self.body: list[str] = []

    def line(self, text: str):
        self.body.append(INDENT + text)

    def coordinates(self):
        """The flat offsets of this program's elements and one index per axis of y."""
        widen = ".to(tl.int64)" if self.schedule.index_64 else ""
        self.line(f"pid = tl.program_id(0){widen}")
        self.line("offsets = pid * BLOCK + tl.arange(0, BLOCK)")
        self.line("mask = offsets < total")
        self.line("rest = offsets")
        for axis in range(self.rank - 1, 0, -1):
            self.line(f"idx_{axis} = rest % size_{axis}")
            self.line(f"rest = rest // size_{axis}")
        self.line("idx_0 = rest")

    def offset(self, uid, skip=None) -> str:
        """The element offset of operand `uid` at y's coordinates (axis `skip` left out)."""
        identifier, strides = self.operands[uid]
        terms = [f"idx_{axis} * {identifier}_stride_{axis}" for axis, stride in enumerate(strides)
                 if stride and axis != skip and self.dims[axis] > 1]
        return " + ".join(terms) or "offsets * 0"  # a tile even where every axis broadcasts

    def gather(self):
        x, index = self.anchor.inputs
        index_id, _ = self.operands[index.uid]
        table_id, table_strides = self.operands[x.uid]
        axis = self.anchor.attrs.axis
        self.line(f"ids = tl.load({index_id}_ptr + {self.offset(index.uid)}, mask=mask, other=0).to(tl.int64)")
        self.line("valid = (ids >= 0) & (ids < AXIS_SIZE)")
        picks = f" + ids * {table_id}_stride_{axis}" if table_strides[axis] else ""
        load = f"tl.load({table_id}_ptr + {self.offset(x.uid, skip=axis)}{picks}, mask=mask & valid, other=0)"
        kind = kind_of(x.data_type)
        self.line(f"picked = {self.emitter.loaded(load, x.data_type)}")
        missing = "float('nan')" if kind == "f" else ("False" if kind == "b" else "0")
        self.line(f"picked = tl.where(valid, picked, {missing})")
        self.emitter.bind(self.anchor.outputs[0].uid, "picked", kind)

    def scatter(self):
        src, index = self.anchor.inputs
        axis = self.anchor.attrs.axis
        index_id, index_strides = self.operands[index.uid]
        src_id, src_strides = self.operands[src.uid]
        index_step = f" + k * {index_id}_stride_{axis}" if index_strides[axis] else ""
        src_step = f" + k * {src_id}_stride_{axis}" if src_strides[axis] else ""
        self.line(f"acc = tl.zeros([BLOCK], dtype={self.compute})")
        self.line("for k in range(0, PICKS):  # in order: the sum is the same on every run")
        self.line(f"    ids = tl.load({index_id}_ptr + {self.offset(index.uid, skip=axis)}{index_step}, mask=mask, "
                  f"other=-1).to(tl.int64)")
        self.line(f"    hit = mask & (ids == idx_{axis})")
        load = f"tl.load({src_id}_ptr + {self.offset(src.uid, skip=axis)}{src_step}, mask=hit, other=0)"
        self.line(f"    value = {self.emitter.loaded(load, src.data_type)}")
        self.line("    acc += tl.where(hit, value, 0.0)")
        self.emitter.bind(self.anchor.outputs[0].uid, "acc", "f")

    def epilogue_and_stores(self):
        made = {self.anchor.outputs[0].uid} | {t.uid for n in self.group.epilogue for t in n.output_tensors()}
        for text in masked_epilogue(self.emitter, self.group.epilogue, made, self.operands, self.offset, self.outputs):
            self.line(text)

    def arguments(self) -> list:
        x = self.anchor.inputs[0]
        args = [KernelArgument("tensor", f"{identifier}_ptr", uid) for uid, (identifier, _) in self.operands.items()]
        args.append(KernelArgument("int", "total", self.schedule.total))
        args += [KernelArgument("int", f"size_{axis}", self.dims[axis]) for axis in range(1, self.rank)]
        for uid, (identifier, strides) in self.operands.items():
            args += [KernelArgument("int", f"{identifier}_stride_{axis}", stride)
                     for axis, stride in enumerate(strides) if stride]
        if self.anchor.op == "gather":
            args.append(KernelArgument("int", "AXIS_SIZE", x.dim[self.anchor.attrs.axis]))
        else:
            args.append(KernelArgument("int", "PICKS", x.dim[self.anchor.attrs.axis]))
        args.append(KernelArgument("constexpr", "BLOCK", self.schedule.block))
        return args


def render(kernel_name: str, schedule, group, compute_type, description: str):
    """The KernelSource (name, source, arguments) of the kernel running a gather group under `schedule`."""
    writer = _GatherWriter(kernel_name, schedule, group, compute_type)
    writer.coordinates()
    if group.anchor.op == "gather":
        writer.gather()
    else:
        writer.scatter()
    writer.epilogue_and_stores()
    args = writer.arguments()
    return KernelSource(kernel_name, kernel_module(description, writer.emitter.globals, kernel_name, args,
                                                   "\n".join(writer.body) + "\n"), args)
