"""Build the launches of an sdpa group: pose the problem, schedule, render, launch.

A forward group is one sdpa node with a pointwise epilogue on o: one flash-attention kernel. A
backward group is one sdpa_backward node: the delta preprocess (when the workspace allows its
B x H x Sq floats; otherwise the row sums are taken inside the other two), the dK/dV kernel, the
dQ kernel, and the dbias kernel when compute_dbias (codegen/sdpa.py).
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

from ..codegen.sdpa import RAGGED_STEMS, AttentionSpec, ScoreModifier, output_strides, render, render_backward, render_combine
from ....errors import UnsupportedError
from ....fusion.patterns import ATTENTION_TYPES, chain_dropout, score_ops
from ..heuristics.layout import INT32_LIMIT
from ..heuristics.sdpa import (COMBINE_ROWS, AttentionProblem, backward_schedule, chain_schedule, forced_attention,
                               schedule)
from .... import ragged
from ....ops.sdpa import BACKWARD_BLOCK_MASK, FORWARD_BLOCK_MASK, AttentionMask, block_mask_of, kv_length, ragged_slots, slot_length
from ....tensor import span
from ....runtime.launch import element_span, kernel_name, launch_of, scratch
from .rows import at_bucket_top


def _check_types(node):
    q, k, v = node.inputs[:3]
    names = {t.data_type.name for t in (q, k, v)}
    if len(names) != 1 or next(iter(names)) not in ATTENTION_TYPES:
        raise UnsupportedError(f"node {node.name!r} (sdpa): q, k and v must share one of {ATTENTION_TYPES}, "
                               f"got {q.data_type.name}, {k.data_type.name}, {v.data_type.name}")


def dot_precision(graph, data_type) -> str:
    """tl.dot input_precision of fp32 operands: IEEE unless the graph allows tf32; "" for 16-bit."""
    if data_type.name != "float32":
        return ""
    return "tf32" if graph.allow_tf32 else "ieee"


SCALARS = ("seedt", "offt", "scale")  # one-element tensors read through their pointer alone
# ragged offsets ([B + 1] ints), read through their pointer alone too
POINTERS = SCALARS + tuple(RAGGED_STEMS.values())


def _spec(graph, node, group, sched, stored_o: bool, stored: dict, index_64: bool) -> AttentionSpec:
    """`stored`: the row outputs the group stores by stem (stats, smax, ssum)."""
    q, k, v, bias, len_q, len_kv, k_table, v_table, seed, offset, sink, scale_t = node.inputs[:12]
    q_off, k_off, v_off, o_off = node.inputs[12:16]
    o = node.outputs[0]
    present = {"q": q, "k": k, "v": v, "o": o if stored_o else None, "bias": bias,
               "lenq": len_q, "lenkv": len_kv, "ktab": k_table, "vtab": v_table, "seedt": seed, "offt": offset,
               "sink": sink, "scale": scale_t, **stored, "qrag": q_off, "krag": k_off, "vrag": v_off,
               "orag": o_off if stored_o else None, "bmask": block_mask_of(node.inputs, FORWARD_BLOCK_MASK)}
    present = {stem: t for stem, t in present.items() if t is not None}
    strides = {stem: () if stem in POINTERS else tuple(t.stride) for stem, t in present.items()}
    for stem in ("bias", "bmask"):  # 0 on the axes they broadcast over
        if stem in present:
            strides[stem] = output_strides(present[stem])
    problem, attrs = sched.problem, node.attrs
    dims = {**head_dims(node, problem), "SQ": problem.s_q,
            "SKV": problem.s_kv, "HEAD_DIM": problem.head_dim, "VALUE_DIM": problem.value_dim}
    if k_table is not None:
        dims["PAGES"] = k.dim[0]  # the pools' page count (k and v hold as many)
    scale = attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(problem.head_dim)
    mask = kernel_mask(node, problem.s_q, problem.s_kv)
    wide = index_64 or any(element_span(t) > INT32_LIMIT for t in present.values()) or \
        problem.batch * problem.heads * problem.s_q * problem.s_kv > INT32_LIMIT
    return AttentionSpec(dims, strides, {stem: t.uid for stem, t in present.items()}, scale, mask.left,
                         mask.right, mask.bottom_right, attrs.dropout, k.dim[2] if k_table is not None else None,
                         (sched.config.block_m, sched.config.block_n, sched.block_d, sched.block_dv), wide,
                         dot_precision(graph, q.data_type), sched.packed, sched.splits, sched.chunk,
                         head_group=sched.head_group, alibi=attrs.use_alibi_mask)


def head_dims(node, problem) -> dict:
    """HEADS, GROUP (query heads per k head), GROUP_V (per v head, where v has its own head
    count) and, with a block mask, its block size MASK_M x MASK_N."""
    k_heads, v_heads = node.inputs[1].dim[1], node.inputs[2].dim[1]
    dims = {"HEADS": problem.heads, "GROUP": problem.heads // k_heads}
    if v_heads != k_heads:
        dims["GROUP_V"] = problem.heads // v_heads
    index = FORWARD_BLOCK_MASK if node.op == "sdpa" else BACKWARD_BLOCK_MASK
    if block_mask_of(node.inputs, index) is not None:
        dims["MASK_M"], dims["MASK_N"] = node.attrs.block_mask_size
    return dims


def kernel_mask(node, s_q: int, s_kv: int) -> AttentionMask:
    """The node's mask with every bound of Sq + Skv or more dropped. With lengths in [0, S],
    j - i' and i' - j never reach Sq + Skv, so such a bound masks nothing; kept, a bound near
    2^31 wraps the kernels' int32 key-range arithmetic (`last_pos + 1 + shift + right`) and
    every key block is skipped."""
    mask, reach = node.attrs.mask, s_q + s_kv

    def kept(bound):
        return None if bound is None or bound >= reach else bound

    return AttentionMask(kept(mask.left), kept(mask.right), mask.bottom_right)


def problem_of(node, fma_dots: bool = False) -> AttentionProblem:
    """The plain-number problem of an sdpa node (the heuristics' input); `fma_dots` where its
    dots are IEEE fp32 (dot_precision)."""
    q, k, v = node.inputs[:3]
    k_table = node.inputs[node.opdef.input_names.index("paged_attention_k_table")]
    bias = node.inputs[node.opdef.input_names.index("bias")]
    s_kv = kv_length(k, k_table, node.attrs)
    mask = kernel_mask(node, q.dim[2], s_kv)
    return AttentionProblem(q.dim[0], q.dim[1], k.dim[1], q.dim[2], s_kv, q.dim[3], v.dim[3],
                            q.data_type.torch_dtype.itemsize, mask.banded,
                            bias.data_type.torch_dtype.itemsize if bias is not None else 0,
                            mask.right is not None and mask.left is None,
                            v.dim[1] if v.dim[1] != k.dim[1] else 0, fma_dots)


def _node_at_top(graph, node):
    """`node` with its operands at the top of the bucket `graph` was specialised at (what
    problem_of reads)."""
    return SimpleNamespace(inputs=[None if t is None else at_bucket_top(graph, t) for t in node.inputs],
                           opdef=node.opdef, attrs=node.attrs)


def build_sdpa(graph, group, context):
    """The flash-attention kernels of an sdpa or sdpa_backward group, for the context's target;
    the first carries the host checks of the group's ragged offsets (run before any launch)."""
    built = _build_sdpa(graph, group, context)
    launches = built if isinstance(built, list) else [built]
    launches[0].host_checks += ragged_host_checks(group.anchor)
    return built


def ragged_host_checks(node) -> tuple:
    """The check of each ragged operand's offsets and lengths (ragged.check_offsets) where they are
    host memory, run by run_launches before any launch of the plan on every path (execute, its
    repeated-binding path, as_function, profile). Offsets in GPU memory are not read back (that
    would wait for the device at every execute): there the kernels trust them."""
    found = [(tensor, node.inputs[index], slot_length(node, index)) for tensor, index in ragged_slots(node)
             if node.inputs[index] is not None]
    if not found:
        return ()

    def check(tensors):
        for tensor, offsets, lengths in found:
            bound_offsets, bound_lengths = tensors[offsets.uid], tensors[lengths.uid]
            if bound_offsets.device.type != "cpu" or bound_lengths.device.type != "cpu":
                continue
            value = tensors[tensor.uid]
            ragged.check_offsets(tensor.name, bound_offsets, bound_lengths, tuple(tensor.dim), value.stride(),
                                 span(value.shape, value.stride()))
    return (check,)


def _build_sdpa(graph, group, context):
    node, budget = group.anchor, context.budget
    _check_types(node)
    if node.op == "sdpa_backward":
        return _build_backward(graph, group, context)
    fma_dots = dot_precision(graph, node.inputs[0].data_type) == "ieee"
    problem = problem_of(node, fma_dots)
    forced = forced_attention(context.options)
    o, stats, score_max, score_sum = node.outputs
    sink = node.inputs[node.opdef.input_names.index("sink_token")]
    ragged = any(t is not None for t in node.inputs[12:16])
    if sink is not None or score_max is not None or score_sum is not None or ragged:
        # the sink and the keys' row max and sum are taken once a program has seen every key:
        # no key splits (whose combine would have to merge them); the combine writes o densely
        forced = dataclasses.replace(forced, splits=1)
    budget_bytes = None if budget is None or budget.limit is None else budget.limit - budget.spent
    sched = schedule(problem, context.target, budget_bytes, forced)
    if sched.packed and getattr(graph, "bucket", None) is not None:
        # decode key splits counted at the bucket's top (SPLITS and CHUNK are constexprs): a
        # split past this size's keys sees none, stores an empty partial the combine weighs 0
        top = schedule(problem_of(_node_at_top(graph, node), fma_dots), context.target, budget_bytes, forced)
        sched = dataclasses.replace(top, problem=problem)
    if sched.packed and forced.splits == 1 and forced_attention(context.options).splits != 1:
        why = "a ragged operand is read and written through its offsets" if ragged else \
            "the sink token and the score outputs are taken once every key is seen"
        sched = dataclasses.replace(sched, reason=sched.reason + f" (one split: {why})")
    rows = {"stats": stats, "smax": score_max, "ssum": score_sum}
    stored = {stem: t for stem, t in rows.items() if t is not None and any(t is u for u in group.outputs)}
    outputs = [t for t in group.outputs if all(t is not r for r in rows.values())]
    spec = _spec(graph, node, group, sched, any(t is o for t in outputs), stored, context.options.sdpa_index_64)
    name = kernel_name(group)
    if sched.splits > 1:
        return _build_split(graph, group, name, spec, sched, budget, outputs)
    source = render(name, spec, group, o.uid, outputs, graph.compute_data_type.triton_type, group.summary())
    return launch_of(group, source, sched.programs, sched.config.num_warps, sched.config_text, sched.reason,
                     num_stages=sched.config.num_stages)


def _build_split(graph, group, name, spec, sched, budget, outputs) -> list:
    """A split decode: the key-split kernel writes partials to the workspace, the combine kernel
    merges them into o (and its epilogue) and the stats."""
    problem, o_uid = sched.problem, group.anchor.outputs[0].uid
    rows = problem.batch * problem.heads * problem.s_q
    o_part, l_part = scratch((rows * sched.splits, sched.block_dv)), scratch((rows * sched.splits,))
    if budget is not None:
        budget.spend(sched.partial_bytes)
    reason = sched.reason + ("" if budget is None else "; " + budget.describe(sched.partial_bytes))
    parts = {"opart": o_part.uid, "lpart": l_part.uid}
    split_uids = {k: v for k, v in spec.uids.items() if k not in ("o", "stats")}
    split_spec = dataclasses.replace(spec, uids={**split_uids, **parts},
                                     strides={**spec.strides, "opart": (), "lpart": ()})
    source = render(name + "_split", split_spec, group, o_uid, [], graph.compute_data_type.triton_type,
                    group.summary())
    split = launch_of(group, source, sched.programs, sched.config.num_warps, sched.config_text, reason,
                      scratch=(o_part, l_part), num_stages=sched.config.num_stages)
    combine_uids = {k: v for k, v in spec.uids.items() if k in ("o", "stats", "lenq")}
    combine_spec = dataclasses.replace(spec, uids={**combine_uids, **parts}, dims={**spec.dims, "ROWS": rows},
                                       strides={**spec.strides, "opart": (), "lpart": ()})
    source = render_combine(name + "_combine", combine_spec, group, o_uid, outputs,
                            graph.compute_data_type.triton_type, COMBINE_ROWS, "combine of " + group.summary())
    programs = -(-rows // COMBINE_ROWS)
    combine = launch_of(group, source, programs, 4, f"combine: BLOCK_R={COMBINE_ROWS} "
                        f"SPLITS={sched.splits} grid=[{programs}]", reason)
    return [split, combine]


GRADIENTS = ("dq", "dk", "dv", "dbias", "dsink")  # the stems a backward kernel stores
READS = ("qrag", "krag", "vrag", "orag", "dorag")  # the ragged offsets of the operands every kernel may read
BACKWARD_STEMS = {"delta": ("o", "do", "delta", "lenq", "lenkv", "orag", "dorag"),
                  "dkdv": ("q", "k", "v", "do", "o", "stats", "delta", "bias", "lenq", "lenkv", "dk", "dv", "seedt",
                           "offt", "scale", "bmask") + READS + ("dkrag", "dvrag"),
                  "dq": ("q", "k", "v", "do", "o", "stats", "delta", "bias", "lenq", "lenkv", "dq", "seedt", "offt",
                         "scale", "bmask") + READS + ("dqrag",),
                  "dbias": ("q", "k", "v", "do", "o", "stats", "delta", "bias", "lenq", "lenkv", "dbias", "seedt",
                            "offt", "scale", "bmask") + READS,
                  "dsink": ("o", "do", "stats", "lenq", "sink", "dsink", "orag", "dorag")}
DSINK_ROWS = 64  # query rows per step of the dsink kernel's walk


# where k and v have their own head counts, dK and dV each have a kernel of the dK/dV kernel's
# tiles, over the heads of their own operand (dV's does not read v)
SPLIT_HEADS = {"dk": ("dkdv", ("dv",)), "dv": ("dkdv", ("dk", "v"))}


def _backward_spec(graph, node, sched, which: str, delta, index_64: bool) -> AttentionSpec:
    q, k, v, o, d_o, stats, bias, len_q, len_kv = node.inputs[:9]
    seed, offset, sink, scale_t = node.inputs[11:15]
    dq, dk, dv, dbias, dsink = node.outputs
    tensors = {"q": q, "k": k, "v": v, "o": o, "do": d_o, "stats": stats, "bias": bias, "lenq": len_q,
               "lenkv": len_kv, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias, "seedt": seed, "offt": offset,
               "sink": sink, "scale": scale_t, "dsink": dsink,
               "bmask": block_mask_of(node.inputs, BACKWARD_BLOCK_MASK),
               **dict(zip(("qrag", "krag", "vrag", "orag", "dorag", "dqrag", "dkrag", "dvrag"), node.inputs[15:23]))}
    kernel, left_out = SPLIT_HEADS.get(which, (which, ()))
    present = {stem: tensors[stem] for stem in BACKWARD_STEMS[kernel]
               if tensors.get(stem) is not None and stem not in left_out}
    which = kernel
    strides = {stem: () if stem in POINTERS else tuple(t.stride) for stem, t in present.items()}
    uids = {stem: t.uid for stem, t in present.items()}
    for stem in ("bias", "bmask"):  # 0 on the axes they broadcast over
        if stem in present:
            strides[stem] = output_strides(present[stem])
    if delta is not None and "delta" in BACKWARD_STEMS[which]:
        problem = sched.problem
        strides["delta"], uids["delta"] = (problem.heads * problem.s_q, problem.s_q, 1), delta.uid
    problem, attrs, config = sched.problem, node.attrs, sched.configs[which if which != "dsink" else "dq"]
    dims = {**head_dims(node, problem), "SQ": problem.s_q,
            "SKV": problem.s_kv, "HEAD_DIM": problem.head_dim, "VALUE_DIM": problem.value_dim}
    if which == "dbias":
        dims.update(BATCH=problem.batch, BIAS_HEADS=sched.bias_dims[1])
    if which == "dsink":
        dims.update(BATCH=problem.batch)
    scale = attrs.attn_scale if attrs.attn_scale is not None else 1.0 / math.sqrt(problem.head_dim)
    wide = index_64 or any(element_span(t) > INT32_LIMIT for t in present.values()) or \
        problem.batch * problem.heads * problem.s_q * problem.s_kv > INT32_LIMIT
    mask = kernel_mask(node, problem.s_q, problem.s_kv)
    block_m = DSINK_ROWS if which == "dsink" else config.block_m
    return AttentionSpec(dims, strides, uids, scale, mask.left, mask.right, mask.bottom_right, attrs.dropout,
                         None, (block_m, config.block_n, sched.block_d, sched.block_dv), wide,
                         dot_precision(graph, q.data_type),
                         bias_dims=sched.bias_dims if which == "dbias" else (),
                         head_group=0 if which == "dsink" else sched.head_group(which),
                         folded_grid=which != "dsink" and sched.folds(which),
                         stored_types={stem: t.data_type for stem, t in present.items() if stem in GRADIENTS},
                         alibi=attrs.use_alibi_mask)


def _build_backward(graph, group, context) -> list:
    node, budget = group.anchor, context.budget
    bias, dbias = node.inputs[6], node.outputs[3]
    fma_dots = dot_precision(graph, node.inputs[0].data_type) == "ieee"
    sched = backward_schedule(problem_of(node, fma_dots), context.target, tuple(bias.dim) if dbias is not None else (),
                              forced_attention(context.options))
    problem = sched.problem
    delta_bytes = problem.batch * problem.heads * problem.s_q * 4
    delta = None
    if budget is None or budget.allows(delta_bytes):
        delta = scratch((problem.batch, problem.heads, problem.s_q))
        if budget is not None:
            budget.spend(delta_bytes)
    launches = []
    dsink = node.outputs[4]
    key_kernels = ("dk", "dv") if problem.v_heads else ("dkdv",)
    kernels = (("delta",) if delta is not None else ()) + key_kernels + ("dq",) + (("dbias",) if dbias is not None else ())
    schedules = {"dv": _v_heads_schedule(sched, context, forced_attention(context.options))} if problem.v_heads else {}
    for which in kernels + (("dsink",) if dsink is not None else ()):
        kernel_sched = schedules.get(which, sched)
        spec = _backward_spec(graph, node, kernel_sched, which, delta, context.options.sdpa_index_64)
        name = f"{kernel_name(group)}_{which}"
        source = render_backward(name, SPLIT_HEADS.get(which, (which,))[0], spec, graph.compute_data_type.triton_type,
                                 f"{which} of {group.summary()}")
        reason = sched.reason + ("" if delta is not None else "; delta inline (no workspace for "
                                 f"{delta_bytes} bytes)")
        if which == "dsink":  # a program per query head walks its (batch, row) pairs: no atomics
            launches.append(launch_of(group, source, (problem.heads,), 4,
                                      f"dsink: BLOCK_M={DSINK_ROWS} grid=[{problem.heads}]", reason))
            continue
        kernel = SPLIT_HEADS.get(which, (which,))[0]
        config = kernel_sched.configs[kernel]
        launches.append(launch_of(group, source, kernel_sched.programs(kernel), config.num_warps,
                                  kernel_sched.config_text(kernel), reason,
                                  scratch=(delta,) if which == "delta" else (), num_stages=config.num_stages))
    return launches


def _v_heads_schedule(sched, context, forced):
    """The schedule of the dV kernel where v has its own head count: the dK/dV tiles over
    (batch, v head) programs."""
    problem = dataclasses.replace(sched.problem, kv_heads=sched.problem.v_heads)
    bias_dims = sched.bias_dims
    return dataclasses.replace(backward_schedule(problem, context.target, bias_dims, forced), configs=sched.configs)


def as_bhsd(tensor, rank: int) -> tuple:
    """(dims, strides) of a rank-3 or rank-4 operand as [B, H, rows, cols], 0 on broadcast axes."""
    pad = 4 - rank
    dims = (1,) * pad + tuple(tensor.dim)
    strides = (0,) * pad + tuple(tensor.stride)
    return dims, tuple(0 if d == 1 else st for d, st in zip(dims, strides))


def build_attention(graph, group, context):
    """The flash kernel of an op-level chain matmul(q, k^T) -> score ops -> softmax -> matmul(., v):
    the score ops become the kernel's score modifier (codegen ScoreModifier)."""
    first, second = group.nodes[0], group.nodes[-1]
    q, kt, v, o = first.inputs[0], first.inputs[1], second.inputs[1], second.outputs[0]
    rank = len(q.dim)
    (qb, qh, s_q, d), q_strides = as_bhsd(q, rank)
    (kb, kh, _, s_kv), kt_strides = as_bhsd(kt, rank)
    (vb, vh, _, dv), v_strides = as_bhsd(v, rank)
    (ob, oh, _, _), o_strides = as_bhsd(o, rank)
    modifier = ScoreModifier(first.outputs[0].uid, score_ops(group.nodes))
    dropout = chain_dropout(group.nodes)
    side_bytes = sum(t.data_type.torch_dtype.itemsize for t in modifier.sides)
    problem = AttentionProblem(ob, oh, oh, s_q, s_kv, d, dv, q.data_type.torch_dtype.itemsize, False, side_bytes,
                               fma_dots=dot_precision(graph, q.data_type) == "ieee")
    sched = chain_schedule(problem, context.target, forced=forced_attention(context.options))  # one query head per K/V head: no packing
    dims = {"HEADS": oh, "GROUP": 1, "SQ": s_q, "SKV": s_kv, "HEAD_DIM": d, "VALUE_DIM": dv}
    # k^T [.., D, Skv]: the kernel's k strides are (batch, head, key, dim)
    strides = {"q": q_strides, "k": (kt_strides[0], kt_strides[1], kt_strides[3], kt_strides[2]),
               "v": v_strides, "o": o_strides}
    present = {"q": q, "k": kt, "v": v, "o": o}
    if dropout is not None:
        drop = dropout.attrs
        present.update({stem: t for stem, t in zip(("seedt", "offt"), dropout.inputs[1:]) if t is not None})
        strides.update({stem: () for stem in ("seedt", "offt") if stem in present})
    wide = context.options.sdpa_index_64 or any(element_span(t) > INT32_LIMIT for t in present.values()) or \
        ob * oh * s_q * s_kv > INT32_LIMIT
    config = sched.config
    spec = AttentionSpec(dims, strides, {stem: t.uid for stem, t in present.items()}, 1.0, None, None, False,
                         None if dropout is None else (drop.p, drop.seed, drop.offset),
                         None, (config.block_m, config.block_n, sched.block_d, sched.block_dv), wide,
                         dot_precision(graph, q.data_type), sched.packed, 1, sched.chunk, head_group=sched.head_group)
    for side in modifier.sides:
        if len(side.dim) > rank:
            raise UnsupportedError(f"attention chain side operand {side.name!r} has rank {len(side.dim)}")
    name = kernel_name(group)
    source = render(name, spec, group, o.uid, [o], graph.compute_data_type.triton_type, group.summary(), modifier)
    return launch_of(group, source, sched.programs, config.num_warps, sched.config_text,
                     "op-level attention chain: " + sched.reason, num_stages=config.num_stages)
