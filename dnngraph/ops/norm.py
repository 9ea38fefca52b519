"""Normalization family: layernorm, rmsnorm, batchnorm (training and inference), instancenorm,
groupnorm, genstats, and their backward forms.

Every norm is "normalize x over some axes of a (possibly grouped) view, then scale and shift per
element of `scale`". The geometry below says, per op, which axes and which statistics shape.
Statistics are float32 and keep the rank of x.
"""
from __future__ import annotations

import dataclasses
import math

from dataclasses import dataclass


from .. import dtypes
from ..tensor import MAX_EXTENT
from ..errors import UnsupportedError
from .base import (AnchorRule, OpDef, OutputSpec, backward_rule, boolean, choice, fail, freeze, integer, lookup, real,
                   register)

PHASES = ("training", "inference")


@dataclass(frozen=True)
class NormAttrs:
    epsilon: float = 1e-5
    norm_forward_phase: str = "training"
    momentum: float = 0.1  # batchnorm running statistics
    groups: int = 1  # groupnorm
    has_dbias: bool = True  # rmsnorm_backward

    def __post_init__(self):
        epsilon = real("norm", "epsilon", self.epsilon)
        if not epsilon > 0:
            fail("norm", f"epsilon must be a positive number, got {epsilon}")
        momentum = real("norm", "momentum", self.momentum)
        if not 0.0 <= momentum <= 1.0:
            fail("norm", f"momentum must be in [0, 1], got {momentum}")
        freeze(self, epsilon=epsilon, momentum=momentum,
               norm_forward_phase=choice("norm", "norm_forward_phase", self.norm_forward_phase, PHASES),
               groups=integer("norm", "groups", self.groups, minimum=1, maximum=MAX_EXTENT),
               has_dbias=boolean("norm", "has_dbias", self.has_dbias))


@dataclass(frozen=True)
class NormGeometry:
    """Where statistics are taken: `groups` splits channels (None: no grouped view)."""

    stat_axes: tuple  # axes of the (grouped) view that are reduced
    stats_dim: tuple  # statistics dims, rank of x
    param_dim: tuple  # dims of scale / bias
    groups: int | None = None


def _feature_geometry(op, x, scale) -> NormGeometry:
    """layernorm / rmsnorm / adalayernorm, as the cuDNN frontend infers them: every axis where
    scale is not 1 is normalized (the last axis where scale is 1 everywhere). adalayernorm never
    normalizes the batch axis: its scale and bias may hold one row per sample."""
    if scale is None or len(scale.dim) != len(x.dim):
        fail(op, f"scale must have the rank of x {list(x.dim)}")
    first = 1 if op.startswith("adalayernorm") else 0
    if len(x.dim) <= first:
        fail(op, f"x {list(x.dim)} needs an axis after the batch axis")
    for axis, (size, whole) in enumerate(zip(scale.dim, x.dim)):
        if size not in (1, whole):
            fail(op, f"scale {list(scale.dim)} does not match x {list(x.dim)} on axis {axis}")
    normalized = tuple(a for a in range(first, len(x.dim)) if scale.dim[a] != 1) or (len(x.dim) - 1,)
    stats = tuple(1 if a in normalized else size for a, size in enumerate(x.dim))
    return NormGeometry(normalized, stats, tuple(scale.dim))


def _channel_geometry(op, x, attrs) -> NormGeometry:
    """batchnorm / instancenorm / groupnorm / genstats over [N, C, *spatial]."""
    if len(x.dim) < 2:
        fail(op, f"x must be [N, C, ...], got {list(x.dim)}")
    batch, channels, rank = x.dim[0], x.dim[1], len(x.dim)
    param = (1, channels) + (1,) * (rank - 2)
    if op.startswith(("batchnorm", "genstats")):
        return NormGeometry((0,) + tuple(range(2, rank)), param, param)
    if op.startswith("instancenorm"):
        return NormGeometry(tuple(range(2, rank + 1)), (batch, channels) + (1,) * (rank - 2),
                            param, groups=channels)
    if channels % attrs.groups:
        fail(op, f"groups={attrs.groups} does not divide the {channels} channels of x")
    return NormGeometry(tuple(range(2, rank + 1)), (batch, attrs.groups) + (1,) * (rank - 2),
                        param, groups=attrs.groups)


def geometry(op: str, x, scale, attrs) -> NormGeometry:
    """Statistics geometry of norm op `op` (forward or backward) for input x."""
    if op.startswith(("layernorm", "rmsnorm", "adalayernorm")):
        return _feature_geometry(op, x, scale)
    return _channel_geometry(op, x, attrs)


def _check(op, what, tensor, dim):
    if tensor is not None and tuple(tensor.dim) != tuple(dim):
        fail(op, f"{what} {tensor.name!r} must be {list(dim)}, got {list(tensor.dim)}")


# --- shape rules --------------------------------------------------------------------------------
def _stats(geo):
    return OutputSpec(geo.stats_dim, dtypes.float32)


def _check_scalar_operands(op, inputs):
    """epsilon and momentum given as tensors (the frontend's, often passed by value): one
    floating element each."""
    for name, tensor in zip(lookup(op).input_names, inputs):
        if name in SCALAR_OPERANDS and tensor is not None:
            if any(size != 1 for size in tensor.dim):
                fail(op, f"{name} {tensor.name!r} must hold one element, got dims {list(tensor.dim)}")
            if not tensor.data_type.is_floating:
                fail(op, f"{name} {tensor.name!r} must be floating, got {tensor.data_type.name}")


def scalar_operand(op, values, attrs, name: str):
    """The value of scalar `name` (epsilon, momentum): its bound tensor's element, else the
    attribute."""
    tensor = dict(zip(lookup(op).input_names, values)).get(name)
    return getattr(attrs, name) if tensor is None else tensor.reshape(())


def _infer_forward(op, stats_count):
    def infer(inputs, attrs: NormAttrs):
        x, scale, bias = inputs[:3]
        _check_scalar_operands(op, inputs)
        geo = geometry(op, x, scale, attrs)
        _check(op, "scale", scale, geo.param_dim)
        _check(op, "bias", bias, geo.param_dim)
        y = OutputSpec(x.dim, layout_source=0)
        training = attrs.norm_forward_phase == "training"
        outputs = [y] + [_stats(geo) if training else None for _ in range(stats_count)]
        if op == "batchnorm":
            for running in inputs[3:5]:
                _check(op, "running statistics", running, geo.param_dim)
            outputs += [OutputSpec(geo.param_dim, dtypes.float32) if r is not None and training else None
                        for r in inputs[3:5]]
        return outputs
    return infer


def _infer_batchnorm_inference(inputs, attrs):
    x, mean, inv_variance, scale, bias = inputs
    geo = geometry("batchnorm_inference", x, scale, attrs)
    for what, tensor in (("mean", mean), ("inv_variance", inv_variance), ("scale", scale), ("bias", bias)):
        _check("batchnorm_inference", what, tensor, geo.param_dim)
    return [OutputSpec(x.dim, layout_source=0)]


def _infer_genstats(inputs, attrs):
    geo = geometry("genstats", inputs[0], None, attrs)
    return [_stats(geo), _stats(geo)]


def _infer_backward(op):
    def infer(inputs, attrs: NormAttrs):
        dy, x, scale, *stats = inputs
        geo = geometry(op, x, scale, attrs)
        if dy.dim != x.dim:
            fail(op, f"dy {list(dy.dim)} and x {list(x.dim)} differ")
        _check(op, "scale", scale, geo.param_dim)
        for tensor in stats:
            _check(op, "statistics", tensor, geo.stats_dim)
        dbias = op != "rmsnorm_backward" or attrs.has_dbias
        params = OutputSpec(geo.param_dim, layout_source=2)
        return [OutputSpec(x.dim, layout_source=1), params, params if dbias else None]
    return infer


# --- reference ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shape:
    dim: tuple
    name: str = "value"


def _spec(value):
    return None if value is None else _Shape(tuple(value.shape))


def _view(t, geo: NormGeometry):
    """The grouped view [N, G, C/G, *spatial] where the norm groups channels."""
    if geo.groups is None or t is None:
        return t
    return t.reshape(t.shape[0], geo.groups, -1, *t.shape[2:])


def _unview(t, like):
    return t.reshape(like.shape)


def _moments(x, axes):
    mean = x.mean(axes, keepdim=True)
    return mean, (x - mean).square().mean(axes, keepdim=True)


def _reference_forward(op):
    def reference(values, attrs: NormAttrs):
        x, scale, bias = values[:3]
        geo = geometry(op, _spec(x), _spec(scale), attrs)
        grouped = _view(x, geo)
        epsilon = scalar_operand(op, values, attrs, "epsilon")
        if op == "rmsnorm":
            mean = None
            inv = (grouped.square().mean(geo.stat_axes, keepdim=True) + epsilon).rsqrt()
            normalized = grouped * inv
        else:
            mean, var = _moments(grouped, geo.stat_axes)
            inv = (var + epsilon).rsqrt()
            normalized = (grouped - mean) * inv
        y = _unview(normalized, x) * scale
        if bias is not None:
            y = y + bias
        if attrs.norm_forward_phase == "inference":
            return [y] + [None] * (len(specs_out[op]) - 1)
        stats = [inv] if op == "rmsnorm" else [mean, inv]
        outputs = [y] + [s.reshape(geo.stats_dim) for s in stats]
        if op == "batchnorm":
            count = x.numel() // x.shape[1]
            unbiased = var * count / max(count - 1, 1)
            momentum = scalar_operand(op, values, attrs, "momentum")
            outputs += [None if running is None else
                        (1 - momentum) * running + momentum * update
                        for running, update in zip(values[3:5], (mean, unbiased))]
        return outputs
    return reference


def _reference_batchnorm_inference(values, attrs):
    x, mean, inv_variance, scale, bias = values
    return [(x - mean) * inv_variance * scale + bias]


def _reference_genstats(values, attrs):
    (x,) = values
    axes = (0,) + tuple(range(2, x.dim()))
    return [x.sum(axes, keepdim=True), x.square().sum(axes, keepdim=True)]


def _sum_over(value, axes):
    """Sum over `axes`, keeping them; no axes is no sum (torch would sum every axis)."""
    return value.sum(axes, keepdim=True) if axes else value


def _reference_backward(op):
    def reference(values, attrs: NormAttrs):
        dy, x, scale, *stats = values
        geo = geometry(op, _spec(x), _spec(scale), attrs)
        centered = op != "rmsnorm_backward"
        mean, inv = (stats if centered else (None, stats[0]))
        view_shape = _view(x, geo).shape
        stat_shape = [view_shape[a] if a not in geo.stat_axes else 1 for a in range(len(view_shape))]
        inv = inv.reshape(stat_shape)
        grouped = _view(x, geo)
        xhat = (grouped - mean.reshape(stat_shape)) * inv if centered else grouped * inv
        g = _view(dy * scale, geo)
        correction = xhat * (g * xhat).mean(geo.stat_axes, keepdim=True)
        if centered:
            correction = correction + g.mean(geo.stat_axes, keepdim=True)
        dx = _unview(inv * (g - correction), x)
        param_axes = tuple(a for a, s in enumerate(geo.param_dim) if s == 1)
        dscale = _sum_over(dy * _unview(xhat, x), param_axes)
        has_dbias = op != "rmsnorm_backward" or attrs.has_dbias
        dbias = _sum_over(dy, param_axes) if has_dbias else None
        return [dx, dscale, dbias]
    return reference


specs_out = {
    "layernorm": ("y", "mean", "inv_variance"),
    "adalayernorm": ("y", "mean", "inv_variance"),
    "rmsnorm": ("y", "inv_variance"),
    "instancenorm": ("y", "mean", "inv_variance"),
    "groupnorm": ("y", "mean", "inv_variance"),
    "batchnorm": ("y", "mean", "inv_variance", "next_running_mean", "next_running_var"),
}
# epsilon and momentum may also be one-element tensors (the frontend's way), trailing optional inputs
SCALAR_OPERANDS = ("epsilon", "momentum")
_FORWARD_INPUTS = {"batchnorm": ("x", "scale", "bias", "in_running_mean", "in_running_var", "epsilon", "momentum")}
_BACKWARD_STATS = {"rmsnorm_backward": ("inv_variance",)}
# fusion: a norm's statistics ride its kernel's epilogue (side_epilogues); its backward's dx does
_NORM_FORWARD = AnchorRule(prologue_inputs=(0,), epilogue_output=0, side_epilogues=True)
_NORM_BACKWARD = AnchorRule(prologue_inputs=(0,), epilogue_output=0)
# batchnorm's dscale and dbias are per-row sums of its dx kernel (rows are channels); layernorm's
# and rmsnorm's are column sums, finished by a combine kernel (or a dscale/dbias kernel) that runs
# their epilogue (a cast, the add of another use's gradient); instance and group norm reduce them
# in a kernel of their own, which runs none
_NORM_BACKWARD_FUSION = {name: AnchorRule((0,), 0, side_epilogues=True)
                         for name in ("batchnorm_backward", "layernorm_backward", "rmsnorm_backward",
                                      "adalayernorm_backward")}

for _op, _outs in specs_out.items():
    register(OpDef(_op, "norm", "anchor", NormAttrs, _FORWARD_INPUTS.get(_op, ("x", "scale", "bias", "epsilon")),
                   _outs, _infer_forward(_op, 2 if _op != "rmsnorm" else 1), _reference_forward(_op),
                   optional=("bias", "in_running_mean", "in_running_var") + SCALAR_OPERANDS, fusion=_NORM_FORWARD))
    _bwd = _op + "_backward"
    register(OpDef(_bwd, "norm", "anchor", NormAttrs,
                   ("dy", "x", "scale") + _BACKWARD_STATS.get(_bwd, ("mean", "inv_variance")),
                   ("dx", "dscale", "dbias"), _infer_backward(_bwd), _reference_backward(_bwd),
                   fusion=_NORM_BACKWARD_FUSION.get(_bwd, _NORM_BACKWARD)))
register(OpDef("batchnorm_inference", "norm", "anchor", NormAttrs,
               ("x", "mean", "inv_variance", "scale", "bias"), ("y",),
               _infer_batchnorm_inference, _reference_batchnorm_inference, fusion=_NORM_FORWARD))
register(OpDef("genstats", "norm", "anchor", NormAttrs, ("x",), ("sum", "sq_sum"),
               _infer_genstats, _reference_genstats, fusion=AnchorRule((0,), None, side_epilogues=True)))


# --- backward rules (autodiff.py) ----------------------------------------------------------------
def _statistics_dx(d, node, mean_grad, inv_grad, mean):
    """dx of gradients that reach the statistics outputs: d mean / dx = 1/n and
    d inv_variance / dx = -inv_variance^3 (x - mean) / n (x alone for rmsnorm), n the elements
    each statistic gathers; None when none reach them."""
    if mean_grad is None and inv_grad is None:
        return None
    x, inv_variance = node.inputs[0], node.outputs[2 if mean is not None else 1]
    if any(size not in (1, whole) for size, whole in zip(inv_variance.dim, x.dim)):
        raise UnsupportedError(f"{node.op}: no gradient through statistics that do not broadcast to x")
    g = d.graph
    count = float(math.prod(x.dim) // math.prod(inv_variance.dim))
    parts = [] if mean_grad is None else [g.div(mean_grad, count)]
    if inv_grad is not None:
        inv = d.value(inv_variance)
        centered = d.value(x) if mean is None else g.sub(d.value(x), mean)
        parts.append(g.mul(g.mul(inv_grad, g.mul(inv, g.mul(inv, inv))), g.mul(centered, -1.0 / count)))
    return parts[0] if len(parts) == 1 else g.add(*parts)


def _with(g, dx, extra):
    return extra if dx is None else dx if extra is None else g.add(dx, extra)


@backward_rule("layernorm", "instancenorm", "groupnorm", "batchnorm", "adalayernorm")
def _mean_norm_backward(d, node, grads):
    """dx, dscale, dbias from the saved mean and inverse variance (the training form's), and the
    gradients that reach the statistics themselves."""
    if node.op == "batchnorm" and node.attrs.norm_forward_phase != "training":
        raise UnsupportedError("batchnorm: gradients need the training phase (batchnorm_inference differentiates)")
    if any(grad is not None for grad in grads[3:]):
        raise UnsupportedError("batchnorm: no gradient through the running statistics")
    x, scale, bias = node.inputs[:3]
    mean, inv_variance = (d.value(t) for t in node.outputs[1:3])
    dx = dscale = dbias = None
    if grads[0] is not None:
        dx, dscale, dbias = d.graph._add_op(node.op + "_backward", [grads[0], d.value(x), d.value(scale), mean,
                                                                   inv_variance], node.attrs)
    dx = _with(d.graph, dx, _statistics_dx(d, node, grads[1], grads[2], mean))
    return [dx, dscale, None if bias is None else dbias] + [None] * (len(node.inputs) - 3)


@backward_rule("rmsnorm")
def _rms_norm_backward(d, node, grads):
    x, scale, bias = node.inputs[:3]
    dx = dscale = dbias = None
    if grads[0] is not None:
        attrs = dataclasses.replace(node.attrs, has_dbias=bias is not None)
        dx, dscale, dbias = d.graph._add_op("rmsnorm_backward", [grads[0], d.value(x), d.value(scale),
                                                                 d.value(node.outputs[1])], attrs)
    dx = _with(d.graph, dx, _statistics_dx(d, node, None, grads[1], None))
    return [dx, dscale, dbias] + [None] * (len(node.inputs) - 3)


@backward_rule("batchnorm_inference")
def _batchnorm_inference_backward(d, node, grads):
    """y = (x - mean) * inv_variance * scale + bias, differentiated op by op."""
    g, dy = d.graph, grads[0]
    x, mean, inv_variance, scale, bias = (d.value(t) for t in node.inputs)
    centered = g.sub(x, mean)
    dx = g.mul(dy, g.mul(inv_variance, scale))
    return [dx, g.neg(dx), g.mul(dy, g.mul(centered, scale)), g.mul(dy, g.mul(centered, inv_variance)), dy]
