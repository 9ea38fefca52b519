"""Build the launch of a pointwise group: schedule, render, load."""
from __future__ import annotations

from ....runtime.kernel_files import load_kernel
from ..codegen.pointwise import render as render_pointwise
from ..heuristics.pointwise import schedule as schedule_pointwise
from ....runtime.launch import KernelLaunch, kernel_name


def build_pointwise(graph, group, context):
    """The pointwise kernel of a group, scheduled for the context's target."""
    sched = schedule_pointwise(group, context.target)
    description = group.summary()
    source, arguments = render_pointwise(kernel_name(group), sched, group.nodes,
                                         graph.compute_data_type, description)
    kernel, path = load_kernel(source, kernel_name(group))
    cfg = sched.config
    config_text = (f"BLOCK_R={cfg.block_rows} BLOCK_C={cfg.block_cols} num_warps={cfg.num_warps} "
                   f"grid={sched.programs} space={list(sched.space.sizes)}"
                   + (" int64-index" if sched.space.index_64 else ""))
    return KernelLaunch(group, kernel, path, arguments, sched.programs, cfg.num_warps, config_text,
                        sched.reason)
