"""The Gluon backend's answers for conv groups (backend.py dispatches here by family): which
convolution forwards and dgrads the implicit-GEMM kernel of conv_library.py takes, its configs and
model, and the launch of one group.

Taken: conv_fprop of fp16 or bf16 x and w (one type), 2D, groups 1, x NHWC (channels_last: C
contiguous) and w KRSC (C contiguous), y NHWC (K contiguous), C and K multiples of 16 bytes and
every other stride too (TMA reads and writes them); strides 1 and 2 with any padding and dilation
(a stride-2 axis through x's phase views: conv_library.py), and any stride whose taps all lie in
phase 0 (a 1x1 filter without padding: the ResNet downsample); either mode (cross-correlation, or
convolution: the filter back to front); the matmul's epilogue ops on scalars and per-channel
vectors ([1, K, 1, 1], a bias), stored in float16, bfloat16 or float32.
conv_dgrad at stride 1 (any filter, padding, dilation, either mode) of dy NHWC and w KRSC to dx
NHWC, with the same epilogues (vectors over dx's C): the forward over dy with the filter flipped
(implicit_gemm), w read as a row-major B. A strided 1x1 dgrad without padding (strides up to 2:
the ResNet downsample's) is the 1x1 over dy stored into dx's phase (0, 0) through a strided view,
followed by the Triton backend's launches of dx's other phases (the epilogue of zeros: no dy
pixel reaches them; _with_zero_phases), which also make the unaligned fallback whole.
(conv_wgrad.py answers for the wgrad.)

Refused, each with a reason starting "gluon": other strided dgrads (dx is a sum over stride
phases: the Triton backend's phase GEMMs run it), groups, 1D / 3D, strides past 2 with taps in other phases, inputs narrower than a
phased stride, other layouts and types, prologues (a batchnorm applied at load; dgrad's drelu on
dy), exits (genstats), epilogue operands of other shapes (a residual, a mask over dx: the epilogue sees
positions in the pixel rectangle, not pixel indices) and ops with no gluon expression (dgrad's
relu_backward on dx, which would also read x at every pixel).

For dgrad the GEMM below has rows N*H*W (dx's pixels), columns C, reduction R*S*K.
Configs (ConvConfig): an output tile is a BLOCK_H x BLOCK_W pixel rectangle of one image by
BLOCK_N channels. The config model (modeled_seconds: it orders the configs; estimate(), what the
registry compares with Triton's, is the measured rate of the direction and shape class instead:
heuristics/conv_measured.py) is the matmul's over the implicit GEMM (rows N*P*Q,
columns K, reduction R*S*C) with the tiles' waste: a rectangle's pixels past P or Q, channels
past K, and the channel block's past C, all computed and thrown away:
    time = max(2 * N*P*Q * K * R*S*C / peak / (tile_use * channel_use), bytes / bandwidth) / wave_efficiency
           + LAUNCH_SECONDS
tile_use = N*P*Q*K / (tiles * BLOCK_M * BLOCK_N), channel_use = C / (ceil(C / BLOCK_K) * BLOCK_K),
wave_efficiency = tiles / (waves * SMs) as the matmul's. So a 7x7 layer takes 8x8 rectangles
(49 of 64 pixels used) over 8x16 ones (49 of 128), a 56x56 layer 8x16.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from ...errors import UnsupportedError
from ...problems import Problem
from ...runtime.launch import KernelLaunch, launch_of
from ...target import Target
from ..contract import Candidate
from ..triton.heuristics import conv_measured
from . import codegen, conv_codegen

# the matmul's (backend.py, which imports this module)
TMA_ALIGNMENT = 16
IN_TYPES = {"float16": "fp16", "bfloat16": "bf16"}
OUT_TYPES = frozenset({"float16", "bfloat16", "float32"})
GROUP_M = 8
PRODUCER_REGS = 40
CONSUMER_REGS = 232
LAUNCH_SECONDS = 3e-6
BARRIER_BYTES = 1024
MEASURED_AS = "gluon"  # this kernel's column of heuristics/conv_measured.py
WARPS = 4  # the kernel's num_warps: the first consumer (the default partition); the rest are workers


@dataclass(frozen=True)
class ConvConfig:
    """BLOCK_H x BLOCK_W output pixels (of one image) by BLOCK_N channels a tile, BLOCK_K
    channels a reduction step (one filter tap), a STAGES-deep ring, CONSUMERS 4-warp warpgroups
    (each BLOCK_H / CONSUMERS rows of the rectangle), the epilogue in subtiles of EPILOGUE_N
    channels, walked in a loop (epilogue_loop) or unrolled."""

    block_h: int
    block_w: int
    block_n: int
    block_k: int
    stages: int
    consumers: int
    epilogue_n: int = 64
    epilogue_loop: bool = False
    group_m: int = GROUP_M

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_w

    @property
    def consumer_rows(self) -> int:
        return self.block_m // self.consumers

    @property
    def text(self) -> str:
        walk = " epilogue-loop" if self.epilogue_loop else ""
        return (f"gluon warp-specialized conv {self.block_h}x{self.block_w}x{self.block_n}x{self.block_k} "
                f"stages={self.stages} consumers={self.consumers} epilogue-n={self.epilogue_n}{walk} tma-store")


# the configs offered before the fit: 128-pixel rectangles (8x16, 16x8) on two consumers of 64
# rows, 64-pixel ones (8x8: the 7x7 and 14x14 layers' least waste) on one; 64 to 256 channels.
# Each consumer holds at most 64 x 256 fp32 accumulators (128 registers a thread), as the matmul's.
CONFIGS = (ConvConfig(8, 16, 128, 64, 4, 2), ConvConfig(16, 8, 128, 64, 4, 2), ConvConfig(8, 16, 256, 64, 3, 2),
           ConvConfig(16, 8, 256, 64, 3, 2), ConvConfig(8, 8, 128, 64, 6, 1), ConvConfig(8, 8, 256, 64, 4, 1),
           ConvConfig(8, 16, 64, 64, 6, 2))
LOOPED_EPILOGUE_REGISTERS = 192  # backend.py's: accumulators and two subtiles' values a thread
HEAVY_OPS = frozenset({"gelu", "gelu_tanh"})


def block_k_for(channels: int) -> int:
    """BLOCK_K: 64 channels (a 128-byte swizzled row of 16-bit values), or the least of 32 and
    16 that covers C (a thin layer reads fewer zeros; 16 is wgmma's K)."""
    for block_k in (16, 32):
        if channels <= block_k:
            return block_k
    return 64


def shared_bytes(config: ConvConfig, in_bytes: int, out_bytes: int) -> int:
    """The ring (a slot: the rectangle's pixels and the filter block), the consumers' staging
    buffers (two each where the epilogue has subtiles), the barriers."""
    ring = config.stages * (config.block_m + config.block_n) * config.block_k * in_bytes
    staging = (2 if config.block_n > config.epilogue_n else 1) * config.block_m * config.epilogue_n * out_bytes
    return ring + staging + BARRIER_BYTES


def looped(config: ConvConfig, heavy: bool) -> bool:
    """The epilogue walk offered: a loop for a heavy epilogue (its code once) where the
    accumulators and two subtiles fit LOOPED_EPILOGUE_REGISTERS, else unrolled (as backend.py
    offered_walk)."""
    accumulators = config.consumer_rows * config.block_n // 128
    subtile = config.consumer_rows * config.epilogue_n // 128
    return heavy and config.block_n > config.epilogue_n and accumulators + 2 * subtile <= LOOPED_EPILOGUE_REGISTERS


# -- layouts ---------------------------------------------------------------------------------------

def _dense(size: int, stride: int, dense: int) -> int:
    """A size-1 axis's stride means nothing: the dense one stands in for it."""
    return stride if size > 1 else dense


def nhwc_strides(dims: tuple, strides: tuple) -> tuple:
    """(channel stride, (N, H, W) strides) of a logical [N, C, H, W] tensor read as NHWC (the
    W stride made dense past C where W is 1, and so on outwards)."""
    n, c, h, w = dims
    channel = _dense(c, strides[1], 1)
    along_w = _dense(w, strides[3], c)
    along_h = _dense(h, strides[2], w * along_w)
    along_n = _dense(n, strides[0], h * along_h)
    return channel, (along_n, along_h, along_w)


def _layout_why(name: str, dims: tuple, strides: tuple, itemsize: int, channels_name: str) -> Optional[str]:
    """Why a [.., C, H, W] operand cannot be read or written through rank-4 TMA as NHWC, or None."""
    channel, outer = nhwc_strides(tuple(dims), tuple(strides))
    if channel != 1:
        return (f"gluon reads and writes convolution tensors channels_last ({channels_name} contiguous), but {name} "
                f"has strides {list(strides)}")
    if dims[1] * itemsize % TMA_ALIGNMENT:
        return (f"gluon's TMA boxes need {channels_name} * itemsize a multiple of {TMA_ALIGNMENT} bytes, but {name} "
                f"has {channels_name} = {dims[1]}")
    for axis, stride in zip("NHW", outer):
        if stride * itemsize % TMA_ALIGNMENT:
            return (f"gluon reads {name} through TMA, but its {axis} stride ({stride} elements) is not a multiple "
                    f"of {TMA_ALIGNMENT} bytes")
    return None


@dataclass(frozen=True)
class ImplicitGemm:
    """A convolution as the kernel runs it (conv_library.py): A is `source` (x in fprop, dy in
    dgrad), NHWC [N, *source_spatial, channels]; the output (y, dx) NHWC [N, *out_spatial,
    filters]; the taps read A at offset tap*dilation - padding (per axis) from each output pixel
    times the stride; w [K, R, S, C] is K-major B (fprop: C the reduction) or row-major B (dgrad:
    K the reduction, C the columns)."""

    source: str
    output: str
    channels_name: str  # the reduction's name (C in fprop, K in dgrad) and the columns'
    filters_name: str
    source_spatial: tuple
    out_spatial: tuple
    channels: int
    filters: int
    padding: tuple
    b_k_major: bool
    stride: tuple = (1, 1)  # the taps' stride over A's pixels (fprop's; a dgrad reads dy densely)
    out_stride: tuple = (1, 1)  # the output's pixels the GEMM writes: every out_stride-th (the rest the epilogue of 0)


def strided_pointwise_dgrad(geometry) -> bool:
    """Whether a dgrad is a strided 1x1 without leading padding (the ResNet downsample's): dx at
    (s*p, s*q) is dy[p, q] @ w, every other pixel of dx zero."""
    g = geometry
    return (g.direction == "dgrad" and any(s > 1 for s in g.stride) and all(r == 1 for r in g.filter)
            and all(p == 0 for p in g.padding))


def implicit_gemm(geometry) -> ImplicitGemm:
    """The GEMM a fprop or dgrad geometry poses. dgrad (stride 1) is the forward over dy with the
    filter flipped and padding (R-1)*dil - pad: dx[i] = sum over r of dy[i + pad - r*dil] w[r]
    is, with tap t = R-1-r, dy[i + t*dil - ((R-1)*dil - pad)] w[R-1-t]. A strided 1x1 dgrad
    without padding is the 1x1 over dy's first ceil(H/s) x ceil(W/s) pixels (the ones a dx pixel of
    phase 0 reads) into dx's phase (0, 0), out_stride apart."""
    g = geometry
    if strided_pointwise_dgrad(g):
        written = tuple(-(-size // stride) for size, stride in zip(g.input_spatial, g.stride))
        return ImplicitGemm("dy", "dx", "K", "C", g.output_spatial, written, g.k, g.c, (0, ) * len(g.stride), False,
                            out_stride=tuple(g.stride))
    if g.direction == "dgrad":
        padding = tuple((taps - 1) * dilation - pad for taps, dilation, pad in zip(g.filter, g.dilation, g.padding))
        return ImplicitGemm("dy", "dx", "K", "C", g.output_spatial, g.input_spatial, g.k, g.c, padding, False)
    return ImplicitGemm("x", "y", "C", "K", g.input_spatial, g.output_spatial, g.c, g.k, g.padding, True,
                        tuple(g.stride))


def tap_phases(taps: int, stride: int, padding: int, dilation: int) -> frozenset:
    """The phases (offset mod stride) of one axis's taps, offsets tap*dilation - padding: each
    phase is a view of x the kernel reads (conv_library.phase_view)."""
    return frozenset((tap * dilation - padding) % stride for tap in range(taps))


def phased_axes(problem: Problem) -> tuple:
    """(PHASED_H, PHASED_W): whether an axis's taps read a phase other than 0 (a stride-2 axis
    whose offsets take both parities, or odd ones); one view of x along it otherwise."""
    g = problem.geometry
    view = implicit_gemm(g)
    return tuple(tap_phases(*axis) != frozenset({0}) for axis in zip(g.filter, view.stride, view.padding, g.dilation))


def _stride_why(problem: Problem) -> Optional[str]:
    """Why the phase views cannot read this convolution's strides, or None."""
    g = problem.geometry
    if g.direction == "dgrad" and any(stride != 1 for stride in g.stride):
        return _strided_dgrad_why(g)
    for name, extent, axis, phased in zip("HW", g.input_spatial, zip(g.filter, g.stride, g.padding, g.dilation),
                                          phased_axes(problem)):
        taps, stride, padding, dilation = axis
        if phased and stride > 2:
            return (f"gluon's implicit GEMM reads a stride past 2 only where every tap lies in phase 0 (a 1x1 filter "
                    f"without padding); stride {list(g.stride)}, filter {list(g.filter)}, padding {list(g.padding)}")
        if phased and extent < stride:
            return f"gluon's phase views need {name} of at least the stride {stride}, not {extent}"
    return None


def _strided_dgrad_why(g) -> Optional[str]:
    """Why a strided dgrad is not one the kernel runs (a 1x1 without leading padding, strides up
    to 2, dx at least the stride along each axis: its phase views), or None."""
    if not strided_pointwise_dgrad(g):
        # dx of a strided conv is a sum over stride phases (the Triton backend's dgrad_phases)
        return (f"gluon's dgrad takes stride 1, or a strided 1x1 without padding, not stride {list(g.stride)} with "
                f"filter {list(g.filter)} and padding {list(g.padding)} (dx by stride phases: the Triton backend's)")
    if any(stride > 2 for stride in g.stride):
        return f"gluon's strided 1x1 dgrad writes dx through phase views of strides up to 2, not {list(g.stride)}"
    for name, extent, stride in zip("HW", g.input_spatial, g.stride):
        if extent < stride:
            return f"gluon's phase views of dx need {name} of at least the stride {stride}, not {extent}"
    return None


# -- the contract's answers -------------------------------------------------------------------------

def _geometry_why(problem: Problem) -> Optional[str]:
    """Why the kernel cannot run this convolution's direction, groups, rank or strides, or None."""
    g = problem.geometry
    if g.direction not in ("fprop", "dgrad"):
        return f"gluon runs the convolution forward and dgrad, not {g.direction}"
    if g.groups != 1:
        return f"gluon's convolution takes groups 1, not {g.groups}"
    if len(g.filter) != 2:
        return f"gluon's convolution takes 2D convolutions, not {len(g.filter)}D"
    return _stride_why(problem)


def _chains_why(problem: Problem) -> Optional[str]:
    """Why the group's fused chains are not the kernel's (an epilogue of its expressions), or None."""
    if problem.prologue:
        return f"gluon fuses no prologue (the group has {', '.join(problem.prologue)})"
    if problem.exits:
        return f"gluon fuses no exits (the group has {', '.join(problem.exits)})"
    for op in problem.epilogue:
        if op not in codegen.EPILOGUE:
            return f"gluon has no epilogue expression for op {op}"
    return None


def _operands_why(problem: Problem, view: ImplicitGemm) -> Optional[str]:
    """Why the GEMM's operands (A and w) are not two NHWC / KRSC tensors of one 16-bit type, or None."""
    source, w = problem.operand(view.source), problem.operand("w")
    if source is None or w is None:
        return "gluon needs both convolution operands"
    for operand in (source, w):
        if operand.data_type.name not in ("float16", "bfloat16"):
            return f"gluon's convolution takes float16 or bfloat16 operands, not {operand.data_type.name}"
    if source.data_type is not w.data_type:
        return f"gluon takes operands of one type, not {source.data_type.name} x {w.data_type.name}"
    itemsize = source.data_type.itemsize
    for name, operand, channels in ((view.source, source, view.channels_name), ("w", w, "C")):
        why = _layout_why(name, operand.dims, operand.strides, itemsize, channels)
        if why is not None:
            return why
    return None


def _output_why(problem: Problem, view: ImplicitGemm) -> Optional[str]:
    """Why the one output and the epilogue operands are not what the kernel stores and reads, or None."""
    if len(problem.outputs) != 1:
        return f"gluon stores one output, the group has {len(problem.outputs)}"
    out = problem.outputs[0]
    if out.data_type.name not in OUT_TYPES:
        return f"gluon stores float16, bfloat16 or float32, not {out.data_type.name}"
    g = problem.geometry
    # the whole output (dx's every pixel where the GEMM writes only its phase (0, 0))
    out_dims = (g.n, view.filters) + tuple(g.input_spatial if g.direction == "dgrad" else g.output_spatial)
    if tuple(out.dims) != out_dims:
        return f"gluon stores the convolution's shape {list(out_dims)}, not {list(out.dims)}"
    why = _layout_why(view.output, out.dims, out.strides, out.data_type.itemsize, view.filters_name)
    if why is not None:
        return why
    for operand in problem.operands:
        if operand.role not in (view.source, "w") and conv_codegen.operand_form(operand.dims, out_dims) is None:
            return (f"gluon's conv epilogue reads scalars and per-channel vectors, not an operand of shape "
                    f"{list(operand.dims)}")
    return None


def supports(problem: Problem) -> Union[bool, str]:
    why = _geometry_why(problem) or _chains_why(problem)
    if why is None:
        view = implicit_gemm(problem.geometry)
        why = _operands_why(problem, view) or _output_why(problem, view)
    return True if why is None else why


def _sizes(problem: Problem) -> tuple:
    """(GEMM rows: output pixels, columns, reduction channels a tap, taps)."""
    g = problem.geometry
    view = implicit_gemm(g)
    pixels = g.n
    for size in view.out_spatial:
        pixels *= size
    taps = 1
    for size in g.filter:
        taps *= size
    return pixels, view.filters, view.channels, taps


def tile_count(problem: Problem, config: ConvConfig) -> int:
    view = implicit_gemm(problem.geometry)
    p, q = view.out_spatial
    return problem.geometry.n * -(-p // config.block_h) * -(-q // config.block_w) * -(-view.filters // config.block_n)


def modeled_seconds(problem: Problem, config: ConvConfig, target: Target) -> float:
    """The config model's seconds (the module docstring's formula): what orders the configs."""
    pixels, filters, channels, taps = _sizes(problem)
    peak = target.peak(IN_TYPES[problem.operand("w").data_type.name])
    moved = sum(o.numel * o.data_type.itemsize for o in problem.operands + problem.outputs)
    tiles = tile_count(problem, config)
    tile_use = pixels * filters / (tiles * config.block_m * config.block_n)
    channel_use = channels / (-(-channels // config.block_k) * config.block_k)
    waves = -(-tiles // target.sms)
    efficiency = tiles / (waves * target.sms)
    compute = 2.0 * pixels * filters * taps * channels / peak / (tile_use * channel_use)
    return max(compute, moved / target.bandwidth) / efficiency + LAUNCH_SECONDS


def _fitting(problem: Problem, target: Target, configs: Optional[tuple] = None) -> list:
    """The configs of `configs` (None: CONFIGS) that fit the target's shared memory, BLOCK_K fitted to the
    reduction's channels (C in fprop, K in dgrad) and the epilogue walk chosen (looped), in that order."""
    in_bytes = problem.operand("w").data_type.itemsize
    out_bytes = problem.outputs[0].data_type.itemsize
    heavy = any(op in HEAVY_OPS for op in problem.epilogue)
    reduction = implicit_gemm(problem.geometry).channels
    found = []
    for config in CONFIGS if configs is None else configs:
        config = replace(config, block_k=block_k_for(reduction))
        config = replace(config, epilogue_loop=looped(config, heavy))
        if shared_bytes(config, in_bytes, out_bytes) <= target.shared_memory:
            found.append(config)
    return found


def estimate(problem: Problem, config: ConvConfig, target: Target) -> Optional[float]:
    """Seconds the registry compares with other backends': the measured rate of the problem's
    direction and shape class (heuristics/conv_measured.py) for the best config, the others in
    their model's ratio to it; None outside the measured classes and sizes (the registry then
    ranks by preference)."""
    if not isinstance(config, ConvConfig):
        return None
    measured = conv_measured.measured_seconds(MEASURED_AS, problem, target)
    if measured is None:
        return None
    modeled = modeled_seconds(problem, config, target)
    best = min([modeled_seconds(problem, fitting, target) for fitting in _fitting(problem, target)], default=modeled)
    return conv_measured.calibrated(modeled, min(best, modeled), measured)


def candidates(backend_name: str, problem: Problem, target: Target, configs: Optional[tuple] = None) -> list:
    """The configs of `configs` (None: CONFIGS) that fit (_fitting), best first by the config model
    (ties: the order given), each with its estimate(): none outside the measured shape classes and
    sizes."""
    fitting = _fitting(problem, target, configs)
    modeled = [modeled_seconds(problem, config, target) for config in fitting]
    order = sorted(range(len(fitting)), key=lambda i: (modeled[i], i))
    return [Candidate(backend_name, fitting[i], estimate(problem, fitting[i], target)) for i in order]


def _chosen(problem: Problem, target: Target, offered: list, candidate: Optional[Candidate]) -> Candidate:
    """The candidate to lower: the given one's config (any of CONFIGS' shapes or another that
    fits; BLOCK_K as given), else the first offered."""
    if candidate is None or not isinstance(candidate.config, ConvConfig):
        if not offered:
            raise UnsupportedError(f"{problem.where}: no gluon conv config fits {target.name}'s shared memory")
        return offered[0]
    config = candidate.config
    in_bytes = problem.operand("w").data_type.itemsize
    out_bytes = problem.outputs[0].data_type.itemsize
    if shared_bytes(config, in_bytes, out_bytes) > target.shared_memory or config.block_h % config.consumers:
        raise UnsupportedError(f"{problem.where}: gluon config {config.text} is not one this problem can run on "
                               f"{target.name} (its shared memory or its rows)")
    return Candidate(candidate.backend, config, estimate(problem, config, target))


def lower(graph, group, problem: Problem, context, offered: list, candidate: Optional[Candidate]) -> list:
    """One persistent launch (grid = min(tiles, SMs)) of the chosen config."""
    target = context.target
    chosen = _chosen(problem, target, offered, candidate)
    config, g = chosen.config, problem.geometry
    view = implicit_gemm(g)
    node = group.anchor
    source, w = node.inputs[:2]  # fprop (x, w), dgrad (dy, w)
    out = group.outputs[0]
    sizes = _launch_sizes(view, g, source, w, out)
    phased = phased_axes(problem)
    # dgrad reads the filter flipped (implicit_gemm): back to front in cross-correlation
    flip = (node.attrs.mode == "convolution") != (g.direction == "dgrad")
    constexprs = {"BLOCK_H": config.block_h, "BLOCK_W": config.block_w, "BLOCK_N": config.block_n,
                  "BLOCK_K": config.block_k, "STAGES": config.stages, "GROUP_M": config.group_m,
                  "CONSUMERS": config.consumers, "EPILOGUE_N": config.epilogue_n, "PRODUCER_REGS": PRODUCER_REGS,
                  "CONSUMER_REGS": CONSUMER_REGS, "FLIP": flip,
                  "EPILOGUE_LOOP": config.epilogue_loop, "STRIDE_H": view.stride[0], "STRIDE_W": view.stride[1],
                  "PHASED_H": phased[0], "PHASED_W": phased[1], "B_K_MAJOR": view.b_k_major,
                  "OUT_STRIDE_H": view.out_stride[0], "OUT_STRIDE_W": view.out_stride[1]}
    stem = f"dnngraph_gluon_{group.kind}_{node.op}"
    source_text = conv_codegen.render(stem, group.summary(), (source.uid, w.uid, out.uid), sizes, node.outputs[0],
                                      tuple(group.epilogue), tuple(out.dim), constexprs, problem.fast_math)
    tiles = tile_count(problem, config)
    programs = max(1, min(tiles, target.sms))
    modeled = modeled_seconds(problem, config, target)  # the config model's, whether or not the registry ranks by it
    ranked = estimate(problem, config, target) if g.direction == "fprop" else None
    measured = f", {ranked * 1e6:.1f} us at the measured rate" if ranked is not None else ""
    reason = (f"{config.text}: model {modeled * 1e6:.1f} us{measured} ({tiles} tiles on {programs} persistent "
              f"programs{_views_text(view.stride, phased)}{_dgrad_text(g)})")
    launch = launch_of(group, source_text, (programs,), WARPS, config.text + f" grid={programs}", reason)
    if view.out_stride != (1, 1):
        return _with_zero_phases(launch, graph, group, problem, context)
    launch.alternative = _unaligned_fallback(graph, group, problem, context)
    if launch.alternative is None:  # an unaligned call would run the TMA kernel: let Triton take it
        raise UnsupportedError(f"{problem.where}: no pointer-load fallback for unaligned calls")
    return [launch]


def _with_zero_phases(launch, graph, group, problem: Problem, context) -> list:
    """A strided 1x1 dgrad's launches: the gluon kernel (dx's phase (0, 0)), then the Triton
    backend's launches of dx's other stride phases, which no tap reaches (the epilogue of zeros:
    pointer stores, any alignment). An unaligned call runs the Triton launch of phase (0, 0) in
    the gluon kernel's place, so the list is the Triton backend's dgrad whole."""
    from ..triton.heuristics.conv import dgrad_phases

    triton = _triton_launches(graph, group, problem, context)
    g = problem.geometry
    phases = dgrad_phases(g.input_spatial, g.filter, g.stride, g.padding, g.dilation, False)
    # the Triton backend's order: phase (0, 0) (the one tap) first, then the phases no tap reaches
    zero_phases = all(0 in phase.taps for phase in phases[1:]) and phases[0].phase == (0, 0)
    if triton is None or len(triton) != len(phases) or not zero_phases:
        raise UnsupportedError(f"{problem.where}: the Triton backend poses this dgrad in {len(triton or ())} "
                               f"launches, not one per stride phase ({len(phases)}) with phase (0, 0) first")
    launch.alternative = triton[0]
    for zero in triton[1:]:
        zero.reason = "dx's stride phase no tap reaches (the epilogue of zeros), by the Triton backend's kernel"
    return [launch] + triton[1:]


def _launch_sizes(view: ImplicitGemm, g, source, w, out) -> dict:
    """The kernel's SIZES (conv_codegen.SIZES): A's (x's or dy's) and the output's extents and
    NHWC strides, w's strides along its own axes, the taps' padding and dilation."""
    _, (x_n, x_h, x_w) = nhwc_strides(tuple(source.dim), tuple(source.stride))
    _, (w_k, w_r, w_s) = nhwc_strides(tuple(w.dim), tuple(w.stride))
    _, (y_n, y_h, y_w) = nhwc_strides(tuple(out.dim), tuple(out.stride))
    (rows, cols), (p, q) = view.source_spatial, view.out_spatial
    (pad_h, pad_w), (dil_h, dil_w) = view.padding, g.dilation
    return {"images": g.n, "x_rows": rows, "x_cols": cols, "channels": view.channels, "x_stride_n": x_n,
            "x_stride_h": x_h, "x_stride_w": x_w, "filters": view.filters, "taps_h": g.filter[0],
            "taps_w": g.filter[1], "w_stride_k": w_k, "w_stride_r": w_r, "w_stride_s": w_s, "out_h": p, "out_w": q,
            "y_stride_n": y_n, "y_stride_h": y_h, "y_stride_w": y_w, "pad_h": pad_h, "pad_w": pad_w,
            "dil_h": dil_h, "dil_w": dil_w, "y_rows": int(out.dim[2]), "y_cols": int(out.dim[3])}


def _dgrad_text(g) -> str:
    """How a dgrad is run, for the launch's reason ("" for the forward)."""
    if g.direction != "dgrad":
        return ""
    view = implicit_gemm(g)
    if view.out_stride != (1, 1):
        return (f", dgrad as the 1x1 over dy into dx's pixels {list(view.out_stride)} apart, the epilogue of zeros "
                f"into the others")
    return f", dgrad as the forward over dy with the filter flipped and padding {list(view.padding)}"


def _views_text(stride: tuple, phased: tuple) -> str:
    """How x is read, for the launch's reason: "" at stride 1, else the stride and phase views."""
    if all(s == 1 for s in stride):
        return ""
    views = (2 if phased[0] else 1) * (2 if phased[1] else 1)
    return f", stride {list(stride)} through {views} phase view{'s' if views > 1 else ''} of x"


def _unaligned_fallback(graph, group, problem, context) -> Optional[KernelLaunch]:
    """The launch that runs where a pointer is below 16-byte alignment (no TMA descriptor can
    take it): the Triton backend's tiled implicit GEMM of the same group (no split-K: one
    launch), or None where it lowers to anything but one launch without scratch."""
    built = _triton_launches(graph, group, problem, context)
    return built[0] if built is not None and len(built) == 1 and not built[0].scratch else None


def _triton_launches(graph, group, problem, context) -> Optional[list]:
    """The Triton backend's launches of the group at its tiled config (1x1 convs are posed as
    matmuls: that config too), or None where it does not lower it."""
    from ..triton.backend import TRITON
    from ..triton.heuristics.matmul import MatmulConfig

    tiled = MatmulConfig("tiled", 64, 64, 32, 4, 3)
    options = replace(context.options, conv_config=tiled, matmul_config=tiled, autotune=False)
    try:
        return TRITON.lower(graph, group, problem, replace(context, options=options, tuner=None))
    except UnsupportedError:
        return None
