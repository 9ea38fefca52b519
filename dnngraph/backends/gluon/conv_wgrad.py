"""The Gluon backend's answers for conv_wgrad groups (backend.py dispatches here by direction):
what the two kernels of conv_wgrad_library.py (wgrad_partials, wgrad_combine) take, their configs and
model, and the launches of one group.

    dw[k, r, s, c] = epilogue(sum over (n, p, q) of dy[n, p, q, k] * x[n, p*st + r*dil - pad, q*st + s*dil - pad, c])

Per tap a GEMM of rows K (filters), columns C, reduction over dy's N*P*Q pixels, split into
`splits` runs of BLOCK_H x BLOCK_W pixel rectangles so that taps x filter blocks x channel blocks x
splits units fill the machine; each unit's fp32 partial goes to a workspace [splits, taps, K, C],
and the combine adds the splits in order (deterministic: the same sum whatever the schedule), runs
the epilogue and stores dw through its own strides (any layout: pointer stores).

Taken: fp16 or bf16 dy and x (one type), 2D, groups 1, both NHWC with K and C multiples of 16
bytes (TMA boxes), the forward's strides (1, 2 through x's phase views, any stride whose taps all
lie in phase 0), padding, dilation, either mode; the matmul's epilogue ops on scalars and vectors
over dw's C; dw stored in float16, bfloat16 or float32. Refused with a reason starting "gluon":
prologues (a drelu on dy), exits, other epilogue operands, layouts and types, and a workspace
limit below one split's partials.

Non-finite x values at pixels that only dy's rectangles past P or Q reach (dy reads zeros there)
would give 0 * inf = NaN where the reference adds nothing: x is read whole per rectangle. Finite
x is exact.

Model (modeled_seconds: it orders the configs; estimate(), what the registry compares with
Triton's, is the measured wgrad rate of the shape class: heuristics/conv_measured.py): the
matmul's over taps x [K, C] x N*P*Q with the tiles' waste (filter and
channel blocks past K and C, rectangle pixels past P and Q), the tensor cores' rate scaled down for
narrow units (FULL_RATE_INTENSITY), the waves of units over the SMs, plus the combine's traffic
(the partials written and read once), its rounds of loads (COMBINE_ROUND_SECONDS) and two launches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ...errors import UnsupportedError
from ...problems import Problem
from ...runtime.launch import launch_of, scratch
from ...target import Target
from ..contract import Candidate
from ..triton.heuristics import conv_measured
from . import conv_backend, conv_codegen
from .conv_backend import (BARRIER_BYTES, CONSUMER_REGS, IN_TYPES, LAUNCH_SECONDS, OUT_TYPES, PRODUCER_REGS, WARPS,
                           _chains_why, _layout_why, _stride_why, _unaligned_fallback, _views_text, nhwc_strides,
                           phased_axes)

COMBINE_BLOCK = (64, 64)  # the combine's tile: filters x channels
MIN_RECTANGLES_PER_SPLIT = 4  # a split shorter than this spends its time filling the ring
# The combine adds a program's splits one after another, COMBINE_IN_FLIGHT loads at a time, each
# round a load's latency: with one split a round, 262 splits took 218 us on the H200 (0.83 us a
# round; ResNet-50's layer1.0.conv1 wgrad, one 64x64 dw, BENCHMARKS.md). So the splits stop at
# MAX_SPLITS: 16 rounds, about 13 us.
COMBINE_IN_FLIGHT = 4
COMBINE_ROUND_SECONDS = 0.83e-6
MAX_SPLITS = 64
UNITS_PER_SM = 2  # units wanted a SM: the last wave's imbalance halved
# flops a byte of the ring's blocks feeds (BM * BN / (BM + BN)) where the tensor cores keep their
# peak: a 128x128 unit's; a 64x64 one (32) is taken at half of it. Not measured yet: it stands for
# the shared-memory reads of the narrow wgmma, which the matmul's model does not price either
FULL_RATE_INTENSITY = 64


@dataclass(frozen=True)
class WgradConfig:
    """BLOCK_M filters by BLOCK_N channels a unit, BLOCK_H x BLOCK_W dy pixels a reduction step,
    a STAGES-deep ring, CONSUMERS 4-warp warpgroups (each BLOCK_M / CONSUMERS filters), the
    partials stored in column subtiles of EPILOGUE_N."""

    block_m: int
    block_n: int
    block_h: int
    block_w: int
    stages: int
    consumers: int
    epilogue_n: int = 64

    @property
    def block_p(self) -> int:
        return self.block_h * self.block_w

    @property
    def text(self) -> str:
        return (f"gluon warp-specialized conv wgrad {self.block_m}x{self.block_n} pixels {self.block_h}x{self.block_w} "
                f"stages={self.stages} consumers={self.consumers}")


# a consumer's dy block is 64 filters (a 128-byte swizzled row of 16-bit values, read transposed);
# 64 pixels a step (8x8: the 7x7 layers waste 15 of 64, the 56x56 ones none)
CONFIGS = (WgradConfig(128, 128, 8, 8, 4, 2), WgradConfig(64, 128, 8, 8, 6, 1), WgradConfig(128, 256, 8, 8, 3, 2),
           WgradConfig(64, 64, 8, 8, 8, 1))


def shared_bytes(config: WgradConfig, in_bytes: int) -> int:
    """The ring (a slot: the rectangle's dy block and its x block) and the barriers."""
    return config.stages * config.block_p * (config.block_m + config.block_n) * in_bytes + BARRIER_BYTES


# -- what it takes -----------------------------------------------------------------------------------

def _operands_why(problem: Problem) -> Optional[str]:
    dy, x = problem.operand("dy"), problem.operand("x")
    if dy is None or x is None:
        return "gluon needs both wgrad operands"
    for operand in (dy, x):
        if operand.data_type.name not in IN_TYPES:
            return f"gluon's convolution takes float16 or bfloat16 operands, not {operand.data_type.name}"
    if dy.data_type is not x.data_type:
        return f"gluon takes operands of one type, not {dy.data_type.name} x {x.data_type.name}"
    for name, operand, channels in (("dy", dy, "K"), ("x", x, "C")):
        why = _layout_why(name, operand.dims, operand.strides, operand.data_type.itemsize, channels)
        if why is not None:
            return why
    return None


def _output_why(problem: Problem) -> Optional[str]:
    if len(problem.outputs) != 1:
        return f"gluon stores one output, the group has {len(problem.outputs)}"
    out = problem.outputs[0]
    if out.data_type.name not in OUT_TYPES:
        return f"gluon stores float16, bfloat16 or float32, not {out.data_type.name}"
    for operand in problem.operands:
        if operand.role not in ("dy", "x") and conv_codegen.operand_form(operand.dims, out.dims) is None:
            return (f"gluon's conv epilogue reads scalars and per-channel vectors, not an operand of shape "
                    f"{list(operand.dims)}")
    return None


def supports(problem: Problem) -> Union[bool, str]:
    g = problem.geometry
    if g.groups != 1:
        return f"gluon's convolution takes groups 1, not {g.groups}"
    if len(g.filter) != 2:
        return f"gluon's convolution takes 2D convolutions, not {len(g.filter)}D"
    why = _stride_why(problem) or _chains_why(problem) or _operands_why(problem) or _output_why(problem)
    return True if why is None else why


# -- the split and the model -------------------------------------------------------------------------

def _blocks(problem: Problem, config: WgradConfig) -> tuple:
    """(taps, filter blocks, channel blocks, dy's pixel rectangles)."""
    g = problem.geometry
    p, q = g.output_spatial
    rectangles = g.n * -(-p // config.block_h) * -(-q // config.block_w)
    return g.filter[0] * g.filter[1], -(-g.k // config.block_m), -(-g.c // config.block_n), rectangles


def split_of(problem: Problem, config: WgradConfig, target: Target, max_bytes: Optional[int] = None) -> tuple:
    """(splits, rectangles a split): enough units for UNITS_PER_SM a SM, each split at least
    MIN_RECTANGLES_PER_SPLIT long, MAX_SPLITS at most, the partials within `max_bytes` (None: no
    limit); every split
    holds one rectangle at least (its count is recomputed from the run length)."""
    taps, tiles_m, tiles_n, rectangles = _blocks(problem, config)
    units = taps * tiles_m * tiles_n
    wanted = max(1, min(-(-UNITS_PER_SM * target.sms // units), rectangles // MIN_RECTANGLES_PER_SPLIT, MAX_SPLITS))
    if max_bytes is not None:
        wanted = max(1, min(wanted, max_bytes // max(1, partial_bytes(problem, 1))))
    per_split = -(-rectangles // wanted)
    return -(-rectangles // per_split), per_split


def partial_bytes(problem: Problem, splits: int) -> int:
    """The workspace of `splits` partials: fp32 [splits, taps, K, C]."""
    g = problem.geometry
    return splits * g.filter[0] * g.filter[1] * g.k * g.c * 4


def modeled_seconds(problem: Problem, config: WgradConfig, target: Target) -> Optional[float]:
    """The config model's seconds (module docstring): it orders the configs."""
    if not isinstance(config, WgradConfig):
        return None
    g = problem.geometry
    taps, tiles_m, tiles_n, rectangles = _blocks(problem, config)
    splits, _ = split_of(problem, config, target)
    pixels = g.n * g.output_spatial[0] * g.output_spatial[1]
    use = (g.k * g.c / (tiles_m * config.block_m * tiles_n * config.block_n)) * (pixels / (rectangles * config.block_p))
    units = taps * tiles_m * tiles_n * splits
    efficiency = units / (-(-units // target.sms) * target.sms)
    rate = min(1.0, config.block_m * config.block_n / (config.block_m + config.block_n) / FULL_RATE_INTENSITY)
    peak = target.peak(IN_TYPES[problem.operand("dy").data_type.name]) * rate
    compute = 2.0 * taps * g.k * g.c * pixels / peak / use
    reads = (problem.operand("dy").numel + problem.operand("x").numel) * problem.operand("dy").data_type.itemsize
    combine = ((2 * partial_bytes(problem, splits) + problem.outputs[0].numel * 4) / target.bandwidth
               + -(-splits // COMBINE_IN_FLIGHT) * COMBINE_ROUND_SECONDS)
    return max(compute, reads / target.bandwidth) / efficiency + combine + 2 * LAUNCH_SECONDS


def _fitting(problem: Problem, target: Target, configs: Optional[tuple] = None) -> list:
    in_bytes = problem.operand("dy").data_type.itemsize
    return [c for c in (CONFIGS if configs is None else configs) if shared_bytes(c, in_bytes) <= target.shared_memory]


def estimate(problem: Problem, config: WgradConfig, target: Target) -> Optional[float]:
    """Seconds the registry compares with Triton's: the measured wgrad rate of the problem's shape
    class (heuristics/conv_measured.py) for the model's best config, the others in their model's
    ratio to it; None outside the measured classes and sizes."""
    measured = conv_measured.measured_seconds(conv_backend.MEASURED_AS, problem, target)
    modeled = modeled_seconds(problem, config, target)
    if measured is None or modeled is None:
        return None
    best = min([modeled_seconds(problem, c, target) for c in _fitting(problem, target)], default=modeled)
    return conv_measured.calibrated(modeled, min(best, modeled), measured)


def candidates(backend_name: str, problem: Problem, target: Target, configs: Optional[tuple] = None) -> list:
    """The configs of `configs` (None: CONFIGS) that fit the target's shared memory, best first by
    the model (ties: the order given), each with its estimate()."""
    fitting = _fitting(problem, target, configs)
    modeled = [modeled_seconds(problem, c, target) for c in fitting]
    order = sorted(range(len(fitting)), key=lambda i: (modeled[i], i))
    return [Candidate(backend_name, fitting[i], estimate(problem, fitting[i], target)) for i in order]


# -- the launches --------------------------------------------------------------------------------------

def _chosen(problem: Problem, target: Target, offered: list, candidate: Optional[Candidate]) -> WgradConfig:
    if candidate is None or not isinstance(candidate.config, WgradConfig):
        if not offered:
            raise UnsupportedError(f"{problem.where}: no gluon wgrad config fits {target.name}'s shared memory")
        return offered[0].config
    config = candidate.config
    if (shared_bytes(config, problem.operand("dy").data_type.itemsize) > target.shared_memory
            or config.block_m % (64 * config.consumers) or config.block_n % config.epilogue_n):
        raise UnsupportedError(f"{problem.where}: gluon config {config.text} is not one this problem can run on "
                               f"{target.name} (its shared memory or its blocks)")
    return config


def _budgeted_split(problem: Problem, config: WgradConfig, context) -> tuple:
    """(splits, rectangles a split) within the context's workspace budget (lower spends it once
    the launches are made)."""
    budget = context.budget
    limit = None if budget is None or budget.limit is None else budget.limit - budget.spent
    splits, per_split = split_of(problem, config, context.target, limit)
    nbytes = partial_bytes(problem, splits)
    if budget is not None and not budget.allows(nbytes):
        raise UnsupportedError(f"{problem.where}: gluon's wgrad partials ({nbytes} bytes) exceed the workspace limit")
    return splits, per_split


def lower(graph, group, problem: Problem, context, offered: list, candidate: Optional[Candidate]) -> list:
    """Two launches: the partials (persistent: grid = min(units, SMs)), then the combine (a
    program a tap x filter block x channel block)."""
    target = context.target
    config = _chosen(problem, target, offered, candidate)
    g = problem.geometry
    node = group.anchor
    dy, x = node.inputs[:2]
    out = group.outputs[0]
    splits, per_split = _budgeted_split(problem, config, context)
    partials = scratch((splits, g.filter[0] * g.filter[1], g.k, g.c))
    phased = phased_axes(problem)
    _, (x_n, x_h, x_w) = nhwc_strides(tuple(x.dim), tuple(x.stride))
    _, (dy_n, dy_h, dy_w) = nhwc_strides(tuple(dy.dim), tuple(dy.stride))
    (rows, cols), (p, q) = g.input_spatial, g.output_spatial
    sizes = {"images": g.n, "x_rows": rows, "x_cols": cols, "channels": g.c, "x_stride_n": x_n, "x_stride_h": x_h,
             "x_stride_w": x_w, "filters": g.k, "dy_stride_n": dy_n, "dy_stride_h": dy_h, "dy_stride_w": dy_w,
             "taps_h": g.filter[0], "taps_w": g.filter[1], "out_h": p, "out_w": q, "pad_h": g.padding[0],
             "pad_w": g.padding[1], "dil_h": g.dilation[0], "dil_w": g.dilation[1], "splits": splits,
             "per_split": per_split}
    constexprs = {"BLOCK_H": config.block_h, "BLOCK_W": config.block_w, "BLOCK_M": config.block_m,
                  "BLOCK_N": config.block_n, "STAGES": config.stages, "CONSUMERS": config.consumers,
                  "EPILOGUE_N": config.epilogue_n, "PRODUCER_REGS": PRODUCER_REGS, "CONSUMER_REGS": CONSUMER_REGS,
                  "STRIDE_H": g.stride[0], "STRIDE_W": g.stride[1], "PHASED_H": phased[0], "PHASED_W": phased[1]}
    stem = f"dnngraph_gluon_{group.kind}_{node.op}"
    taps, tiles_m, tiles_n, _ = _blocks(problem, config)
    units = splits * taps * tiles_m * tiles_n
    programs = max(1, min(units, target.sms))
    source = conv_codegen.render_wgrad_partials(stem, group.summary(), (dy.uid, x.uid, partials.uid), sizes,
                                                constexprs)
    reason = (f"{config.text}: model {modeled_seconds(problem, config, target) * 1e6:.1f} us ({units} units: {splits} "
              f"pixel splits of {per_split} rectangles, on {programs} persistent programs"
              f"{_views_text(g.stride, phased)})")
    first = launch_of(group, source, (programs,), WARPS, config.text + f" splits={splits} grid={programs}", reason,
                      scratch=[partials])
    second = _combine_launch(group, problem, node, out, partials.uid, splits, stem)
    # an unaligned call runs the Triton backend's whole wgrad in place of each launch: dw written
    # twice alike (no blended output reaches here: the backend refuses them), the partials unused
    first.alternative = second.alternative = _unaligned_fallback(graph, group, problem, context)
    if first.alternative is None:
        raise UnsupportedError(f"{problem.where}: no pointer-load fallback for unaligned calls")
    if context.budget is not None:
        context.budget.spend(partials.nbytes)
    return [first, second]


def _combine_launch(group, problem: Problem, node, out, partials_uid: int, splits: int, stem: str):
    g = problem.geometry
    dw_k, dw_c, dw_r, dw_s = (int(s) for s in out.stride)
    sizes = {"filters": g.k, "channels": g.c, "taps_h": g.filter[0], "taps_w": g.filter[1], "splits": splits,
             "dw_stride_k": dw_k, "dw_stride_c": dw_c, "dw_stride_r": dw_r, "dw_stride_s": dw_s}
    block_m, block_n = COMBINE_BLOCK
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "FLIP": node.attrs.mode == "convolution"}
    source = conv_codegen.render_wgrad_combine(stem + "_combine", group.summary(), (partials_uid, out.uid), sizes,
                                               node.outputs[0], tuple(group.epilogue), tuple(out.dim), constexprs,
                                               problem.fast_math)
    programs = g.filter[0] * g.filter[1] * -(-g.k // block_m) * -(-g.c // block_n)
    return launch_of(group, source, (programs,), WARPS, f"wgrad combine {block_m}x{block_n} grid={programs}",
                     f"adds the {splits} pixel splits' partials in order (deterministic), the epilogue, dw stored")
