"""The Gluon backend's answers for the sdpa family (backend.py dispatches here by family): which
sdpa forwards the attention kernel of attention_library.py takes, its config and model, and the
launch of one group.

Taken: the sdpa forward of fp16 or bf16 q, k, v (one type) in [B, H, S, D] with the last axis
contiguous and every other stride a multiple of 16 bytes (TMA reads them), head dims 64 and 128
(D_qk == D_v), no mask, a causal one or diagonal band bounds (a sliding window), aligned top left
or bottom right (the kernel skips the key blocks outside them); grouped-query heads (H
a multiple of H_kv); a positive attention scale (refused at lowering otherwise); o in q's type (TMA-stored) and, where the group stores
them, the float32 log-sum-exp stats (natural log, as the Triton backend stores them). Refused,
each with a reason starting "gluon": dropout, bias, padding lengths, paged K/V,
other head dims, other types, a fused epilogue on o, the backward.

The model (estimate): the flops of S = Q K^T and O = P V over the visible pairs at the rate the
kernel was measured at for the problem's shape class (MEASURED_TFLOPS: head dim and mask, as
the Triton backend's model keys its own, heuristics/sdpa.py; scaled to the target by its peak),
or the bytes of q, k, v, o moved once at its bandwidth, whichever is longer, over the wave
efficiency of the B * H * cdiv(Sq, 128) programs on the SMs:
    time = max(4 * B * H * D * visible_pairs / measured_rate, bytes / bandwidth) / wave_efficiency + LAUNCH
A problem of a class, or shorter than the sequences, never measured has no estimate (None): the
registry then ranks by preference order, where the default puts Triton first. So a default
build takes Gluon exactly where both models hold measurements and Gluon's rate is the higher.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Union

from ...errors import UnsupportedError
from ...problems import Problem
from ...problems.attention import forward_shape_class, forward_work, mask_bounds
from ...runtime.launch import KernelLaunch, launch_of
from ...target import Target
from ..contract import Candidate
from ..triton.heuristics import sdpa as sdpa_heuristics
from . import attention_codegen

TMA_ALIGNMENT = 16
IN_TYPES = {"float16": "fp16", "bfloat16": "bf16"}
HEAD_DIMS = (64, 128)
MASKS = ("none", "causal", "causal_bottom_right", "band")
PRODUCER_REGS = 40
CONSUMER_REGS = 232
BARRIER_BYTES = 1024
LOG2E = 1.4426950408889634
# operands the kernel does not read: present, the group is refused
UNTAKEN = {"bias": "an additive bias", "seq_len_q": "padding lengths (seq_len_q)",
           "seq_len_kv": "padding lengths (seq_len_kv)", "paged_attention_k_table": "paged K/V",
           "paged_attention_v_table": "paged K/V", "dropout_seed": "dropout", "dropout_offset": "dropout",
           "sink_token": "sink token", "attn_scale": "tensor attn_scale",
           "score_max": "score_max output", "score_sum_exp": "score_sum_exp output",
           **{f"{stem}_ragged_offset": "ragged (THD) operands" for stem in ("q", "k", "v", "o")},
           "block_mask": "block-sparse mask"}


# Rates of the plain schedule on an H200 (BENCHMARKS.md "Gluon attention forward", bf16; fp16
# runs the same dots), TFLOP/s over the visible pairs, by (head dim, mask): (rate, the shortest
# sequence measured, Sq and Skv; shorter ones have no estimate).
MEASURED_TFLOPS = {
    (64, "none"): (370, 2048),  # B8 H16 S2048 D64: 0.89x the Triton kernel's 413 (second run)
    (128, "none"): (566, 4096),  # B4 H32 S4096 D128: 1.20x Triton's 473 (first run, before the one-FMA scores)
    (128, "causal"): (506, 4096),  # B4 H32 S4096 causal: 1.18x Triton's 429 (GQA 32:8 502, 1.16x; S16384 605, 1.28x)
}


@dataclass(frozen=True)
class AttentionConfig:
    """BLOCK_M query rows a program (two 4-warp consumers of BLOCK_M / 2 rows), BLOCK_N keys a
    ring slot, a STAGES-deep K/V ring; pingpong: the consumers take turns issuing their wgmmas
    (attention_library.py)."""

    block_m: int
    block_n: int
    stages: int
    pingpong: bool = False

    @property
    def text(self) -> str:
        return (f"gluon warp-specialized attention {self.block_m}x{self.block_n} stages={self.stages} "
                f"consumers=2 tma-store" + (" schedule=pingpong" if self.pingpong else ""))


# head dim -> the configs offered, first preferred (the ring as deep as the shared memory allows
# beside Q). The ping-pong schedule is offered after the plain one: on an H200 it gained nothing
# at D64 and lost 4% at D128 (BENCHMARKS.md, Gluon attention forward).
CONFIGS = {64: (AttentionConfig(128, 128, 3), AttentionConfig(128, 128, 3, pingpong=True)),
           128: (AttentionConfig(128, 128, 2), AttentionConfig(128, 128, 2, pingpong=True))}


def shared_bytes(config: AttentionConfig, head_dim: int, itemsize: int) -> int:
    q = config.block_m * head_dim * itemsize
    ring = 2 * config.stages * config.block_n * head_dim * itemsize
    return q + ring + BARRIER_BYTES


def _dense(size: int, stride: int, dense: int) -> int:
    """A stride as a descriptor takes it: an axis of one element carries the dense one."""
    return stride if size > 1 else dense


def head_strides(dims: tuple, strides: tuple) -> tuple:
    """(batch, head, row) strides in elements of a [B, H, S, D] tensor (size-1 axes made dense)."""
    b, h, s, d = dims
    row = _dense(s, strides[2], d)
    return _dense(b, strides[0], h * s * row), _dense(h, strides[1], s * row), row


def _tma_legal(operand) -> Optional[str]:
    """Why `operand` ([B, H, S, D]) cannot be read or written through per-head TMA descriptors."""
    if operand.strides[3] != 1 and operand.dims[3] > 1:
        return f"its last dimension has stride {operand.strides[3]}, not 1"
    itemsize = operand.data_type.itemsize
    for name, stride in zip(("batch", "head", "row"), head_strides(operand.dims, operand.strides)):
        if stride * itemsize % TMA_ALIGNMENT:
            return f"its {name} stride ({stride} elements) is not a multiple of {TMA_ALIGNMENT} bytes"
    return None


def supports(problem: Problem) -> Union[bool, str]:
    """True where the attention kernel takes `problem` (an sdpa group; the target is checked by
    the backend), else the reason."""
    g = problem.geometry
    if g.direction != "forward":
        return f"gluon has no sdpa {g.direction} kernel (only the forward)"
    if problem.prologue or problem.epilogue or problem.exits:
        fused = ", ".join(problem.prologue + problem.epilogue + problem.exits)
        return f"gluon's attention fuses no pointwise ops (the group has {fused})"
    for role, what in UNTAKEN.items():
        if problem.operand(role) is not None:
            return f"gluon's attention takes no {what}"
    if g.dropout:
        return "gluon's attention takes no dropout"
    if g.bias:
        return "gluon's attention takes no additive bias"
    if g.alibi:
        return "gluon's attention takes no ALiBi mask"
    if g.paged:
        return "gluon's attention reads no paged K/V"
    if g.mask not in MASKS:
        return (f"gluon's attention takes no mask, a causal one or diagonal band bounds (top left or bottom "
                f"right), not a {g.mask} mask")
    q, k, v = problem.operand("q"), problem.operand("k"), problem.operand("v")
    if q is None or k is None or v is None:
        return "gluon's attention needs q, k and v"
    for operand in (q, k, v):
        if operand.data_type.name not in IN_TYPES:
            return f"gluon's attention takes float16 or bfloat16 q, k and v, not {operand.role} of {operand.data_type.name}"
        if len(operand.dims) != 4:
            return f"gluon's attention takes [B, H, S, D] operands, not {operand.role} of rank {len(operand.dims)}"
    if not (q.data_type is k.data_type is v.data_type):
        return (f"gluon's attention takes q, k and v of one type, not {q.data_type.name}, {k.data_type.name}, "
                f"{v.data_type.name}")
    if g.head_dim != g.value_dim:
        return f"gluon's attention needs the same head dim for q, k and v, not {g.head_dim} and {g.value_dim}"
    if g.head_dim not in HEAD_DIMS:
        return f"gluon's attention takes head dims {' or '.join(map(str, HEAD_DIMS))}, not {g.head_dim}"
    if g.heads % g.kv_heads:
        return f"gluon's attention needs H ({g.heads}) a multiple of H_kv ({g.kv_heads})"
    if v.dims[1] != k.dims[1]:
        return f"gluon's attention reads k and v of one head count, not {k.dims[1]} and {v.dims[1]}"
    if g.s_q < 1 or g.s_kv < 1:
        return "gluon's attention needs Sq >= 1 and Skv >= 1"
    o = problem.operand("o")
    if o is None:
        return "gluon's attention stores o: the group does not"
    if o.data_type is not q.data_type:
        return f"gluon's attention stores o in q's type ({q.data_type.name}), not {o.data_type.name}"
    for operand in (q, k, v, o):
        why = _tma_legal(operand)
        if why is not None:
            return f"gluon's attention moves {operand.role} through TMA, but {why}"
    stats = problem.operand("stats")
    if stats is not None and stats.data_type.name != "float32":
        return f"gluon's attention stores float32 stats, not {stats.data_type.name}"
    return True


def estimate(problem: Problem, config: AttentionConfig, target: Target) -> Optional[float]:
    """The model's seconds (the module docstring), None where the shape was never measured."""
    if not isinstance(config, AttentionConfig):
        return None
    shape_class = forward_shape_class(problem)
    measured = MEASURED_TFLOPS.get(shape_class)
    g = problem.geometry
    if measured is None or min(g.s_q, g.s_kv) < measured[1]:
        return None
    flops, moved = forward_work(problem)
    programs = g.batch * g.heads * -(-g.s_q // config.block_m)
    dot = IN_TYPES[problem.operand("q").data_type.name]
    return sdpa_heuristics.forward_seconds(measured[0], flops, moved, programs, dot, target)


def candidates(backend_name: str, problem: Problem, target: Target) -> list:
    """The configs of the head dim that fit the target's shared memory, in CONFIGS' order (the
    model does not tell the schedules apart)."""
    g = problem.geometry
    itemsize = problem.operand("q").data_type.itemsize
    return [Candidate(backend_name, config, estimate(problem, config, target)) for config in CONFIGS[g.head_dim]
            if shared_bytes(config, g.head_dim, itemsize) <= target.shared_memory]


def lower(graph, group, problem: Problem, context, offered: list, candidate: Optional[Candidate]) -> list:
    """One launch, grid (cdiv(Sq, BLOCK_M), B * H), of the first offered config, or of the given
    candidate's (which must be one offered)."""
    target = context.target
    if not offered:
        raise UnsupportedError(f"{problem.where}: the gluon attention ring does not fit {target.name}'s shared memory")
    chosen = offered[0]
    if candidate is not None and isinstance(candidate.config, AttentionConfig):
        matching = [c for c in offered if c.config == candidate.config]
        if not matching:
            raise UnsupportedError(f"{problem.where}: gluon config {candidate.config.text} is not one this problem "
                                   f"can run on {target.name}")
        chosen = matching[0]
    config, g = chosen.config, problem.geometry
    node = group.anchor
    q, k, v = node.inputs[:3]
    o, stats = node.outputs[:2]
    stored_stats = stats is not None and any(t is stats for t in group.outputs)
    tensors = {"q": q, "k": k, "v": v, "o": o, "stats": stats if stored_stats else None}
    uids = {stem: t.uid for stem, t in tensors.items() if t is not None}
    strides = {stem: head_strides(tuple(t.dim), tuple(t.stride)) for stem, t in tensors.items()
               if t is not None and stem != "stats"}
    if stored_stats:
        strides["stats"] = tuple(int(s) for s in stats.stride[:3])
    left, right = mask_bounds(node.attrs, g.s_q, g.s_kv)
    aligned = g.s_kv - g.s_q if node.attrs.mask.bottom_right else 0  # query i sits at row i + aligned
    # key j visible to query i: j <= i + shift (a right bound), j >= i + window_shift (a left one)
    shift = aligned + (right if right is not None else 0)
    window_shift = aligned - left + 1 if left is not None else 0
    arguments = attention_codegen.AttentionArguments(uids, strides, g.s_q, g.s_kv, g.heads, g.heads // g.kv_heads,
                                                     shift, window_shift)
    scale = node.attrs.attn_scale if node.attrs.attn_scale is not None else 1.0 / math.sqrt(g.head_dim)
    if not float(scale) > 0:  # the kernel scales the row max, not each score (attention_library.py)
        raise UnsupportedError(f"{problem.where}: gluon's attention takes a positive attention scale, not {scale}")
    constexprs = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "HEAD_DIM": g.head_dim,
                  "STAGES": config.stages, "CAUSAL": right is not None, "WINDOW": left is not None,
                  "STATS": stored_stats,
                  "QK_SCALE": float(scale) * LOG2E, "PRODUCER_REGS": PRODUCER_REGS,
                  "CONSUMER_REGS": CONSUMER_REGS, "PINGPONG": config.pingpong}
    stem = f"dnngraph_gluon_{group.kind}_{node.op}"
    source = attention_codegen.render(stem, group.summary(), arguments, constexprs)
    grid = (-(-g.s_q // config.block_m), g.batch * g.heads)
    if not target.grid_fits(grid):  # no fold of batch x heads here: the Triton kernel folds its grid
        raise UnsupportedError(f"{problem.where}: gluon attention's grid {list(grid)} exceeds {target.name}'s "
                               f"grid limits (batch x heads = {g.batch * g.heads})")
    estimate_seconds = chosen.estimate if chosen.estimate is not None else estimate(problem, config, target)
    model = "no model (shape never measured)" if estimate_seconds is None else f"model {estimate_seconds * 1e6:.1f} us"
    reason = (f"{config.text}: {model} ({grid[0] * grid[1]} programs, "
              f"mask {g.mask}{', stats' if stored_stats else ''})")
    launch = launch_of(group, source, grid, WARPS, config.text + f" grid={list(grid)}", reason)
    launch.alternative = _unaligned_fallback(graph, group, problem, context)
    if launch.alternative is None:  # an unaligned call would run the TMA kernel: let Triton take it
        raise UnsupportedError(f"{problem.where}: no pointer-load fallback for unaligned calls")
    return [launch]


def _unaligned_fallback(graph, group, problem, context) -> Optional[KernelLaunch]:
    """The launch that runs where a pointer is below 16-byte alignment (no TMA descriptor can
    take it): the Triton backend's flash kernel of the same group (one launch: no key split),
    or None where it lowers to anything else."""
    from ..triton.backend import TRITON

    options = replace(context.options, sdpa_splits=1, autotune=False)
    try:
        built = TRITON.lower(graph, group, problem, replace(context, options=options, tuner=None))
    except UnsupportedError:
        return None
    return built[0] if len(built) == 1 and not built[0].scratch else None


WARPS = 4  # the kernel's num_warps: the first consumer (the default partition); the rest are workers
