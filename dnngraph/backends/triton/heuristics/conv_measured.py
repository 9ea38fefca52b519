"""The convolutions' measured rates, per backend, direction and shape class: what the registry
compares the Triton and Gluon convs by (as heuristics/sdpa.py and gluon/attention_backend.py do
for attention).

Each backend's config model (heuristics/conv.py conv_estimate, gluon/conv_backend.py
modeled_seconds) orders its own configs well enough, but the two are not comparable: on
ResNet-50's layers on the H200 the Gluon model predicted 1.23-2.43x the Triton model's speed while
the GPU measured 0.90-1.36x (the Gluon model runs its tiles at the dense peak; the Triton model's
1x1 pose is not the matmul kernel the lowering runs). Refitted with three terms each (a rate per
tile round of the config that ran, a cost per round, a fixed cost), they came within 0.86-1.12x
(Gluon) and 0.79-1.25x (Triton) of the measured times, still more than the backends differ on
most layers (median 1.08x), and mis-ranked 6 of the 22 layers.

So the rule is measured efficiency per direction and shape class (problems/conv.py
measured_shape_class: the forward "narrow", fewer than 128 filters, or "wide"; the dgrad
"unit-stride" or "strided"; the wgrad "pointwise", 1x1, "pointwise-strided" or "spatial"), inside the envelope of the
measured layers (measured_envelope): the same work for both backends, a serial roofline (a short
reduction does not hide the epilogue's stores behind the mainloop),
    seconds = (2*N*P*Q*K*C*R*S / peak + bytes moved / bandwidth) / efficiency + LAUNCH_SECONDS,
with efficiency the geometric mean over the class's measured layers of that work over the
measured time (MEASURED_LAYERS, one line a layer). Within a class the backend of the higher
efficiency always leads.
- Forward: on the 22 measured layers the rule agrees with the faster backend on 20: it misses
  layer1.0.conv1 (Triton ranked, Gluon 21.6 us against 22.1) and layer4.0.conv1 (Gluon ranked,
  23.6 us against Triton's 23.3), 0.8 us in all (the faster backend's times add to 560 us);
  "Gluon wherever it runs" missed 3 (layer1.1.conv1: 3.7 us, layer1.0.conv2, layer4.0.conv1), 4.4 us.
- dgrad: Gluon leads both classes; of the 19 layers Gluon runs it is slower on 2 and ties on 1
  (1.7 us in all; ranked by the rule, the 19 take 484 us against Triton's 561). The strided 3x3
  dgrad has no Gluon kernel (Triton alone runs it, so it is not in the table).
- wgrad (measured after the combine's splits were capped and loaded four at a time): Gluon leads
  "spatial" (1.09-2.45x Triton on all 7) and "pointwise" (the 1x1 at stride 1: faster on 6 of
  12), Triton "pointwise-strided" (the three downsample layers, which Gluon reads through phase
  views). The 6 pointwise layers Triton runs faster cost 28.9 us; the 22 layers take 978 us ranked,
  990 on Gluon alone, 1168 on Triton alone.
A shape outside a class or the envelope has no estimate (None): the registry then ranks by
preference order (Triton first by default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ....problems.conv import measured_shape_class, plain_work, shape_class_of
from ....target import H200, Target

MEASURED_ON = H200
LAUNCH_SECONDS = 3e-6
# A batch within this factor of the measured one (32) is inside the envelope, its GEMM rows inside
# theirs too: each class's rates held over a 64x span of rows (1568..100352), but a batch of 1 or
# 8 runs fewer tiles per layer than any measured one (a wave or less), so its rate is unknown.
BATCH_FACTOR = 2


@dataclass(frozen=True)
class MeasuredLayer:
    """One layer of BENCHMARKS.md's Gluon convolution tables: bf16 NHWC, the forward with bias +
    relu, the gradients bare, square filter, microseconds per backend in one process."""

    label: str
    n: int
    c: int
    k: int
    size: int  # H = W
    filter: int
    stride: int
    padding: int
    us: dict  # backend name -> measured microseconds
    direction: str = "fprop"

    @property
    def out_size(self) -> int:
        return (self.size + 2 * self.padding - self.filter) // self.stride + 1

    @property
    def shape_class(self) -> str:
        return shape_class_of(self.direction, self.k, (self.filter, self.filter), (self.stride, self.stride))

    def work(self, dot: str, target: Target) -> float:
        """The serial roofline's seconds (flops at peak, then bytes at the bandwidth), x, w, y
        and the forward's bias in bf16."""
        p = self.out_size
        flops = 2.0 * self.n * p * p * self.k * self.c * self.filter ** 2
        moved = 2 * (self.n * self.size ** 2 * self.c + self.k * self.c * self.filter ** 2 + self.n * p * p * self.k
                     + self.k * (self.direction == "fprop"))
        return flops / target.peak(dot) + moved / target.bandwidth


def _layer(label, n, c, k, size, filter_, stride, padding, triton_us, gluon_us, direction="fprop") -> MeasuredLayer:
    return MeasuredLayer(label, n, c, k, size, filter_, stride, padding, {"triton": triton_us, "gluon": gluon_us},
                         direction)


def _dgrad(*args) -> MeasuredLayer:
    return _layer(*args, direction="dgrad")


def _wgrad(*args) -> MeasuredLayer:
    return _layer(*args, direction="wgrad")


# H200, torch 2.11, triton 3.6.0, one process (BENCHMARKS.md "Gluon convolution forward", bench_conv.py
# --gluon): label, N, C, K, H=W, filter, stride, padding, Triton us, Gluon us. The stems (C = 3:
# no TMA box) run Triton under both and are left out.
FORWARD_LAYERS = (
    _layer("layer1.0.conv1", 32, 64, 64, 56, 1, 1, 0, 22.1, 21.6),  # 37.1 / 38.1 TFLOP/s
    _layer("layer1.0.conv2", 32, 64, 64, 56, 3, 1, 1, 32.1, 32.5),  # 231 / 228
    _layer("layer1.0.conv3", 32, 64, 256, 56, 1, 1, 0, 47.8, 37.6),  # 68.8 / 87.4
    _layer("layer1.1.conv1", 32, 256, 64, 56, 1, 1, 0, 32.5, 36.2),  # 101 / 90.8
    _layer("layer2.0.conv1", 32, 256, 128, 56, 1, 1, 0, 42.8, 31.5),  # 154 / 209
    _layer("layer2.0.conv2", 32, 128, 128, 56, 3, 2, 1, 31.0, 29.2),  # 238 / 254
    _layer("layer2.0.conv3", 32, 128, 512, 28, 1, 1, 0, 29.0, 24.6),  # 114 / 133
    _layer("layer2.0.downsample.0", 32, 256, 512, 56, 1, 2, 0, 35.5, 29.6),  # 185 / 222
    _layer("layer2.1.conv1", 32, 512, 128, 28, 1, 1, 0, 22.2, 20.5),  # 148 / 160
    _layer("layer2.1.conv2", 32, 128, 128, 28, 3, 1, 1, 30.1, 25.1),  # 246 / 295
    _layer("layer3.0.conv1", 32, 512, 256, 28, 1, 1, 0, 30.4, 27.3),  # 217 / 241
    _layer("layer3.0.conv2", 32, 256, 256, 28, 3, 2, 1, 26.9, 25.9),  # 275 / 285
    _layer("layer3.0.conv3", 32, 256, 1024, 14, 1, 1, 0, 21.6, 19.7),  # 152 / 167
    _layer("layer3.0.downsample.0", 32, 512, 1024, 28, 1, 2, 0, 32.9, 25.0),  # 200 / 263
    _layer("layer3.1.conv1", 32, 1024, 256, 14, 1, 1, 0, 16.8, 16.2),  # 195 / 203
    _layer("layer3.1.conv2", 32, 256, 256, 14, 3, 1, 1, 25.9, 22.8),  # 286 / 325
    _layer("layer4.0.conv1", 32, 1024, 512, 14, 1, 1, 0, 23.3, 23.6),  # 282 / 278
    _layer("layer4.0.conv2", 32, 512, 512, 14, 3, 2, 1, 35.1, 28.5),  # 211 / 260
    _layer("layer4.0.conv3", 32, 512, 2048, 7, 1, 1, 0, 18.9, 18.7),  # 174 / 176
    _layer("layer4.0.downsample.0", 32, 1024, 2048, 14, 1, 2, 0, 26.5, 25.0),  # 248 / 263
    _layer("layer4.1.conv1", 32, 2048, 512, 7, 1, 1, 0, 19.3, 16.5),  # 170 / 200
    _layer("layer4.1.conv2", 32, 512, 512, 7, 3, 1, 1, 34.8, 26.7),  # 213 / 277
)


# H200, torch 2.11, triton 3.6.0, one process (BENCHMARKS.md "Gluon convolution dgrad and wgrad",
# bench_conv.py --rows dgrad,wgrad --gluon), as FORWARD_LAYERS, the layers the Gluon column ran
# Gluon on: dx and dw alone (no epilogue). The strided 3x3 dgrads run Triton under both. The
# wgrad's lines are from a later run of the same session (bench_conv.py --rows wgrad --gluon
# --no-cudnn), after the Gluon combine's change.
DGRAD_LAYERS = (
    _dgrad("layer1.0.conv1", 32, 64, 64, 56, 1, 1, 0, 19.6, 19.2),  # 42 / 43 TFLOP/s
    _dgrad("layer1.0.conv2", 32, 64, 64, 56, 3, 1, 1, 31.2, 30.5),  # 237 / 243
    _dgrad("layer1.0.conv3", 32, 64, 256, 56, 1, 1, 0, 31.3, 32.4),  # 105 / 102
    _dgrad("layer1.1.conv1", 32, 256, 64, 56, 1, 1, 0, 42.2, 30.0),  # 78 / 109
    _dgrad("layer2.0.conv1", 32, 256, 128, 56, 1, 1, 0, 48.7, 33.1),  # 135 / 199
    _dgrad("layer2.0.conv3", 32, 128, 512, 28, 1, 1, 0, 19.7, 18.8),  # 167 / 175
    _dgrad("layer2.0.downsample.0", 32, 256, 512, 56, 1, 2, 0, 50.1, 43.6),  # 131 / 151
    _dgrad("layer2.1.conv1", 32, 512, 128, 28, 1, 1, 0, 26.8, 21.5),  # 123 / 153
    _dgrad("layer2.1.conv2", 32, 128, 128, 28, 3, 1, 1, 28.6, 24.2),  # 259 / 306
    _dgrad("layer3.0.conv1", 32, 512, 256, 28, 1, 1, 0, 30.8, 27.7),  # 213 / 238
    _dgrad("layer3.0.conv3", 32, 256, 1024, 14, 1, 1, 0, 15.5, 15.5),  # 212 / 212
    _dgrad("layer3.0.downsample.0", 32, 512, 1024, 28, 1, 2, 0, 39.1, 35.9),  # 168 / 183
    _dgrad("layer3.1.conv1", 32, 1024, 256, 14, 1, 1, 0, 20.1, 17.6),  # 164 / 187
    _dgrad("layer3.1.conv2", 32, 256, 256, 14, 3, 1, 1, 27.7, 21.2),  # 267 / 349
    _dgrad("layer4.0.conv1", 32, 1024, 512, 14, 1, 1, 0, 24.4, 23.7),  # 270 / 278
    _dgrad("layer4.0.conv3", 32, 512, 2048, 7, 1, 1, 0, 17.7, 14.5),  # 186 / 227
    _dgrad("layer4.0.downsample.0", 32, 1024, 2048, 14, 1, 2, 0, 35.6, 32.9),  # 185 / 200
    _dgrad("layer4.1.conv1", 32, 2048, 512, 7, 1, 1, 0, 16.3, 16.9),  # 202 / 195
    _dgrad("layer4.1.conv2", 32, 512, 512, 7, 3, 1, 1, 35.6, 24.7),  # 208 / 299
)
WGRAD_LAYERS = (
    _wgrad("layer1.0.conv1", 32, 64, 64, 56, 1, 1, 0, 47.6, 55.0),  # 17 / 15 TFLOP/s
    _wgrad("layer1.0.conv2", 32, 64, 64, 56, 3, 1, 1, 151.2, 61.8),  # 49 / 120
    _wgrad("layer1.0.conv3", 32, 64, 256, 56, 1, 1, 0, 58.8, 65.9),  # 56 / 50
    _wgrad("layer1.1.conv1", 32, 256, 64, 56, 1, 1, 0, 71.8, 68.7),  # 46 / 48
    _wgrad("layer2.0.conv1", 32, 256, 128, 56, 1, 1, 0, 73.2, 61.1),  # 90 / 108
    _wgrad("layer2.0.conv2", 32, 128, 128, 56, 3, 2, 1, 61.5, 55.6),  # 120 / 133
    _wgrad("layer2.0.conv3", 32, 128, 512, 28, 1, 1, 0, 51.3, 41.5),  # 64 / 79
    _wgrad("layer2.0.downsample.0", 32, 256, 512, 56, 1, 2, 0, 45.3, 50.7),  # 145 / 130
    _wgrad("layer2.1.conv1", 32, 512, 128, 28, 1, 1, 0, 50.4, 42.9),  # 65 / 77
    _wgrad("layer2.1.conv2", 32, 128, 128, 28, 3, 1, 1, 61.4, 50.8),  # 121 / 146
    _wgrad("layer3.0.conv1", 32, 512, 256, 28, 1, 1, 0, 45.0, 52.4),  # 146 / 126
    _wgrad("layer3.0.conv2", 32, 256, 256, 28, 3, 2, 1, 58.1, 42.9),  # 127 / 173
    _wgrad("layer3.0.conv3", 32, 256, 1024, 14, 1, 1, 0, 29.2, 31.6),  # 113 / 104
    _wgrad("layer3.0.downsample.0", 32, 512, 1024, 28, 1, 2, 0, 36.4, 38.0),  # 181 / 173
    _wgrad("layer3.1.conv1", 32, 1024, 256, 14, 1, 1, 0, 29.4, 32.4),  # 112 / 102
    _wgrad("layer3.1.conv2", 32, 256, 256, 14, 3, 1, 1, 58.2, 40.7),  # 127 / 182
    _wgrad("layer4.0.conv1", 32, 1024, 512, 14, 1, 1, 0, 36.4, 38.0),  # 180 / 173
    _wgrad("layer4.0.conv2", 32, 512, 512, 14, 3, 2, 1, 54.0, 39.6),  # 137 / 187
    _wgrad("layer4.0.conv3", 32, 512, 2048, 7, 1, 1, 0, 32.6, 24.4),  # 101 / 135
    _wgrad("layer4.0.downsample.0", 32, 1024, 2048, 14, 1, 2, 0, 29.0, 33.7),  # 227 / 195
    _wgrad("layer4.1.conv1", 32, 2048, 512, 7, 1, 1, 0, 32.4, 24.5),  # 101 / 134
    _wgrad("layer4.1.conv2", 32, 512, 512, 7, 3, 1, 1, 54.5, 37.8),  # 136 / 196
)
MEASURED_LAYERS = {"fprop": FORWARD_LAYERS, "dgrad": DGRAD_LAYERS, "wgrad": WGRAD_LAYERS}


def _efficiencies(layers, backend: str) -> dict:
    """Shape class -> the geometric mean over its measured layers of work over measured time."""
    logs = {}
    for layer in layers:
        seconds = layer.us[backend] * 1e-6 - LAUNCH_SECONDS
        logs.setdefault(layer.shape_class, []).append(math.log(layer.work("bf16", MEASURED_ON) / seconds))
    return {shape_class: math.exp(sum(values) / len(values)) for shape_class, values in logs.items()}


# direction -> backend -> shape class -> efficiency (about 0.5-0.6 of the serial roofline for the
# forward; see the docstring)
EFFICIENCY = {direction: {backend: _efficiencies(layers, backend) for backend in ("triton", "gluon")}
              for direction, layers in MEASURED_LAYERS.items()}


def _span(values) -> tuple:
    values = tuple(values)
    return min(values), max(values)


@dataclass(frozen=True)
class Envelope:
    """The sizes the measured layers span (inclusive): batch (BATCH_FACTOR around the measured),
    input and output channels, output height and width, GEMM rows N*P*Q."""

    batch: tuple
    channels: tuple
    filters: tuple
    out_size: tuple
    rows: tuple

    def holds(self, n: int, c: int, k: int, out_spatial: tuple) -> bool:
        rows = n
        for size in out_spatial:
            rows *= size
        inside = lambda value, span: span[0] <= value <= span[1]
        return (inside(n, self.batch) and inside(c, self.channels) and inside(k, self.filters)
                and all(inside(size, self.out_size) for size in out_spatial) and inside(rows, self.rows))


def measured_envelope(layers=FORWARD_LAYERS) -> Envelope:
    """The Envelope of `layers` (ResNet-50's at N32, for each direction: channels 64..2048,
    outputs 7..56 a side, rows 1568..100352, batch 16..64)."""
    batches = _span(layer.n for layer in layers)
    return Envelope((batches[0] // BATCH_FACTOR, batches[1] * BATCH_FACTOR), _span(layer.c for layer in layers),
                    _span(layer.k for layer in layers), _span(layer.out_size for layer in layers),
                    _span(layer.n * layer.out_size ** 2 for layer in layers))


ENVELOPES = {direction: measured_envelope(layers) for direction, layers in MEASURED_LAYERS.items()}


def measured_class(problem) -> Optional[str]:
    """The problem's shape class where it lies inside its direction's measured envelope, else None."""
    shape_class = measured_shape_class(problem)
    g = problem.geometry
    if shape_class is None or not ENVELOPES[g.direction].holds(g.n, g.c, g.k, tuple(g.output_spatial)):
        return None
    return shape_class


def measured_seconds(backend: str, problem, target: Target) -> Optional[float]:
    """The measured-rate seconds of `backend`'s conv of `problem` on `target` (the same fraction
    of its peak and bandwidth as measured on MEASURED_ON for the direction and class), None
    outside a measured class and envelope or on an interpreted target."""
    shape_class = measured_class(problem)
    efficiency = EFFICIENCY[problem.geometry.direction].get(backend, {}).get(shape_class)
    if efficiency is None or target.interpreted:
        return None
    flops, moved, dot = plain_work(problem)
    return (flops / target.peak(dot) + moved / target.bandwidth) / efficiency + LAUNCH_SECONDS


def calibrated(modeled: float, best_modeled: float, seconds: Optional[float]) -> Optional[float]:
    """A config's estimate where its backend's best config runs in `seconds` (the measured
    rate): the same ratio to it as its own model's `modeled` to `best_modeled` (the config
    model orders a backend's configs; the measured rate sets the level); None without `seconds`."""
    if seconds is None:
        return None
    return seconds * modeled / best_modeled
