"""Build the launch of a pointwise group: schedule, render, launch."""
from __future__ import annotations

from ..codegen.emitter import blends_of
from ..codegen.pointwise import render as render_pointwise
from ..heuristics.pointwise import schedule as schedule_pointwise
from ....runtime.launch import kernel_name, launch_of


def build_pointwise(graph, group, context):
    """The pointwise kernel of a group, scheduled for the context's target."""
    sched = schedule_pointwise(group, context.target)
    description = group.summary()
    source = render_pointwise(kernel_name(group), sched, group.nodes, graph.compute_data_type, description,
                              blends_of(group.outputs))
    cfg = sched.config
    config_text = (f"BLOCK_R={cfg.block_rows} BLOCK_C={cfg.block_cols} num_warps={cfg.num_warps} "
                   f"grid={sched.programs} space={list(sched.space.sizes)}"
                   + (" int64-index" if sched.space.index_64 else ""))
    return launch_of(group, source, sched.programs, cfg.num_warps, config_text, sched.reason)
