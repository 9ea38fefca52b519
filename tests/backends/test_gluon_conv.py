"""The Gluon backend's convolution forward and stride-1 dgrad (backends/gluon/conv_*.py): an
implicit GEMM on the matmul's warp-specialized mainloop, A per filter tap by rank-4 TMA boxes over
NHWC x (dy in dgrad: the forward over dy with the filter flipped, w a row-major B).

CPU (here): every config offered, over both 16-bit types, every epilogue form and geometry
(stride 1 with padding and dilation, stride 2 through phase views, the strided 1x1, thin channels,
a flipped filter),
compiles for sm_90a with warp specialization, wgmma, TMA and no spills; supports() names why it
refuses each case it refuses; the tile choice (the pixel rectangle by its waste) and the
launch's arguments as plain data; explain() names a refusing gluon's reason.
GPU (@pytest.mark.gpu, an H100 or H200): results against the float64 reference over
geometries, types, epilogues, strides and forced configs; explain() naming gluon; a run under
Triton's concurrency sanitizer.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from gluon_conv_cases import (CONFIGS, DGRAD_GEOMETRIES, EPILOGUES, GEOMETRIES, TYPES, compile_cases, compile_variants,
                              conv_graph, conv_group, dgrad_compile_variants, dgrad_graph, lowered, nhwc,
                              wgrad_compile_variants)
from helpers import CONSAN_HEAD, check, clean_under_consan, compiled_for_sm90

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.backends.gluon.conv_backend import (LAUNCH_SECONDS, ConvConfig, block_k_for, estimate, modeled_seconds,
                                                  shared_bytes, tap_phases)
from dnngraph.backends.triton.heuristics import conv_measured
from dnngraph.options import BuildOptions
from dnngraph.target import H100, H200

GLUON_FIRST = ("gluon", "triton")


# -- (a) every variant compiles for sm_90a ---------------------------------------------------------

def test_every_conv_variant_compiles_for_sm90a_with_warp_specialization():
    """Every variant's kernels: the implicit GEMM (fprop, dgrad) or wgrad's partials kernel warp
    specialized, with wgmma and TMA; wgrad's combine after it (plain loads and stores)."""
    labels = [v[0] for v in compile_variants()] + [v[0] for v in dgrad_compile_variants()]
    wgrad_labels = [v[0] for v in wgrad_compile_variants()]
    kernels = sum(len(launches) for _, launches, _ in compile_cases())  # a strided 1x1 dgrad's Triton zero phases too
    assert kernels > len(labels) + 2 * len(wgrad_labels)
    output = compiled_for_sm90("gluon_conv_cases:compile_cases", timeout=1200)
    assert f"compiled {kernels} kernels for sm_90" in output
    facts = {}
    for line in output.splitlines():
        if line.startswith("facts "):
            _, label, text = line.split(" ", 2)
            facts.setdefault(label, []).append(json.loads(text))
    assert sorted(facts) == sorted(labels + wgrad_labels)
    for label, kernels in facts.items():
        assert len(kernels) == (2 if label in wgrad_labels else 1), label
        found = kernels[0]
        assert found["warp_specialize"] and found["setmaxnreg"] > 0, label
        assert found["wgmma"] > 0 and found["tma_load"] > 0 and found["global_scratch"] > 0, label
        assert found["shared"] <= H100.shared_memory, label
        assert all(kernel["spill_stores"] == 0 for kernel in kernels), label


def test_the_compile_cases_meet_every_config_in_each_type():
    """Pairwise coverage: each config in both types, each type with every epilogue and geometry,
    and the flipped filter."""
    variants = list(compile_variants())
    forced = {(type_name, config) for _, type_name, _, _, config, _ in variants if config is not None}
    assert forced == {(t, c) for t in TYPES for c in CONFIGS}
    for position, values in ((2, EPILOGUES), (3, GEOMETRIES)):
        assert {v[position] for v in variants} == set(values)
    assert any(mode == "convolution" for *_, mode in variants)


def test_the_dgrad_compile_cases_meet_every_config_type_epilogue_and_geometry():
    variants = list(dgrad_compile_variants())
    assert {config for *_, config, _ in variants if config is not None} == set(CONFIGS)
    for position, values in ((1, TYPES), (2, EPILOGUES), (3, DGRAD_GEOMETRIES)):
        assert {v[position] for v in variants} == set(values)
    assert any(mode == "convolution" for *_, mode in variants)


# -- (b) what it takes and refuses ------------------------------------------------------------------

def _answer(g, target=H100):
    return GLUON.supports(conv_group(g)[1], target)


def _refusal(g, target=H100) -> str:
    answer = _answer(g, target)
    assert isinstance(answer, str) and answer.startswith("gluon"), answer
    return answer


def _graph(t=dg.bfloat16, x_dim=(2, 64, 9, 9), w_dim=(64, 64, 3, 3), x_stride=None, w_stride=None, **attrs):
    g = dg.Graph(name="refused", io_data_type=t)
    x = g.tensor(name="x", dim=list(x_dim), stride=x_stride or nhwc(x_dim), data_type=t)
    w = g.tensor(name="w", dim=list(w_dim), stride=w_stride or nhwc(w_dim), data_type=t)
    conv = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    conv.update(attrs)
    return g, x, w, conv


def test_supports_strides_1_and_2_and_the_strided_1x1_convolutions():
    for geometry in GEOMETRIES.values():
        n, c, h, w, k, f, s, p, d = geometry
        for type_name in TYPES:
            assert _answer(conv_graph(type_name, "bias_relu", n, c, h, w, k, f, s, p, d)) is True, geometry
    assert _answer(conv_graph("bf16", "none", 1, 64, 9, 9, 64, 3, mode="convolution", padding=1)) is True
    # a channels_last slice: W and H strides of the whole tensor (128 channels), 64 read
    sliced = conv_graph("bf16", "bias_relu", 2, 64, 9, 9, 64, 3, padding=1, x_stride=[9 * 9 * 128, 1, 9 * 128, 128])
    assert _answer(sliced) is True and _answer(sliced, H200) is True


def test_supports_names_why_it_refuses():
    g, x, w, conv = _graph()
    g.conv_fprop(x, w, **conv).set_output(True)
    assert "capability" in _refusal(g, dataclasses.replace(H100, capability=(10, 0)))

    g, x, w, conv = _graph()  # 3x3 / 3: taps in three phases
    g.conv_fprop(x, w, **dict(conv, stride=[1, 3])).set_output(True)
    assert "stride past 2" in _refusal(g) and "stride [1, 3]" in _refusal(g)

    g, x, w, conv = _graph(w_dim=(64, 64, 1, 1))  # 1x1 / 3 with padding: taps in phase 2
    g.conv_fprop(x, w, **dict(conv, stride=[3, 3])).set_output(True)
    assert "padding [1, 1]" in _refusal(g)

    g, x, w, conv = _graph(x_dim=(2, 64, 1, 9))  # one row: no phase-1 view of it
    g.conv_fprop(x, w, **dict(conv, stride=[2, 2])).set_output(True)
    assert "H of at least the stride 2, not 1" in _refusal(g)

    g, x, w, conv = _graph(w_dim=(64, 32, 3, 3))
    g.conv_fprop(x, w, **dict(conv, groups=2)).set_output(True)
    assert "groups 1, not 2" in _refusal(g)

    g = dg.Graph(name="conv1d", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[2, 64, 9], stride=[9 * 64, 1, 64], data_type=dg.bfloat16)
    w = g.tensor(name="w", dim=[64, 64, 3], stride=[3 * 64, 1, 64], data_type=dg.bfloat16)
    g.conv_fprop(x, w, padding=[1], stride=[1], dilation=[1]).set_output(True)
    assert "2D convolutions, not 1D" in _refusal(g)

    g, x, w, conv = _graph(x_stride=[64 * 81, 81, 9, 1])  # NCHW x
    g.conv_fprop(x, w, **conv).set_output(True)
    assert "channels_last" in _refusal(g) and "x has strides" in _refusal(g)

    g, x, w, conv = _graph(w_stride=[64 * 9, 9, 3, 1])  # KCRS w
    g.conv_fprop(x, w, **conv).set_output(True)
    assert "w has strides" in _refusal(g)

    g, x, w, conv = _graph(x_dim=(2, 20, 9, 9), w_dim=(64, 20, 3, 3))  # 40-byte pixels
    g.conv_fprop(x, w, **conv).set_output(True)
    assert "C = 20" in _refusal(g)

    g, x, w, conv = _graph(w_dim=(36, 64, 3, 3))  # 72-byte output pixels
    g.conv_fprop(x, w, **conv).set_output(True)
    assert "K = 36" in _refusal(g)

    g, x, w, conv = _graph(t=dg.float32)
    g.conv_fprop(x, w, **conv).set_output(True)
    assert "float16 or bfloat16 operands, not float32" in _refusal(g)

    g, x, w, conv = _graph()
    g.conv_fprop(g.relu(x), w, **conv).set_output(True)
    assert "prologue" in _refusal(g)

    g, x, w, conv = _graph()
    g.exp(g.conv_fprop(x, w, **conv)).set_output(True)
    assert "op exp" in _refusal(g)

    g, x, w, conv = _graph()  # a residual: an operand of the output's shape
    y = g.conv_fprop(x, w, **conv)
    g.add(y, g.tensor(name="r", dim=[2, 64, 9, 9], stride=nhwc((2, 64, 9, 9)))).set_output(True)
    assert "scalars and per-channel vectors" in _refusal(g)

    g, x, w, conv = _graph()
    y = g.conv_fprop(x, w, **conv)
    y.set_output(True)
    g.relu(y).set_output(True)
    assert "one output" in _refusal(g)

    g, x, w, conv = _graph()
    g.conv_fprop(x, w, **conv).set_output(True).set_stride(nhwc((2, 64, 9, 9))[:1] + [81, 9, 1])  # NCHW y
    assert "y has strides" in _refusal(g)


def test_supports_the_stride_1_dgrad():
    for geometry in DGRAD_GEOMETRIES.values():
        for type_name in TYPES:
            assert _answer(dgrad_graph(type_name, "bias_relu", *geometry)) is True, geometry
    assert _answer(dgrad_graph("bf16", "none", 2, 64, 9, 9, 64, 3, padding=1, mode="convolution")) is True
    assert _answer(dgrad_graph("bf16", "none", 2, 64, 9, 9, 64, 3, padding=2, post_padding=0)) is True


def _dgrad(dy_dim=(2, 64, 9, 9), w_dim=(64, 64, 3, 3), x_dim=(2, 64, 9, 9), dy_stride=None, t=dg.bfloat16, **attrs):
    """(graph, dy, w, the conv_dgrad keyword arguments): dy NHWC (or `dy_stride`), w KRSC."""
    g = dg.Graph(name="refused_dgrad", io_data_type=t)
    dy = g.tensor(name="dy", dim=list(dy_dim), stride=dy_stride or nhwc(dy_dim), data_type=t)
    w = g.tensor(name="w", dim=list(w_dim), stride=nhwc(w_dim), data_type=t)
    conv = dict(x_dim=list(x_dim), padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    conv.update(attrs)
    return g, dy, w, conv


def test_supports_names_why_it_refuses_a_dgrad():
    g, dy, w, conv = _dgrad(dy_dim=(2, 64, 5, 5), x_dim=(2, 64, 9, 9), stride=[2, 2])
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "dgrad takes stride 1, or a strided 1x1 without padding, not stride [2, 2]" in _refusal(g)

    g, dy, w, conv = _dgrad(dy_dim=(2, 64, 3, 3), w_dim=(64, 64, 1, 1), x_dim=(2, 64, 9, 9), stride=[3, 3],
                            padding=[0, 0])  # a strided 1x1 past stride 2
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "phase views of strides up to 2, not [3, 3]" in _refusal(g)

    g, dy, w, conv = _dgrad(dy_dim=(2, 64, 6, 6), w_dim=(64, 64, 1, 1), x_dim=(2, 64, 9, 9), stride=[2, 2],
                            padding=[1, 1])  # a padded strided 1x1: the taps in phase 1
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "or a strided 1x1 without padding, not stride [2, 2] with filter [1, 1] and padding [1, 1]" in _refusal(g)

    g, dy, w, conv = _dgrad(dy_dim=(2, 64, 1, 5), w_dim=(64, 64, 1, 1), x_dim=(2, 64, 1, 9), stride=[2, 2],
                            padding=[0, 0])  # one row of dx: no phase-1 view of it
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "dx need H of at least the stride 2, not 1" in _refusal(g)

    g, dy, w, conv = _dgrad(dy_stride=[64 * 81, 81, 9, 1])  # NCHW dy
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "channels_last (K contiguous), but dy has strides" in _refusal(g)

    g, dy, w, conv = _dgrad(dy_dim=(2, 36, 9, 9), w_dim=(36, 64, 3, 3))  # 72-byte dy pixels
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "dy has K = 36" in _refusal(g)

    g, dy, w, conv = _dgrad(w_dim=(64, 20, 3, 3), x_dim=(2, 20, 9, 9))  # 40-byte filter rows and dx pixels
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "w has C = 20" in _refusal(g)

    g, dy, w, conv = _dgrad()
    g.conv_dgrad(dy, w, **conv).set_output(True).set_stride([64 * 81, 81, 9, 1])  # NCHW dx
    assert "dx has strides" in _refusal(g)

    g, dy, w, conv = _dgrad()  # drelu on dy: a prologue
    g.conv_dgrad(g.relu_backward(dy, g.tensor(name="y", dim=[2, 64, 9, 9], stride=nhwc((2, 64, 9, 9)))), w,
                 **conv).set_output(True)
    assert "prologue" in _refusal(g)

    g, dy, w, conv = _dgrad()  # drelu on dx: no gluon expression (and it reads x at every pixel)
    x = g.tensor(name="x", dim=[2, 64, 9, 9], stride=nhwc((2, 64, 9, 9)))
    g.relu_backward(g.conv_dgrad(dy, w, **conv), x).set_output(True)
    assert "no epilogue expression for op relu_backward" in _refusal(g)

    g, dy, w, conv = _dgrad()  # a mask over dx's pixels
    mask = g.tensor(name="mask", dim=[2, 64, 9, 9], stride=nhwc((2, 64, 9, 9)))
    g.mul(g.conv_dgrad(dy, w, **conv), mask).set_output(True)
    assert "scalars and per-channel vectors, not an operand of shape [2, 64, 9, 9]" in _refusal(g)

    g, dy, w, conv = _dgrad(t=dg.float32)
    g.conv_dgrad(dy, w, **conv).set_output(True)
    assert "float16 or bfloat16 operands, not float32" in _refusal(g)


# -- (c) the tile choice and the launch as plain data ----------------------------------------------

def _offered(g, target=H100) -> list:
    return GLUON.candidates(conv_group(g)[1], target)


def test_candidates_fit_shared_memory_and_rank_by_the_model():
    """Ordered by the config model; a measured layer's (ResNet-50's layer1.0.conv2) estimates
    are the measured rate's seconds for the first, the others in the model's ratio to it."""
    g = conv_graph("bf16", "bias_relu", 32, 64, 56, 56, 64, 3, padding=1)
    offered = _offered(g)
    assert offered and all(c.backend == "gluon" and c.estimate > 0 for c in offered)
    assert [c.estimate for c in offered] == sorted(c.estimate for c in offered)
    problem = conv_group(g)[1]
    modeled = [modeled_seconds(problem, c.config, H100) for c in offered]
    assert modeled == sorted(modeled)
    assert offered[0].estimate == pytest.approx(conv_measured.measured_seconds("gluon", problem, H100))
    for candidate, seconds in zip(offered, modeled):
        assert shared_bytes(candidate.config, 2, 2) <= H100.shared_memory
        assert estimate(problem, candidate.config, H100) == pytest.approx(candidate.estimate)
        assert candidate.estimate == pytest.approx(offered[0].estimate * seconds / modeled[0])


def test_the_pixel_rectangle_is_chosen_by_its_waste():
    """A 7x7 layer wastes 15 of every 64 pixels in 8x8 rectangles and 79 of 128 in 8x16 ones;
    a 56x56 layer none in either, where the wider tiles win."""
    small = conv_graph("bf16", "bias_relu", 32, 512, 7, 7, 512, 3, padding=1)
    best = _offered(small)[0].config
    assert (best.block_h, best.block_w) == (8, 8)
    large = conv_graph("bf16", "bias_relu", 32, 64, 56, 56, 64, 3, padding=1)
    best = _offered(large)[0].config
    assert best.block_m == 128
    # one rectangle an image either way (as many tiles): the wider one computes twice the rows
    problem = conv_group(small)[1]
    square, wide = ConvConfig(8, 8, 128, 64, 6, 1), ConvConfig(8, 16, 128, 64, 4, 2)
    assert modeled_seconds(problem, wide, H100) == pytest.approx(
        2 * (modeled_seconds(problem, square, H100) - LAUNCH_SECONDS) + LAUNCH_SECONDS)


def test_block_k_fits_thin_channels():
    assert [block_k_for(c) for c in (8, 16, 24, 32, 40, 64, 264)] == [16, 16, 32, 32, 64, 64, 64]
    offered = _offered(conv_graph("fp16", "none", 3, 16, 13, 11, 40, 5, padding=4, dilation=2))
    assert offered and all(c.config.block_k == 16 for c in offered)


def _values(launch, kind) -> dict:
    return {a.name: a.value for a in launch.arguments if a.kind == kind}


def test_the_phase_views_a_stride_takes():
    """Phase of each tap's offset r*dil - pad mod the stride: both parities at 3x3/2 p1, none but
    0 at 1x1/2 p0 (any stride), only 1 at 1x1/2 p1."""
    assert tap_phases(3, 2, 1, 1) == {0, 1} and tap_phases(7, 2, 3, 1) == {0, 1}
    assert tap_phases(1, 2, 0, 1) == {0} and tap_phases(1, 4, 0, 1) == {0} and tap_phases(1, 2, 1, 1) == {1}
    assert tap_phases(3, 1, 1, 2) == {0} and tap_phases(3, 2, 2, 2) == {0}  # even offsets: phase 0 only


def test_the_launch_reads_x_with_its_own_sizes_and_strides():
    n, c, h, w, k = 2, 64, 13, 11, 128
    (plain,) = lowered(conv_graph("bf16", "bias_relu", n, c, h, w, k, 3, padding=1, dilation=1))
    ints = _values(plain, "int")
    assert (ints["x_rows"], ints["x_cols"], ints["x_stride_h"], ints["x_stride_w"]) == (h, w, w * c, c)
    assert (ints["pad_h"], ints["pad_w"], ints["taps_h"], ints["out_h"], ints["out_w"]) == (1, 1, 3, h, w)
    assert (ints["w_stride_k"], ints["w_stride_r"], ints["w_stride_s"]) == (9 * c, 3 * c, c)
    assert (ints["y_stride_n"], ints["y_stride_h"], ints["y_stride_w"]) == (h * w * k, w * k, k)
    values = _values(plain, "constexpr")
    assert (values["STRIDE_H"], values["STRIDE_W"], values["PHASED_H"], values["PHASED_W"]) == (1, 1, False, False)
    (strided,) = lowered(conv_graph("bf16", "bias_relu", n, c, h, w, k, 1, stride=2))
    ints, values = _values(strided, "int"), _values(strided, "constexpr")
    assert (ints["x_rows"], ints["x_cols"], ints["x_stride_h"], ints["x_stride_w"]) == (h, w, w * c, c)
    assert (ints["out_h"], ints["out_w"], ints["pad_h"]) == (7, 6, 0)
    assert (values["STRIDE_H"], values["PHASED_H"], values["PHASED_W"]) == (2, False, False)
    assert "stride [2, 2] through 1 phase view of x" in strided.reason
    (phased,) = lowered(conv_graph("bf16", "bias_relu", n, c, h, w, k, 3, stride=2, padding=1))
    values = _values(phased, "constexpr")
    assert (values["STRIDE_H"], values["STRIDE_W"], values["PHASED_H"], values["PHASED_W"]) == (2, 2, True, True)
    assert "through 4 phase views" in phased.reason
    (flipped,) = lowered(conv_graph("bf16", "none", n, c, h, w, k, 3, padding=1, mode="convolution"))
    assert _values(flipped, "constexpr")["FLIP"] is True and _values(plain, "constexpr")["FLIP"] is False


def test_lower_gives_one_persistent_launch_with_an_unaligned_fallback():
    g = conv_graph("bf16", "bias_relu", 3, 64, 13, 11, 136, 3, padding=1)
    (launch,) = lowered(g)
    config = _offered(g)[0].config
    tiles = 3 * -(-13 // config.block_h) * -(-11 // config.block_w) * -(-136 // config.block_n)
    assert launch.grid == (min(tiles, H100.sms), 1, 1) and launch.num_warps == 4
    assert "gluon warp-specialized conv" in launch.config_text and " us " in launch.reason
    assert launch.alternative is not None and launch.alternative.scratch == ()
    source = open(launch.source_path).read()
    assert "conv_lib.implicit_gemm(" in source and "bias" not in source.split('"""', 2)[2]  # no user names in code
    forced = ConvConfig(16, 8, 256, 64, 3, 2)
    (launch,) = lowered(g, forced)
    assert "16x8x256x64 stages=3 consumers=2" in launch.config_text
    with pytest.raises(dg.UnsupportedError, match="is not one this problem can run"):
        lowered(g, ConvConfig(16, 16, 256, 64, 8, 2))  # its ring does not fit


def test_a_dgrad_lowers_to_one_launch_over_dy_with_the_filter_row_major():
    """dx [3, 136, 13, 11] from dy [3, 64, 13, 11]: the kernel's A is dy (its channels K), its
    columns C; w row-major B; flipped in cross-correlation; the Triton fallback for unaligned calls."""
    g = dgrad_graph("bf16", "bias_relu", 3, 136, 13, 11, 64, 3, padding=1)
    (launch,) = lowered(g)
    config = _offered(g)[0].config
    tiles = 3 * -(-13 // config.block_h) * -(-11 // config.block_w) * -(-136 // config.block_n)
    assert launch.grid == (min(tiles, H100.sms), 1, 1)
    assert "dgrad as the forward over dy with the filter flipped and padding [1, 1]" in launch.reason
    assert launch.alternative is not None and launch.alternative.scratch == ()
    ints, values = _values(launch, "int"), _values(launch, "constexpr")
    assert (ints["channels"], ints["filters"], ints["x_stride_w"], ints["y_stride_w"]) == (64, 136, 64, 136)
    assert (ints["w_stride_k"], ints["w_stride_r"], ints["w_stride_s"]) == (9 * 136, 3 * 136, 136)
    assert (values["B_K_MAJOR"], values["FLIP"], values["BLOCK_K"]) == (False, True, 64)
    assert "conv_lib.implicit_gemm(" in open(launch.source_path).read()
    (unflipped,) = lowered(dgrad_graph("bf16", "none", 3, 136, 13, 11, 64, 3, padding=1, mode="convolution"))
    assert _values(unflipped, "constexpr")["FLIP"] is False
    assert [c.config.block_k for c in _offered(dgrad_graph("bf16", "none", 2, 64, 9, 9, 24, 3, padding=1))] == [
        32] * len(CONFIGS)  # BLOCK_K fitted to K, the reduction


def test_default_options_rank_gluon_for_convs_by_the_models():
    """gluon is verified for conv: a default build ranks it with Triton by the two backends'
    measured rates (gluon first for a measured layer it was faster on, ResNet-50's layer2.1.conv2:
    BENCHMARKS.md), never on interpreted builds."""
    problem = conv_group(conv_graph("bf16", "bias_relu", 32, 128, 28, 28, 128, 3, padding=1))[1]
    assert "conv" in GLUON.families and "conv" in registry.verified_families(GLUON)
    for target in (H100, H200):
        assert registry.choose(problem, target, BuildOptions(target=target), interpreted=False).name == "gluon"
        assert registry.choose(problem, target, BuildOptions(target=target), interpreted=True).name == "triton"
    pairs = registry.ranked(problem, H100, BuildOptions(backends=GLUON_FIRST, target=H100), interpreted=False)
    assert {b.name for b, _ in pairs} == {"gluon", "triton"}
    assert registry.choose(problem, H100, BuildOptions(backends=("gluon",)), interpreted=False).name == "gluon"


def test_refusals_name_gluons_reason_for_a_stride_3():
    g, x, w, conv = _graph()
    g.conv_fprop(x, w, **dict(conv, stride=[3, 3])).set_output(True)
    problem = conv_group(g)[1]
    text = registry.refusals(problem, H100, BuildOptions(backends=GLUON_FIRST, target=H100))
    assert text.startswith("gluon: gluon's implicit GEMM reads a stride past 2")
    assert registry.refusals(problem, H100, BuildOptions(backends=("triton",), target=H100)) == ""


def test_a_cpu_build_with_gluon_first_runs_triton_in_the_interpreter():
    g = conv_graph("bf16", "bias_relu", 1, 16, 5, 6, 16, 3, padding=1)
    inputs = _inputs(g, "cpu")
    check(g, inputs, dtype=torch.bfloat16, options=BuildOptions(backends=GLUON_FIRST))
    assert {launch.backend for launch in g.plan.launches} == {"triton"}


# -- (d) on a GPU (H100 / H200) --------------------------------------------------------------------

def _inputs(g, device="cuda") -> dict:
    """Random inputs of `g` with its strides (x and w scaled so sums stay near 1)."""
    found = {}
    for t in g.tensors:
        if t.producer is None:
            value = torch.randn(*t.dim, device=device) * (0.25 if t.name in ("x", "w", "dy") else 1.0)
            found[t.name] = torch.empty_strided(tuple(t.dim), tuple(t.stride), dtype=t.data_type.torch_dtype,
                                                device=device).copy_(value.to(t.data_type.torch_dtype))
    return found


def _few_sms(device="cuda"):
    """The device's target with 3 SMs: programs loop over many tiles (the ring wraps across them)."""
    return dataclasses.replace(dg.target.from_properties(torch.cuda.get_device_properties(device)), sms=3)


def _check_gluon(g, type_name, target=None, tolerance=None):
    out_type = g.outputs()[0].data_type.torch_dtype
    tolerance = tolerance or {torch.float32: 1e-2}.get(out_type)
    outputs = check(g, _inputs(g), dtype=TYPES[type_name].torch_dtype, device="cuda", tolerance=tolerance,
                    options=BuildOptions(backends=("gluon", ), target=target or _few_sms()))
    assert {launch.backend for launch in g.plan.launches} == {"gluon"}
    return outputs


# (id, n, c, h, w, k, filter, stride, padding, dilation): 1x1/1, 1x1/2 (odd sizes: the view's
# last row and column), 3x3/1 p1, 5x5/1 p2 and dilated, 7x7 p3, 3x3/2 and 7x7/2 (four phase views;
# odd and even H, W); odd N, H, W; C and K from 8 to 264
GPU_GEOMETRIES = (
    ("1x1s1", 3, 264, 13, 11, 136, 1, 1, 0, 1),
    ("1x1s2", 3, 64, 13, 11, 264, 1, 2, 0, 1),
    ("3x3s1p1", 3, 64, 13, 11, 136, 3, 1, 1, 1),
    ("3x3s1p0", 2, 72, 9, 17, 64, 3, 1, 0, 1),
    ("5x5s1p2", 3, 16, 13, 11, 40, 5, 1, 2, 1),
    ("5x5d2p4", 2, 32, 12, 10, 24, 5, 1, 4, 2),
    ("7x7s1p3", 1, 24, 15, 9, 264, 7, 1, 3, 1),
    ("3x3s2p1", 3, 64, 13, 12, 136, 3, 2, 1, 1),
    ("3x3s2p1d2", 2, 32, 17, 11, 64, 3, 2, 1, 2),
    ("7x7s2p3", 2, 8, 23, 18, 64, 7, 2, 3, 1),
    ("1x1s2p1", 2, 64, 9, 10, 64, 1, 2, 1, 1),
)


def gpu_cases() -> list:
    """(type, epilogue, geometry) of the reference tests: every geometry x epilogue once, the
    16-bit type alternating over them, so each type meets every geometry and every epilogue."""
    types = sorted(TYPES)
    return [(types[(i + j) % len(types)], epilogue, geometry)
            for i, geometry in enumerate(GPU_GEOMETRIES) for j, epilogue in enumerate(sorted(EPILOGUES))]


def test_the_gpu_cases_meet_every_pair_of_type_epilogue_and_geometry():
    cases = gpu_cases()
    assert {(e, g[0]) for _, e, g in cases} == {(e, g[0]) for e in EPILOGUES for g in GPU_GEOMETRIES}
    assert {(t, e) for t, e, _ in cases} == {(t, e) for t in TYPES for e in EPILOGUES}
    assert {(t, g[0]) for t, _, g in cases} == {(t, g[0]) for t in TYPES for g in GPU_GEOMETRIES}


@pytest.mark.gpu
@pytest.mark.parametrize("case", gpu_cases(), ids=lambda case: f"{case[0]}-{case[1]}-{case[2][0]}")
def test_gluon_conv_matches_the_reference(case):
    type_name, epilogue, (_, n, c, h, w, k, f, s, p, d) = case
    _check_gluon(conv_graph(type_name, epilogue, n, c, h, w, k, f, s, p, d), type_name)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=lambda i: CONFIGS[i].text.replace(" ", "_"))
def test_every_config_matches_the_reference(index, monkeypatch):
    """Every config forced in turn, over a 3x3 layer whose rectangles and channel blocks are
    partly past P, Q, C and K, at stride 1 and 2 (four phase views), and a strided 1x1; a NaN in
    input pixel (4, 5) of image 1 reaches exactly the output pixels whose windows hold it."""
    import dnngraph.backends.gluon.conv_backend as conv_backend
    from dnngraph.runtime.plan_cache import PLANS
    monkeypatch.setattr(conv_backend, "CONFIGS", (CONFIGS[index], ))
    PLANS.clear()
    config = CONFIGS[index]
    # stride 1: rows 3..5, columns 4..6; stride 2: output p reads rows 2p - 1 .. 2p + 1
    for stride, rows, cols in ((1, (3, 4, 5), (4, 5, 6)), (2, (2, ), (2, 3))):
        g = conv_graph("bf16", "bias_relu", 3, 72, 19, 21, 264, 3, stride=stride, padding=1)
        inputs = _inputs(g)
        inputs["x"][1, :, 4, 5] = float("nan")
        outputs = check(g, inputs, dtype=torch.bfloat16, device="cuda",
                        options=BuildOptions(backends=("gluon", ), target=_few_sms()))
        (output, ) = outputs.values()
        nan_pixels = torch.isnan(output).any(dim=1).nonzero().tolist()
        assert sorted(nan_pixels) == [[1, p, q] for p in rows for q in cols], stride
        assert f"conv {config.block_h}x{config.block_w}x{config.block_n}x64 stages={config.stages}" in (
            g.plan.launches[0].config_text)
    _check_gluon(conv_graph("fp16", "bias_silu", 2, 64, 15, 13, 136, 1, stride=2), "fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_a_channels_last_slice_and_a_flipped_filter(type_name):
    """x a channels_last slice (64 of 128 channels: H and W strides of the whole), and
    mode="convolution" (the filter back to front)."""
    sliced = conv_graph(type_name, "bias_relu", 3, 64, 13, 11, 72, 3, padding=1,
                        x_stride=[13 * 11 * 128, 1, 11 * 128, 128])
    _check_gluon(sliced, type_name)
    _check_gluon(conv_graph(type_name, "scale_gelu_tanh", 2, 40, 9, 10, 64, 3, padding=1, mode="convolution"), type_name)


@pytest.mark.gpu
def test_a_resnet_sized_layer_on_every_sm():
    g = conv_graph("bf16", "bias_relu", 8, 256, 14, 14, 256, 3, padding=1)
    _check_gluon(g, "bf16", target=dg.target.from_properties(torch.cuda.get_device_properties("cuda")))


# the dgrad's (id, n, c, h, w, k, filter, stride, padding, dilation) of the forward x -> dy: 1x1,
# 3x3 p1 and p0, 5x5 p2 and dilated, 7x7 p3, 1x1 p1 (taps inside dy); odd N, H, W; C and K 16..264
DGRAD_GPU_GEOMETRIES = (
    ("1x1", 3, 136, 13, 11, 264, 1, 1, 0, 1),
    ("3x3p1", 3, 136, 13, 11, 64, 3, 1, 1, 1),
    ("3x3p0", 2, 64, 9, 17, 72, 3, 1, 0, 1),
    ("5x5p2", 3, 40, 13, 11, 16, 5, 1, 2, 1),
    ("5x5d2p4", 2, 24, 12, 10, 32, 5, 1, 4, 2),
    ("7x7p3", 1, 264, 15, 9, 24, 7, 1, 3, 1),
    ("1x1p1", 3, 64, 9, 11, 40, 1, 1, 1, 1),
    ("1x1s2", 3, 136, 13, 12, 264, 1, 2, 0, 1),  # gluon writes dx's phase (0, 0), Triton the zeros
)


def dgrad_gpu_cases() -> list:
    """(type, epilogue, geometry) of the dgrad's reference tests, as gpu_cases pairs them."""
    types = sorted(TYPES)
    return [(types[(i + j) % len(types)], epilogue, geometry)
            for i, geometry in enumerate(DGRAD_GPU_GEOMETRIES) for j, epilogue in enumerate(sorted(EPILOGUES))]


def test_the_dgrad_gpu_cases_meet_every_pair_of_type_epilogue_and_geometry():
    cases = dgrad_gpu_cases()
    assert {(e, g[0]) for _, e, g in cases} == {(e, g[0]) for e in EPILOGUES for g in DGRAD_GPU_GEOMETRIES}
    assert {(t, e) for t, e, _ in cases} == {(t, e) for t in TYPES for e in EPILOGUES}
    assert {(t, g[0]) for t, _, g in cases} == {(t, g[0]) for t in TYPES for g in DGRAD_GPU_GEOMETRIES}
    for _, n, c, h, w, k, f, s, p, d in DGRAD_GPU_GEOMETRIES:  # every one is the gluon's
        assert _answer(dgrad_graph("bf16", "none", n, c, h, w, k, f, s, p, d)) is True


@pytest.mark.gpu
@pytest.mark.parametrize("case", dgrad_gpu_cases(), ids=lambda case: f"{case[0]}-{case[1]}-{case[2][0]}")
def test_gluon_dgrad_matches_the_reference(case):
    type_name, epilogue, (_, n, c, h, w, k, f, s, p, d) = case
    _check_gluon(dgrad_graph(type_name, epilogue, n, c, h, w, k, f, s, p, d), type_name)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=lambda i: CONFIGS[i].text.replace(" ", "_"))
def test_every_config_runs_the_dgrad(index, monkeypatch):
    """Every config forced on a 3x3 p1 dgrad whose rectangles and channel blocks are partly past
    H, W, C and K (C 264: a last block of 8 channels); a NaN in dy pixel (4, 5) of image 1 reaches
    exactly dx's pixels 3..5 x 4..6 (those whose windows hold it), and nothing else of dx."""
    import dnngraph.backends.gluon.conv_backend as conv_backend
    from dnngraph.runtime.plan_cache import PLANS
    monkeypatch.setattr(conv_backend, "CONFIGS", (CONFIGS[index], ))
    PLANS.clear()
    config = CONFIGS[index]
    g = dgrad_graph("bf16", "bias_relu", 3, 264, 19, 21, 72, 3, padding=1)
    inputs = _inputs(g)
    inputs["dy"][1, :, 4, 5] = float("nan")
    outputs = check(g, inputs, dtype=torch.bfloat16, device="cuda",
                    options=BuildOptions(backends=("gluon", ), target=_few_sms()))
    (output, ) = outputs.values()
    nan_pixels = torch.isnan(output).any(dim=1).nonzero().tolist()
    assert sorted(nan_pixels) == [[1, p, q] for p in (3, 4, 5) for q in (4, 5, 6)]
    assert f"conv {config.block_h}x{config.block_w}x{config.block_n}x64 stages={config.stages}" in (
        g.plan.launches[0].config_text)
    _check_gluon(dgrad_graph("fp16", "bias_silu", 2, 40, 15, 13, 24, 3, padding=2, dilation=2), "fp16")
    _check_gluon(dgrad_graph("bf16", "bias_relu", 2, 72, 15, 14, 136, 1, stride=2), "bf16")  # relu(bias) between


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_a_dgrad_of_a_dy_slice_a_flipped_filter_and_asymmetric_padding(type_name):
    """dy a channels_last slice (72 of 128 channels), mode="convolution" (the filter front to
    back), padding 2 before and 0 after each axis; a float32 dx."""
    p, q = 13, 11
    sliced = dgrad_graph(type_name, "bias_relu", 3, 64, p, q, 72, 3, padding=1, dy_stride=[p * q * 128, 1, q * 128, 128])
    _check_gluon(sliced, type_name)
    _check_gluon(dgrad_graph(type_name, "scale_gelu_tanh", 2, 40, 9, 10, 64, 3, padding=1, mode="convolution"), type_name)
    _check_gluon(dgrad_graph(type_name, "relu_cast", 2, 48, 9, 10, 64, 3, padding=2, post_padding=0), type_name)


@pytest.mark.gpu
def test_a_resnet_sized_dgrad_on_every_sm():
    g = dgrad_graph("bf16", "none", 8, 256, 14, 14, 256, 3, padding=1)
    _check_gluon(g, "bf16", target=dg.target.from_properties(torch.cuda.get_device_properties("cuda")))
    assert "dnngraph_gluon_conv_conv_dgrad" in g.explain()


@pytest.mark.gpu
def test_explain_names_the_gluon_kernel_and_a_refusal():
    g = conv_graph("bf16", "bias_relu", 2, 64, 13, 11, 64, 3, padding=1)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=BuildOptions(backends=("gluon", )))
    text = g.explain()
    assert "  backend: gluon" in text and "gluon warp-specialized conv" in text
    assert "dnngraph_gluon_conv_conv_fprop" in text
    strided = conv_graph("bf16", "bias_relu", 2, 64, 13, 11, 64, 3, stride=3, padding=1)
    check(strided, _inputs(strided), dtype=torch.bfloat16, device="cuda", options=BuildOptions(backends=GLUON_FIRST))
    text = strided.explain()
    assert "  backend: triton" in text and "  refused: gluon: gluon's implicit GEMM reads a stride past 2" in text


CONSAN = CONSAN_HEAD + """from gluon_conv_cases import conv_graph, dgrad_graph
from helpers import check
import dnngraph as dg
target = dataclasses.replace(dg.target.from_properties(torch.cuda.get_device_properties(0)), sms=2)
# two consumers (3x3, padded) and one (the 8x8 rectangles of a 7x7 output), each program over
# several tiles; a strided 1x1; a 3x3 / 2 through four phase views
for args, kwargs in (((3, 64, 13, 11, 136, 3), dict(padding=1)), ((2, 64, 7, 7, 64, 3), dict(padding=1)),
                     ((2, 64, 13, 11, 128, 1), dict(stride=2)), ((2, 64, 15, 13, 64, 3), dict(stride=2, padding=1))):
    g = conv_graph("bf16", "bias_relu", *args, **kwargs)
    inputs = {{t.name: torch.empty_strided(tuple(t.dim), tuple(t.stride), dtype=t.data_type.torch_dtype,
                                          device="cuda").copy_(torch.randn(*t.dim, device="cuda") / 4)
              for t in g.tensors if t.producer is None}}
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=dg.BuildOptions(backends=("gluon",), target=target))
    assert g.plan.launches[0].backend == "gluon"
# the dgrad: w a row-major B, two consumers and one; padding past (R-1)*dil (1x1 p1); a strided 1x1
for args, kwargs in (((3, 136, 13, 11, 64, 3), dict(padding=1)), ((2, 64, 7, 7, 64, 3), dict(padding=1)),
                     ((2, 64, 9, 11, 32, 1), dict(padding=1)), ((2, 64, 13, 11, 128, 1), dict(stride=2))):
    g = dgrad_graph("bf16", "bias_relu", *args, **kwargs)
    inputs = {{t.name: torch.empty_strided(tuple(t.dim), tuple(t.stride), dtype=t.data_type.torch_dtype,
                                          device="cuda").copy_(torch.randn(*t.dim, device="cuda") / 4)
              for t in g.tensors if t.producer is None}}
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=dg.BuildOptions(backends=("gluon",), target=target))
    assert g.plan.launches[0].backend == "gluon"
print("consan clean")
"""


@pytest.mark.gpu
def test_a_small_run_is_clean_under_the_concurrency_sanitizer(tmp_path):
    clean_under_consan(CONSAN, __file__, tmp_path)


def test_each_partition_makes_the_descriptors_it_copies_through():
    """A device-side descriptor is acquired only by the warps that make it: the producer makes
    x's phase views and w's (dy's in wgrad), each consumer y's, the kernel bodies none."""
    import ast
    import inspect

    from dnngraph.backends.gluon import conv_library, conv_wgrad_library

    functions = [node for module in (conv_library, conv_wgrad_library)
                 for node in ast.walk(ast.parse(inspect.getsource(module))) if isinstance(node, ast.FunctionDef)]
    makers = {node.name for node in functions for call in ast.walk(node) if isinstance(call, ast.Call)
              and getattr(call.func, "attr", None) == "make_tensor_descriptor"}
    assert makers == {"phase_view", "filter_descriptor", "wgrad_load_partition"}, makers
    # x's views and w's: the producers' own; y's (phase) views the consumers' (the wgrad's
    # consumers store their partials by pointer)
    for helper, producers in (("phase_view", {"conv_load_partition", "wgrad_load_partition", "conv_mma_partition"}),
                              ("filter_descriptor", {"conv_load_partition"})):
        callers = {node.name for node in functions for call in ast.walk(node)
                   if isinstance(call, ast.Call) and getattr(call.func, "id", None) == helper}
        assert callers == producers, (helper, callers)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The storage of `tensor` from its first element on, as one flat tensor (the kernel's pointer)."""
    span = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    return tensor.as_strided((span, ), (1, ))


def _filter_taps(launch, w: torch.Tensor) -> torch.Tensor:
    """w read through the launch's w strides as the kernel's descriptor reads it, [taps_h,
    taps_w, filters (the GEMM's columns), channels (its reduction)]: K-major [filters, R, S,
    channels] in fprop, row-major [channels, R, S, filters] in dgrad (conv_library.filter_descriptor)."""
    ints, values = _values(launch, "int"), _values(launch, "constexpr")
    axes = (ints["filters"], ints["channels"])
    outer, inner = axes if values["B_K_MAJOR"] else axes[::-1]
    view = _flat(w).as_strided((outer, ints["taps_h"], ints["taps_w"], inner),
                               (ints["w_stride_k"], ints["w_stride_r"], ints["w_stride_s"], 1), w.storage_offset())
    view = view.permute(1, 2, 0, 3) if values["B_K_MAJOR"] else view.permute(1, 2, 3, 0)
    return view.double()


def _emulated(launch, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The output [N, filters, out_h, out_w] as the kernel reads its operands from the launch's
    arguments and the storage of x (fprop's x, dgrad's dy) and w alone (no GPU): each tap's box
    from phase view (phase_h, phase_w) of x's storage (conv_library.phase_view: x_ptr + phase *
    stride, rows STRIDE apart, zeros outside the view), at view rows p + shift where the tap's
    offset r*dil - pad = phase + STRIDE * shift, times the filter tap (_filter_taps; back to front
    where FLIP)."""
    ints, values = _values(launch, "int"), _values(launch, "constexpr")
    n, c, k = ints["images"], ints["channels"], ints["filters"]
    p_out, q_out = ints["out_h"], ints["out_w"]
    stride = (values["STRIDE_H"], values["STRIDE_W"])
    y = torch.zeros(n, k, p_out, q_out, dtype=torch.float64)
    storage, taps = _flat(x), _filter_taps(launch, w)
    for r in range(ints["taps_h"]):
        for s in range(ints["taps_w"]):
            offsets = (r * ints["dil_h"] - ints["pad_h"], s * ints["dil_w"] - ints["pad_w"])
            phases = tuple(o % st for o, st in zip(offsets, stride))
            shifts = tuple((o - ph) // st for o, ph, st in zip(offsets, phases, stride))
            for phased, phase in zip((values["PHASED_H"], values["PHASED_W"]), phases):
                assert phased or phase == 0  # an unphased axis has only view 0
            rows = -(-(ints["x_rows"] - phases[0]) // stride[0])
            cols = -(-(ints["x_cols"] - phases[1]) // stride[1])
            view = storage.as_strided((n, rows, cols, c), (ints["x_stride_n"], stride[0] * ints["x_stride_h"],
                                                            stride[1] * ints["x_stride_w"], 1),
                                      x.storage_offset() + phases[0] * ints["x_stride_h"]
                                      + phases[1] * ints["x_stride_w"])
            box = torch.zeros(n, p_out, q_out, c, dtype=torch.float64)  # TMA's zero fill
            for p in range(p_out):
                for q in range(q_out):
                    v, u = p + shifts[0], q + shifts[1]
                    if 0 <= v < rows and 0 <= u < cols:
                        box[:, p, q] = view[:, v, u].double()
            tap = (ints["taps_h"] - 1 - r, ints["taps_w"] - 1 - s) if values["FLIP"] else (r, s)
            y += torch.einsum("npqc,kc->nkpq", box, taps[tap[0], tap[1]])
    return _placed(launch, y)


def _placed(launch, y: torch.Tensor) -> torch.Tensor:
    """The whole output [N, filters, y_rows, y_cols] the kernel writes: the GEMM's pixels into
    phase (0, 0), OUT_STRIDE apart (all of it at stride 1), and the epilogue of zeros (zeros: no
    epilogue here) into the other phases (conv_library.store_zero_phases)."""
    ints, values = _values(launch, "int"), _values(launch, "constexpr")
    strides = (values["OUT_STRIDE_H"], values["OUT_STRIDE_W"])
    assert (ints["out_h"], ints["out_w"]) == tuple(-(-ints[f"y_{axis}"] // st) for axis, st in zip(("rows", "cols"),
                                                                                                    strides))
    whole = torch.zeros(y.shape[0], y.shape[1], ints["y_rows"], ints["y_cols"], dtype=y.dtype)
    whole[:, :, ::strides[0], ::strides[1]] = y
    return whole


@pytest.mark.parametrize("case", [
    ("3x3s1p1", dict(filter_size=3, padding=1)), ("5x5d2", dict(filter_size=5, padding=4, dilation=2)),
    ("1x1s2", dict(filter_size=1, stride=2)), ("3x3s2p1", dict(filter_size=3, stride=2, padding=1)),
    ("7x7s2p3", dict(filter_size=7, stride=2, padding=3)), ("1x1s2p1", dict(filter_size=1, stride=2, padding=1)),
    ("3x3s2d2", dict(filter_size=3, stride=2, padding=2, dilation=2)),
    ("flip", dict(filter_size=3, stride=2, padding=1, mode="convolution"))], ids=lambda case: case[0])
def test_the_launch_arguments_read_the_convolution(case):
    """The sizes, strides and phase constexprs lower() gives, read as the kernel reads them
    (_emulated), compute the convolution torch computes: x a channels_last slice (8 of 16
    channels), odd H and W."""
    _, geometry = case
    n, c, h, w, k = 2, 8, 11, 9, 16
    g = conv_graph("bf16", "none", n, c, h, w, k, x_stride=[h * w * 16, 1, w * 16, 16], **geometry)
    (launch,) = lowered(g)
    whole = torch.randn(n, 16, h, w).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    x = whole[:, :8]
    weights = torch.randn(k, c, geometry["filter_size"], geometry["filter_size"]).to(torch.bfloat16)
    weights = weights.contiguous(memory_format=torch.channels_last)  # KRSC, as the graph declares it
    expected = g.reference({"x": x, "w": weights})
    (out,) = expected.values()
    assert torch.allclose(_emulated(launch, x, weights), out.double(), rtol=1e-2, atol=1e-2)


def test_refusals_skip_entries_for_other_families():
    """An entry "gluon:sdpa" takes no conv: it is no refusal to report for a conv group, while an
    entry that takes convs (the default's "gluon:conv,sdpa") reports gluon's reason."""
    g, x, w, conv = _graph()
    g.conv_fprop(x, w, **dict(conv, stride=[3, 3])).set_output(True)
    problem = conv_group(g)[1]
    assert registry.refusals(problem, H100, BuildOptions(backends=("triton", "gluon:sdpa"), target=H100)) == ""
    assert registry.refusals(problem, H100, BuildOptions(target=H100)) \
        .startswith("gluon: gluon's implicit GEMM reads a stride past 2")


@pytest.mark.parametrize("case", [
    ("3x3p1", dict(filter_size=3, padding=1)), ("3x3p0", dict(filter_size=3)),
    ("5x5d2p4", dict(filter_size=5, padding=4, dilation=2)), ("5x5p2", dict(filter_size=5, padding=2)),
    ("1x1", dict(filter_size=1)), ("1x1p1", dict(filter_size=1, padding=1)),
    ("3x3p3", dict(filter_size=3, padding=3)), ("3x3p2post0", dict(filter_size=3, padding=2, post_padding=0)),
    ("flip", dict(filter_size=3, padding=1, mode="convolution")), ("1x1s2", dict(filter_size=1, stride=2)),
    ("1x1s2post1", dict(filter_size=1, stride=2, post_padding=1))], ids=lambda case: case[0])
def test_the_dgrad_launch_arguments_read_the_data_gradient(case):
    """The dgrad's launch arguments, read as the kernel reads them (_emulated: dy through its
    boxes, w as a row-major B), compute the data gradient g.reference computes: dy a channels_last
    slice (24 of 40 channels) at a storage offset, odd H and W, C 16, padding past (R-1)*dil (the
    taps start inside dy), asymmetric padding, and the strided 1x1 (dx's phase (0, 0) written,
    the others zeros; odd and even extents)."""
    _, geometry = case
    n, c, h, w, k = 2, 16, 11, 8, 24
    filter_size, padding, dilation = geometry["filter_size"], geometry.get("padding", 0), geometry.get("dilation", 1)
    post, stride = geometry.get("post_padding", padding), geometry.get("stride", 1)
    p, q = ((size + padding + post - dilation * (filter_size - 1) - 1) // stride + 1 for size in (h, w))
    g = dgrad_graph("bf16", "none", n, c, h, w, k, dy_stride=[p * q * 40, 1, q * 40, 40], **geometry)
    (launch, *zero_phases) = lowered(g)
    whole = torch.randn(n, 40, p, q).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    dy = whole[:, 8:32]
    weights = torch.randn(k, c, filter_size, filter_size).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    (out,) = g.reference({"dy": dy, "w": weights}).values()
    assert out.shape == (n, c, h, w)
    emulated = _emulated(launch, dy, weights)
    assert len(zero_phases) == (3 if stride == 2 else 0)
    if zero_phases:  # the Triton launches of dx's other phases, run here in the interpreter
        dx = _run_zero_phases(g, launch, zero_phases, emulated, {"dy": dy, "w": weights})
        assert not torch.isnan(dx).any()  # every pixel of dx written by one launch or another
        emulated = dx
    assert torch.allclose(emulated, out.double(), rtol=1e-2, atol=1e-2)


def _run_zero_phases(g, gluon_launch, launches, phase_zero: torch.Tensor, inputs: dict) -> torch.Tensor:
    """dx (float64): `phase_zero` (the gluon kernel's part, emulated) at its phase (0, 0) pixels
    (OUT_STRIDE apart), the other pixels as the zero-phase launches (Triton kernels, run in the
    interpreter) write them into a NaN-poisoned dx."""
    out = g.outputs()[0]
    dx = torch.full_like(phase_zero, float("nan")).to(out.data_type.torch_dtype).contiguous(
        memory_format=torch.channels_last)
    tensors = {t.uid: inputs[t.name] for t in g.tensors if t.name in inputs}
    tensors[out.uid] = dx
    for launch in launches:
        launch.interpret(tensors)
    result = dx.double()
    values = _values(gluon_launch, "constexpr")
    written = torch.zeros_like(result, dtype=torch.bool)
    written[:, :, ::values["OUT_STRIDE_H"], ::values["OUT_STRIDE_W"]] = True
    return torch.where(written, phase_zero, result)


def test_unmeasured_gradients_stay_on_triton_by_default_and_take_gluon_when_asked():
    """A dgrad and a wgrad outside their measured envelopes (batch 8: the measured layers ran 32,
    heuristics/conv_measured.py) carry no estimate, so the default build ("triton" first) runs
    Triton's, a build naming gluon first runs Gluon's; the same layers at batch 32 are ranked by
    the two backends' measured rates (dgrad and 3x3 wgrad: Gluon; strided 1x1 wgrad: Triton)."""
    from gluon_conv_cases import wgrad_graph
    for n, expected in ((8, None), (32, "gluon")):
        graphs = {"dgrad": dgrad_graph("bf16", "none", n, 64, 28, 28, 128, 3, padding=1),
                  "wgrad": wgrad_graph("bf16", "none", n, 64, 28, 28, 128, 3, padding=1)}
        for direction, g in graphs.items():
            problem = conv_group(g)[1]
            assert GLUON.supports(problem, H100) is True, direction
            estimates = [c.estimate for c in GLUON.candidates(problem, H100, BuildOptions(target=H100))]
            assert all(e is None for e in estimates) if expected is None else all(e is not None for e in estimates)
            for target in (H100, H200):
                chosen = registry.choose(problem, target, BuildOptions(target=target), interpreted=False).name
                assert chosen == (expected or "triton"), (n, direction)
                assert registry.choose(problem, target, BuildOptions(backends=GLUON_FIRST, target=target),
                                       interpreted=False).name == "gluon"
    strided_pointwise_wgrad = conv_group(wgrad_graph("bf16", "none", 32, 256, 56, 56, 512, 1, stride=2))[1]
    assert registry.choose(strided_pointwise_wgrad, H200, BuildOptions(target=H200), interpreted=False).name == "triton"
    fprop = conv_group(conv_graph("bf16", "none", 32, 128, 28, 28, 128, 3, padding=1))[1]  # a measured layer
    assert all(c.estimate is not None for c in GLUON.candidates(fprop, H100, BuildOptions(target=H100)))
