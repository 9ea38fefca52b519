"""Build the launch of an sdpa group: pose the problem, schedule, render, load.

A group is one sdpa node with a pointwise epilogue on o. The forward kernel is flash attention
(codegen/sdpa.py); sdpa_backward has no kernel yet and raises UnsupportedError at build.
"""
from __future__ import annotations

import math

from ..codegen.cache import load_kernel
from ..codegen.sdpa import AttentionSpec, output_strides, render
from ..errors import UnsupportedError
from ..heuristics import device_model
from ..heuristics.layout import INT32_LIMIT
from ..heuristics.sdpa import AttentionProblem, schedule
from ..ops.sdpa import kv_length
from .launch import KernelLaunch, element_span, kernel_name

ATTENTION_TYPES = ("float16", "bfloat16", "float32")


def _check_types(node):
    q, k, v = node.inputs[:3]
    names = {t.data_type.name for t in (q, k, v)}
    if len(names) != 1 or next(iter(names)) not in ATTENTION_TYPES:
        raise UnsupportedError(f"node {node.name!r} (sdpa): q, k and v must share one of {ATTENTION_TYPES}, "
                               f"got {q.data_type.name}, {k.data_type.name}, {v.data_type.name}")


def _spec(node, group, sched, stored_o: bool, stats) -> AttentionSpec:
    q, k, v, bias, len_q, len_kv, k_table, v_table = node.inputs
    o = node.outputs[0]
    present = {"q": q, "k": k, "v": v, "o": o if stored_o else None, "stats": stats, "bias": bias,
               "lenq": len_q, "lenkv": len_kv, "ktab": k_table, "vtab": v_table}
    present = {stem: t for stem, t in present.items() if t is not None}
    strides = {stem: tuple(t.stride) for stem, t in present.items()}
    if bias is not None:
        strides["bias"] = output_strides(bias)
    problem, attrs = sched.problem, node.attrs
    dims = {"HEADS": problem.heads, "GROUP": problem.heads // problem.kv_heads, "SQ": problem.s_q,
            "SKV": problem.s_kv, "HEAD_DIM": problem.head_dim, "VALUE_DIM": problem.value_dim}
    scale = attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(problem.head_dim)
    mask = attrs.mask
    wide = any(element_span(t) > INT32_LIMIT for t in present.values()) or \
        problem.batch * problem.heads * problem.s_q * problem.s_kv > INT32_LIMIT
    return AttentionSpec(dims, strides, {stem: t.uid for stem, t in present.items()}, scale, mask.left,
                         mask.right, mask.bottom_right, attrs.dropout, k.dim[2] if k_table is not None else None,
                         (sched.config.block_m, sched.config.block_n, sched.block_d, sched.block_dv), wide,
                         "ieee" if q.data_type.name == "float32" else "")


def problem_of(node) -> AttentionProblem:
    """The plain-number problem of an sdpa node (the heuristics' input)."""
    q, k, v = node.inputs[:3]
    return AttentionProblem(q.dim[0], q.dim[1], k.dim[1], q.dim[2], kv_length(k, node.inputs[6], node.attrs),
                            q.dim[3], v.dim[3], q.data_type.torch_dtype.itemsize, node.attrs.mask.banded)


def build_sdpa(graph, group, index, tuner=None, device=None, budget=None):
    """The flash-attention forward kernel of an sdpa group."""
    node = group.anchor
    if node.op != "sdpa":
        raise UnsupportedError(f"node {node.name!r} ({node.op}): no sdpa_backward kernel exists yet; "
                               f"graph.reference() computes it")
    _check_types(node)
    sched = schedule(problem_of(node), device_model(device))
    o, stats = node.outputs
    outputs = [t for t in group.outputs if t is not stats]
    stored_stats = stats if stats is not None and stats in group.outputs else None
    spec = _spec(node, group, sched, any(t is o for t in outputs), stored_stats)
    name = kernel_name(group, index)
    source, arguments = render(name, spec, group, o.uid, outputs, graph.compute_data_type.triton_type,
                               group.describe())
    kernel, path = load_kernel(source, name)
    return KernelLaunch(group, kernel, path, arguments, sched.programs, sched.config.num_warps,
                        sched.config_text, sched.reason, num_stages=sched.config.num_stages)
