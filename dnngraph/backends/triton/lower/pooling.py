"""Build the launch of a pooling group: schedule, render, launch."""
from __future__ import annotations

from ..codegen.pooling import render as render_pooling
from ..heuristics.pooling import schedule as schedule_pooling
from ....runtime.launch import kernel_name, launch_of
from .rows import require_floating_inputs


def build_pooling(graph, group, context):
    """The pooling kernel of a group, scheduled for the context's target."""
    require_floating_inputs(group.anchor, group.anchor.inputs[:2])  # a max backward's int64 indices are compared
    sched = schedule_pooling(group, context.target)
    name = kernel_name(group)
    source = render_pooling(name, sched, group, graph.compute_data_type, group.summary())
    return launch_of(group, source, sched.programs, sched.config.num_warps, sched.config_text, sched.reason)
