"""Build the launch of a windowed normalization group (LRN, divisive normalization)."""
from __future__ import annotations

from ....ops.lrn import window_axes
from ....runtime.launch import kernel_name, launch_of
from ..codegen.lrn import render as render_lrn
from ..heuristics.lrn import schedule as schedule_lrn
from .rows import require_floating_inputs


def build_lrn(graph, group, context):
    """The kernel of a windowed normalization group, scheduled for the context's target."""
    anchor = group.anchor
    require_floating_inputs(anchor)
    x = anchor.inputs[1] if anchor.op.endswith("_backward") else anchor.inputs[0]
    options = context.options
    sched = schedule_lrn(group, context.target, window_axes(anchor.op, len(x.dim)), options.lrn_tile_elements,
                         options.lrn_schedule, options.lrn_programs)
    source = render_lrn(kernel_name(group), sched, group, graph.compute_data_type, group.summary())
    return launch_of(group, source, sched.programs, sched.config.num_warps, sched.config_text, sched.reason,
                     num_stages=sched.stages if sched.persistent else None)
