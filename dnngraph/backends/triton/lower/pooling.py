"""Build the launch of a pooling group: schedule, render, launch."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from ..codegen.pooling import render as render_pooling
from ..heuristics.pooling import schedule as schedule_pooling
from ....runtime.launch import kernel_name, launch_of
from .rows import at_bucket_top, require_floating_inputs


def _group_at_top(graph, group):
    """The tensors `group`'s pooling schedule reads, at the top of the bucket `graph` was
    specialised at (uids, types and everything else their own)."""
    anchor = group.anchor
    top = lambda tensors: [None if t is None else at_bucket_top(graph, t) for t in tensors]
    anchor_at_top = SimpleNamespace(op=anchor.op, attrs=anchor.attrs, inputs=top(anchor.inputs),
                                    outputs=top(anchor.outputs), input_tensors=lambda: top(anchor.input_tensors()))
    return SimpleNamespace(anchor=anchor_at_top, inputs=top(group.inputs), outputs=top(group.outputs),
                           nodes=[anchor_at_top if node is anchor else node for node in group.nodes])


def build_pooling(graph, group, context):
    """The pooling kernel of a group, scheduled for the context's target."""
    require_floating_inputs(group.anchor, group.anchor.inputs[:2])  # a max backward's int64 indices are compared
    sched = schedule_pooling(group, context.target)
    if getattr(graph, "bucket", None) is not None:  # chosen at the bucket's top, run at this size
        top = schedule_pooling(_group_at_top(graph, group), context.target)
        sched = replace(top, x_dims=sched.x_dims, y_dims=sched.y_dims, index_64=top.index_64 or sched.index_64)
    name = kernel_name(group)
    source = render_pooling(name, sched, group, graph.compute_data_type, group.summary())
    return launch_of(group, source, sched.programs, sched.config.num_warps, sched.config_text, sched.reason)
