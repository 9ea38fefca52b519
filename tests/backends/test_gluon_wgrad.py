"""The Gluon backend's convolution wgrad (backends/gluon/conv_wgrad.py, conv_wgrad_library.py):
per tap a GEMM over dy's pixel rectangles (dy an M-major A, x's phase views a row-major B), split
over the pixels, the fp32 partials added in split order by a combine kernel with the epilogue.

CPU (here): what it takes and refuses and why; the split (every split non-empty, the workspace
limit); the two launches' arguments, read as the kernels read them, compute the weight gradient
g.reference computes. Its kernels compile for sm_90a in test_gluon_conv.py's compile test.
GPU (@pytest.mark.gpu, an H100 or H200): results against the float64 reference over geometries,
types, epilogues, forced configs and splits; a run under the concurrency sanitizer.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from gluon_conv_cases import (EPILOGUES, TYPES, WGRAD_GEOMETRIES, conv_group, nhwc, wgrad_compile_variants,
                              wgrad_graph)
from helpers import CONSAN_HEAD, check, clean_under_consan
from test_gluon_conv import _check_gluon, _few_sms, _flat, _inputs, _values

import dnngraph as dg
from dnngraph.backends.contract import BuildContext, Candidate
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.backends.gluon.conv_wgrad import CONFIGS, WgradConfig, partial_bytes, shared_bytes, split_of
from dnngraph.options import BuildOptions
from dnngraph.runtime.workspace import WorkspaceBudget
from dnngraph.target import H100


def _answer(g):
    return GLUON.supports(conv_group(g)[1], H100)


def _refusal(g) -> str:
    answer = _answer(g)
    assert isinstance(answer, str) and answer.startswith("gluon"), answer
    return answer


def _lowered(g, config=None, budget=None) -> list:
    """The gluon launches of `g`'s wgrad group for an H100, lowered directly (a workspace
    `budget` where given)."""
    group, problem = conv_group(g)
    options = dg.BuildOptions(backends=("gluon", "triton"), target=H100)
    context = BuildContext(torch.device("cuda"), H100, options, budget=budget)
    return GLUON.lower(g, group, problem, context, None if config is None else Candidate("gluon", config, None))


# -- what it takes and refuses ------------------------------------------------------------------------

def test_the_compile_cases_meet_every_wgrad_config_type_epilogue_and_geometry():
    variants = list(wgrad_compile_variants())
    assert {(t, c) for _, t, _, _, c, _ in variants if c is not None} == {(t, c) for t in TYPES for c in CONFIGS}
    for position, values in ((2, EPILOGUES), (3, WGRAD_GEOMETRIES)):
        assert {v[position] for v in variants} == set(values)
    assert any(mode == "convolution" for *_, mode in variants)


def test_supports_the_wgrad_at_strides_1_and_2():
    for geometry in WGRAD_GEOMETRIES.values():
        for type_name in TYPES:
            assert _answer(wgrad_graph(type_name, "bias_relu", *geometry)) is True, geometry
    assert _answer(wgrad_graph("bf16", "none", 2, 64, 9, 9, 64, 3, padding=1, mode="convolution")) is True
    # dw in any layout (the combine stores through its strides): KCRS here
    assert _answer(wgrad_graph("bf16", "none", 2, 64, 9, 9, 64, 3, padding=1, dw_stride=[576, 9, 3, 1])) is True


def _wgrad(x_dim=(2, 64, 9, 9), dy_dim=(2, 64, 9, 9), t=dg.bfloat16, x_stride=None, dy_stride=None, **attrs):
    g = dg.Graph(name="refused_wgrad", io_data_type=t)
    dy = g.tensor(name="dy", dim=list(dy_dim), stride=dy_stride or nhwc(dy_dim), data_type=t)
    x = g.tensor(name="x", dim=list(x_dim), stride=x_stride or nhwc(x_dim), data_type=t)
    conv = dict(w_dim=[dy_dim[1], x_dim[1], 3, 3], padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    conv.update(attrs)
    return g, dy, x, conv


def test_supports_names_why_it_refuses_a_wgrad():
    g, dy, x, conv = _wgrad(x_dim=(2, 64, 9, 9), dy_dim=(2, 64, 3, 3), stride=[3, 3])
    g.conv_wgrad(dy, x, **conv).set_output(True)
    assert "stride past 2" in _refusal(g)

    g, dy, x, conv = _wgrad(dy_stride=[64 * 81, 81, 9, 1])
    g.conv_wgrad(dy, x, **conv).set_output(True)
    assert "channels_last (K contiguous), but dy has strides" in _refusal(g)

    g, dy, x, conv = _wgrad(x_dim=(2, 20, 9, 9))  # 40-byte x pixels
    g.conv_wgrad(dy, x, **conv).set_output(True)
    assert "x has C = 20" in _refusal(g)

    g, dy, x, conv = _wgrad(dy_dim=(2, 36, 9, 9))  # 72-byte dy pixels
    g.conv_wgrad(dy, x, **conv).set_output(True)
    assert "dy has K = 36" in _refusal(g)

    g, dy, x, conv = _wgrad(x_dim=(2, 64, 9, 9), dy_dim=(2, 64, 9, 9), groups=2)
    g.conv_wgrad(dy, x, **dict(conv, w_dim=[64, 32, 3, 3])).set_output(True)
    assert "groups 1, not 2" in _refusal(g)

    g, dy, x, conv = _wgrad()  # drelu on dy: a prologue
    y = g.tensor(name="y", dim=[2, 64, 9, 9], stride=nhwc((2, 64, 9, 9)))
    g.conv_wgrad(g.relu_backward(dy, y), x, **conv).set_output(True)
    assert "prologue" in _refusal(g)

    g, dy, x, conv = _wgrad()  # a whole-filter operand
    dw = g.conv_wgrad(dy, x, **conv)
    g.add(dw, g.tensor(name="decay", dim=[64, 64, 3, 3], stride=nhwc((64, 64, 3, 3)))).set_output(True)
    assert "scalars and per-channel vectors, not an operand of shape [64, 64, 3, 3]" in _refusal(g)

    g, dy, x, conv = _wgrad(t=dg.float32)
    g.conv_wgrad(dy, x, **conv).set_output(True)
    assert "float16 or bfloat16 operands, not float32" in _refusal(g)


# -- the split and the launches ------------------------------------------------------------------------

def test_the_split_leaves_no_split_empty_and_keeps_within_the_workspace():
    problem = conv_group(wgrad_graph("bf16", "none", 3, 64, 17, 9, 64, 3, padding=1))[1]
    config = WgradConfig(64, 64, 8, 8, 8, 1)
    rectangles = 3 * 3 * 2
    for sms in (1, 9, 36, 132, 100000):
        splits, per_split = split_of(problem, config, dataclasses.replace(H100, sms=sms))
        assert (splits - 1) * per_split < rectangles <= splits * per_split, sms
    assert split_of(problem, config, dataclasses.replace(H100, sms=1)) == (1, rectangles)
    wide = split_of(problem, config, H100)
    assert wide[0] > 1 and wide[1] >= 4  # a split holds MIN_RECTANGLES_PER_SPLIT at least
    one = partial_bytes(problem, 1)
    assert split_of(problem, config, H100, max_bytes=2 * one)[0] == 2
    assert split_of(problem, config, H100, max_bytes=one - 1)[0] == 1


def test_lower_gives_the_partials_then_the_combine_within_the_budget():
    g = wgrad_graph("bf16", "bias_relu", 3, 64, 17, 9, 136, 3, padding=1)
    budget = WorkspaceBudget(None)
    partials, combine = _lowered(g, budget=budget)
    (workspace,) = partials.scratch
    splits = _values(partials, "int")["splits"]
    assert workspace.dim == (splits, 9, 136, 64) and workspace.torch_dtype == torch.float32
    assert budget.spent == workspace.nbytes
    assert _values(combine, "int")["splits"] == splits and combine.scratch == ()
    assert "conv wgrad" in partials.config_text and "deterministic" in combine.reason
    assert partials.alternative is not None and partials.alternative is combine.alternative
    assert "dnngraph_gluon_conv_conv_wgrad" in open(partials.source_path).read()
    assert "wgrad_lib.wgrad_combine(" in open(combine.source_path).read()
    # a limit of one split's partials: one split; below it, refused (Triton runs the wgrad)
    (tight, _) = _lowered(g, budget=WorkspaceBudget(workspace.nbytes // splits))
    assert _values(tight, "int")["splits"] == 1
    with pytest.raises(dg.UnsupportedError, match="exceed the workspace limit"):
        _lowered(g, budget=WorkspaceBudget(workspace.nbytes // splits - 1))
    forced = CONFIGS[2]
    assert forced.text in _lowered(g, forced)[0].config_text
    with pytest.raises(dg.UnsupportedError, match="is not one this problem can run"):
        _lowered(g, WgradConfig(128, 256, 8, 8, 8, 2))  # its ring does not fit
    assert shared_bytes(CONFIGS[0], 2) <= H100.shared_memory


def _box(view: torch.Tensor, image: int, top: int, left: int, rows: int, cols: int) -> torch.Tensor:
    """A TMA box [rows, cols, channels] of `view` [N, H, W, C] at (image, top, left): zeros
    outside the view."""
    box = torch.zeros(rows, cols, view.shape[3], dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            v, u = top + i, left + j
            if 0 <= v < view.shape[1] and 0 <= u < view.shape[2]:
                box[i, j] = view[image, v, u].double()
    return box


def _emulated_partials(launch, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The workspace [splits, taps, K, C] as wgrad_partials computes it from its arguments and
    the storage of dy and x: split s reduces rectangles [s * per_split, ...) of dy (images
    outermost), each tap's x box from the phase view its offset lands in."""
    ints, values = _values(launch, "int"), _values(launch, "constexpr")
    n, c, k, p_out, q_out = ints["images"], ints["channels"], ints["filters"], ints["out_h"], ints["out_w"]
    bh, bw, stride = values["BLOCK_H"], values["BLOCK_W"], (values["STRIDE_H"], values["STRIDE_W"])
    tiles_h, tiles_w = -(-p_out // bh), -(-q_out // bw)
    rectangles, splits, per_split = n * tiles_h * tiles_w, ints["splits"], ints["per_split"]
    assert (splits - 1) * per_split < rectangles <= splits * per_split  # no split empty
    dy_view = _flat(dy).as_strided((n, p_out, q_out, k), (ints["dy_stride_n"], ints["dy_stride_h"],
                                                          ints["dy_stride_w"], 1), dy.storage_offset())
    partials = torch.zeros(splits, ints["taps_h"] * ints["taps_w"], k, c, dtype=torch.float64)
    for tap in range(ints["taps_h"] * ints["taps_w"]):
        r, s = divmod(tap, ints["taps_w"])
        offsets = (r * ints["dil_h"] - ints["pad_h"], s * ints["dil_w"] - ints["pad_w"])
        phases = tuple(o % st for o, st in zip(offsets, stride))
        shifts = tuple((o - ph) // st for o, ph, st in zip(offsets, phases, stride))
        rows = -(-(ints["x_rows"] - phases[0]) // stride[0])
        cols = -(-(ints["x_cols"] - phases[1]) // stride[1])
        x_view = _flat(x).as_strided((n, rows, cols, c), (ints["x_stride_n"], stride[0] * ints["x_stride_h"],
                                                          stride[1] * ints["x_stride_w"], 1),
                                     x.storage_offset() + phases[0] * ints["x_stride_h"] + phases[1] * ints["x_stride_w"])
        for index in range(rectangles):
            image, local = divmod(index, tiles_h * tiles_w)
            p0, q0 = (local // tiles_w) * bh, (local % tiles_w) * bw
            a = _box(dy_view, image, p0, q0, bh, bw)
            b = _box(x_view, image, p0 + shifts[0], q0 + shifts[1], bh, bw)
            partials[index // per_split, tap] += torch.einsum("ijk,ijc->kc", a, b)
    return partials


def _emulated_combine(launch, partials: torch.Tensor, dw_like: torch.Tensor) -> torch.Tensor:
    """dw as wgrad_combine writes it from its arguments: the splits added in order, each tap's
    [K, C] stored through dw's strides at the tap (back to front where FLIP); NaN where nothing
    was written."""
    ints, values = _values(launch, "int"), _values(launch, "constexpr")
    assert ints["splits"] == partials.shape[0]
    taps_h, taps_w = ints["taps_h"], ints["taps_w"]
    storage = torch.full((dw_like.untyped_storage().nbytes() // dw_like.element_size(), ), float("nan"),
                         dtype=torch.float64)
    dw = storage.as_strided((ints["filters"], ints["channels"], taps_h, taps_w),
                            (ints["dw_stride_k"], ints["dw_stride_c"], ints["dw_stride_r"], ints["dw_stride_s"]))
    for tap in range(taps_h * taps_w):
        r, s = divmod(tap, taps_w)
        if values["FLIP"]:
            r, s = taps_h - 1 - r, taps_w - 1 - s
        total = torch.zeros_like(partials[0, tap])
        for split in range(partials.shape[0]):
            total += partials[split, tap]
        dw[:, :, r, s] = total
    return dw


@pytest.mark.parametrize("case", [
    ("3x3p1", dict(filter_size=3, padding=1)), ("3x3p0", dict(filter_size=3)),
    ("5x5d2p4", dict(filter_size=5, padding=4, dilation=2)), ("1x1", dict(filter_size=1)),
    ("1x1s2", dict(filter_size=1, stride=2)), ("3x3s2p1", dict(filter_size=3, stride=2, padding=1)),
    ("3x3s2d2", dict(filter_size=3, stride=2, padding=2, dilation=2)),
    ("flip", dict(filter_size=3, stride=2, padding=1, mode="convolution")),
    ("kcrs", dict(filter_size=3, padding=1, dw_stride=[16 * 9, 9, 3, 1]))], ids=lambda case: case[0])
def test_the_wgrad_launch_arguments_read_the_weight_gradient(case):
    """The partials' and the combine's arguments, read as the kernels read them, compute the
    weight gradient g.reference computes: x a channels_last slice (16 of 24 channels) at a
    storage offset, odd H and W, several splits (the last one shorter), dw KRSC or KCRS."""
    _, geometry = case
    n, c, h, w, k = 3, 16, 17, 11, 24
    g = wgrad_graph("bf16", "none", n, c, h, w, k, x_stride=[h * w * 24, 1, w * 24, 24], **geometry)
    partials_launch, combine_launch = _lowered(g)
    dy_tensor = next(t for t in g.tensors if t.name == "dy")
    dy = torch.randn(*dy_tensor.dim).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    x = torch.randn(n, 24, h, w).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)[:, 4:20]
    (out,) = g.reference({"dy": dy, "x": x}).values()
    dw_tensor = g.outputs()[0]
    dw_like = torch.empty_strided(tuple(dw_tensor.dim), tuple(dw_tensor.stride))
    partials = _emulated_partials(partials_launch, dy, x)
    emulated = _emulated_combine(combine_launch, partials, dw_like)
    assert not torch.isnan(emulated).any()
    assert torch.allclose(emulated, out.double(), rtol=1e-2, atol=5e-2)


def test_a_cpu_build_with_gluon_first_runs_triton_in_the_interpreter():
    """On CPU tensors (the interpreter) gluon takes no part: a wgrad and a strided 1x1 dgrad built
    with gluon first run the Triton backend's kernels, against the reference."""
    from gluon_conv_cases import dgrad_graph

    for g in (wgrad_graph("bf16", "bias_relu", 1, 16, 5, 6, 16, 3, padding=1),
              dgrad_graph("bf16", "bias_relu", 1, 16, 5, 6, 16, 1, stride=2)):
        check(g, _inputs(g, "cpu"), dtype=torch.bfloat16, options=BuildOptions(backends=("gluon", "triton")))
        assert {launch.backend for launch in g.plan.launches} == {"triton"}


# -- on a GPU (H100 / H200) -------------------------------------------------------------------------

# (id, n, c, h, w, k, filter, stride, padding, dilation): 1x1/1 and /2, 3x3/1 p1 and /2, 5x5 p2 and
# dilated, 7x7/2 p3; odd N, H, W; C and K 16..264
WGRAD_GPU_GEOMETRIES = (
    ("1x1s1", 3, 264, 13, 11, 136, 1, 1, 0, 1),
    ("1x1s2", 3, 64, 13, 11, 264, 1, 2, 0, 1),
    ("3x3s1p1", 3, 64, 13, 11, 136, 3, 1, 1, 1),
    ("3x3s2p1", 3, 72, 13, 12, 64, 3, 2, 1, 1),
    ("5x5s1p2", 3, 16, 13, 11, 40, 5, 1, 2, 1),
    ("5x5d2p4", 2, 32, 12, 10, 24, 5, 1, 4, 2),
    ("7x7s2p3", 2, 16, 23, 18, 64, 7, 2, 3, 1),
)


def wgrad_gpu_cases() -> list:
    types = sorted(TYPES)
    return [(types[(i + j) % len(types)], epilogue, geometry)
            for i, geometry in enumerate(WGRAD_GPU_GEOMETRIES) for j, epilogue in enumerate(sorted(EPILOGUES))]


def test_the_wgrad_gpu_cases_meet_every_pair_and_are_the_gluons():
    cases = wgrad_gpu_cases()
    assert {(e, g[0]) for _, e, g in cases} == {(e, g[0]) for e in EPILOGUES for g in WGRAD_GPU_GEOMETRIES}
    assert {(t, e) for t, e, _ in cases} == {(t, e) for t in TYPES for e in EPILOGUES}
    for _, n, c, h, w, k, f, s, p, d in WGRAD_GPU_GEOMETRIES:
        assert _answer(wgrad_graph("bf16", "none", n, c, h, w, k, f, s, p, d)) is True


@pytest.mark.gpu
@pytest.mark.parametrize("case", wgrad_gpu_cases(), ids=lambda case: f"{case[0]}-{case[1]}-{case[2][0]}")
def test_gluon_wgrad_matches_the_reference(case):
    type_name, epilogue, (_, n, c, h, w, k, f, s, p, d) = case
    _check_gluon(wgrad_graph(type_name, epilogue, n, c, h, w, k, f, s, p, d), type_name)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=lambda i: CONFIGS[i].text.replace(" ", "_"))
def test_every_wgrad_config_matches_the_reference_and_repeats_bit_for_bit(index, monkeypatch):
    """Every config forced on a 3x3 p1 wgrad with blocks partly past K and C, over several splits
    (the few-SM target takes one split; the device's many); two runs agree bit for bit (the
    combine's order is fixed); a NaN in filter 5 of dy pixel (4, 5) of image 1 reaches every
    (c, r, s) of dw's filter 5 (each tap reads that pixel, x finite) and no other filter."""
    import dnngraph.backends.gluon.conv_wgrad as conv_wgrad
    from dnngraph.runtime.plan_cache import PLANS
    monkeypatch.setattr(conv_wgrad, "CONFIGS", (CONFIGS[index], ))
    PLANS.clear()
    device_target = dg.target.from_properties(torch.cuda.get_device_properties("cuda"))
    for target in (_few_sms(), device_target):
        g = wgrad_graph("bf16", "bias_relu", 3, 72, 19, 21, 136, 3, padding=1)
        inputs = _inputs(g)
        first = check(g, inputs, dtype=torch.bfloat16, device="cuda",
                      options=BuildOptions(backends=("gluon", ), target=target))
        second = check(g, inputs, dtype=torch.bfloat16, device="cuda")
        assert all(torch.equal(first[name], second[name]) for name in first)
        assert CONFIGS[index].text in g.plan.launches[0].config_text
        inputs["dy"][1, 5, 4, 5] = float("nan")
        (output, ) = check(g, inputs, dtype=torch.bfloat16, device="cuda").values()
        nan_filters = torch.isnan(output).flatten(1)
        assert nan_filters[5].all() and not nan_filters[torch.arange(136) != 5].any()


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_a_wgrad_of_an_x_slice_a_flipped_filter_and_a_kcrs_dw(type_name):
    sliced = wgrad_graph(type_name, "bias_relu", 3, 64, 13, 11, 72, 3, padding=1,
                         x_stride=[13 * 11 * 128, 1, 11 * 128, 128])
    _check_gluon(sliced, type_name)
    _check_gluon(wgrad_graph(type_name, "scale_gelu_tanh", 2, 40, 9, 10, 64, 3, padding=1, mode="convolution"),
                 type_name)
    _check_gluon(wgrad_graph(type_name, "relu_cast", 2, 48, 9, 10, 64, 3, padding=1, dw_stride=[48 * 9, 9, 3, 1]),
                 type_name)


@pytest.mark.gpu
def test_a_resnet_sized_wgrad_on_every_sm():
    g = wgrad_graph("bf16", "none", 8, 256, 14, 14, 256, 3, padding=1)
    _check_gluon(g, "bf16", target=dg.target.from_properties(torch.cuda.get_device_properties("cuda")))
    text = g.explain()
    assert "dnngraph_gluon_conv_conv_wgrad" in text and "wgrad combine" in text


CONSAN = CONSAN_HEAD + """from gluon_conv_cases import wgrad_graph
from helpers import check
import dnngraph as dg
target = dataclasses.replace(dg.target.from_properties(torch.cuda.get_device_properties(0)), sms=2)
# two consumers and one, several splits and units a program; stride 2 through four phase views
import dnngraph.backends.gluon.conv_wgrad as conv_wgrad
every_config = conv_wgrad.CONFIGS
for config_index, args, kwargs in ((0, (3, 64, 13, 11, 136, 3), dict(padding=1)),
                                   (3, (2, 64, 15, 13, 64, 3), dict(stride=2, padding=1))):
    conv_wgrad.CONFIGS = (every_config[config_index], )
    g = wgrad_graph("bf16", "bias_relu", *args, **kwargs)
    inputs = {{t.name: torch.empty_strided(tuple(t.dim), tuple(t.stride), dtype=t.data_type.torch_dtype,
                                          device="cuda").copy_(torch.randn(*t.dim, device="cuda") / 4)
              for t in g.tensors if t.producer is None}}
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=dg.BuildOptions(backends=("gluon",), target=target))
    assert g.plan.launches[0].backend == "gluon"
print("consan clean")
"""


@pytest.mark.gpu
def test_a_small_wgrad_is_clean_under_the_concurrency_sanitizer(tmp_path):
    clean_under_consan(CONSAN, __file__, tmp_path)


def test_the_combines_chain_of_splits_is_bounded_on_every_measured_layer():
    """The combine adds a program's splits one round of loads after another (COMBINE_IN_FLIGHT a
    round); a 64x64 dw split 262 ways took 218 us on the H200. On every measured wgrad layer and
    every config the splits stop at MAX_SPLITS, and the model counts the rounds."""
    from dnngraph.backends.gluon import conv_wgrad
    from dnngraph.backends.triton.heuristics.conv_measured import WGRAD_LAYERS
    from dnngraph.target import H200
    for layer in WGRAD_LAYERS:
        problem = conv_group(wgrad_graph("bf16", "none", layer.n, layer.c, layer.size, layer.size, layer.k,
                                         layer.filter, stride=layer.stride, padding=layer.padding))[1]
        for config in CONFIGS:
            splits, per_split = split_of(problem, config, H200)
            assert 1 <= splits <= conv_wgrad.MAX_SPLITS, (layer.label, config.text, splits)
            rounds = -(-splits // conv_wgrad.COMBINE_IN_FLIGHT) * conv_wgrad.COMBINE_ROUND_SECONDS
            assert rounds <= 14e-6 and conv_wgrad.modeled_seconds(problem, config, H200) > rounds
    tiny_dw = conv_group(wgrad_graph("bf16", "none", 32, 64, 56, 56, 64, 1))[1]  # layer1.0.conv1
    assert conv_wgrad.MAX_SPLITS // 2 < split_of(tiny_dw, CONFIGS[0], H200)[0] <= conv_wgrad.MAX_SPLITS  # was 262
