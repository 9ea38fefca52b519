"""Build the launch of a gather group: schedule, render, launch."""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.gather import render as render_gather
from ..heuristics.layout import INT32_LIMIT
from ....runtime.launch import kernel_name, launch_of

# Elements per program: a gather is two dependent loads (the id, then the table) per element;
# 1024 at 4 warps is 8 per thread, enough loads in flight without spilling.
BLOCK = 1024
NUM_WARPS = 4


@dataclass(frozen=True)
class GatherSchedule:
    y_dims: tuple
    total: int
    block: int
    index_64: bool  # some offset may pass 2^31: index math in int64


def _span(tensor) -> int:
    return sum((size - 1) * stride for size, stride in zip(tensor.dim, tensor.stride)) + 1


def schedule_gather(group) -> GatherSchedule:
    y_dims = tuple(group.anchor.outputs[0].dim)
    total = 1
    for size in y_dims:
        total *= size
    block = min(BLOCK, max(16, 1 << (total - 1).bit_length()))
    tensors = list(group.inputs) + list(group.outputs)
    index_64 = max([total] + [_span(t) for t in tensors]) > INT32_LIMIT
    return GatherSchedule(y_dims, total, block, index_64)


def build_gather(graph, group, context):
    """The gather kernel of a group (and its epilogue)."""
    sched = schedule_gather(group)
    name = kernel_name(group)
    source = render_gather(name, sched, group, graph.compute_data_type, group.summary())
    programs = -(-sched.total // sched.block)
    # a small y: fewer warps than lanes left idle
    num_warps = NUM_WARPS if sched.block >= 32 * 8 * NUM_WARPS else max(1, sched.block // 256)
    config_text = f"BLOCK={sched.block} num_warps={num_warps} grid={programs}" + (" int64-index" if sched.index_64 else "")
    anchor = group.anchor
    if anchor.op == "gather":
        reason = f"one program per {sched.block} elements of y ({sched.total}); ids checked against the table"
    else:
        picks = anchor.inputs[0].dim[anchor.attrs.axis]
        reason = (f"one program per {sched.block} elements of y ({sched.total}), each summing over its "
                  f"{picks} ids in order (deterministic, no atomics)")
    return launch_of(group, source, programs, num_warps, config_text, reason)
