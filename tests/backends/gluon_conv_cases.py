"""Conv fprop and dgrad groups the Gluon backend lowers (its implicit GEMM, backends/gluon/conv_*.py),
for the sm_90a compile test (tests/sm90_compile.py) and the GPU tests of test_gluon_conv.py."""
from __future__ import annotations

import dataclasses

import torch

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.contract import BuildContext, Candidate
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.backends.gluon.conv_backend import CONFIGS, ConvConfig, block_k_for
from dnngraph.backends.gluon.conv_wgrad import CONFIGS as WGRAD_CONFIGS
from dnngraph.fusion import partition
from dnngraph.problems import problem_of
from dnngraph.target import H100

TYPES = {"bf16": dg.bfloat16, "fp16": dg.float16}


def _bias_relu(g, y, k, t):
    return g.relu(g.add(y, g.tensor(name="bias", dim=[1, k, 1, 1], data_type=t)))


def _scale_gelu_tanh(g, y, k, t):
    return g.gelu_tanh(g.mul(y, g.tensor(name="s", dim=[1], data_type=dg.float32)))


def _bias_silu(g, y, k, t):
    return g.silu(g.add(y, g.tensor(name="bias", dim=[k, 1, 1], data_type=t)))


def _relu_cast(g, y, k, t):
    return g.cast(g.relu(y), dg.float32)


EPILOGUES = {"none": None, "bias_relu": _bias_relu, "scale_gelu_tanh": _scale_gelu_tanh, "bias_silu": _bias_silu,
             "relu_cast": _relu_cast}


def nhwc(dims) -> list:
    """The channels_last strides of a logical [N, C, H, W] (or [K, C, R, S]) tensor."""
    n, c, h, w = dims
    return [h * w * c, 1, w * c, c]


def conv_graph(type_name: str, epilogue: str, n: int, c: int, h: int, w: int, k: int, filter_size: int,
               stride: int = 1, padding: int = 0, dilation: int = 1, x_stride=None, mode="cross_correlation"):
    """out = epilogue(conv_fprop(x, w)): x NHWC [n, c, h, w] (or `x_stride`: a channels_last slice's),
    w KRSC, square filter, stride, padding and dilation."""
    t = TYPES[type_name]
    g = dg.Graph(name="gluon_conv_case", io_data_type=t)
    x = g.tensor(name="x", dim=[n, c, h, w], stride=x_stride or nhwc([n, c, h, w]), data_type=t)
    weight = g.tensor(name="w", dim=[k, c, filter_size, filter_size], stride=nhwc([k, c, filter_size, filter_size]),
                      data_type=t)
    y = g.conv_fprop(x, weight, padding=[padding] * 2, stride=[stride] * 2, dilation=[dilation] * 2, mode=mode)
    out = EPILOGUES[epilogue](g, y, k, t) if EPILOGUES[epilogue] else y
    out.set_output(True)
    return g


def dgrad_graph(type_name: str, epilogue: str, n: int, c: int, h: int, w: int, k: int, filter_size: int,
                stride: int = 1, padding: int = 0, dilation: int = 1, dy_stride=None, mode="cross_correlation",
                post_padding=None):
    """out = epilogue(conv_dgrad(dy, w)): dx of the forward x [n, c, h, w] -> dy [n, k, p, q] (NHWC,
    or `dy_stride`: a channels_last slice's), w KRSC, square filter, `padding` before each axis and
    `post_padding` (default: the same) after it; the epilogue's vectors over C."""
    t = TYPES[type_name]
    g = dg.Graph(name="gluon_dgrad_case", io_data_type=t)
    post = padding if post_padding is None else post_padding
    p, q = ((size + padding + post - dilation * (filter_size - 1) - 1) // stride + 1 for size in (h, w))
    dy = g.tensor(name="dy", dim=[n, k, p, q], stride=dy_stride or nhwc([n, k, p, q]), data_type=t)
    weight = g.tensor(name="w", dim=[k, c, filter_size, filter_size], stride=nhwc([k, c, filter_size, filter_size]),
                      data_type=t)
    dx = g.conv_dgrad(dy, weight, x_dim=[n, c, h, w], pre_padding=[padding] * 2, post_padding=[post] * 2,
                      stride=[stride] * 2, dilation=[dilation] * 2, mode=mode)
    out = EPILOGUES[epilogue](g, dx, c, t) if EPILOGUES[epilogue] else dx
    out.set_output(True)
    return g


def wgrad_graph(type_name: str, epilogue: str, n: int, c: int, h: int, w: int, k: int, filter_size: int,
                stride: int = 1, padding: int = 0, dilation: int = 1, x_stride=None, mode="cross_correlation",
                dw_stride=None):
    """out = epilogue(conv_wgrad(dy, x)): dw [k, c, f, f] (KRSC, or `dw_stride`) of the forward
    x [n, c, h, w] (NHWC, or `x_stride`) -> dy [n, k, p, q] (NHWC); the epilogue's vectors over C."""
    t = TYPES[type_name]
    g = dg.Graph(name="gluon_wgrad_case", io_data_type=t)
    p, q = ((size + 2 * padding - dilation * (filter_size - 1) - 1) // stride + 1 for size in (h, w))
    dy = g.tensor(name="dy", dim=[n, k, p, q], stride=nhwc([n, k, p, q]), data_type=t)
    x = g.tensor(name="x", dim=[n, c, h, w], stride=x_stride or nhwc([n, c, h, w]), data_type=t)
    dw = g.conv_wgrad(dy, x, w_dim=[k, c, filter_size, filter_size], padding=[padding] * 2, stride=[stride] * 2,
                      dilation=[dilation] * 2, mode=mode)
    out = EPILOGUES[epilogue](g, dw, c, t) if EPILOGUES[epilogue] else dw
    out.set_output(True)
    if dw_stride is not None:
        out.set_stride(dw_stride)
    return g


def conv_group(g):
    (group,) = [x for x in partition(g, registry.families()) if x.kind == "conv"]
    return group, problem_of(g, group)


def lowered(g, config: ConvConfig = None, target=H100):
    """The gluon launches of `g`'s conv group for `target`, lowered directly (this machine's
    builds are interpreted, where gluon does not take part)."""
    group, problem = conv_group(g)
    options = dg.BuildOptions(backends=("gluon", "triton"), target=target)
    context = BuildContext(torch.device("cuda"), target, options)
    candidate = None if config is None else Candidate("gluon", config, None)
    return GLUON.lower(g, group, problem, context, candidate)


# (label, type, epilogue, geometry (n, c, h, w, k, filter, stride, padding, dilation), mode) of the
# compile cases; each config of CONFIGS is forced on some of them so that every config meets each
# type, each epilogue walk and each operand form (pairwise, not the product)
GEOMETRIES = {
    "3x3s1p1": (2, 64, 14, 14, 128, 3, 1, 1, 1),
    "1x1s1": (2, 256, 7, 7, 64, 1, 1, 0, 1),
    "1x1s2": (2, 64, 13, 11, 128, 1, 2, 0, 1),
    "5x5d2c16": (3, 16, 13, 11, 40, 5, 1, 4, 2),
    "7x7p3c24": (1, 24, 9, 9, 64, 7, 1, 3, 1),
    "3x3s2p1": (2, 64, 13, 11, 64, 3, 2, 1, 1),
    "7x7s2p3c8": (2, 8, 17, 15, 64, 7, 2, 3, 1),
}


def compile_variants():
    """(label, type, epilogue, geometry name, config, mode): every config once per 16-bit type
    (alternating epilogues and geometries), plus the flipped filter and the thin-channel blocks."""
    epilogues = sorted(EPILOGUES)
    geometries = sorted(GEOMETRIES)
    index = 0
    for config_index, config in enumerate(CONFIGS):
        for type_name in sorted(TYPES):
            epilogue = epilogues[index % len(epilogues)]
            geometry = geometries[index % len(geometries)]
            index += 1
            yield (f"conv/{type_name}/{epilogue}/{geometry}/{config.block_h}x{config.block_w}x{config.block_n}",
                   type_name, epilogue, geometry, config, "cross_correlation")
    yield "conv/bf16/bias_relu/3x3s1p1/flip", "bf16", "bias_relu", "3x3s1p1", None, "convolution"


# the dgrad's compile geometries (n, c, h, w, k, filter, stride, padding, dilation) of the forward
# x -> dy: the row-major filter blocks over C (BLOCK_N), K the reduction (BLOCK_K fitted to it);
# padding past (R-1)*dil (1x1 p1: the taps start inside dy)
DGRAD_GEOMETRIES = {
    "3x3s1p1": (2, 128, 14, 14, 64, 3, 1, 1, 1),
    "1x1s1": (2, 64, 7, 7, 256, 1, 1, 0, 1),
    "5x5d2k16": (3, 40, 13, 11, 16, 5, 1, 4, 2),
    "1x1p1k32": (2, 64, 9, 11, 32, 1, 1, 1, 1),
    "7x7p3": (1, 64, 9, 9, 24, 7, 1, 3, 1),
    "1x1s2": (2, 64, 13, 10, 128, 1, 2, 0, 1),  # dx's phase (0, 0) through a strided view
}


def dgrad_compile_variants():
    """(label, type, epilogue, geometry name, config, mode) of the dgrad: every config once, the
    types, epilogues and geometries alternating over them, plus mode="convolution"."""
    epilogues = sorted(EPILOGUES)
    geometries = sorted(DGRAD_GEOMETRIES)
    types = sorted(TYPES)
    for index, config in enumerate(CONFIGS):
        type_name, epilogue = types[index % len(types)], epilogues[index % len(epilogues)]
        geometry = geometries[index % len(geometries)]
        yield (f"dgrad/{type_name}/{epilogue}/{geometry}/{config.block_h}x{config.block_w}x{config.block_n}",
               type_name, epilogue, geometry, config, "cross_correlation")
    yield "dgrad/fp16/bias_relu/3x3s1p1/flip", "fp16", "bias_relu", "3x3s1p1", None, "convolution"


# the wgrad's compile geometries (n, c, h, w, k, filter, stride, padding, dilation): stride 1 and
# the phase views of stride 2, a strided 1x1, dilation, thin channels (C 16, K 40: partial blocks)
WGRAD_GEOMETRIES = {
    "3x3s1p1": (2, 128, 14, 14, 64, 3, 1, 1, 1),
    "3x3s2p1": (2, 64, 13, 11, 128, 3, 2, 1, 1),
    "1x1s2": (2, 64, 13, 11, 256, 1, 2, 0, 1),
    "5x5d2c16": (3, 16, 13, 11, 40, 5, 1, 4, 2),
}


def wgrad_compile_variants():
    """(label, type, epilogue, geometry name, config, mode) of the wgrad: every config once per
    type, epilogues and geometries alternating, plus mode="convolution"."""
    epilogues = sorted(EPILOGUES)
    geometries = sorted(WGRAD_GEOMETRIES)
    index = 0
    for config in WGRAD_CONFIGS:
        for type_name in sorted(TYPES):
            epilogue, geometry = epilogues[index % len(epilogues)], geometries[index % len(geometries)]
            index += 1
            yield (f"wgrad/{type_name}/{epilogue}/{geometry}/{config.block_m}x{config.block_n}", type_name, epilogue,
                   geometry, config, "cross_correlation")
    yield "wgrad/bf16/none/3x3s2p1/flip", "bf16", "none", "3x3s2p1", None, "convolution"


def _compiled(g, config, reduction: int):
    """(launches, dtypes) of `g` for the compile test; a forced config with BLOCK_K fitted to the
    reduction's channels, as candidates() fits it."""
    if config is not None:
        config = dataclasses.replace(config, block_k=block_k_for(reduction))
    return lowered(g, config), {t.uid: t.data_type.torch_dtype for t in g.tensors}


def compile_cases():
    """(label, launches, dtypes) of every compile variant: the forward's, the dgrad's, the wgrad's."""
    for label, type_name, epilogue, geometry, config, mode in compile_variants():
        n, c, h, w, k, f, s, p, d = GEOMETRIES[geometry]
        yield (label, ) + _compiled(conv_graph(type_name, epilogue, n, c, h, w, k, f, s, p, d, mode=mode), config, c)
    for label, type_name, epilogue, geometry, config, mode in dgrad_compile_variants():
        n, c, h, w, k, f, s, p, d = DGRAD_GEOMETRIES[geometry]
        yield (label, ) + _compiled(dgrad_graph(type_name, epilogue, n, c, h, w, k, f, s, p, d, mode=mode), config, k)
    for label, type_name, epilogue, geometry, config, mode in wgrad_compile_variants():
        n, c, h, w, k, f, s, p, d = WGRAD_GEOMETRIES[geometry]
        g = wgrad_graph(type_name, epilogue, n, c, h, w, k, f, s, p, d, mode=mode)
        launches = lowered(g, config)
        dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
        dtypes.update({s.uid: s.torch_dtype for launch in launches for s in launch.scratch})  # the partials
        yield label, launches, dtypes
