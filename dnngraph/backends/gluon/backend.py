"""The Gluon backend behind the backend contract (backends/contract.py): warp-specialized
persistent matmuls for Hopper (sm_90a) written in Gluon (triton.experimental.gluon).

It is the worked example of a second backend: the fixed kernel structure is library.py's, the
generated part (signature, epilogue) codegen.py's, and this file answers the contract: which
problems it takes (supports), which configs it offers and what the model says of them
(candidates, estimate), and the launch of the chosen one (lower).

sdpa groups (the attention forward) are answered by attention_backend.py (its kernel:
attention_library.py and attention_codegen.py), conv groups (the convolution forward as an
implicit GEMM on the matmul's mainloop, and the stride-1 dgrad) by conv_backend.py
(conv_library.py, conv_codegen.py), conv_wgrad groups by conv_wgrad.py (a split over pixels and
a combine: conv_wgrad_library.py); each method below hands them on by family.

verified = False, verified_families = {"conv", "sdpa"}: its GPU tests pass on an H200 (cooperative
and ping-pong matmuls, the attention and convolution forwards; runs of each under the concurrency
sanitizer). Its matmuls are on average no faster than the Triton backend's (BENCHMARKS.md, Gluon
matmul), so the default BuildOptions.backends (options.py: registry.verified()) takes gluon for
conv and sdpa groups only ("gluon:conv,sdpa", where the models of both backends rank it:
attention_backend.py, conv_backend.py), and a build asks for its matmuls with
BuildOptions(backends=("gluon", "triton")).

The model (estimate): a tile config runs B*M*N*K multiply-adds at the target's dense peak of the
operand type (facts.bf16 / facts.fp16 / facts.fp8) and moves the operands and outputs once at its bandwidth:
    time = max(2*B*M*N*K / peak, bytes / bandwidth) / wave_efficiency + LAUNCH_SECONDS
where wave_efficiency = tiles / (waves * SMs), waves = ceil(tiles / SMs), tiles = B * ceil(M/BM)
* ceil(N/BN): a persistent kernel whose last wave is partly empty leaves SMs idle for its length.
Configs that do not fit the target's shared memory (ring of STAGES slots of A and B tiles, the
output staging buffers, barriers) are not offered, nor, under a heavy epilogue (heavy_epilogue),
the widest tiles (HEAVY_OPS says why).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import triton

from ...errors import UnsupportedError
from ...problems import Problem
from ...runtime.launch import KernelLaunch, launch_of
from ...target import Target
from ...versions import __version__
from ..contract import Candidate
from . import attention_backend, codegen, conv_backend, conv_wgrad

TMA_ALIGNMENT = 16  # bytes: TMA global strides and base addresses
IN_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float8_e4m3": "fp8", "float8_e5m2": "fp8"}
FP8_TYPES = frozenset({"float8_e4m3", "float8_e5m2"})
OUT_TYPES = frozenset({"float16", "bfloat16", "float32"})
GROUP_M = 8
PRODUCER_REGS = 40
CONSUMER_REGS = 232
LAUNCH_SECONDS = 3e-6
BARRIER_BYTES = 1024  # mbarriers and the compiler's own slack


SCHEDULES = ("cooperative", "pingpong")


@dataclass(frozen=True)
class GluonConfig:
    """One tile config: BLOCK_M x BLOCK_N x BLOCK_K tiles, a STAGES-deep ring, CONSUMERS 4-warp
    warpgroups, TMA stores where the output allows. schedule "cooperative": the consumers split
    each tile's rows (BLOCK_M // CONSUMERS each) and run their epilogues together; "pingpong":
    two consumers take whole tiles in turn, one's epilogue beside the other's mainloop
    (library.pingpong_partition)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    consumers: int
    epilogue_n: int = 64
    tma_store: bool = True
    group_m: int = GROUP_M
    schedule: str = "cooperative"
    # the epilogue's column subtiles (epilogue_n wide) in a loop, their code in the kernel once
    # (library.finish_tile), else unrolled; both compile without spills, the GPU timing of each is
    # benchmarks/bench_gelu_epilogue.py --epilogue-walk both (issue 28)
    epilogue_loop: bool = True

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"gluon schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.schedule == "pingpong" and self.consumers != 2:
            raise ValueError(f"the gluon ping-pong schedule takes two consumers, not {self.consumers}")

    @property
    def pingpong(self) -> bool:
        return self.schedule == "pingpong"

    @property
    def consumer_rows(self) -> int:
        """The rows of a tile one consumer computes (and stages)."""
        return self.block_m if self.pingpong else self.block_m // self.consumers

    @property
    def text(self) -> str:
        store = "tma-store" if self.tma_store else "pointer-store"
        schedule = " schedule=pingpong" if self.pingpong else ""  # the cooperative text as it was
        unrolled = "" if self.epilogue_loop else " epilogue-unrolled"  # the looped text as it was
        return (f"gluon warp-specialized {self.block_m}x{self.block_n}x{self.block_k} stages={self.stages} "
                f"consumers={self.consumers} epilogue-n={self.epilogue_n}{unrolled} {store}{schedule}")


# the configs offered, before the shared-memory fit (each consumer's accumulator is at most
# 64 x 256 or 128 x 128 fp32: 128 registers a thread)
CONFIGS = (GluonConfig(128, 256, 64, 4, 2), GluonConfig(128, 256, 64, 3, 2), GluonConfig(128, 128, 64, 6, 2),
           GluonConfig(128, 128, 64, 4, 1), GluonConfig(128, 128, 64, 4, 2, epilogue_n=128))

# Ping-pong configs: each consumer a whole tile of at most 128 accumulators a thread (128 x 128 or
# 64 x 256), the epilogue in subtiles of 32 values a thread (as heavy epilogues compile without
# spills beside 128 accumulators). Their GPU tests pass, but measured on an H200 they do not beat
# the cooperative configs (BENCHMARKS.md, Gluon matmul: +2% at 8192^3 with GELU, -8% at 4096^3),
# so candidates() offers them only where OFFER_PINGPONG is set, while lower() takes them from
# outside (a Candidate carrying one, as a test or a tuner passes) as it takes CONFIGS.
PINGPONG_CONFIGS = (GluonConfig(128, 128, 64, 4, 2, epilogue_n=32, schedule="pingpong"),
                    GluonConfig(64, 256, 64, 4, 2, epilogue_n=64, schedule="pingpong"),
                    GluonConfig(128, 128, 64, 5, 2, epilogue_n=32, schedule="pingpong"))
OFFER_PINGPONG = False


# Registers: each consumer thread holds (BLOCK_M // CONSUMERS) * BLOCK_N / 128 fp32 accumulators,
# and the epilogue runs in column subtiles of EPILOGUE_N (library.finish_tile), each thread's
# share of one subtile live beside them. A heavy epilogue (one that loads a whole output-shaped
# tile, or evaluates erf / tanh: gelu) compiles without spills at 128 accumulators and two 32-value
# subtiles (tests/backends/test_gluon.py asserts no spills in any config offered), but runs slowly
# there: bf16 bias + gelu_tanh at 4096^3 on an H200 ran 465 TFLOP/s at 128x256 (whichever subtile
# width, 64 to 256) against 600 at 128x128 with two consumers (BENCHMARKS.md, Gluon matmul). Heavy
# epilogues are offered only the cooperative configs of at most HEAVY_EPILOGUE_ACCUMULATORS a
# thread; the ping-pong schedule, whose epilogues overlap the other consumer's mainloop, is meant
# for them and is not held to it (unmeasured: see PINGPONG_CONFIGS). Those figures are of the
# precise GELU; a bf16 or fp16 output now takes the 16-bit math (problems/base.py
# fast_math_outputs: 15 instructions an element for gelu_tanh where there were 33, 25 for gelu
# where there were 33; the 128x256 kernel's SASS 6200 instructions where there were 10816), and
# the epilogue's subtiles now run in a loop (GluonConfig.epilogue_loop: its code once per
# consumer, not once per subtile; bf16 bias + gelu_tanh at 128x256 2976 SASS instructions where
# unrolled takes 6200, bias + gelu 3600 where it takes 8768; no spills), all to be measured with
# forced configs (benchmarks/bench_gelu_epilogue.py --epilogue-walk both, issue 28): the filter
# now bars only the unrolled walk from the wider tiles (offered_walk).
HEAVY_OPS = frozenset({"gelu", "gelu_tanh"})
HEAVY_EPILOGUE_ACCUMULATORS = 64


def accumulators_per_thread(config: GluonConfig) -> int:
    return config.consumer_rows * config.block_n // 128


# A looped epilogue (GluonConfig.epilogue_loop) keeps the whole accumulator live through its loop
# and moves each subtile into the loop's own registers, so a thread holds its accumulators and
# two subtiles' values before the epilogue's temporaries: at most LOOPED_EPILOGUE_REGISTERS of
# those. bf16 bias + gelu_tanh at 128x256 compiles without spills in subtiles of 64 columns
# (128 + 2 * 32) and spills 252 bytes in subtiles of 128 (128 + 2 * 64), where the unrolled walk
# spills none; a heavy epilogue (heavy_epilogue) past it runs unrolled (looped_epilogue). A light
# one has few temporaries: 128 x 128 with one consumer (128 + 2 * 64) loops without spills
# (tests/backends/test_gluon.py compiles every config offered and asserts none).
LOOPED_EPILOGUE_REGISTERS = 192


# Measured on an H200 (2026-11-29, bench_gelu_epilogue.py --epilogue-walk both, bf16, TFLOP/s
# loop / unrolled): bias + gelu_tanh at 128x256 s4 718 / 709 (4096^3) and 690 / 647 (8192^3), erf
# gelu 689 / 632 and 649 / 671, and 128x256 ahead of 128x128 in three of those four; bias alone
# 756 / 762 and 698 / 745. So the walk offered (offered_walk) loops heavy epilogues, which then
# take the 128x256 tiles (HEAVY_EPILOGUE_ACCUMULATORS no longer bars a looped one), and unrolls
# light ones.


def offered_walk(config: GluonConfig, heavy: bool) -> bool:
    """The epilogue walk candidates() offers: a loop for a heavy epilogue whose registers allow
    it (looped_epilogue), unrolled for a light one."""
    return heavy and looped_epilogue(config, heavy)


def looped_epilogue(config: GluonConfig, heavy: bool) -> bool:
    """Whether `config`'s epilogue walks its subtiles in a loop: where it asks to and, for a
    heavy epilogue, its registers allow (LOOPED_EPILOGUE_REGISTERS; one subtile needs no moves)."""
    subtile_values = config.consumer_rows * config.epilogue_n // 128
    splits = config.block_n // config.epilogue_n
    fits = splits == 1 or accumulators_per_thread(config) + 2 * subtile_values <= LOOPED_EPILOGUE_REGISTERS
    return config.epilogue_loop and (fits or not heavy)


def heavy_epilogue(problem: Problem) -> bool:
    """Whether the epilogue loads a whole tile or evaluates gelu (HEAVY_OPS)."""
    g = problem.geometry
    out_dims = tuple(g.batch_dims) + (g.m, g.n)
    tiles = any(codegen.broadcast_form(o.dims, out_dims) == "tile" for o in problem.operands
                if o.role not in ("a", "b"))
    return tiles or any(op in HEAVY_OPS for op in problem.epilogue)


def staging_buffers(config: GluonConfig) -> int:
    """TMA-store staging buffers per consumer (library.staging_buffers): two where a tile's
    epilogue runs in subtiles, else one."""
    return 2 if config.block_n > config.epilogue_n else 1


def shared_bytes(config: GluonConfig, in_bytes: int, out_bytes: int) -> int:
    """The ring (a slot: the tile's A rows and B's block), the consumers' staging buffers (each
    consumer its own, of its rows: ping-pong consumers stage whole tiles), the barriers."""
    ring = config.stages * (config.block_m * config.block_k + config.block_k * config.block_n) * in_bytes
    rows = config.consumers * config.consumer_rows  # BLOCK_M, or 2 * BLOCK_M in ping-pong
    staging = staging_buffers(config) * rows * config.epilogue_n * out_bytes if config.tma_store else 0
    return ring + staging + BARRIER_BYTES


def _dense(size: int, stride: int, dense: int) -> int:
    """A stride as a descriptor takes it: an axis of one element may carry any stride in a view,
    which means nothing; it is given the dense one."""
    return stride if size > 1 else dense


def _matrix_strides(dims: tuple, strides: tuple) -> tuple:
    """(batch stride, row stride, column stride) of a rank-2 or rank-3 operand, size-1 axes'
    strides made dense; the batch stride is 0 where there is no batch (or one)."""
    rows, cols = dims[-2], dims[-1]
    col = _dense(cols, strides[-1], 1)
    row = _dense(rows, strides[-2], cols)
    batch = _dense(dims[0], strides[0], rows * cols) if len(dims) == 3 and dims[0] > 1 else 0
    return batch, row, col


def block_k_for(config: GluonConfig, itemsize: int) -> int:
    """BLOCK_K for operands of `itemsize` bytes: the bytes per k step of CONFIGS' 16-bit BLOCK_K
    (fp8: 128 for 64), so the ring's bytes, and the shared-memory fit, are the 16-bit ones."""
    return config.block_k * 2 // itemsize


def _transposed(dims: tuple, strides: tuple) -> tuple:
    """(dims, strides) of the view with the last two axes swapped ([K, N] -> [N, K])."""
    dims, strides = tuple(dims), tuple(strides)
    return dims[:-2] + (dims[-1], dims[-2]), strides[:-2] + (strides[-1], strides[-2])


def b_layout(b) -> tuple:
    """(k_major, why) of operand B: how the kernel reads it, or why it cannot (k_major None).
    Row-major (N contiguous, k_major False) where TMA takes [K, N]; else K-major (K contiguous,
    B^T [N, K] read through a descriptor over that view) where TMA takes the view. fp8 operands
    are read K-major only: wgmma takes both fp8 operands K-major from shared memory."""
    itemsize = b.data_type.itemsize
    row_why = _tma_legal(b.dims, b.strides, itemsize)
    col_why = _tma_legal(*_transposed(b.dims, b.strides), itemsize)
    if b.data_type.name in FP8_TYPES:
        if col_why is None:
            return True, None
        if row_why is None:
            return None, (f"gluon's fp8 wgmma reads B K-major (K contiguous: B^T [N, K] dense), but b is "
                          f"row-major (N contiguous, strides {list(b.strides)}); give it as the transposed view "
                          f"of an [N, K] tensor")
        return None, f"gluon reads fp8 b K-major through TMA, but as [N, K] {col_why}"
    if row_why is None:
        return False, None
    if col_why is None:
        return True, None
    if _matrix_strides(*_transposed(b.dims, b.strides))[2] == 1:  # K-major, misaligned
        return None, f"gluon reads b K-major through TMA, but as [N, K] {col_why}"
    return None, f"gluon reads b through TMA, but {row_why} (nor is K contiguous)"


def _tma_legal(dims, strides, itemsize: int) -> Optional[str]:
    """Why an operand cannot be read (or written) through TMA, or None."""
    batch, row, col = _matrix_strides(tuple(dims), tuple(strides))
    if col != 1:
        return f"its last dimension has stride {col}, not 1"
    for name, stride in (("row", row), ("batch", batch)):
        if stride * itemsize % TMA_ALIGNMENT:
            return f"its {name} stride ({stride} elements) is not a multiple of {TMA_ALIGNMENT} bytes"
    return None


def _conv_module(problem: Problem):
    """The module answering for a conv group: conv_wgrad.py for a wgrad (two kernels over a
    workspace), conv_backend.py for the forward and the dgrad (one implicit GEMM)."""
    return conv_wgrad if problem.geometry.direction == "wgrad" else conv_backend


class GluonBackend:
    """The contract over library.py and codegen.py, for matmul groups on sm_90."""

    name = "gluon"
    version = f"dnngraph {__version__}, triton {triton.__version__}, gluon matmul 2, gluon attention 1, gluon conv 2"
    # sdpa: attention_backend.py, conv: conv_backend.py (dispatched by family)
    families = frozenset({"matmul", "sdpa", "conv"})
    interpretable = False
    prologue_stored_apart = frozenset()
    verified = False  # not every family: its matmuls are opt-in (the module docstring says why)
    # the attention forward's GPU tests pass on an H200 and it runs 1.18-1.28x the Triton kernel
    # at D128 (BENCHMARKS.md, Gluon attention forward); the convolution forward's pass too and it
    # runs 1.10x the Triton conv over ResNet-50's fprop layers (BENCHMARKS.md, Gluon convolution
    # forward): a default build ranks them beside Triton's, and the models' estimates decide (the
    # conv forward's: measured rates per shape class, backends/triton/heuristics/conv_measured.py)
    verified_families = frozenset({"conv", "sdpa"})

    def cache_key(self) -> tuple:
        return (self.name, self.version, self.interpretable, self.verified, tuple(sorted(self.verified_families)),
                tuple((kind, self.lower.__module__, type(self).__qualname__, id(type(self).lower))
                      for kind in sorted(self.families)))

    # -- what it takes ---------------------------------------------------------------------------

    def supports(self, problem: Problem, target: Target) -> Union[bool, str]:
        if target.capability != (9, 0):
            return (f"gluon kernels are built for sm_90a (Hopper, capability (9, 0)) only; the target "
                    f"{target.name} has capability {target.capability}")
        if problem.blended:
            return "gluon's epilogues store no blended output (Tensor.set_blend)"
        if problem.family == "sdpa":
            return attention_backend.supports(problem)
        if problem.family == "conv":
            return _conv_module(problem).supports(problem)
        if problem.family != "matmul":
            return f"gluon has no {problem.family} kernel"
        g = problem.geometry
        if problem.prologue:
            return f"gluon fuses no prologue (the group has {', '.join(problem.prologue)})"
        if problem.exits:
            return f"gluon fuses no row exits (the group has {', '.join(problem.exits)})"
        for op in problem.epilogue:
            if op not in codegen.EPILOGUE:
                return f"gluon has no epilogue expression for op {op}"
        a, b = problem.operand("a"), problem.operand("b")
        if a is None or b is None:
            return "gluon needs both matmul operands"
        for operand in (a, b):
            if operand.data_type.name not in IN_TYPES:
                return (f"gluon takes float16, bfloat16, float8_e4m3 or float8_e5m2 operands, not "
                        f"{operand.data_type.name}")
        if a.data_type is not b.data_type:
            return f"gluon takes operands of one type, not {a.data_type.name} x {b.data_type.name}"
        for role in ("scale_a", "scale_b"):
            scale = problem.operand(role)
            if scale is None:
                continue
            if scale.numel != 1:  # a block or row scale: no kernel here applies one
                return f"gluon applies per-tensor scales (one element), not {role} of shape {list(scale.dims)}"
            if scale.data_type.name not in OUT_TYPES:
                return f"gluon loads float32, float16 or bfloat16 scales, not {role} of {scale.data_type.name}"
        for operand in (a, b):
            if len(operand.dims) not in (2, 3):
                return f"gluon takes rank-2 or rank-3 operands, not {operand.role} of rank {len(operand.dims)}"
        if len(g.batch_dims) > 1:
            return f"gluon takes one batch dimension, not {len(g.batch_dims)}"
        if g.k < 1:
            return "gluon needs K >= 1"
        why = _tma_legal(a.dims, a.strides, a.data_type.itemsize)
        if why is not None:
            return f"gluon reads a through TMA (K contiguous), but {why}"
        k_major, why = b_layout(b)
        if k_major is None:
            return why
        if len(problem.outputs) != 1:
            return f"gluon stores one output, the group has {len(problem.outputs)}"
        out = problem.outputs[0]
        if out.data_type.name not in OUT_TYPES:
            return f"gluon stores float16, bfloat16 or float32, not {out.data_type.name}"
        out_dims = tuple(g.batch_dims) + (g.m, g.n)
        if tuple(out.dims) != out_dims:
            return f"gluon stores the matmul's shape {list(out_dims)}, not {list(out.dims)}"
        for operand in problem.operands:
            if operand.role in ("a", "b"):
                continue
            if codegen.broadcast_form(operand.dims, out_dims) is None:
                return (f"gluon's epilogue reads scalars, row vectors over N and tiles of the output's shape, "
                        f"not an operand of shape {list(operand.dims)}")
        return True

    # -- the model -------------------------------------------------------------------------------

    def _sizes(self, problem: Problem) -> tuple:
        g = problem.geometry
        a, out = problem.operand("a"), problem.outputs[0]
        return g.batch, g.m, g.n, g.k, a.data_type.itemsize, out.data_type.itemsize

    def _tma_store_ok(self, problem: Problem) -> bool:
        out = problem.outputs[0]
        return _tma_legal(out.dims, out.strides, out.data_type.itemsize) is None

    def estimate(self, problem: Problem, config: GluonConfig, target: Target) -> Optional[float]:
        if problem.family == "sdpa":
            return attention_backend.estimate(problem, config, target)
        if problem.family == "conv":
            return _conv_module(problem).estimate(problem, config, target)
        if not isinstance(config, GluonConfig):
            return None
        batch, m, n, k, in_bytes, out_bytes = self._sizes(problem)
        peak = target.peak(IN_TYPES[problem.operand("a").data_type.name])
        moved = sum(o.numel * o.data_type.itemsize for o in problem.operands + problem.outputs)
        tiles = batch * -(-m // config.block_m) * -(-n // config.block_n)
        waves = -(-tiles // target.sms)
        efficiency = tiles / (waves * target.sms)
        seconds = max(2.0 * batch * m * n * k / peak, moved / target.bandwidth) / efficiency
        return seconds + LAUNCH_SECONDS

    def candidates(self, problem: Problem, target: Target, options=None) -> list:
        """The configs that fit the target's shared memory, best first by estimate (ties: the
        order of CONFIGS): CONFIGS, and PINGPONG_CONFIGS where OFFER_PINGPONG is set."""
        return self._fitted(problem, target, CONFIGS + (PINGPONG_CONFIGS if OFFER_PINGPONG else ()))

    def _fitted(self, problem: Problem, target: Target, configs: tuple) -> list:
        """Candidates of those of `configs` that fit, as candidates() describes them."""
        if self.supports(problem, target) is not True:
            return []
        if problem.family == "sdpa":
            return attention_backend.candidates(self.name, problem, target)
        if problem.family == "conv":
            return _conv_module(problem).candidates(self.name, problem, target)
        _, _, _, _, in_bytes, out_bytes = self._sizes(problem)
        store = self._tma_store_ok(problem)
        heavy = heavy_epilogue(problem)
        found = []
        for config in configs:
            wide = accumulators_per_thread(config) > HEAVY_EPILOGUE_ACCUMULATORS
            if heavy and not config.pingpong and wide and not offered_walk(config, heavy):
                continue  # slow unrolled (see HEAVY_OPS)
            config = replace(config, block_k=block_k_for(config, in_bytes))
            config = replace(config, tma_store=store, epilogue_loop=offered_walk(config, heavy))
            if store and shared_bytes(config, in_bytes, out_bytes) > target.shared_memory:
                config = replace(config, tma_store=False)  # the staging buffers do not fit beside the ring
            if shared_bytes(config, in_bytes, out_bytes) > target.shared_memory:
                continue
            found.append(Candidate(self.name, config, self.estimate(problem, config, target)))
        order = {id(c): i for i, c in enumerate(found)}
        return sorted(found, key=lambda c: (c.estimate, order[id(c)]))

    # -- lowering --------------------------------------------------------------------------------

    def _checked(self, candidate: Candidate, problem: Problem, target, offered: list) -> Candidate:
        """A config given from outside, as candidates() would have offered it: the store path
        its output allows, a ring that fits (UnsupportedError where none does) and the epilogue
        walk it asks for where its registers allow (looped_epilogue)."""
        in_bytes = problem.operand("a").data_type.itemsize
        asked = candidate.config
        for offer in offered:
            config = offer.config
            # BLOCK_K as given, or as CONFIGS gives it (16-bit), which the operand type scales
            if (config.block_m, config.block_n, config.stages, config.consumers, config.epilogue_n,
                    config.schedule) == (asked.block_m, asked.block_n, asked.stages, asked.consumers,
                                         asked.epilogue_n, asked.schedule) and config.block_k in (
                    asked.block_k, block_k_for(asked, in_bytes)):
                # how the epilogue walks its subtiles changes neither the fit nor the model
                walked = replace(config, epilogue_loop=asked.epilogue_loop)
                walk = looped_epilogue(walked, heavy_epilogue(problem))
                return replace(offer, config=replace(walked, epilogue_loop=walk))
        raise UnsupportedError(f"{problem.where}: gluon config {candidate.config.text} is not one this problem "
                               f"can run on {target.name} (its store path or shared memory)")

    def lower(self, graph, group, problem: Problem, context, candidate: Optional[Candidate] = None) -> list:
        """One persistent launch (grid = min(tiles, SMs)) of the given candidate's config, else
        of the best of candidates()."""
        target = context.target
        ok = self.supports(problem, target)
        if ok is not True:
            raise UnsupportedError(f"{problem.where}: {ok}")
        offered = self.candidates(problem, target, context.options)
        if problem.family == "sdpa":
            return attention_backend.lower(graph, group, problem, context, offered, candidate)
        if problem.family == "conv":
            return _conv_module(problem).lower(graph, group, problem, context, offered, candidate)
        if candidate is not None and isinstance(candidate.config, GluonConfig):
            # a config from outside may be any this backend knows, offered or not yet
            known = self._fitted(problem, target, CONFIGS + PINGPONG_CONFIGS)
            chosen = self._checked(candidate, problem, target, known)
        elif offered:
            chosen = offered[0]
        else:
            raise UnsupportedError(f"{problem.where}: no gluon config fits {target.name}'s shared memory")
        config = chosen.config
        estimate = chosen.estimate if chosen.estimate is not None else self.estimate(problem, config, target)
        node = group.anchor
        a, b, c = node.inputs[0], node.inputs[1], node.outputs[0]
        scale_a, scale_b = (list(node.inputs[2:]) + [None, None])[:2]
        out = group.outputs[0]
        g = problem.geometry
        batch = g.batch
        a_batch, a_row, _ = _matrix_strides(tuple(a.dim), tuple(a.stride))
        k_major, _ = b_layout(problem.operand("b"))
        b_view = _transposed(b.dim, b.stride) if k_major else (tuple(b.dim), tuple(b.stride))
        b_batch, b_row, _ = _matrix_strides(*b_view)  # the rows of [N, K] where B is K-major
        c_strides = _matrix_strides(tuple(out.dim), tuple(out.stride))
        gemm = codegen.GemmArguments(a.uid, b.uid, out.uid, g.m, g.n, g.k, batch, (a_batch, a_row), (b_batch, b_row),
                                     c_strides, scale_a.uid if scale_a is not None else None,
                                     scale_b.uid if scale_b is not None else None)
        constexprs = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                      "STAGES": config.stages, "GROUP_M": config.group_m, "CONSUMERS": config.consumers,
                      "BATCHED_A": batch > 1 and a_batch != 0, "BATCHED_B": batch > 1 and b_batch != 0,
                      "BATCHED_C": batch > 1, "TMA_STORE": config.tma_store, "EPILOGUE_N": config.epilogue_n,
                      "PRODUCER_REGS": PRODUCER_REGS,
                      "CONSUMER_REGS": CONSUMER_REGS, "B_K_MAJOR": bool(k_major), "SCALE_A": scale_a is not None,
                      "SCALE_B": scale_b is not None, "PINGPONG": config.pingpong,
                      "EPILOGUE_LOOP": config.epilogue_loop}
        stem = f"dnngraph_gluon_{group.kind}_{group.nodes[-1].op}"
        source = codegen.render(stem, group.summary(), gemm, c, tuple(group.epilogue), tuple(out.dim), constexprs,
                                problem.fast_math)
        tiles = batch * -(-g.m // config.block_m) * -(-g.n // config.block_n)
        programs = max(1, min(tiles, target.sms))
        reason = (f"{config.text}: model {estimate * 1e6:.1f} us "
                  f"({tiles} tiles on {programs} persistent programs)")
        launch = launch_of(group, source, (programs,), codegen_warps(), config.text + f" grid={programs}", reason)
        launch.alternative = _unaligned_fallback(graph, group, problem, context)
        if launch.alternative is None:  # an unaligned call would run the TMA kernel: let Triton take it
            raise UnsupportedError(f"{problem.where}: no pointer-load fallback for unaligned calls")
        return [launch]


def _unaligned_fallback(graph, group, problem, context) -> Optional[KernelLaunch]:
    """The launch that runs where a pointer is below 16-byte alignment (no TMA descriptor can
    take it): the Triton backend's tiled matmul of the same group (pointer loads), or None
    where it lowers to anything but one launch without scratch."""
    from ..triton.backend import TRITON
    from ..triton.heuristics.matmul import MatmulConfig

    fallback = MatmulConfig("tiled", 64, 64, 32, 4, 3)
    options = replace(context.options, matmul_config=fallback, autotune=False)
    try:
        built = TRITON.lower(graph, group, problem, replace(context, options=options, tuner=None))
    except UnsupportedError:
        return None
    return built[0] if len(built) == 1 and not built[0].scratch else None


def codegen_warps() -> int:
    """The kernel's num_warps: the first consumer warpgroup (the default partition); the second
    consumer and the producer are warp_specialize's workers."""
    return 4


GLUON = GluonBackend()
