"""Convolutions, bf16 NHWC, against cuDNN (through torch and the cuDNN frontend) and torch.compile.

One process, providers side by side per layer. Rows (one table each):

  fprop      y = relu(conv(x, w) + bias) on the distinct conv layers of torchvision's ResNet-50 at
             N=32, 224x224, plus the stem at N=64 and N=256. Anchors: cuDNN+sep (F.conv2d with cudnn.benchmark, then + bias and relu
             as separate eager ops), compile (torch.compile of that function), cuDNN FE (the
             frontend graph conv_fprop -> bias -> relu, one fused plan)
  dgrad      dx from dy and w (ResNet-50 layers). Anchors: torch.nn.grad.conv2d_input (cuDNN), aten bwd
             (aten.convolution_backward on the real NHWC tensors, as autograd calls it), cuDNN FE
  wgrad      dw from dy and x (ResNet-50 layers, plus the stem at N=64). Anchors:
             torch.nn.grad.conv2d_weight, aten bwd, cuDNN FE
  stats      y = conv(x, w) with the per-channel sum and sum of squares of y (BatchNorm training
             statistics; dnngraph: conv_fprop -> genstats, one graph). Anchors: conv+BN (cuDNN conv,
             then F.batch_norm(training=True), which also normalizes), its torch.compile, and
             conv+sums (cuDNN conv, then the two float32 sums in eager torch: the same outputs)
  depthwise  fprop + bias + relu, MobileNetV2 3x3 and ConvNeXt-T 7x7 depthwise layers, against
             torch eager and torch.compile
  other      fprop + bias + relu, a 3x3x3 3D conv and a kernel-3 1D conv, against eager and compile
  int8       y = relu(conv(x8, w8) * scale + bias): int8 NHWC x and w, int32 accumulation, a
             per-channel float scale (dequantization), bf16 y, on the ResNet-50 layers. torch has no
             CUDA int8 convolution, so the anchors are the cuDNN frontend's int8 graph (conv_fprop
             of INT8 tensors computing in INT32, then scale, bias and relu; layers cuDNN's int8
             engines refuse, as C not a multiple of 4, print n/a) and, as the reference point,
             cuDNN's bf16 conv of the same layer through torch (+ scale, bias, relu as eager ops)
  int8_dgrad dx = conv_dgrad(dy8, w8) * scale: int8 NHWC dy and w, int32 accumulation, a per-tensor
             float scale (dequantization), bf16 dx (ResNet-50 layers). Anchors: cuDNN's bf16 dgrad
             of the same layer (torch.nn.grad.conv2d_input, aten bwd), the path a user has today
  int8_wgrad dw = conv_wgrad(dy8, x8) * scale, as int8_dgrad; anchors torch.nn.grad.conv2d_weight
             and aten bwd in bf16

dnngraph providers: "dg" is g.build() (the heuristics' first choice); "dg tuned" is
g.build(autotune=True), with --autotune. Throughput is TFLOP/s over 2*N*K*prod(output spatial)*
C/groups*prod(filter) (epilogue and statistics flops ignored); ratios are anchor time / dnngraph time
(> 1: dnngraph faster). Each provider's output is compared with a float32 torch reference (TF32
off) on the same inputs before it is timed: relative errors past TOLERANCE print "(!)". Inputs are
random normal (x, dy ~ N(0, 1); w scaled so y ~ N(0, 1); bias ~ N(0, 0.25)). A provider that
fails prints "n/a" (the reason is listed under the tables) and the run goes on. Goals, checked at
the end against the "dg" build: fprop geomean >= 1.0x cuDNN FE with no layer below 0.7x; dgrad and
wgrad geomean >= 0.9x the faster cuDNN (torch or FE) per layer; depthwise >= 1.0x eager; stats
>= 1.2x conv+BN.

    python benchmarks/bench_conv.py                          # GPU, every row; $OUT/conv.json
    python benchmarks/bench_conv.py --quick                  # a few layers per row
    python benchmarks/bench_conv.py --rows fprop,stats --autotune --only layer3
    python benchmarks/bench_conv.py --cudnn-fe-path /tmp/fe  # a pip --target folder holding `cudnn`
    python benchmarks/bench_conv.py --rows fprop --gluon --cudnn-fe-path /tmp/fe --no-compile
                                                             # "dg": Triton alone; "dg gluon": Gluon where it runs
    python benchmarks/bench_conv.py --rows dgrad --gluon --cudnn-fe-path /tmp/fe --no-compile
                                                             # the same for the dgrad (Gluon: stride 1)
    python benchmarks/bench_conv.py --rows wgrad --gluon --cudnn-fe-path /tmp/fe --no-compile
    python benchmarks/bench_conv.py --list-shapes            # the layers of each row, no device needed
    python benchmarks/bench_conv.py --check-cpu              # tiny fp32 shapes through dnngraph on CPU

--check-cpu runs no timing: each row's graph on tiny fp32 shapes through Triton's interpreter,
compared with float64 torch, and the torch references cross-checked against g.reference(). It exits
0 when all pass, 2 when the only failures are graphs dnngraph cannot build yet (UnsupportedError),
1 otherwise. The dnngraph builds use a fresh DNNGRAPH_CACHE_DIR unless --reuse-cache.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

if "--check-cpu" in sys.argv[1:]:  # CPU tensors run through Triton's interpreter, GPU or not
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

import dnngraph as dg  # first: on a CPU-only machine it selects Triton's interpreter before triton loads
import triton
from bench_matmul import _failed, _geomean, _host_us, _short, _sync, _tflops, flush_us, frontend_from_args
from common import cpu_exit, family_parser, median_ms, print_table, rel_error, run_family, run_rows

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
TOLERANCE = 2e-2  # bf16 outputs against the float32 reference
CPU_TOLERANCE = 1e-4  # fp32 through the interpreter against float64
BN_EPS = 1e-5

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_INPUT = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
CONV_WEIGHT = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


# --- shapes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvShape:
    """One convolution: x [N, C, *size], w [K, C/groups, *kernel]; per-axis stride/padding/dilation."""

    label: str
    n: int
    c: int
    k: int
    size: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int = 1

    @property
    def spatial(self) -> int:
        return len(self.size)

    @property
    def out_size(self) -> tuple:
        return tuple((s + 2 * p - d * (r - 1) - 1) // st + 1 for s, r, st, p, d in
                     zip(self.size, self.kernel, self.stride, self.padding, self.dilation))

    @property
    def x_dim(self) -> tuple:
        return (self.n, self.c) + self.size

    @property
    def w_dim(self) -> tuple:
        return (self.k, self.c // self.groups) + self.kernel

    @property
    def y_dim(self) -> tuple:
        return (self.n, self.k) + self.out_size

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.k * math.prod(self.out_size) * (self.c // self.groups) * math.prod(self.kernel)

    def geometry(self) -> dict:
        """stride / padding / dilation / groups as torch's conv functions take them."""
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)

    def describe(self) -> str:
        size, kernel = "x".join(map(str, self.size)), "x".join(map(str, self.kernel))
        group = f" g{self.groups}" if self.groups > 1 else ""
        return (f"N{self.n} C{self.c} K{self.k} {size} {kernel}/{self.stride[0]} "
                f"p{self.padding[0]}{group}")


def conv_shape(label, n, c, k, size, kernel, stride=1, padding=0, groups=1, spatial=2) -> ConvShape:
    """A ConvShape with int arguments expanded to every spatial axis."""
    def axes(value):
        return tuple(value) if isinstance(value, (tuple, list)) else (value,) * spatial
    return ConvShape(label, n, c, k, axes(size), axes(kernel), axes(stride), axes(padding), axes(1), groups)


BATCH = 32
# (first module name, C, K, H=W, filter, stride, padding): the distinct Conv2d layers of torchvision's
# resnet50() on 224x224 in forward order, deduplicated by (C, K, H, W, R, S, stride, padding); used
# when torchvision is not importable. layer1.0.downsample.0 has layer1.0.conv3's key.
RESNET50_FALLBACK = [
    ("conv1", 3, 64, 224, 7, 2, 3),
    ("layer1.0.conv1", 64, 64, 56, 1, 1, 0), ("layer1.0.conv2", 64, 64, 56, 3, 1, 1),
    ("layer1.0.conv3", 64, 256, 56, 1, 1, 0), ("layer1.1.conv1", 256, 64, 56, 1, 1, 0),
    ("layer2.0.conv1", 256, 128, 56, 1, 1, 0), ("layer2.0.conv2", 128, 128, 56, 3, 2, 1),
    ("layer2.0.conv3", 128, 512, 28, 1, 1, 0), ("layer2.0.downsample.0", 256, 512, 56, 1, 2, 0),
    ("layer2.1.conv1", 512, 128, 28, 1, 1, 0), ("layer2.1.conv2", 128, 128, 28, 3, 1, 1),
    ("layer3.0.conv1", 512, 256, 28, 1, 1, 0), ("layer3.0.conv2", 256, 256, 28, 3, 2, 1),
    ("layer3.0.conv3", 256, 1024, 14, 1, 1, 0), ("layer3.0.downsample.0", 512, 1024, 28, 1, 2, 0),
    ("layer3.1.conv1", 1024, 256, 14, 1, 1, 0), ("layer3.1.conv2", 256, 256, 14, 3, 1, 1),
    ("layer4.0.conv1", 1024, 512, 14, 1, 1, 0), ("layer4.0.conv2", 512, 512, 14, 3, 2, 1),
    ("layer4.0.conv3", 512, 2048, 7, 1, 1, 0), ("layer4.0.downsample.0", 1024, 2048, 14, 1, 2, 0),
    ("layer4.1.conv1", 2048, 512, 7, 1, 1, 0), ("layer4.1.conv2", 512, 512, 7, 3, 1, 1),
]

DEPTHWISE = [  # MobileNetV2 (expanded 3x3 depthwise) and ConvNeXt-T (7x7 depthwise, stages 1-2)
    conv_shape("mbv2 144@56", BATCH, 144, 144, 56, 3, 1, 1, groups=144),
    conv_shape("mbv2 144@56/2", BATCH, 144, 144, 56, 3, 2, 1, groups=144),
    conv_shape("mbv2 192@28", BATCH, 192, 192, 28, 3, 1, 1, groups=192),
    conv_shape("mbv2 384@14", BATCH, 384, 384, 14, 3, 1, 1, groups=384),
    conv_shape("convnext 96@56 7x7", BATCH, 96, 96, 56, 7, 1, 3, groups=96),
    conv_shape("convnext 192@28 7x7", BATCH, 192, 192, 28, 7, 1, 3, groups=192),
]
OTHER = [
    conv_shape("3d 64@16x56x56", 4, 64, 64, (16, 56, 56), 3, 1, 1, spatial=3),
    conv_shape("1d 256@4096", BATCH, 256, 256, 4096, 3, 1, 1, spatial=1),
]
# The stem at the batches its cliffs were measured at on the H100, per filter tap (wgrad at N=64:
# 2815 us against ~250 us for cuDNN; fprop at N=64: 850 us against ~390, at N=256: 3333 us against
# 1522): the cases of the few-channel tap fold (heuristics/conv.py fold_taps).
STEM_N64 = conv_shape("conv1 N64 (stem)", 64, 3, 64, 224, 7, 2, 3)
EXTRA = {"wgrad": [STEM_N64], "fprop": [STEM_N64, conv_shape("conv1 N256 (stem)", 256, 3, 64, 224, 7, 2, 3)]}
QUICK = ("conv1 N64 (stem)", "layer1.0.conv2", "layer2.0.conv2", "layer3.1.conv1", "layer4.1.conv2",
         "mbv2 144@56", "convnext 96@56 7x7", "3d 64@16x56x56", "1d 256@4096")
CPU_SHAPES = {  # tiny odd sizes for --check-cpu
    "fprop": [conv_shape("cpu 3x3/2", 2, 5, 6, (9, 7), 3, 2, 1), conv_shape("cpu 1x1", 3, 8, 4, 5, 1),
              conv_shape("cpu stem 7x7/2", 2, 3, 6, (13, 11), 7, 2, 3)],
    "dgrad": [conv_shape("cpu 3x3/2", 2, 5, 6, (9, 7), 3, 2, 1)],
    "wgrad": [conv_shape("cpu 3x3/2", 2, 5, 6, (9, 7), 3, 2, 1),
              conv_shape("cpu stem 7x7/2", 2, 3, 6, (13, 11), 7, 2, 3)],
    "stats": [conv_shape("cpu 3x3", 2, 5, 6, 7, 3, 1, 1)],
    "depthwise": [conv_shape("cpu dw 3x3", 2, 6, 6, 7, 3, 1, 1, groups=6)],
    "int8": [conv_shape("cpu 3x3/2", 2, 5, 6, (9, 7), 3, 2, 1), conv_shape("cpu 1x1", 3, 8, 4, 5, 1),
             conv_shape("cpu grouped 3x3", 2, 8, 6, 6, 3, 1, 1, groups=2)],
    "int8_dgrad": [conv_shape("cpu 3x3/2", 2, 5, 6, (9, 7), 3, 2, 1), conv_shape("cpu 1x1", 3, 8, 4, 5, 1)],
    "int8_wgrad": [conv_shape("cpu 3x3/2", 2, 5, 6, (9, 7), 3, 2, 1),
                   conv_shape("cpu stem 7x7/2", 2, 3, 6, (13, 11), 7, 2, 3)],
    "other": [conv_shape("cpu 3d", 1, 3, 4, (4, 5, 6), 3, 1, 1, spatial=3),
              conv_shape("cpu 1d", 2, 5, 4, 11, 3, 1, 1, spatial=1)],
}


def resnet50_fallback(batch=BATCH) -> list:
    return [conv_shape(name, batch, c, k, hw, r, s, p) for name, c, k, hw, r, s, p in RESNET50_FALLBACK]


def resnet50_layers(batch=BATCH, image=224) -> tuple:
    """(shapes, source): torchvision's resnet50() traced on the meta device with forward hooks, one
    ConvShape per distinct (C, K, H, W, R, S, stride, padding, dilation, groups), first name kept;
    the hard-coded list when torchvision cannot be used."""
    try:
        import torchvision

        with torch.device("meta"):
            model = torchvision.models.resnet50()
        seen = {}

        def record(name, module, inputs, output):
            x = inputs[0]
            shape = ConvShape(name, batch, x.shape[1], module.out_channels, tuple(x.shape[2:]),
                              tuple(module.kernel_size), tuple(module.stride), tuple(module.padding),
                              tuple(module.dilation), module.groups)
            seen.setdefault(replace(shape, label="", n=0), shape)

        hooks = [module.register_forward_hook(lambda m, i, o, name=name: record(name, m, i, o))
                 for name, module in model.named_modules() if isinstance(module, torch.nn.Conv2d)]
        with torch.no_grad():
            model(torch.empty(1, 3, image, image, device="meta"))
        for hook in hooks:
            hook.remove()
        return list(seen.values()), f"torchvision {torchvision.__version__} resnet50(), traced on the meta device"
    except Exception as error:  # noqa: BLE001 - torchvision missing or not matching this torch
        return resnet50_fallback(batch), f"hard-coded list (torchvision unusable: {_short(error, 120)})"


# --- rows ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowSpec:
    key: str
    op: str  # the graph built: fprop (+ bias + relu), dgrad, wgrad, stats
    title: str
    anchors: tuple  # provider names, in table order
    goal_anchors: tuple  # per layer, the fastest of these is the goal's anchor
    goal_geomean: Optional[float] = None
    goal_min: Optional[float] = None


ROWS = {
    "fprop": RowSpec("fprop", "fprop", "ResNet-50 fprop + bias + relu", ("torch", "compile", "cudnn_fe"),
                     ("cudnn_fe",), 1.0, 0.7),
    "dgrad": RowSpec("dgrad", "dgrad", "ResNet-50 dgrad", ("torch", "autograd", "cudnn_fe"),
                     ("torch", "autograd", "cudnn_fe"), 0.9),
    "wgrad": RowSpec("wgrad", "wgrad", "ResNet-50 wgrad", ("torch", "autograd", "cudnn_fe"),
                     ("torch", "autograd", "cudnn_fe"), 0.9),
    "stats": RowSpec("stats", "stats", "ResNet-50 conv + BN statistics (sum, sum of squares)",
                     ("torch", "compile", "torch_sums"), ("torch",), 1.2),
    "depthwise": RowSpec("depthwise", "fprop", "depthwise fprop + bias + relu", ("torch", "compile"),
                         ("torch",), 1.0),
    "other": RowSpec("other", "fprop", "3D and 1D fprop + bias + relu", ("torch", "compile"), ("torch",)),
    "int8": RowSpec("int8", "int8", "ResNet-50 int8 fprop (int32 accumulate) * channel scale + bias, relu -> bf16",
                    ("torch", "cudnn_fe"), ("cudnn_fe",)),
    "int8_dgrad": RowSpec("int8_dgrad", "int8_dgrad", "ResNet-50 int8 dgrad (int32 accumulate) * scale -> bf16",
                          ("torch", "autograd"), ("torch", "autograd")),
    "int8_wgrad": RowSpec("int8_wgrad", "int8_wgrad", "ResNet-50 int8 wgrad (int32 accumulate) * scale -> bf16",
                          ("torch", "autograd"), ("torch", "autograd")),
}
TITLES = {
    "fprop": {"torch": "cuDNN+sep", "compile": "compile", "cudnn_fe": "cuDNN FE"},
    "dgrad": {"torch": "conv2d_input", "autograd": "aten bwd", "cudnn_fe": "cuDNN FE"},
    "wgrad": {"torch": "conv2d_weight", "autograd": "aten bwd", "cudnn_fe": "cuDNN FE"},
    "stats": {"torch": "conv+BN", "compile": "compile conv+BN", "torch_sums": "conv+sums"},
    "depthwise": {"torch": "eager", "compile": "compile"},
    "other": {"torch": "eager", "compile": "compile"},
    "int8": {"torch": "cuDNN bf16+sep", "cudnn_fe": "cuDNN FE int8"},
    "int8_dgrad": {"torch": "conv2d_input bf16", "autograd": "aten bwd bf16"},
    "int8_wgrad": {"torch": "conv2d_weight bf16", "autograd": "aten bwd bf16"},
}
# the int8 gradient rows: the bf16 op their anchors run
INT8_GRADIENTS = {"int8_dgrad": "dgrad", "int8_wgrad": "wgrad"}
DG_PROVIDERS = {"dg": "dg", "dg_tuned": "dg tuned", "dg_gluon": "dg gluon"}
# --gluon: "dg" built by the Triton backend alone, beside "dg gluon": Gluon wherever it supports the
# layer (built()), Triton for the rest
TRITON_ONLY = ("triton",)
GLUON_FIRST = ("gluon", "triton")


def row_shapes(key, args, resnet) -> list:
    """The layers of row `key` after --quick and --only."""
    shapes = {"depthwise": DEPTHWISE, "other": OTHER}.get(key, resnet + EXTRA.get(key, []))
    if args.quick:
        shapes = [s for s in shapes if s.label in QUICK] or shapes[:3]
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    return [s for s in shapes if not words or any(w in s.label for w in words)]


# --- inputs and references -----------------------------------------------------------------------
def channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """The same values stored with the channel axis (1) innermost: NLC, NHWC or NDHWC."""
    order = (0,) + tuple(range(2, tensor.dim())) + (1,)
    inverse = [order.index(axis) for axis in range(tensor.dim())]
    return tensor.permute(order).contiguous().permute(inverse)


def nhwc_strides(dim) -> tuple:
    """Dense strides of `dim` [N, C, *spatial] with C innermost, then the spatial axes, N outermost."""
    strides, step = [0] * len(dim), 1
    for axis in (1,) + tuple(range(len(dim) - 1, 1, -1)) + (0,):
        strides[axis], step = step, step * dim[axis]
    return tuple(strides)


def poisoned(dim, stride, dtype, device) -> torch.Tensor:
    return torch.empty_strided(tuple(dim), tuple(stride), dtype=dtype, device=device).fill_(float("nan"))


def make_inputs(shape: ConvShape, device, dtype, seed=0) -> dict:
    """x, w, bias (rank-matched [1, K, 1, ...]) and dy, channels-last, random normal."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(dim, scale=1.0):
        return channels_last((scale * torch.randn(dim, generator=gen, device=device)).to(dtype))

    fan_in = (shape.c // shape.groups) * math.prod(shape.kernel)
    return {"x": normal(shape.x_dim), "w": normal(shape.w_dim, 1 / math.sqrt(fan_in)),
            "bias": normal((1, shape.k) + (1,) * shape.spatial, 0.5), "dy": normal(shape.y_dim)}


def int8_inputs(shape: ConvShape, device, seed=1) -> dict:
    """The int8 row's operands, channels-last: x8 and w8 over the whole int8 range, and a
    per-channel float32 scale that brings y near N(0, 1) (a uniform int8 value has standard
    deviation ~74, so one product ~5476, a sum of fan_in of them sqrt(fan_in) times that)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fan_in = (shape.c // shape.groups) * math.prod(shape.kernel)
    quantized = lambda dim: channels_last(torch.randint(-128, 128, dim, generator=gen, device=device,
                                                        dtype=torch.int8))
    spread = 0.5 + torch.rand((1, shape.k) + (1,) * shape.spatial, generator=gen, device=device)
    # the gradients' per-tensor scales: dgrad sums K/groups x taps products, wgrad N x pixels
    per_tensor = lambda fan: torch.full((1,) * (shape.spatial + 2), 1 / (5476.0 * math.sqrt(fan)), device=device)
    return {"x8": quantized(shape.x_dim), "w8": quantized(shape.w_dim), "dy8": quantized(shape.y_dim),
            "scale": spread / (5476.0 * math.sqrt(fan_in)),
            "dgrad_scale": per_tensor(shape.k // shape.groups * math.prod(shape.kernel)),
            "wgrad_scale": per_tensor(shape.n * math.prod(shape.out_size))}


def int8_gradient_references(op: str, shape: ConvShape, inputs, dtype) -> dict:
    """The int8 gradient row's output (the integer gradient exact in float64, times the scale) and,
    as flavour "<dx|dw>_bf16", the same gradient of the bf16 tensors the anchors read."""
    dy8, dy = inputs["dy8"].double(), inputs["dy"].double()
    if op == "int8_dgrad":
        grad = lambda dy, w: CONV_INPUT[shape.spatial](shape.x_dim, w, dy, **shape.geometry())
        exact, bf16 = grad(dy8, inputs["w8"].double()), grad(dy, inputs["w"].double())
    else:
        grad = lambda dy, x: CONV_WEIGHT[shape.spatial](x, shape.w_dim, dy, **shape.geometry())
        exact, bf16 = grad(dy8, inputs["x8"].double()), grad(dy, inputs["x"].double())
    name = FLAVOUR[op]
    return {name: ((exact * inputs[op[5:] + "_scale"].double()).to(dtype),), name + "_bf16": (bf16.to(dtype),)}


def int8_references(shape: ConvShape, inputs, dtype) -> dict:
    """y of the int8 row (the integer conv exact in float64, then the float epilogue) and, as flavour
    "y_bf16", the same layer on the bf16 x and w the bf16 anchor convolves."""
    conv = CONV[shape.spatial]
    bias, scale = inputs["bias"].double(), inputs["scale"].double()
    exact = conv(inputs["x8"].double(), inputs["w8"].double(), None, **shape.geometry())
    bf16 = conv(inputs["x"].double(), inputs["w"].double(), None, **shape.geometry())
    return {"y": (torch.relu(exact * scale + bias).to(dtype),), "y_bf16": (torch.relu(bf16 * scale + bias).to(dtype),)}


def stat_axes(spatial: int) -> tuple:
    return (0,) + tuple(range(2, 2 + spatial))


def references(op, shape: ConvShape, inputs, dtype) -> dict:
    """flavour -> tuple of reference outputs in `dtype` (one flavour per output set a provider makes)."""
    if op == "int8":
        return int8_references(shape, inputs, dtype)
    if op in INT8_GRADIENTS:
        return int8_gradient_references(op, shape, inputs, dtype)
    x, w = inputs["x"].to(dtype), inputs["w"].to(dtype)
    conv = CONV[shape.spatial]
    if op == "fprop":
        return {"y": (torch.relu(conv(x, w, None, **shape.geometry()) + inputs["bias"].to(dtype)),)}
    if op == "dgrad":
        return {"dx": (CONV_INPUT[shape.spatial](shape.x_dim, w, inputs["dy"].to(dtype), **shape.geometry()),)}
    if op == "wgrad":
        return {"dw": (CONV_WEIGHT[shape.spatial](x, shape.w_dim, inputs["dy"].to(dtype), **shape.geometry()),)}
    y = conv(x, w, None, **shape.geometry())
    axes = stat_axes(shape.spatial)
    total, squares = y.double().sum(axes, keepdim=True), y.double().square().sum(axes, keepdim=True)
    mean, var = y.mean(axes, keepdim=True), y.var(axes, unbiased=False, keepdim=True)
    return {"stats": (y, total, squares), "bn": ((y - mean) * torch.rsqrt(var + BN_EPS),)}


# --- torch anchors (module level: torch.compile caches per function) -----------------------------
def conv_bias_relu(x, w, bias, stride, padding, dilation, groups):
    y = CONV[x.dim() - 2](x, w, None, stride, padding, dilation, groups)
    return torch.relu(y + bias)


def conv_batchnorm(x, w, stride, padding, dilation, groups):
    y = CONV[x.dim() - 2](x, w, None, stride, padding, dilation, groups)
    return F.batch_norm(y, None, None, training=True, eps=BN_EPS)


def conv_sums(x, w, stride, padding, dilation, groups):
    y = CONV[x.dim() - 2](x, w, None, stride, padding, dilation, groups)
    wide, axes = y.float(), stat_axes(x.dim() - 2)
    return y, wide.sum(axes, keepdim=True), wide.square().sum(axes, keepdim=True)


def geometry_args(shape: ConvShape) -> tuple:
    return shape.stride, shape.padding, shape.dilation, shape.groups


class Skipped(Exception):
    """A provider not run (not requested, budget spent): status "skipped", not "n/a"."""


def torch_provider(row: RowSpec, shape: ConvShape, inputs) -> Callable:
    """factory() -> (run, outputs, flavour, extra) of the eager cuDNN anchor of `row`."""
    x, w, dy, bias, geo = inputs["x"], inputs["w"], inputs["dy"], inputs["bias"], geometry_args(shape)
    if row.op in INT8_GRADIENTS:  # the bf16 gradient a user runs today, checked against its own reference
        run, outputs, flavour, extra = torch_provider(replace(row, op=INT8_GRADIENTS[row.op]), shape, inputs)()
        return lambda: (run, outputs, flavour + "_bf16", extra)
    if row.op == "dgrad":
        fn = CONV_INPUT[shape.spatial]
        return lambda: ((lambda: fn(shape.x_dim, w, dy, *geo)), None, "dx", {})
    if row.op == "wgrad":
        fn = CONV_WEIGHT[shape.spatial]
        return lambda: ((lambda: fn(x, shape.w_dim, dy, *geo)), None, "dw", {})
    if row.op == "stats":
        return lambda: ((lambda: conv_batchnorm(x, w, *geo)), None, "bn", {})
    if row.op == "int8":  # the bf16 reference point: cuDNN's bf16 conv, then scale, bias, relu
        scale = inputs["scale"].to(x.dtype)
        return lambda: ((lambda: torch.relu(CONV[shape.spatial](x, w, None, *geo) * scale + bias)), None, "y_bf16", {})
    return lambda: ((lambda: conv_bias_relu(x, w, bias, *geo)), None, "y", {})


def compile_provider(row: RowSpec, shape: ConvShape, inputs, ctx) -> Callable:
    """factory of torch.compile(the eager anchor), skipped once the compile budget is spent."""
    def factory():
        if ctx.args.no_compile:
            raise Skipped("--no-compile")
        if time.perf_counter() > ctx.compile_deadline:
            raise Skipped("torch.compile time budget spent (--compile-budget-s)")
        eager = conv_batchnorm if row.op == "stats" else conv_bias_relu
        if eager not in ctx.compiled:
            ctx.compiled[eager] = torch.compile(eager, dynamic=False)
        compiled = ctx.compiled[eager]
        x, w, geo = inputs["x"], inputs["w"], geometry_args(shape)
        if row.op == "stats":
            return (lambda: compiled(x, w, *geo)), None, "bn", {}
        return (lambda: compiled(x, w, inputs["bias"], *geo)), None, "y", {}
    return factory


def autograd_provider(row: RowSpec, shape: ConvShape, inputs) -> Callable:
    """aten.convolution_backward on the real NHWC x and w, one gradient asked for: what autograd runs
    in training. (torch.nn.grad.conv2d_input passes x as an expanded stride-0 tensor, which can steer
    cuDNN to another layout.)"""
    op = INT8_GRADIENTS.get(row.op, row.op)  # an int8 row's anchor: the bf16 gradient
    x, w, dy, wanted = inputs["x"], inputs["w"], inputs["dy"], int(op == "wgrad")
    args = (list(shape.stride), list(shape.padding), list(shape.dilation), False, [0] * shape.spatial, shape.groups,
            [wanted == 0, wanted == 1, False])
    backward = torch.ops.aten.convolution_backward
    flavour = FLAVOUR[op] + ("_bf16" if row.op in INT8_GRADIENTS else "")
    return lambda: ((lambda: backward(dy, x, w, None, *args)[wanted]), None, flavour, {})


def sums_provider(shape: ConvShape, inputs) -> Callable:
    x, w, geo = inputs["x"], inputs["w"], geometry_args(shape)
    return lambda: ((lambda: conv_sums(x, w, *geo)), None, "stats", {})


# --- the cuDNN frontend --------------------------------------------------------------------------
class CudnnConv:
    """cuDNN frontend (cudnn.pygraph) convolution graphs on NHWC bf16 tensors, float32 inside.

    Calls, as in the frontend's test/python (test_conv_bias.py, test_conv_fuzzer.py, test_wgrads.py):
    pygraph(io_data_type, intermediate_data_type, compute_data_type, handle), tensor(name, dim,
    stride, data_type), conv_fprop(image, weight, padding, stride, dilation), bias(input, bias),
    relu(input), conv_dgrad(loss, filter, padding, stride, dilation), conv_wgrad(image, loss,
    padding, stride, dilation), set_output / set_dim / set_stride / set_data_type (dgrad and wgrad
    outputs need their dims set: cuDNN cannot infer them), validate, build_operation_graph,
    create_execution_plans([heur_mode.A, heur_mode.FALLBACK]), check_support, build_plans,
    get_workspace_size, execute(variant_pack, workspace, handle=...). Used for groups=1 2D layers only.
    """

    def __init__(self, module):
        self.fe = module
        self.handle = module.create_handle()
        module.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)

    def _graph(self):
        fe = self.fe
        return fe.pygraph(io_data_type=fe.data_type.BFLOAT16, intermediate_data_type=fe.data_type.FLOAT,
                          compute_data_type=fe.data_type.FLOAT, handle=self.handle)

    def _tensor(self, g, name, value):
        return g.tensor(name=name, dim=list(value.shape), stride=list(value.stride()),
                        data_type=self.fe.data_type.BFLOAT16)

    def _output(self, tensor, buffer):
        tensor.set_output(True).set_dim(list(buffer.shape)).set_stride(list(buffer.stride()))
        tensor.set_data_type(self.fe.data_type.BFLOAT16)
        return tensor

    def _finish(self, g, pack) -> Callable:
        fe = self.fe
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([fe.heur_mode.A, fe.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        handle = self.handle
        return lambda: g.execute(pack, workspace, handle=handle)

    @staticmethod
    def _geometry(shape: ConvShape) -> dict:
        return dict(padding=list(shape.padding), stride=list(shape.stride), dilation=list(shape.dilation))

    def fprop_bias_relu(self, shape: ConvShape, x, w, bias):
        g = self._graph()
        X, W, B = self._tensor(g, "x", x), self._tensor(g, "w", w), self._tensor(g, "bias", bias)
        conv = g.conv_fprop(image=X, weight=W, name="conv", **self._geometry(shape))
        Y = g.relu(input=g.bias(input=conv, bias=B, name="bias_add"), name="relu")
        y = poisoned(shape.y_dim, nhwc_strides(shape.y_dim), BF16, "cuda")
        return self._finish(g, {X: x, W: w, B: bias, self._output(Y, y): y}), y

    def int8_fprop_scale_bias_relu(self, shape: ConvShape, x8, w8, scale, bias):
        """The int8 row's graph: INT8 x and w, conv computing in INT32, then float scale, bias and
        relu into bf16 (the frontend's int8 conv tests' form; cuDNN wants NHWC, C a multiple of 4)."""
        fe = self.fe
        g = fe.pygraph(io_data_type=fe.data_type.INT8, intermediate_data_type=fe.data_type.FLOAT,
                       compute_data_type=fe.data_type.INT32, handle=self.handle)
        X = g.tensor(name="x", dim=list(x8.shape), stride=list(x8.stride()), data_type=fe.data_type.INT8)
        W = g.tensor(name="w", dim=list(w8.shape), stride=list(w8.stride()), data_type=fe.data_type.INT8)
        S = g.tensor(name="scale", dim=list(scale.shape), stride=list(scale.stride()), data_type=fe.data_type.FLOAT)
        B = self._tensor(g, "bias", bias)
        conv = g.conv_fprop(image=X, weight=W, compute_data_type=fe.data_type.INT32, name="conv",
                            **self._geometry(shape))
        scaled = g.mul(a=conv, b=S, compute_data_type=fe.data_type.FLOAT, name="dequant")
        Y = g.relu(input=g.bias(input=scaled, bias=B, name="bias_add"), name="relu")
        y = poisoned(shape.y_dim, nhwc_strides(shape.y_dim), BF16, "cuda")
        return self._finish(g, {X: x8, W: w8, S: scale, B: bias, self._output(Y, y): y}), y

    def dgrad(self, shape: ConvShape, dy, w):
        g = self._graph()
        DY, W = self._tensor(g, "dy", dy), self._tensor(g, "w", w)
        DX = g.conv_dgrad(loss=DY, filter=W, name="dgrad", **self._geometry(shape))
        dx = poisoned(shape.x_dim, nhwc_strides(shape.x_dim), BF16, "cuda")
        return self._finish(g, {DY: dy, W: w, self._output(DX, dx): dx}), dx

    def wgrad(self, shape: ConvShape, dy, x):
        g = self._graph()
        DY, X = self._tensor(g, "dy", dy), self._tensor(g, "x", x)
        DW = g.conv_wgrad(image=X, loss=DY, name="wgrad", **self._geometry(shape))
        dw = poisoned(shape.w_dim, nhwc_strides(shape.w_dim), BF16, "cuda")
        return self._finish(g, {DY: dy, X: x, self._output(DW, dw): dw}), dw


def cudnn_provider(row: RowSpec, shape: ConvShape, inputs, frontend: Optional[CudnnConv], note: str):
    def factory():
        if frontend is None:
            raise RuntimeError(f"cuDNN frontend {note}")
        if row.op == "fprop":
            run, out = frontend.fprop_bias_relu(shape, inputs["x"], inputs["w"], inputs["bias"])
            return run, (lambda: out), "y", {}
        if row.op == "int8":
            run, out = frontend.int8_fprop_scale_bias_relu(shape, inputs["x8"], inputs["w8"], inputs["scale"],
                                                           inputs["bias"])
            return run, (lambda: out), "y", {}
        if row.op == "dgrad":
            run, out = frontend.dgrad(shape, inputs["dy"], inputs["w"])
            return run, (lambda: out), "dx", {}
        run, out = frontend.wgrad(shape, inputs["dy"], inputs["x"])
        return run, (lambda: out), "dw", {}
    return factory


# --- dnngraph ------------------------------------------------------------------------------------
OUTPUT_NAMES = {"fprop": ("y",), "dgrad": ("dx",), "wgrad": ("dw",), "stats": ("y", "sum", "sq_sum"), "int8": ("y",),
                "int8_dgrad": ("dx",), "int8_wgrad": ("dw",)}
FLAVOUR = {"fprop": "y", "dgrad": "dx", "wgrad": "dw", "stats": "stats", "int8": "y", "int8_dgrad": "dx",
           "int8_wgrad": "dw"}
GRAPH_INPUTS = {"dgrad": ("dy", "w"), "wgrad": ("dy", "x"), "stats": ("x", "w"), "int8": ("x8", "w8", "scale", "bias"),
                "int8_dgrad": ("dy8", "w8", "dgrad_scale"), "int8_wgrad": ("dy8", "x8", "wgrad_scale")}


def dg_graph(op, shape: ConvShape, inputs, io_type, name="conv"):
    """(graph, bindings of its inputs, its outputs): the dnngraph graph of one row's op."""
    g = dg.Graph(name=name, io_data_type=io_type, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    bound = {key: g.tensor_like(inputs[key], name=key) for key in GRAPH_INPUTS.get(op, ("x", "w", "bias"))}
    geometry = dict(padding=list(shape.padding), stride=list(shape.stride), dilation=list(shape.dilation),
                    groups=shape.groups)
    if op == "dgrad":
        outputs = [g.conv_dgrad(bound["dy"], bound["w"], x_dim=list(shape.x_dim), **geometry)]
    elif op == "wgrad":
        outputs = [g.conv_wgrad(bound["dy"], bound["x"], w_dim=list(shape.w_dim), **geometry)]
    elif op == "int8":  # int32 accumulator -> float32 epilogue: per-channel scale, bias, relu
        y = g.conv_fprop(bound["x8"], bound["w8"], **geometry)
        outputs = [g.relu(g.add(g.mul(y, bound["scale"]), bound["bias"]))]
    elif op == "int8_dgrad":  # int32 accumulator -> float32 dequantizing scale -> io type
        dx = g.conv_dgrad(bound["dy8"], bound["w8"], x_dim=list(shape.x_dim), **geometry)
        outputs = [g.mul(dx, bound["dgrad_scale"])]
    elif op == "int8_wgrad":
        dw = g.conv_wgrad(bound["dy8"], bound["x8"], w_dim=list(shape.w_dim), **geometry)
        outputs = [g.mul(dw, bound["wgrad_scale"])]
    else:
        y = g.conv_fprop(bound["x"], bound["w"], **geometry)
        outputs = [y, *g.genstats(y)] if op == "stats" else [g.relu(g.add(y, bound["bias"]))]
    for tensor, out_name in zip(outputs, OUTPUT_NAMES[op]):
        tensor.set_output(True).set_name(out_name)
    return g, {tensor: inputs[key] for key, tensor in bound.items()}, outputs


def plan_summary(plan) -> dict:
    launches = list(getattr(plan, "launches", None) or [])
    sources = [getattr(getattr(l, "tuning", None), "source", None) for l in launches]
    return {"launches": len(launches), "configs": [getattr(l, "config_text", "") for l in launches],
            "tuning": [s for s in sources if s], "backends": [getattr(l, "backend", None) or "?" for l in launches]}


def dg_provider(op, shape: ConvShape, inputs, io_type, autotune: bool, backends=None) -> Callable:
    """A dnngraph build of the row's graph (`backends`: BuildOptions.backends, None the default)."""
    def factory():
        name = "conv_gluon" if backends else "conv_tuned" if autotune else "conv"
        start = time.perf_counter()
        g, bindings, outputs = built(op, shape, inputs, io_type, name, autotune, backends)
        extra = {"build_s": time.perf_counter() - start, "plan": plan_summary(g.plan)}
        device = inputs["x"].device
        buffers = [poisoned(t.dim, t.stride, t.data_type.torch_dtype, device) for t in outputs]
        bindings.update(zip(outputs, buffers))
        return (lambda: g.execute(bindings)), (lambda: tuple(buffers)), FLAVOUR[op], extra
    return factory


def built(op, shape: ConvShape, inputs, io_type, name: str, autotune: bool, backends) -> tuple:
    """(graph, bindings, outputs) of the row's graph built with `backends`. GLUON_FIRST tries the
    Gluon backend alone first, so a layer it supports is timed on Gluon whatever the ranking
    says (the column measures Gluon; the ranking is conv_measured.py's, fitted from it), and
    falls back to Gluon-then-Triton for the layers Gluon refuses."""
    tries = [("gluon",), GLUON_FIRST] if backends == GLUON_FIRST else [backends]
    for position, chosen in enumerate(tries):
        g, bindings, outputs = dg_graph(op, shape, inputs, io_type, name=name)
        try:
            g.build(autotune=autotune, options=dg.BuildOptions(backends=chosen) if chosen else None)
            return g, bindings, outputs
        except dg.UnsupportedError:
            if position == len(tries) - 1:
                raise


def reference_check(op, shape: ConvShape, inputs, refs) -> float:
    """The largest relative error between this file's torch references and g.reference() (float64):
    a check of the benchmark's own reference, runnable with no conv kernel."""
    g, bindings, _ = dg_graph(op, shape, inputs, dg.float32)
    graph_refs = g.reference(bindings)
    return max(rel_error(ours, graph_refs[name]) for ours, name in zip(refs[FLAVOUR[op]], OUTPUT_NAMES[op]))


# --- measuring -----------------------------------------------------------------------------------
@dataclass
class Context:
    args: argparse.Namespace
    device: str
    dtype: torch.dtype
    ref_dtype: torch.dtype
    tolerance: float
    timed: bool
    frontend: Optional[CudnnConv] = None
    fe_note: str = "not loaded"
    compile_deadline: float = math.inf
    compiled: dict = None


def measure(factory: Callable, refs: dict, shape: ConvShape, ctx: Context) -> dict:
    """Build, check against the reference, then time one provider; failures become status cells."""
    try:
        start = time.perf_counter()
        run, outputs, flavour, extra = factory()
        result = run()
        _sync(ctx.device)
        first_call_s = time.perf_counter() - start  # build + first call (compile, cuDNN benchmark, tuning)
        produced = outputs() if outputs is not None else result
        produced = produced if isinstance(produced, tuple) else (produced,)
        error = max(rel_error(out, ref) for out, ref in zip(produced, refs[flavour]))
        row = {"status": "ok", "flavour": flavour, "rel_error": error, "first_call_s": first_call_s,
               "checked": math.isfinite(error) and error <= ctx.tolerance, **extra}
        del produced, result
        if ctx.timed:
            ms = median_ms(run, warmup=25, rep=ctx.args.rep_ms)
            row.update(ms=ms, tflops=shape.flops / ms / 1e9, host_us=_host_us(run, ctx.device))
        return row
    except Skipped as reason:
        return {"status": "skipped", "error": str(reason)}
    except dg.UnsupportedError as error:
        return _failed(f"not implemented yet: {_short(error, 400)}")
    except Exception as error:  # noqa: BLE001 - one provider failing leaves the others measured
        return _failed(error)


def run_case(row: RowSpec, shape: ConvShape, ctx: Context) -> dict:
    """Every provider of `row` on one layer: anchors first (a faulting dnngraph kernel then leaves
    them measured), then the heuristics build before the tuned one (which may cache a winner)."""
    inputs = make_inputs(shape, ctx.device, ctx.dtype)
    if row.op.startswith("int8"):
        inputs.update(int8_inputs(shape, ctx.device))
    refs = references(row.op, shape, inputs, ctx.ref_dtype)
    anchors = {"torch": lambda: torch_provider(row, shape, inputs),
               "compile": lambda: compile_provider(row, shape, inputs, ctx),
               "cudnn_fe": lambda: cudnn_provider(row, shape, inputs, ctx.frontend, ctx.fe_note),
               "autograd": lambda: autograd_provider(row, shape, inputs),
               "torch_sums": lambda: sums_provider(shape, inputs)}
    factories = {name: anchors[name]() for name in row.anchors} if ctx.timed else {}
    io_type = dg.bfloat16 if ctx.dtype == BF16 else dg.float32
    gluon = getattr(ctx.args, "gluon", False)
    # with --gluon, "dg" is the Triton backend alone and "dg gluon" Gluon wherever it takes the
    # layer (built(): the rates conv_measured.py ranks by come from these two columns); without,
    # "dg" is the default build
    factories["dg"] = dg_provider(row.op, shape, inputs, io_type, autotune=False,
                                  backends=TRITON_ONLY if gluon else None)
    if ctx.args.autotune:
        factories["dg_tuned"] = dg_provider(row.op, shape, inputs, io_type, autotune=True)
    if gluon:
        factories["dg_gluon"] = dg_provider(row.op, shape, inputs, io_type, autotune=False, backends=GLUON_FIRST)
    case = {"label": shape.label, "shape": shape.describe(), "gflop": shape.flops / 1e9}
    for name, factory in factories.items():
        case[name] = measure(factory, refs, shape, ctx)
    if not ctx.timed:
        try:
            case["reference_check"] = reference_check(row.op, shape, inputs, refs)
        except Exception as error:  # noqa: BLE001
            case["reference_check"] = float("nan")
            case["reference_check_error"] = _short(error, 200)
    return case


# --- reporting -----------------------------------------------------------------------------------
def _ok(result) -> bool:
    return bool(result) and result.get("status") == "ok" and "ms" in result


def _cell(result) -> str:
    if not result:
        return "-"
    if result.get("status") == "ok":
        text = _tflops(result["tflops"]) if "tflops" in result else f"err {result['rel_error']:.0e}"
        return text + ("" if result["checked"] else " (!)")
    return result.get("status", "-")


def _ratio(anchor, ours) -> Optional[float]:
    return anchor["ms"] / ours["ms"] if _ok(anchor) and _ok(ours) else None


def goal_ratio(row: RowSpec, case: dict, ours: str) -> Optional[float]:
    """Goal anchor time (the fastest measured of row.goal_anchors) / dnngraph time."""
    times = [case[a]["ms"] for a in row.goal_anchors if _ok(case.get(a))]
    return min(times) / case[ours]["ms"] if times and _ok(case.get(ours)) else None


def dg_names(cases) -> list:
    return [p for p in DG_PROVIDERS if any(p in c for c in cases)]


def report_row(row: RowSpec, cases: list) -> list:
    """Print the row's tables; returns its goal lines."""
    titles, ours = TITLES[row.key], dg_names(cases)
    providers = list(row.anchors) + ours
    print_table(f"{row.title}: TFLOP/s (bf16 NHWC, float32 accumulate)",
                ["layer", "shape", "GFLOP"] + [titles.get(p, DG_PROVIDERS.get(p)) for p in providers],
                [[c["label"], c["shape"], f"{c['gflop']:.3g}"] + [_cell(c.get(p)) for p in providers]
                 for c in cases])
    ratio_columns = [(a, o) for o in ours for a in row.anchors]
    if "dg" in ours and "dg_gluon" in ours:  # what opting in to the Gluon backend gains
        ratio_columns.append(("dg", "dg_gluon"))
    print_table(f"{row.title}: anchor time / dnngraph time (> 1: dnngraph faster); relative errors",
                ["layer"] + [f"{titles.get(a, DG_PROVIDERS.get(a))} / {DG_PROVIDERS[o]}" for a, o in ratio_columns]
                + [f"err {titles.get(p, DG_PROVIDERS.get(p))}" for p in providers]
                + [f"{DG_PROVIDERS[o]} kernels" for o in ours] + ["dg gluon backend"] * ("dg_gluon" in ours),
                [[c["label"]] + [_fmt_ratio(_ratio(c.get(a), c.get(o))) for a, o in ratio_columns]
                 + [f"{c[p]['rel_error']:.0e}" if (c.get(p) or {}).get("status") == "ok" else "-" for p in providers]
                 + [str((c[o].get("plan") or {}).get("launches", "-")) for o in ours]
                 + ([_backends_cell(c["dg_gluon"])] if "dg_gluon" in ours else [])
                 for c in cases])
    return [line for o in ours for line in goal_lines(row, cases, o)]


def _backends_cell(result: dict) -> str:
    """The backends a build's plan ran, as one cell."""
    return "+".join(sorted(set((result.get("plan") or {}).get("backends", ["-"]))))


def _fmt_ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def goal_lines(row: RowSpec, cases: list, ours: str) -> list:
    """Geomean and min of each anchor ratio, then the goal verdict."""
    titles, lines = TITLES[row.key], []
    for anchor in row.anchors:
        ratios = [(r, c["label"]) for c in cases if (r := _ratio(c.get(anchor), c.get(ours))) is not None]
        if ratios:
            low = min(ratios)
            lines.append(f"- {row.key}: {DG_PROVIDERS[ours]} vs {titles[anchor]}: geomean "
                         f"{_geomean([r for r, _ in ratios]):.3f}x, min {low[0]:.2f}x ({low[1]}) "
                         f"over {len(ratios)} of {len(cases)} layer(s)")
    if row.goal_geomean is None:
        return lines
    ratios = [(r, c["label"]) for c in cases if (r := goal_ratio(row, c, ours)) is not None]
    names = [titles[a] for a in row.goal_anchors]
    anchor = names[0] if len(names) == 1 else f"the fastest of {', '.join(names)}"
    goal = f">= {row.goal_geomean}x {anchor}" + (f", no layer < {row.goal_min}x" if row.goal_min else "")
    if not ratios:
        return lines + [f"- {row.key} GOAL {goal}: NOT JUDGED ({DG_PROVIDERS[ours]} or the anchor not measured)"]
    mean, low = _geomean([r for r, _ in ratios]), min(ratios)
    met = mean >= row.goal_geomean and (row.goal_min is None or low[0] >= row.goal_min)
    partial = "" if len(ratios) == len(cases) else f", only {len(ratios)} of {len(cases)} layers measured"
    return lines + [f"- {row.key} GOAL {goal}: {'met' if met else 'BELOW GOAL'} ({DG_PROVIDERS[ours]} geomean "
                    f"{mean:.3f}x, min {low[0]:.2f}x at {low[1]}{partial})"]


def failure_notes(key: str, cases: list, head_start_us: float) -> list:
    """Why cells are missing or doubtful. do_bench clears L2 before each timed call, which gives the
    host `head_start_us` to enqueue the call: only a host time past device time + that can idle the GPU."""
    reasons = {}
    for case in cases:
        for name, result in case.items():
            if not isinstance(result, dict):
                continue
            title = TITLES[key].get(name, DG_PROVIDERS.get(name, name))
            if result.get("status") in ("n/a", "skipped"):
                reason = f"{result['status']}: {result.get('error', '')}"
            elif result.get("status") == "ok" and not result["checked"]:
                reason = f"rel error {result['rel_error']:.1e} past {TOLERANCE:g} vs the {result['flavour']} reference"
            elif _ok(result) and result.get("host_us", 0) > result["ms"] * 1e3 + head_start_us:
                reason = (f"host time per call exceeds the device time + do_bench's L2 flush ({head_start_us:.0f} us):"
                          " the timing may hold host time")
            else:
                continue
            reasons.setdefault((title, reason), []).append(case["label"])
    return [f"- {key} {name}: {reason} [{'; '.join(labels)}]" for (name, reason), labels in reasons.items()]


def report(results: dict, header: dict):
    goals, notes = [], []
    for key, cases in results.items():
        if cases:
            goals += report_row(ROWS[key], cases)
            notes += failure_notes(key, cases, header.get("flush_us", 0.0))
    print("\nRatios and goals (dnngraph speed over each anchor, geometric mean over layers):\n" + "\n".join(goals))
    if notes:
        print("\nNot measured, past tolerance, or timings that may hold host time:\n" + "\n".join(notes))
    print(f"\ndevice: {header['device']}, torch {header['torch']}, triton {header['triton']}, "
          f"cuDNN (torch) {header['torch_cudnn']}; cuDNN frontend: {header['cudnn_frontend']}")
    print(f"ResNet-50 layers: {header['resnet_source']}; run took {header['seconds']:.0f} s")


# --- main ----------------------------------------------------------------------------------------
def parse_args(argv):
    """The command line."""
    parser = family_parser(__doc__.splitlines()[0], ROWS, "a few layers per row", "layers")
    parser.add_argument("--autotune", action="store_true", help="also time g.build(autotune=True)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"ResNet-50's batch (default {BATCH})")
    parser.add_argument("--gluon", action="store_true",
                        help="time 'dg' as a Triton-only build (BuildOptions(backends=('triton',))) beside "
                             "'dg gluon': the Gluon implicit-GEMM conv (fprop, stride-1 dgrad, wgrad) wherever it "
                             "takes the layer (backends=('gluon',)), Triton for the rest")
    return parser.parse_args(argv)


def main(argv=None):
    """Run the benchmark (or --list-shapes / --check-cpu) with command-line arguments `argv`."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_family(args, "dnngraph-bench-conv-", list_shapes, check_cpu, run_gpu)


def list_shapes(args):
    resnet, source = resnet50_layers(args.batch)
    print(f"ResNet-50 layers: {source}")
    for key in args.rows:
        shapes = row_shapes(key, args, resnet)
        print_table(ROWS[key].title, ["layer", "shape", "GFLOP"],
                    [[s.label, s.describe(), f"{s.flops / 1e9:.3g}"] for s in shapes])


def run_gpu(args, cache_dir):
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: use --check-cpu for the CPU smoke test")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # the float32 references are full float32
    torch.backends.cuda.matmul.allow_tf32 = False
    for knob in ("recompile_limit", "cache_size_limit"):  # one static compile per layer
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))
    started = time.perf_counter()
    torch.empty(1, device="cuda")  # torch's CUDA context before cuDNN's
    frontend, fe_note = frontend_from_args(args, CudnnConv)
    print(f"cuDNN frontend: {fe_note}", flush=True)
    resnet, resnet_source = resnet50_layers(args.batch)
    ctx = Context(args, "cuda", BF16, F32, TOLERANCE, True, frontend, fe_note,
                  started + args.compile_budget_s, {})
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "torch_cudnn": torch.backends.cudnn.version(), "cudnn_frontend": fe_note,
              "resnet_source": resnet_source, "tolerance": TOLERANCE, "dnngraph_cache_dir": cache_dir,
              "fresh_cache": not args.reuse_cache, "flush_us": flush_us(), "flops": "2*N*K*prod(P)*C/groups*prod(R)", "rows": args.rows}
    return run_rows({key: ROWS[key] for key in args.rows}, lambda key: row_shapes(key, args, resnet),
                    lambda row, shape: timed_case(row, shape, ctx, started), report, "conv.json", header, started)


def timed_case(row: RowSpec, shape: ConvShape, ctx: Context, started: float) -> dict:
    start = time.perf_counter()
    try:
        case = run_case(row, shape, ctx)
    except Exception as error:  # noqa: BLE001 - the inputs or the reference of the layer failed
        case = {"label": shape.label, "shape": shape.describe(), "gflop": shape.flops / 1e9,
                **{p: _failed(error) for p in list(row.anchors) + ["dg"]}}
    case["seconds"] = time.perf_counter() - start
    titles = TITLES[row.key]
    cells = [f"{titles.get(p, DG_PROVIDERS.get(p))} {_cell(case[p])}" for p in case if isinstance(case[p], dict)]
    print(f"[{time.perf_counter() - started:5.0f} s] {row.key} {shape.label} ({case['seconds']:.0f} s): "
          + ", ".join(cells), flush=True)
    return case


def check_cpu(args):
    """Each requested row's dnngraph graph on tiny fp32 shapes (interpreter) against float64 torch."""
    ctx = Context(args, "cpu", F32, F64, CPU_TOLERANCE, False, compiled={})
    cases, verdicts = [], []
    for key in args.rows:
        for shape in CPU_SHAPES[key]:
            start = time.perf_counter()
            case = run_case(ROWS[key], shape, ctx)
            cases.append((key, case))
            for name in dg_names([case]):
                verdicts.append(cpu_verdict(case[name]))
            verdicts.append("ok" if case["reference_check"] <= 1e-6 else "wrong")
            print(f"{key} {shape.label} ({time.perf_counter() - start:.1f} s): "
                  + " | ".join(f"{DG_PROVIDERS[n]} {cpu_cell(case[n])}" for n in dg_names([case]))
                  + f" | torch ref vs g.reference {case['reference_check']:.0e}"
                  + (f" ({case['reference_check_error']})" if "reference_check_error" in case else ""), flush=True)
    print_table(f"CPU check (Triton interpreter, fp32): relative error vs float64 torch (tolerance {CPU_TOLERANCE:g})",
                ["row", "layer", "shape"] + [DG_PROVIDERS[n] for n in dg_names([c for _, c in cases])]
                + ["torch ref vs g.reference"],
                [[key, c["label"], c["shape"]] + [cpu_cell(c[n]) for n in dg_names([c for _, c in cases])]
                 + [f"{c['reference_check']:.0e}"] for key, c in cases])
    return cpu_exit(verdicts, "dnngraph graph(s) raise UnsupportedError at build()")


def cpu_verdict(result) -> str:
    if result.get("status") == "ok":
        return "ok" if result["checked"] else "wrong"
    return "unsupported" if result.get("error", "").startswith("not implemented yet") else "wrong"


def cpu_cell(result) -> str:
    if result.get("status") == "ok":
        return f"err {result['rel_error']:.1e}" + ("" if result["checked"] else " (!)")
    return f"{result.get('status')}: {result.get('error', '')[:160]}"


if __name__ == "__main__":
    main()
