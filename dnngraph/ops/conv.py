"""Convolution family: fprop, dgrad, wgrad over [N, C, (D,) H, W], 1D/2D/3D, grouped.

mode="cross_correlation" is what deep-learning frameworks call convolution; mode="convolution"
flips the filter spatially.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import dtypes
from ..tensor import MAX_EXTENT
from .matmul import check_int8_operands, exact_integer_product, wrapped_to_int32
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, choice, fail, freeze, int_tuple, integer, register

MODES = ("cross_correlation", "convolution")


@dataclass(frozen=True)
class ConvAttrs:
    padding: tuple
    stride: tuple
    dilation: tuple
    groups: int = 1
    mode: str = "cross_correlation"
    shape: tuple = ()  # x_dim for dgrad, w_dim for wgrad
    # `padding` is the frontend's pre_padding (before the first element of each spatial axis, the
    # offset every kernel reads with); post_padding, after the last, is () where it equals it
    post_padding: tuple = ()

    def __post_init__(self):
        padding = int_tuple("conv", "padding", self.padding, minimum=0, maximum=MAX_EXTENT)
        spatial = len(padding)
        if not 1 <= spatial <= 3:
            fail("conv", f"padding must have 1 to 3 values, got {list(padding)}")
        shape = int_tuple("conv", "shape", self.shape, minimum=1, maximum=MAX_EXTENT)
        if shape and len(shape) != spatial + 2:
            fail("conv", f"shape {list(shape)} must have rank {spatial + 2} for {spatial} spatial dims")
        post = int_tuple("conv", "post_padding", self.post_padding, minimum=0, maximum=MAX_EXTENT)
        if post and len(post) != spatial:
            fail("conv", f"post_padding {list(post)} must have {spatial} values, as padding {list(padding)}")
        freeze(self, padding=padding, post_padding=() if post == padding else post,
               stride=int_tuple("conv", "stride", self.stride, spatial, minimum=1, maximum=MAX_EXTENT),
               dilation=int_tuple("conv", "dilation", self.dilation, spatial, minimum=1,
                                  maximum=MAX_EXTENT),
               groups=integer("conv", "groups", self.groups, minimum=1, maximum=MAX_EXTENT),
               mode=choice("conv", "mode", self.mode, MODES), shape=shape)


def post_padding(attrs: ConvAttrs) -> tuple:
    """The padding after the last element of each spatial axis (the frontend's post_padding)."""
    return attrs.post_padding or attrs.padding


def is_asymmetric(attrs: ConvAttrs) -> bool:
    return post_padding(attrs) != attrs.padding


def output_dims(op, x_dim, w_dim, attrs: ConvAttrs) -> tuple[int, ...]:
    """fprop output dims [N, K, *O]; validates channels, groups and sizes."""
    spatial = len(attrs.padding)
    if len(x_dim) != spatial + 2 or len(w_dim) != spatial + 2:
        fail(op, f"x {list(x_dim)} and w {list(w_dim)} must have rank {spatial + 2} "
                 f"for {spatial} spatial dims")
    channels, filters = x_dim[1], w_dim[0]
    if channels % attrs.groups or filters % attrs.groups:
        fail(op, f"groups={attrs.groups} must divide input channels {channels} and filters {filters}")
    if w_dim[1] * attrs.groups != channels:
        fail(op, f"w {list(w_dim)} has {w_dim[1]} channels per group; x has {channels} channels "
                 f"in {attrs.groups} groups")
    out = []
    for size, r, pre, post, s, d in zip(x_dim[2:], w_dim[2:], attrs.padding, post_padding(attrs), attrs.stride,
                                        attrs.dilation):
        extent = size + pre + post - d * (r - 1) - 1
        if extent < 0:
            fail(op, f"filter {list(w_dim[2:])} (dilation {list(attrs.dilation)}) is larger than the "
                     f"padded input {list(x_dim[2:])}")
        out.append(extent // s + 1)
    return (x_dim[0], filters) + tuple(out)


def infer_fprop(inputs, attrs):
    x, w = inputs
    dim = output_dims("conv_fprop", x.dim, w.dim, attrs)
    integer = check_int8_operands("conv_fprop", x, w, math.prod(w.dim[1:]))  # channels per group x taps
    return [OutputSpec(dim, dtypes.int32 if integer else None, layout_source=0)]


# int8 gradients (quantized training, as cuDNN's int8 dgrad/wgrad): int8 x int8 products summed
# in int32, the result int32 unless the user sets another output type (a dequantizing epilogue).
# dgrad sums filters-per-group x taps products per element, a short reduction held to
# INT8_MAX_K as fprop's is (refused, never wrapped). wgrad sums N x output pixels products, a
# reduction a realistic batch takes past INT8_MAX_K (ResNet-50's 56x56 layers at batch 64 sum
# 200704 products) while real gradients stay far below 2^31: as in cuDNN, the int32 accumulator
# wraps modulo 2^32 where a sum exceeds it (the user's problem), and the reference wraps alike.
def infer_dgrad(inputs, attrs):
    dy, w = inputs
    expected = output_dims("conv_dgrad", attrs.shape, w.dim, attrs)
    if tuple(dy.dim) != expected:
        fail("conv_dgrad", f"dy must be {list(expected)} for x_dim {list(attrs.shape)}, got {list(dy.dim)}")
    # each dx element sums (filters per group) x taps products at most
    integer = check_int8_operands("conv_dgrad", dy, w, (w.dim[0] // attrs.groups) * math.prod(w.dim[2:]))
    return [OutputSpec(tuple(attrs.shape), dtypes.int32 if integer else None, layout_source=0)]


def infer_wgrad(inputs, attrs):
    dy, x = inputs
    expected = output_dims("conv_wgrad", x.dim, attrs.shape, attrs)
    if tuple(dy.dim) != expected:
        fail("conv_wgrad", f"dy must be {list(expected)} for w_dim {list(attrs.shape)}, got {list(dy.dim)}")
    integer = check_int8_operands("conv_wgrad", dy, x, None)  # wraps past int32 (see above)
    return [OutputSpec(tuple(attrs.shape), dtypes.int32 if integer else None, layout_source=1)]


def _flip(w, attrs):
    return w.flip(tuple(range(2, w.dim()))) if attrs.mode == "convolution" else w


def _args(attrs):
    """torch's keyword arguments; asymmetric padding is applied to x by _padded (torch pads
    symmetrically), so torch then pads nothing."""
    padding = (0,) * len(attrs.padding) if is_asymmetric(attrs) else attrs.padding
    return dict(stride=attrs.stride, padding=padding, dilation=attrs.dilation, groups=attrs.groups)


def _pad_widths(attrs) -> list:
    """F.pad's widths, last axis first: (pre, post) per spatial axis when asymmetric, else 0."""
    if not is_asymmetric(attrs):
        return [0] * (2 * len(attrs.padding))
    return [width for pre, post in reversed(list(zip(attrs.padding, post_padding(attrs)))) for width in (pre, post)]


def _padded(x, attrs):
    return F.pad(x, _pad_widths(attrs)) if is_asymmetric(attrs) else x


def _padded_dims(dims, attrs) -> list:
    spatial = [size + pre + post for size, pre, post in zip(dims[2:], attrs.padding, post_padding(attrs))]
    return list(dims[:2]) + spatial if is_asymmetric(attrs) else list(dims)


def reference_fprop(values, attrs):
    x, w = values
    fn = (F.conv1d, F.conv2d, F.conv3d)[len(attrs.padding) - 1]
    convolve = lambda x, w: fn(_padded(x, attrs), _flip(w, attrs), **_args(attrs))
    if not x.is_floating_point():  # int8 x int8: the exact int32 sum
        return [exact_integer_product(convolve, x, w)]
    return [convolve(x, w)]


def reference_dgrad(values, attrs):
    dy, w = values
    fn = (torch.nn.grad.conv1d_input, torch.nn.grad.conv2d_input,
          torch.nn.grad.conv3d_input)[len(attrs.padding) - 1]
    grad = lambda dy, w: fn(_padded_dims(attrs.shape, attrs), _flip(w, attrs), dy, **_args(attrs))
    # int8 x int8: the exact int32 sum (its reduction is bounded by infer_dgrad)
    dx = grad(dy, w) if dy.is_floating_point() else exact_integer_product(grad, dy, w)
    if is_asymmetric(attrs):  # the gradient of the padded x, cropped to x
        dx = dx[(slice(None), slice(None)) + tuple(slice(pre, pre + size) for pre, size
                                                    in zip(attrs.padding, attrs.shape[2:]))]
    return [dx]


def reference_wgrad(values, attrs):
    dy, x = values
    fn = (torch.nn.grad.conv1d_weight, torch.nn.grad.conv2d_weight,
          torch.nn.grad.conv3d_weight)[len(attrs.padding) - 1]
    grad = lambda dy, x: _flip(fn(_padded(x, attrs), list(attrs.shape), dy, **_args(attrs)), attrs)
    if dy.is_floating_point():
        return [grad(dy, x)]
    # int8 x int8: the exact sum (below 2^53: float64 adds it exactly), wrapped as int32 holds it
    return [wrapped_to_int32(exact_integer_product(grad, dy, x))]


register(OpDef("conv_fprop", "conv", "anchor", ConvAttrs, ("x", "w"), ("y",), infer_fprop, reference_fprop,
                  # the scale-bias-relu of a preceding batchnorm applied at load; the batchnorm
                  # statistics of the output (genstats) folded from per-tile column sums
                  fusion=AnchorRule((0,), 0, stats_exit=True)))
register(OpDef("conv_dgrad", "conv", "anchor", ConvAttrs, ("dy", "w"), ("dx",), infer_dgrad, reference_dgrad,
                  fusion=AnchorRule((0,), 0)))
register(OpDef("conv_wgrad", "conv", "anchor", ConvAttrs, ("dy", "x"), ("dw",), infer_wgrad, reference_wgrad,
                  fusion=AnchorRule((0,), 0)))


@backward_rule("conv_fprop")
def _conv_backward(d, node, grads):
    """dx by conv_dgrad, dw by conv_wgrad, with the forward's padding, stride, dilation, groups."""
    g, dy, attrs = d.graph, grads[0], node.attrs
    x, w = node.inputs
    common = dict(pre_padding=list(attrs.padding), post_padding=list(post_padding(attrs)), stride=list(attrs.stride),
                  dilation=list(attrs.dilation), groups=attrs.groups, mode=attrs.mode)
    dx = g.conv_dgrad(dy, d.value(w), list(x.dim), **common) if d.needs(x) else None
    dw = g.conv_wgrad(dy, d.value(x), list(w.dim), **common) if d.needs(w) else None
    return [dx, dw]
