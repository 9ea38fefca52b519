"""Build the launch of a MoE group: config, render, launch (one kernel, whatever E)."""
from __future__ import annotations

from ....errors import ExecutionError, UnsupportedError, ValidationError
from ....ops.moe import expert_ranges
from ....problems.moe import moe_problem
from ..codegen.moe import render as render_moe
from ..heuristics.matmul import choose_dot
from ..heuristics.moe import schedule
from ....runtime.launch import kernel_name, launch_of


def build_moe(graph, group, context):
    """The grouped GEMM kernel of a group (and its epilogue)."""
    geometry = moe_problem(graph, group).geometry
    anchor = group.anchor
    first, second = anchor.inputs[:2]
    if not (first.data_type.is_floating and second.data_type.is_floating):
        raise UnsupportedError(f"node {anchor.name!r} ({anchor.op}): operands must be floating, got "
                               f"{first.data_type.name} and {second.data_type.name}")
    dot = choose_dot(first.data_type.name, second.data_type.name, first.data_type.triton_type,
                     second.data_type.triton_type, geometry.allow_tf32)
    interpreted = context.target.interpreted  # the build's target picks the tiles (an H200's for CPU tensors too)
    forced = context.options.moe_config
    config = schedule(geometry.op, geometry.rows, geometry.k, geometry.n, geometry.experts, interpreted, forced,
                      fma_dots=dot.dot == "fp32")
    name = kernel_name(group)
    source = render_moe(name, config, group, geometry, graph.compute_data_type, dot, group.summary())
    columns = geometry.n // 2 if geometry.paired else geometry.n  # a pair's tile covers both halves
    tiles_n = -(-columns // config.block_n)
    if geometry.op == "moe_grouped_matmul":
        slots = -(-geometry.rows // config.block_m) + geometry.experts
        programs = slots * tiles_n
        reason = (f"{slots} row-tile slots (cdiv(T={geometry.rows}, {config.block_m}) + E={geometry.experts}: every "
                  f"expert's partial tile) x {tiles_n} N tiles; each slot finds its expert from the offsets on "
                  f"the device (no host sync, one launch); {dot.dot} dot")
        if geometry.paired:
            reason += f"; column pairs: each tile computes columns n and n + {columns} (gate and up) together"
    else:
        tiles_k = -(-geometry.k // config.block_k)
        programs = geometry.experts * tiles_k * tiles_n
        reason = (f"one program per (expert, K tile, N tile) = {geometry.experts} x {tiles_k} x {tiles_n}, each "
                  f"reducing over its expert's rows {config.block_m} at a time in order (deterministic, no "
                  f"atomics); {dot.dot} dot")
    if forced is not None:
        reason += "; config forced by BuildOptions.moe_config"
    config_text = f"{config.text()} grid={programs}"
    return launch_of(group, source, programs, config.num_warps, config_text, reason, num_stages=config.num_stages,
                     host_checks=_offset_checks(anchor, geometry.rows))


def _offset_checks(anchor, rows: int) -> tuple:
    """The check of bound offsets on the host (a graph input's; an intermediate is not written
    yet when the checks run): ExecutionError naming the node where they do not start at 0,
    decrease or pass T."""
    offsets = anchor.inputs[2]
    if offsets.producer is not None:
        return ()

    def check(tensors):
        try:
            expert_ranges(tensors[offsets.uid], rows)
        except ValidationError as error:
            raise ExecutionError(f"node {anchor.name!r} ({anchor.op}): {error}") from None
    return (check,)
