"""Build the launches of an attention_backward group (the derivation of attention written as
ops, fusion/attention.py): the log-sum-exp pass into a scratch buffer, then the dK/dV kernel
(where dK or dV is wanted) and the dQ kernel (where dQ is wanted), codegen/attention.py.
"""
from __future__ import annotations

from ..codegen.attention import render_chain_backward, render_lse
from ..codegen.sdpa import AttentionSpec, output_strides
from ..heuristics.layout import INT32_LIMIT
from ..heuristics.sdpa import AttentionProblem, chain_backward_schedule, chain_schedule, forced_attention
from ....runtime.launch import element_span, kernel_name, launch_of, scratch
from .sdpa import as_bhsd, dot_precision


def _swapped(strides: tuple) -> tuple:
    """[B, H, a, b] strides of a tensor read as [B, H, b, a]."""
    return strides[:2] + (strides[3], strides[2])


def _operands(roles, rank: int) -> tuple:
    """(tensors, strides) by kernel stem, in the kernels' [B, H, rows, cols] orientation."""
    tensors = {"q": roles.q, "k": roles.kt, "do": roles.d_o}
    strides = {"q": as_bhsd(roles.q, rank)[1], "k": _swapped(as_bhsd(roles.kt, rank)[1]),
               "do": as_bhsd(roles.d_o, rank)[1]}
    if roles.vt is not None:
        tensors["v"], strides["v"] = roles.vt, _swapped(as_bhsd(roles.vt, rank)[1])
    if roles.delta is not None:
        tensors["delta"], strides["delta"] = roles.delta, output_strides(roles.delta)
    for stem, tensor in roles.products().items():
        made = as_bhsd(tensor, rank)[1]
        tensors[stem], strides[stem] = tensor, _swapped(made) if stem == "dk" and roles.dk_transposed else made
    if roles.dropout is not None:
        for stem, tensor in zip(("seedt", "offt"), roles.dropout.inputs[1:]):
            if tensor is not None:
                tensors[stem], strides[stem] = tensor, ()
    return tensors, strides


def build_attention_backward(graph, group, context) -> list:
    """The kernels of an attention_backward group, for the context's target."""
    roles = group.roles
    rank = len(roles.q.dim)
    (batch, heads, s_q, s_kv), _ = as_bhsd(roles.scores.outputs[0], rank)
    head_dim, value_dim = roles.q.dim[-1], roles.d_o.dim[-1]
    tensors, strides = _operands(roles, rank)
    target, forced = context.target, forced_attention(context.options)
    problem = AttentionProblem(batch, heads, heads, s_q, s_kv, head_dim, value_dim,
                               roles.q.data_type.torch_dtype.itemsize, False, 0,
                               fma_dots=dot_precision(graph, roles.q.data_type) == "ieee")
    lse = scratch((batch, heads, s_q))
    uids = {stem: t.uid for stem, t in tensors.items()}
    uids["stats"], strides["stats"] = lse.uid, (heads * s_q, s_q, 1)
    wide = context.options.sdpa_index_64 or any(element_span(t) > INT32_LIMIT for t in tensors.values()) or \
        batch * heads * s_q * s_kv > INT32_LIMIT
    dims = {"HEADS": heads, "GROUP": 1, "SQ": s_q, "SKV": s_kv, "HEAD_DIM": head_dim, "VALUE_DIM": value_dim}
    drop = roles.dropout
    dropout = None if drop is None else (drop.attrs.p, drop.attrs.seed, drop.attrs.offset)
    precision = dot_precision(graph, roles.q.data_type)
    name = kernel_name(group)

    forward = chain_schedule(problem, target, "lse", forced)
    config = forward.config
    lse_stems = ("q", "k", "stats")
    lse_spec = AttentionSpec(dims, {s: strides[s] for s in lse_stems}, {s: uids[s] for s in lse_stems}, 1.0,
                             None, None, False, None, None,
                             (config.block_m, config.block_n, forward.block_d, forward.block_dv), wide, precision,
                             stats_only=True, head_group=forward.head_group)
    source = render_lse(name + "_lse", lse_spec, group, roles, graph.compute_data_type.triton_type,
                        "log-sum-exp pass of " + group.summary())
    launches = [launch_of(group, source, forward.programs, config.num_warps, "lse: " + forward.config_text,
                          "op-level attention backward: " + forward.reason, scratch=(lse,),
                          num_stages=config.num_stages)]

    sched = chain_backward_schedule(problem, target, forced)
    wanted = [("dkdv", ("dk", "dv")), ("dq", ("dq",))]
    for which, outputs in wanted:
        if not any(stem in tensors for stem in outputs):
            continue
        kept = {"q", "k", "v", "do", "delta", "stats", "seedt", "offt"} | set(outputs)
        config = sched.configs[which]
        spec = AttentionSpec(dims, {s: v for s, v in strides.items() if s in kept},
                             {s: v for s, v in uids.items() if s in kept}, 1.0, None, None, False, dropout, None,
                             (config.block_m, config.block_n, sched.block_d, sched.block_dv), wide, precision,
                             head_group=sched.head_group(which),
                             stored_types={stem: tensors[stem].data_type for stem in outputs if stem in tensors})
        source = render_chain_backward(f"{name}_{which}", which, spec, roles, graph.compute_data_type.triton_type,
                                       f"{which} of {group.summary()}")
        launches.append(launch_of(group, source, sched.programs(which), config.num_warps, sched.config_text(which),
                                  "op-level attention backward: " + sched.reason, num_stages=config.num_stages))
    return launches
