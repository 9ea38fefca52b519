"""Convolution configs: implicit-GEMM candidates per problem, ranked by the matmul model.

fprop per group is a GEMM of M = N * output pixels, N = filters per group and K = taps x
channels per group, walked tap by tap in BLOCK_K channel steps: channels past the group's end
are padded in the loader, so a tap costs cdiv(C, BLOCK_K) * BLOCK_K of math. The model is the
matmul roofline (heuristics/matmul.py) on that padded K with no TMA, times the gather's
efficiency; small channel counts (the ResNet stem, C = 3) get narrow BLOCK_K candidates so the
padding stays small.

With few channels per group (FOLD_CHANNELS_BELOW) the taps fold into K instead: k decomposes
into (taps..., channel) or (channel, taps...) (folded_axes), K = C x taps is walked in full
BLOCK_K steps and padded once at its end, not once per tap.

A 1x1 stride-1 unpadded conv over an activation whose pixels merge into one row axis is a plain
matmul and is scheduled as one (heuristics/matmul.py, TMA included).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ....errors import UnsupportedError
from ....target import Target
from .matmul import (MatmulConfig, MatmulProblem, MatmulSchedule, candidates as matmul_candidates, dot_bytes, estimate,
                     min_block_k)

# The activation gather computes a pixel's coordinates and padding mask per tap and loads
# through masked pointers (no TMA): the model charges it against the matmul kernels' rate, per
# warp count. Timing every candidate of the ResNet-50 3x3 layers (N=32, bf16 NHWC, H100) put
# 64x128x64 on 4 warps ahead of the 8-warp 128x128 and 256x128 tiles the matmul model prefers
# (256@14: 25.8 us against 31.4; 512@7: 31.3 against 38.7 split-K; 256@28/2: 25.6 against 29.9):
# several one-warpgroup programs per SM hide the masked loads' latency better.
GATHER_EFFICIENCY = {4: 0.85, 8: 0.65}
# tiles too small for 4 warps' dots run on fewer (heuristics/mma.py): charged as one warpgroup
GATHER_EFFICIENCY.update({1: GATHER_EFFICIENCY[4], 2: GATHER_EFFICIENCY[4]})
# ... but not a 128x128 accumulator on one warpgroup: with the gather's addresses and masks it ran
# 30.1 us against 25.0 for 64x128 (256@14) and 35.1 against 28.9 (128@28) in the same sweep.
GATHER_WIDE_ONE_WARPGROUP = 0.8
# extra BLOCK_K choices where the group's channels are few, for 16-bit operands; a narrower type
# takes as many bytes per step (narrow_block_ks): an int8 step of 32 holds 32 bytes of a row, half
# a bf16 step of 32, and the 64 channels of ResNet's layer1 then ran in steps of 32 (int8 dgrad,
# H200 plan), twice the steps and barriers of bf16's 64
NARROW_K = (16, 32)
FORCED_BY = "BuildOptions.conv_config"  # what a forced config's reason names


@dataclass(frozen=True)
class ConvProblem:
    """What the model needs to know of one conv kernel (plain data; the cache key)."""

    groups: int
    m: int  # output pixels (N x spatial)
    n: int  # filters per group
    channels: int  # channels per group
    taps: int
    dot: str
    a_bytes: int
    b_bytes: int
    out_bytes: int
    layout: str  # a short text of the operands' layouts (part of the signature only)
    epilogue: str = ""
    folded: bool = False  # the taps folded into K (fold_taps): K walked whole, padded once

    @property
    def batch(self) -> int:
        return self.groups

    @property
    def k(self) -> int:
        return self.taps * self.channels

    @property
    def k_run(self) -> int:
        """The k a step walks before its padding: the whole K folded, one tap's channels else."""
        return self.k if self.folded else self.channels

    def padded(self, block_k: int) -> MatmulProblem:
        """The GEMM the kernel runs at `block_k`: each tap's channels rounded up to the block
        (folded: K rounded up once)."""
        k = -(-self.k_run // block_k) * block_k * (1 if self.folded else self.taps)
        return MatmulProblem(self.groups, self.m, self.n, k, self.dot, self.a_bytes, self.b_bytes, self.out_bytes,
                             False, "strided", "strided", self.epilogue)

    def signature(self) -> str:
        return (f"conv g{self.groups} m{self.m} n{self.n} c{self.channels} t{self.taps}"
                f"{' folded' if self.folded else ''} {self.dot} "
                f"a{self.a_bytes} b{self.b_bytes} o{self.out_bytes} {self.layout} {self.epilogue}").strip()


def candidates(problem: ConvProblem, target: Target) -> list[MatmulConfig]:
    """Pointer-load GEMM configs for the conv (no persistent/TMA variant), plus narrow-K twins
    where a narrower step pads less: the group's channels fill less than the step, or (folded)
    the whole K ends in a partial step (147 for the stem: 192 at 64, 160 at 32)."""
    found = {}
    for config in matmul_candidates(problem.padded(1), target):
        if config.variant == "persistent":
            continue
        block_ks = {config.block_k} | {k for k in narrow_block_ks(problem.dot)
                                       if min_block_k(problem.dot) <= k < config.block_k
                                       and _pads_less(problem, k, config.block_k)}
        for block_k in sorted(block_ks):
            narrowed = replace(config, block_k=block_k)
            found.setdefault(narrowed.key(), narrowed)
    return list(found.values())


def narrow_block_ks(dot: str) -> tuple:
    """The narrow BLOCK_K choices of a dot type: NARROW_K's bytes per row for types narrower than
    16 bits (32 and 64 for int8 and fp8), NARROW_K itself otherwise."""
    return tuple(k * max(1, 2 // dot_bytes(dot)) for k in NARROW_K)


def _pads_less(problem: ConvProblem, narrow: int, block_k: int) -> bool:
    if problem.folded:
        return problem.padded(narrow).k < problem.padded(block_k).k
    return problem.channels < block_k


def conv_estimate(config: MatmulConfig, problem: ConvProblem, target: Target) -> float:
    """Model seconds for `config` on `problem` on `target`."""
    efficiency = GATHER_EFFICIENCY[config.num_warps]
    if config.num_warps == 4 and config.block_m * config.block_n >= 128 * 128:
        efficiency *= GATHER_WIDE_ONE_WARPGROUP
    return estimate(config, problem.padded(config.block_k), target) / efficiency


def rank(problem: ConvProblem, target: Target) -> list[MatmulConfig]:
    """Candidates with their model time, best first (ties: no split, bigger tiles, wide N: 64x128
    ran 31.3 us against 33.9 for 128x64 at 512@7 3x3, where the model cannot tell them apart)."""
    ranked = [replace(c, estimate_us=conv_estimate(c, problem, target) * 1e6) for c in candidates(problem, target)]
    ranked.sort(key=lambda c: (round(c.estimate_us, 3), c.split_k, -c.block_m * c.block_n, c.block_m > c.block_n,
                               -c.block_k))
    return ranked


# wgrad reduces over N x output pixels with few output tiles (filters x channels per tap), so
# split-K must fill the machine. Timing every candidate (ResNet-50, N=32, bf16, H100): at 64@56
# 3x3, 64x64 tiles split 16 ways (144 programs) ran 84 us against 178 us for the model's
# 32x64 split 4 (72 programs); the matmul model lets one program pull 4x its share of HBM,
# which its gathered loads do not. A grid short of one wave is charged for the idle SMs.
WGRAD_SPLITS = (2, 4, 8, 16, 32)


# --- few channels per group: the filter taps folded into the GEMM -------------------------------
# Posed tap by tap, a conv walks per filter tap a GEMM dimension of the group's channels: the
# ResNet-50 stem (C = 3, 7x7, stride 2, 224x224) pads that dimension to a 16-wide block (81%
# padding) 49 times.
#   wgrad (N = channels): 49 GEMMs of 64 x 3 over K = N x 112 x 112 pixels, re-reading dy (102 MB
#   bf16 at N = 64) once per tap: ~5 GB of traffic, 2815 us on the H100 against ~250 us for
#   cuDNN. Folded, the columns are (channel, taps...): N = C x R x S = 147, one GEMM, dy read once
#   per column tile (and the column tiles of one k range run side by side, so mostly once from
#   HBM). The price is a gather whose tap varies per column (a [BLOCK_K, BLOCK_N] padding mask
#   instead of a [BLOCK_K] one).
#   fprop (K = taps x channels): 49 k steps of 16 holding 3 channels each, 5.3x the math and the
#   gathered loads of K = 147 (3333 us at N = 256 on the H100 against 1522 us for cuDNN).
#   Folded, k is (taps..., channel): K = 147 walked in 5 steps of 32 (or 3 of 64), 9% padding; the
#   activation's padding mask becomes [BLOCK_M, BLOCK_K] (its tap varies along k) and a run of k
#   (s, c) is one run of NHWC memory per pixel. dgrad's phases fold the same way where the
#   filters per group (its reduction) are few. The model charges the folded gather the per-tap
#   gather's GATHER_EFFICIENCY (not timed apart yet: no GPU in the session that wrote this).
# At 32 channels and more the per-tap block is full (NHWC channels contiguous along it, narrow
# BLOCK_K steps for 16 and 32), so the per-tap GEMMs stay (the ResNet-50 3x3 layers, C >= 64,
# timed well that way); a 1x1 filter has no taps to fold.
FOLD_CHANNELS_BELOW = 32
# Folded wgrad has few output tiles (64 x 147 for the stem: 3 column tiles of 64) and a long
# reduction (802816 pixels), so it splits deeper than the per-tap pose (64 x 3 tiles x 64 splits
# = 192 programs); the partials stay small (64 x 64 x 147 x 4 bytes = 2.4 MB).
WGRAD_FOLDED_SPLITS = (2, 4, 8, 16, 32, 64)


def fold_taps(channels_per_group: int, taps: int, fold_below: int = FOLD_CHANNELS_BELOW) -> bool:
    """Whether a conv folds the filter taps into the GEMM with the group's channels (wgrad's
    columns, fprop's and dgrad's k) for `channels_per_group` reduced or produced per tap: below
    `fold_below` of them (reasoning above)."""
    return taps > 1 and channels_per_group < fold_below


def folded_axes(rank: int, gathered_strides: tuple) -> tuple:
    """The folded axes (wgrad's columns, fprop's k), outer first: -1 the channel, a >= 0 the tap
    along spatial axis a. Channels go innermost where the gathered tensor (x; dy in dgrad) stores
    them innermost (NHWC: a run (s, c) is one run of its memory at a pixel), outermost otherwise
    (NCHW: the last tap axis walks its unit stride)."""
    taps = tuple(range(rank))
    channel_stride, spatial = abs(gathered_strides[1]), [abs(s) for s in gathered_strides[2:] if s]
    channels_inner = channel_stride != 0 and all(channel_stride <= s for s in spatial)
    return taps + (-1,) if channels_inner else (-1,) + taps


def wgrad_schedule(problem: MatmulProblem, target: Target, folded: bool = False,
                   forced: Optional[MatmulConfig] = None, staged: bool = False) -> MatmulSchedule:
    """wgrad's config: matmul candidates (splits up to 32, 64 `folded`) ranked by the matmul
    model on `target`, a grid below one wave charged for its idle SMs; `forced` runs whatever
    the model says; `staged`: the operands are pixel-major copies (the reason says so)."""
    ranked = []
    for config in matmul_candidates(problem, target, WGRAD_FOLDED_SPLITS if folded else WGRAD_SPLITS):
        programs = _tiles(config, problem) * config.split_k
        seconds = estimate(config, problem, target) * max(1.0, target.sms / programs)
        ranked.append(replace(config, estimate_us=seconds * 1e6))
    ranked.sort(key=lambda c: (round(c.estimate_us, 3), -c.block_m * c.block_n, c.split_k))
    pose = "filter taps folded into N" if folded else "one GEMM per filter tap"
    pose += " over pixel-major copies of dy and x" if staged else ""
    best = ranked[0]
    reason = (f"wgrad model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us for {problem.batch} x "
              f"{problem.m}x{problem.n}x{problem.k} {problem.dot} ({pose}; split-K over N x pixels)")
    if forced is not None:
        reason = f"forced by {FORCED_BY} over the {best.text} of " + reason
        ranked.insert(0, forced)
        best = forced
    return MatmulSchedule(problem, tuple(ranked), best, reason)


def _tiles(config: MatmulConfig, problem: MatmulProblem) -> int:
    return -(-problem.m // config.block_m) * -(-problem.n // config.block_n) * problem.batch


def schedule(problem: ConvProblem, target: Target, forced: Optional[MatmulConfig] = None) -> MatmulSchedule:
    """The model's choice for `problem` on `target`, with the ranked list autotuning draws from;
    `forced` runs whatever the model says."""
    ranked = rank(problem, target)
    if not ranked and forced is None:
        raise UnsupportedError(f"convolution {problem.groups} group(s) x {problem.m}x{problem.n}x{problem.k}: no tile "
                               f"fits the {target.shared_memory} bytes of shared memory and {target.registers} "
                               f"registers of {target.name}")
    pose = "filter taps folded into K" if problem.folded else "one k run per filter tap"
    best = ranked[0] if ranked else forced
    flops = 2.0 * problem.groups * problem.m * problem.n * problem.k
    reason = (f"model rank 1 of {len(ranked)}: {best.estimate_us:.1f} us (~{flops / max(best.estimate_us, 1e-3) / 1e6:.0f}"
              f" TFLOP/s) for {problem.groups} group(s) x {problem.m}x{problem.n}x{problem.k} implicit GEMM {problem.dot}"
              f" ({pose})")
    if forced is not None:  # the implicit GEMM loads through pointers: no persistent kernel
        if forced.variant == "persistent":
            forced = replace(forced, variant="tiled", flatten=False, warp_specialize=False, epilogue_subtile=1,
                             tma_store=False)
        reason = f"forced by {FORCED_BY} over the {best.text} of " + reason
        ranked.insert(0, forced)
        best = forced
    return MatmulSchedule(problem, tuple(ranked), best, reason)


# --- dgrad as stride phases ---------------------------------------------------------------------
@dataclass(frozen=True)
class DgradPhase:
    """dx at input positions stride * t + phase (per spatial axis) as a stride-1 conv over dy:
    tap j reads dy at t - padding + j * dilation and the filter at base + step * j."""

    phase: tuple
    rows: tuple  # t per axis (cdiv(input - phase, stride))
    taps: tuple  # filter taps that reach this phase per axis (0: none, dx there is 0)
    padding: tuple
    dilation: tuple
    filter_base: tuple
    filter_step: tuple


def _axis_phase(phase: int, size: int, taps: int, stride: int, padding: int, dilation: int, flip: bool):
    """(rows, taps, padding, dilation, filter base, filter step) of one axis of a phase.

    Input i = s*t + phase gets dy[o] w[r] where o*s = i + p - r*d: the taps r with
    (phase + p - r*d) divisible by s, an arithmetic run r0, r0 + q, ... (q = s / gcd(s, d)), each
    reading dy at t + (phase + p - r*d) / s. Walked last tap first, the dy offset grows by
    d * q / s per tap: a stride-1 conv with that dilation."""
    rows = -(-(size - phase) // stride)
    reaching = [r for r in range(taps) if (phase + padding - r * dilation) % stride == 0]
    if not reaching:
        return rows, 0, 0, 1, 0, 1
    first, count = reaching[0], len(reaching)
    step = reaching[1] - first if count > 1 else stride
    offset_first = (phase + padding - first * dilation) // stride
    tap_dilation = dilation * step // stride
    base, filter_step = first + (count - 1) * step, -step
    if flip:  # mode="convolution" reads the filter back to front
        base, filter_step = taps - 1 - base, step
    return rows, count, (count - 1) * tap_dilation - offset_first, max(1, tap_dilation), base, filter_step


def dgrad_phases(input_sizes, filter_sizes, stride, padding, dilation, flip: bool) -> list[DgradPhase]:
    """The stride phases of a dgrad that own at least one dx element (every element in one)."""
    phases = []
    ranges = [range(min(s, n)) for s, n in zip(stride, input_sizes)]
    for phase in _product_of(ranges):
        axes = [_axis_phase(f, n, r, s, p, d, flip)
                for f, n, r, s, p, d in zip(phase, input_sizes, filter_sizes, stride, padding, dilation)]
        phases.append(DgradPhase(tuple(phase), *(tuple(a[i] for a in axes) for i in range(6))))
    return phases


def _product_of(ranges) -> list:
    combos = [()]
    for values in ranges:
        combos = [c + (v,) for c in combos for v in values]
    return combos
