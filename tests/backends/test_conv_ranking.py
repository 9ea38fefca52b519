"""The convolutions' ranking between the Triton and Gluon backends (heuristics/conv_measured.py):
measured efficiency per direction and shape class inside the measured envelope, no Gluon
estimate outside it.

All on CPU, as plain data: the registry's choice for every measured layer (forward, dgrad, wgrad)
on an H200 target against the faster backend measured (MEASURED_LAYERS, checked against
BENCHMARKS.md's tables), the rule's documented misses and their cost, the estimates' distance
from the measured times, and shapes outside the measured classes or sizes staying on Triton by
default.
"""
from __future__ import annotations

import math
import pathlib
import re

import pytest
from gluon_conv_cases import conv_graph, conv_group, dgrad_graph, wgrad_graph

from dnngraph.backends import registry
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.backends.triton.backend import TRITON
from dnngraph.backends.triton.heuristics import conv_measured
from dnngraph.backends.triton.heuristics.conv_measured import FORWARD_LAYERS, MEASURED_LAYERS, MeasuredLayer
from dnngraph.options import BuildOptions
from dnngraph.problems.conv import measured_shape_class
from dnngraph.target import H100, H200

GLUON_FIRST = ("gluon", "triton")
BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
LAYERS = [layer for layers in MEASURED_LAYERS.values() for layer in layers]
LAYER_IDS = [f"{layer.direction}-{layer.label}" for layer in LAYERS]
# The layers the rule ranks to the slower backend (conv_measured's docstring): the ones a
# class-level rule cannot tell apart within its class (dgrad's layer3.0.conv3 is a tie).
DOCUMENTED_MISSES = {("fprop", "layer1.0.conv1"): "triton", ("fprop", "layer4.0.conv1"): "gluon",
                     ("dgrad", "layer1.0.conv3"): "gluon", ("dgrad", "layer3.0.conv3"): "gluon",
                     ("dgrad", "layer4.1.conv1"): "gluon",
                     ("wgrad", "layer1.0.conv1"): "gluon", ("wgrad", "layer1.0.conv3"): "gluon",
                     ("wgrad", "layer3.0.conv1"): "gluon", ("wgrad", "layer3.0.conv3"): "gluon",
                     ("wgrad", "layer3.1.conv1"): "gluon", ("wgrad", "layer4.0.conv1"): "gluon"}
MISS_COST_LIMIT_US = {"fprop": 1.0, "dgrad": 2.0, "wgrad": 30.0}  # 0.8, 1.7 and 28.9 us measured
# each backend's first estimate over its measured time, over a direction's layers (the rule's
# range: fprop 0.72..1.56, dgrad 0.70..1.39, wgrad 0.48..1.50)
ESTIMATE_RANGE = {"fprop": (0.6, 1.7), "dgrad": (0.6, 1.7), "wgrad": (0.4, 1.7)}
ESTIMATE_OUTLIERS = frozenset()
GRAPHS = {"fprop": (conv_graph, "bias_relu"), "dgrad": (dgrad_graph, "none"), "wgrad": (wgrad_graph, "none")}
TABLE_MARKS = {"fprop": "### Gluon convolution forward", "dgrad": "dgrad, TFLOP/s", "wgrad": "wgrad, TFLOP/s"}


def _problem(layer: MeasuredLayer, type_name: str = "bf16", n=None):
    """The conv group of bench_conv.py's row of the layer's direction: bf16 NHWC, the forward with
    bias + relu, the gradients bare."""
    graph, epilogue = GRAPHS[layer.direction]
    g = graph(type_name, epilogue, layer.n if n is None else n, layer.c, layer.size, layer.size, layer.k,
              layer.filter, stride=layer.stride, padding=layer.padding)
    return conv_group(g)[1]


def _faster(layer: MeasuredLayer) -> str:
    return min(layer.us, key=layer.us.get)


def _chosen(problem, target=H200, backends=None) -> str:
    options = BuildOptions(target=target) if backends is None else BuildOptions(backends=backends, target=target)
    return registry.choose(problem, target, options, interpreted=False).name


def _benchmark_rows(direction: str) -> dict:
    """label -> (shape text, Triton TFLOP/s, Gluon TFLOP/s) of BENCHMARKS.md's Gluon convolution
    table of `direction`."""
    text = BENCHMARKS.read_text()
    section = text[text.index(TABLE_MARKS[direction]):]
    ends = ("\n## ", "\n### ", "\ndgrad, TFLOP/s", "\nwgrad, TFLOP/s")
    section = section[:min(section.find(end, 1) % (len(section) + 1) for end in ends)]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and re.match(r"N\d+ C\d+", cells[1]):
            rows[cells[0]] = (cells[1], float(cells[3]), float(cells[4]))
    return rows


@pytest.mark.parametrize("direction", list(MEASURED_LAYERS))
def test_the_measured_layers_are_the_benchmark_tables_rows(direction):
    """Each line of MEASURED_LAYERS is its BENCHMARKS.md row: the shape, and the microseconds of
    its TFLOP/s (3 significant figures there, 0.1 us here); every layer the Gluon column ran Gluon
    on is measured (not the C=3 stems: no TMA box; not the strided 3x3 dgrads: no Gluon kernel)."""
    rows = _benchmark_rows(direction)
    for layer in MEASURED_LAYERS[direction]:
        shape, triton_tflops, gluon_tflops = rows[layer.label]
        p = layer.out_size
        assert shape == (f"N{layer.n} C{layer.c} K{layer.k} {layer.size}x{layer.size} "
                         f"{layer.filter}x{layer.filter}/{layer.stride} p{layer.padding}")
        flops = 2.0 * layer.n * p * p * layer.k * layer.c * layer.filter ** 2
        for backend, tflops in (("triton", triton_tflops), ("gluon", gluon_tflops)):
            assert layer.us[backend] == pytest.approx(flops / tflops / 1e6, rel=0.006, abs=0.05), (layer.label, backend)
    unmeasured = {label for label, (shape, _, _) in rows.items()
                  if shape.split()[1] == "C3" or (direction == "dgrad" and "3x3/2" in shape)}
    assert set(rows) - unmeasured == {layer.label for layer in MEASURED_LAYERS[direction]}
    assert len(MEASURED_LAYERS[direction]) == {"fprop": 22, "dgrad": 19, "wgrad": 22}[direction]


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_every_measured_layer_ranks_to_the_faster_backend_but_the_documented_misses(layer):
    problem = _problem(layer)
    assert GLUON.supports(problem, H200) is True
    expected = DOCUMENTED_MISSES.get((layer.direction, layer.label), _faster(layer))
    assert _chosen(problem) == expected
    # ranked by the estimates (both carry one), whichever backend a build names first
    pairs = registry.ranked(problem, H200, BuildOptions(target=H200), interpreted=False)
    assert all(c.estimate is not None for _, c in pairs)
    assert _chosen(problem, backends=GLUON_FIRST) == expected
    assert registry.ranking_reason(pairs).startswith(f"backend {expected} ranked over")
    assert "by the model" in registry.ranking_reason(pairs)


@pytest.mark.parametrize("direction", list(MEASURED_LAYERS))
def test_the_confusion_is_the_documented_misses_and_their_cost(direction):
    missed = {layer.label: abs(layer.us["triton"] - layer.us["gluon"]) for layer in MEASURED_LAYERS[direction]
              if _chosen(_problem(layer)) != _faster(layer)}
    assert set(missed) == {label for d, label in DOCUMENTED_MISSES if d == direction}
    assert sum(missed.values()) < MISS_COST_LIMIT_US[direction]


def test_the_rule_beats_one_backend_everywhere_on_every_direction():
    """Ranked by the rule, each direction's measured layers take less time than on either backend
    alone, but the dgrad's, which Gluon leads in both classes (the forward's old rule, Gluon
    wherever it runs, missed layer1.1.conv1 alone by 3.7 us)."""
    for direction, layers in MEASURED_LAYERS.items():
        ranked = sum(layer.us[_chosen(_problem(layer))] for layer in layers)
        alone = {backend: sum(layer.us[backend] for layer in layers) for backend in ("triton", "gluon")}
        assert ranked < alone["triton"], direction
        assert ranked < alone["gluon"] if direction != "dgrad" else ranked == alone["gluon"], direction
    assert _faster(next(layer for layer in FORWARD_LAYERS if layer.label == "layer1.1.conv1")) == "triton"


def test_each_backends_estimate_is_comparable_to_its_measured_time():
    """The first candidate of each backend, on an H200, within its direction's ESTIMATE_RANGE of
    the time measured, and 1.0x in geometric mean per direction and class."""
    ratios = {}
    for layer in LAYERS:
        problem = _problem(layer)
        for backend in (TRITON, GLUON):
            estimate = backend.candidates(problem, H200)[0].estimate
            ratio = estimate / (layer.us[backend.name] * 1e-6)
            low, high = ESTIMATE_RANGE[layer.direction]
            if (layer.direction, layer.label, backend.name) not in ESTIMATE_OUTLIERS:
                assert low < ratio < high, (layer.direction, layer.label, backend.name, ratio)
            ratios.setdefault((layer.direction, backend.name, measured_shape_class(problem)), []).append(ratio)
    for key, values in ratios.items():
        # geometric mean of the time past the launch is 1 by construction; with it, close to 1
        assert math.exp(sum(math.log(v) for v in values) / len(values)) == pytest.approx(1.0, abs=0.1), key


@pytest.mark.parametrize("layer", [FORWARD_LAYERS[1], MEASURED_LAYERS["dgrad"][1], MEASURED_LAYERS["wgrad"][1]],
                         ids=["fprop", "dgrad", "wgrad"])
def test_estimates_keep_each_backends_own_config_order(layer):
    problem = _problem(layer)  # layer1.0.conv2
    for backend in (TRITON, GLUON):
        offered = backend.candidates(problem, H200)
        assert [c.estimate for c in offered] == sorted(c.estimate for c in offered)
        for candidate in offered:
            if candidate.config is not None:
                assert backend.estimate(problem, candidate.config, H200) == pytest.approx(candidate.estimate)


def test_the_shape_classes_and_envelopes_come_from_the_measured_layers():
    classes = {"fprop": {"narrow", "wide"}, "dgrad": {"unit-stride", "strided"},
               "wgrad": {"pointwise", "pointwise-strided", "spatial"}}
    for direction, layers in MEASURED_LAYERS.items():
        assert {layer.shape_class for layer in layers} == classes[direction]
        assert set(conv_measured.EFFICIENCY[direction]) == {"triton", "gluon"}
        for efficiencies in conv_measured.EFFICIENCY[direction].values():
            assert set(efficiencies) == classes[direction] and all(0.2 < e < 0.9 for e in efficiencies.values())
        envelope = conv_measured.ENVELOPES[direction]
        assert (envelope.channels, envelope.filters, envelope.out_size) == ((64, 2048), (64, 2048), (7, 56))
        assert envelope.batch == (16, 64) and envelope.rows == (32 * 7 * 7, 32 * 56 * 56)
        for layer in layers:
            assert measured_shape_class(_problem(layer)) == layer.shape_class == conv_measured.measured_class(
                _problem(layer))


LAYER = FORWARD_LAYERS[9]  # layer2.1.conv2: N32 C128 K128 28x28 3x3/1, Gluon 1.20x Triton


def _variant(**changes) -> tuple:
    """(conv_graph's arguments, conv_graph's keyword arguments) of LAYER with `changes`."""
    args = dict(type_name="bf16", epilogue="bias_relu", n=LAYER.n, c=LAYER.c, h=LAYER.size, w=LAYER.size, k=LAYER.k,
                filter_size=LAYER.filter)
    keywords = dict(stride=LAYER.stride, padding=LAYER.padding)
    for name, value in changes.items():
        (keywords if name in ("stride", "padding", "dilation") else args)[name] = value
    return args, keywords


# shapes far from the measured layers, each of them one change away from LAYER (Gluon-ranked)
UNMEASURED = {
    "batch 1": _variant(n=1),
    "batch 8": _variant(n=8),
    "batch 128": _variant(n=128, h=14, w=14),
    "tiny spatial 4x4": _variant(h=4, w=4),
    "channels 4096": _variant(c=4096, h=7, w=7),
    "filters 4096": _variant(k=4096, h=7, w=7),
    "channels 32": _variant(c=32),
    "rows past the envelope": _variant(h=112, w=112),
    "a 5x5 filter": _variant(filter_size=5, padding=2),
    "dilation 2": _variant(padding=2, dilation=2),
    "a gelu epilogue": _variant(epilogue="scale_gelu_tanh"),
    "an fp32 output": _variant(epilogue="relu_cast"),
}


@pytest.mark.parametrize("name", list(UNMEASURED))
def test_an_unmeasured_shape_stays_on_triton_by_default_and_takes_gluon_when_asked(name):
    args, keywords = UNMEASURED[name]
    problem = conv_group(conv_graph(*args.values(), **keywords))[1]
    assert GLUON.supports(problem, H200) is True, name  # Gluon could run it: only the rule keeps it off
    assert conv_measured.measured_class(problem) is None
    for target in (H100, H200):
        assert all(c.estimate is None for c in GLUON.candidates(problem, target))
        assert _chosen(problem, target) == "triton"
        assert _chosen(problem, target, GLUON_FIRST) == "gluon"
        pairs = registry.ranked(problem, target, BuildOptions(target=target), interpreted=False)
        assert "by preference order (no model estimate from gluon)" in registry.ranking_reason(pairs)


def test_the_measured_layer_itself_ranks_gluon_and_fp16_as_bf16():
    args, keywords = _variant()
    assert _chosen(conv_group(conv_graph(*args.values(), **keywords))[1]) == "gluon"
    args, keywords = _variant(type_name="fp16")
    assert _chosen(conv_group(conv_graph(*args.values(), **keywords))[1]) == "gluon"


def test_another_hopper_ranks_as_the_h200_measured():
    """The efficiencies are fractions of the target's peak and bandwidth: an H100 ranks alike."""
    for layer in LAYERS:
        assert _chosen(_problem(layer), H100) == _chosen(_problem(layer), H200), (layer.direction, layer.label)


def test_an_interpreted_target_has_no_measured_estimate():
    problem = _problem(LAYER)
    assert conv_measured.measured_seconds("triton", problem, H200) is not None
    from dnngraph.target import INTERPRETER
    assert conv_measured.measured_seconds("triton", problem, INTERPRETER) is None
    assert conv_measured.measured_seconds("gluon", problem, INTERPRETER) is None


@pytest.mark.parametrize("args, epilogue", [((32, 64, 7, 7, 128, 1), "bias_relu"), ((32, 256, 28, 28, 512, 1), "none")],
                         ids=["test_backend_choice._gpu_conv", "test_conv.test_pointwise_conv_runs_on_tma"])
def test_the_gpu_tests_default_convs_rank_gluon(args, epilogue):
    """The convs GPU tests expect a default build on Hopper to lower to Gluon are inside a measured
    class and the envelope."""
    problem = conv_group(conv_graph("bf16", epilogue, *args))[1]
    assert conv_measured.measured_class(problem) == "wide"
    for target in (H100, H200):
        assert _chosen(problem, target) == "gluon"
