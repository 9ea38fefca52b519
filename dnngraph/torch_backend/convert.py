"""aten ops as dnngraph ops: the table the torch.compile backend partitions and converts by.

Each converter takes (graph, node, value) where `value(arg)` gives the dnngraph tensor of an FX
node argument (or the argument itself: numbers, lists), and returns the dnngraph tensor of the
node's result (a tuple for ops with several results, None where one is not computed).
`value.true(dims)` is an all-true bool input of `dims` (broadcast: one element in memory) that
the caller binds, for `expand`; `value.seed()` an int64 seed input the caller draws from torch's
generator at every call, for dropout; `value.constant(node)` a graph input the caller binds to the
value of a constant op (CONSTANTS: arange, zeros, ...), made once in torch. `unsupported(node)` says why a node stays in torch (None: it
converts): the form checks below, then the converter itself run on the node alone in a scratch
graph (`_trial`), so the partitioner never claims a node its converter cannot make (one predicate:
what converts is what is supported), and `convert` checks that what a converter made has torch's
dims for the result.
"""
from __future__ import annotations

import math
import numbers
import operator
import weakref
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree

from .. import dtypes
from ..errors import GraphError
from ..graph import Graph

aten = torch.ops.aten

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
TENSOR_TYPES = FLOAT_TYPES + (torch.bool, torch.int32, torch.int64)

UNARY = {aten.relu.default: "relu", aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh",
         aten.exp.default: "exp", aten.log.default: "log", aten.neg.default: "neg", aten.rsqrt.default: "rsqrt",
         aten.sqrt.default: "sqrt", aten.erf.default: "erf", aten.abs.default: "abs",
         aten.reciprocal.default: "reciprocal", aten.silu.default: "silu", aten.sin.default: "sin",
         aten.cos.default: "cos", aten.tan.default: "tan"}
BINARY = {aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul", aten.div.Tensor: "div",
          aten.maximum.default: "maximum", aten.minimum.default: "minimum",
          aten.pow.Tensor_Scalar: "pow", aten.pow.Tensor_Tensor: "pow", aten.add.Scalar: "add",
          aten.sub.Scalar: "sub", aten.mul.Scalar: "mul", aten.div.Scalar: "div",
          aten.fmod.Tensor: "mod", aten.fmod.Scalar: "mod"}  # mod is fmod (ops/pointwise.py)
COMPARE = {aten.gt: "cmp_gt", aten.ge: "cmp_ge", aten.lt: "cmp_lt", aten.le: "cmp_le", aten.eq: "cmp_eq",
           aten.ne: "cmp_ne"}
for _packet, _op in COMPARE.items():
    BINARY[_packet.Tensor] = _op
    BINARY[_packet.Scalar] = _op
REDUCE = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max", aten.amin.default: "min"}
# aten ops whose result is always a view of their first argument's memory (no copy in torch)
VIEW_OPS = frozenset({aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default,
                      aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                      aten.squeeze.default, aten.alias.default, aten.slice.Tensor, aten.expand.default,
                      aten.select.int, aten.detach.default})


def _result(node):
    return node.meta.get("val")


def _shape(node) -> list:
    """The result's dims; a 0-d result is [1] (dnngraph tensors have at least one axis)."""
    return scalar_dims(_result(node))


def scalar_dims(meta) -> list:
    """A tensor's dims as dnngraph holds them: a 0-d tensor as [1]."""
    return [int(d) for d in meta.shape] or [1]


def _typed(graph_tensor, node):
    """The result in the type torch gives it (intermediates keep torch's types)."""
    graph_tensor.set_data_type(dtypes.from_torch(_result(node).dtype))
    return graph_tensor


def _reshaped_result(g, tensor, meta):
    """`tensor` with the dims and type torch gives a result (`meta`): cast first, then reshaped,
    so the reshape stays a view and the cast can ride the kernel that makes the value."""
    wanted = dtypes.from_torch(meta.dtype)
    if tensor.data_type != wanted:
        tensor = g.cast(tensor, data_type=wanted)
    return g.reshape(tensor, scalar_dims(meta))


def _unary(g, node, value):
    return getattr(g, UNARY[node.target])(value(node.args[0]))


def _binary(g, node, value):
    op = BINARY[node.target]
    a, b = value(node.args[0]), value(node.args[1])
    alpha = node.args[2] if len(node.args) > 2 else node.kwargs.get("alpha", 1)  # .Scalar: positional
    if alpha != 1:  # add and sub: a + alpha * b (a number b is scaled here, as torch does)
        b = b * alpha if isinstance(b, numbers.Number) else g.mul(b, alpha)
    return getattr(g, op)(a, b)


def _gelu(g, node, value):
    return (g.gelu_tanh if node.kwargs.get("approximate", "none") == "tanh" else g.gelu)(value(node.args[0]))


RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _rows_unmerged(arg):
    """The FX node `arg` views with its leading axes merged into rows and its last axis kept (a
    Linear's input [..., K] seen as [M, K]), or None."""
    if not isinstance(arg, torch.fx.Node) or arg.target not in RESHAPES or not isinstance(arg.args[0], torch.fx.Node):
        return None
    shape, source_shape = _shape(arg), _shape(arg.args[0])
    return arg.args[0] if len(shape) == 2 and len(source_shape) > 2 and source_shape[-1] == shape[-1] else None


def _linear(g, node, value, a, b, bias=None):
    """a @ b (+ bias): an `a` that views x [..., K] as [M, K] is multiplied as x, and the result
    [..., N] reshaped to [M, N]. Ops after the view torch applies back to [..., N] (a residual
    add, SwiGLU's product) then read the product itself and join the matmul's epilogue; the plan
    folds the batch axes back into rows (one GEMM)."""
    source = _rows_unmerged(a)
    if source is None:
        product = g.matmul(value(a), value(b))
        return product if bias is None else g.add(product, value(bias))
    product = g.matmul(value(source), value(b))
    if bias is not None:
        bias_value = value(bias)
        if len(bias_value.dim) == 2 and bias_value.dim[0] != 1:  # a row of its own per row of M
            bias_value = _reshape(g, bias_value, list(product.dim[:-1]) + [bias_value.dim[-1]])
        product = g.add(product, bias_value)
    return g.reshape(_typed(product, node), _shape(node))


def _matmul(g, node, value):
    if node.target is aten.mm.default:
        return _linear(g, node, value, node.args[0], node.args[1])
    return g.matmul(value(node.args[0]), value(node.args[1]))


def _addmm(g, node, value):
    bias, a, b = node.args[:3]
    return _linear(g, node, value, a, b, bias)


def _permute(g, node, value):
    return g.transpose(value(node.args[0]), [d % len(node.args[1]) for d in node.args[1]])


def _t(g, node, value):
    return g.transpose(value(node.args[0]), [1, 0])


def _transpose(g, node, value):
    rank = len(_shape(node))
    order = list(range(rank))
    a, b = node.args[1] % rank, node.args[2] % rank
    order[a], order[b] = order[b], order[a]
    return g.transpose(value(node.args[0]), order)


def _view(g, node, value):
    return _reshape(g, value(node.args[0]), _shape(node))


def _reshape(g, x, dims):
    """x with `dims`; a reshape of a reshape back to its source's dims is that source."""
    producer = x.producer
    if producer is not None and producer.op == "reshape" and list(producer.inputs[0].dim) == list(dims):
        return producer.inputs[0]
    return g.reshape(x, dims)


def _clone(g, node, value):
    """A copy only where the graph returns it (a returned value must be memory of its own); read
    inside the graph, a clone is its argument's value (its layout, contiguous before a view,
    is the view planner's to decide: written in place by the producer, or copied)."""
    source = value(node.args[0])
    return g.cast(source, data_type=source.data_type) if _returned(node) else source


def _returned(node) -> bool:
    """Does the graph return `node`'s value, itself or through views torch applies to it?"""
    values = [node]  # the value and the views of it met so far
    while values:
        current = values.pop()
        for user in current.users:
            if user.op == "output":
                return True
            if user.op == "call_function" and user.target in VIEW_OPS and user.args[0] is current:
                values.append(user)
    return False


def _detach(g, node, value):
    """detach is a view in torch (the same memory, no autograd history): its value is the
    argument's, with no kernel (a returned one is applied in torch, as other views are)."""
    return value(node.args[0])


def _softmax(g, node, value):
    log = node.target is aten._log_softmax.default
    x = value(node.args[0])
    return g.softmax(x, axis=node.args[1] % len(x.dim), log=log)


def _safe_softmax(g, node, value):
    """torch's softmax of attention written as ops: a row that sees only -inf is zero (a plain
    softmax makes it NaN)."""
    source = x = value(node.args[0])
    wanted = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    if wanted is not None:
        x = g.cast(x, data_type=dtypes.from_torch(wanted))
    axis = node.args[1] % len(x.dim)
    # torch tests the input before its cast (values that overflow in `dtype` still give NaN)
    blind = g.cmp_eq(g.reduction(source, mode="max", axes=[axis]), float("-inf"))
    return g.where(blind, 0.0, g.softmax(x, axis=axis))


def _reduce(g, node, value):
    x = value(node.args[0])
    axes = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    axes = list(range(len(x.dim))) if not axes else axes  # None and [] reduce every axis, as torch's do
    axes = sorted({a % len(x.dim) for a in axes})
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    wanted = node.kwargs.get("dtype")
    if wanted is not None and x.data_type != dtypes.from_torch(wanted):  # torch casts the input first
        x = g.cast(x, data_type=dtypes.from_torch(wanted))
    reduced = g.reduction(x, REDUCE[node.target], axes)
    return reduced if keep else g.reshape(reduced, _shape(node))


def _where(g, node, value):
    return g.where(*(value(x) for x in node.args[:3]))


def _to_copy(g, node, value):
    """A type change; one of a reshaped value is made before the reshape (the same elements), so
    the reshape stays a view and the cast can ride the kernel that makes the value."""
    source, wanted = value(node.args[0]), dtypes.from_torch(_result(node).dtype)
    if source.producer is not None and source.producer.op == "reshape" and source.data_type != wanted:
        return g.reshape(g.cast(source.producer.inputs[0], data_type=wanted), list(source.dim))
    return g.cast(source, data_type=wanted)


def _cat(g, node, value):
    tensors = [value(x) for x in node.args[0]]
    axis = node.args[1] if len(node.args) > 1 else 0
    return g.concatenate(tensors, axis % len(tensors[0].dim))


def _gelu_backward(g, node, value):
    tanh = node.kwargs.get("approximate", "none") == "tanh"
    return (g.gelu_tanh_backward if tanh else g.gelu_backward)(value(node.args[0]), value(node.args[1]))


def _silu_backward(g, node, value):
    return g.silu_backward(value(node.args[0]), value(node.args[1]))


def _threshold_backward(g, node, value):
    """aten's: 0 where x <= threshold, else grad (a NaN x passes its gradient)."""
    grad, x = value(node.args[0]), value(node.args[1])
    return g.where(g.cmp_le(x, node.args[2]), 0.0, grad)


def _sigmoid_backward(g, node, value):
    """aten's takes the output y: dy * y * (1 - y)."""
    grad, y = value(node.args[0]), value(node.args[1])
    return g.mul(grad, g.mul(y, g.sub(1.0, y)))


def _tanh_backward(g, node, value):
    """aten's takes the output y: dy * (1 - y^2)."""
    grad, y = value(node.args[0]), value(node.args[1])
    return g.mul(grad, g.sub(1.0, g.mul(y, y)))


def _softmax_backward(g, node, value):
    grad, y = value(node.args[0]), value(node.args[1])
    return g.softmax_backward(grad, y, axis=node.args[2] % len(y.dim),
                              log=node.target is aten._log_softmax_backward_data.default)


def _reshaped(g, node, value):
    """unsqueeze, squeeze: the same elements with the result's dims."""
    return _reshape(g, value(node.args[0]), _shape(node))


def _slice(g, node, value):
    x = value(node.args[0])
    axis = (node.args[1] if len(node.args) > 1 else 0) % len(x.dim)
    start, stop, step = (list(node.args[2:5]) + [None, None, 1][len(node.args[2:5]):])[:3]
    slices = [slice(None)] * len(x.dim)
    slices[axis] = slice(*slice(start, stop, step).indices(x.dim[axis]))  # aten's ends run to 2^63 - 1
    return g.slice(x, slices)


def _split(g, node, value):
    """split / split_with_sizes: slices along one axis."""
    x = value(node.args[0])
    axis = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(x.dim)
    sizes = [int(meta.shape[axis]) for meta in _result(node)]
    parts, start = [], 0
    for size in sizes:
        slices = [slice(None)] * len(x.dim)
        slices[axis] = slice(start, start + size)
        parts.append(g.slice(x, slices))
        start += size
    return tuple(parts)


def _select(g, node, value):
    """x[..., index, ...]: the one-wide slice at `index` with the axis dropped."""
    x = value(node.args[0])
    axis, index = node.args[1] % len(x.dim), node.args[2]
    slices = [slice(None)] * len(x.dim)
    slices[axis] = slice(index % x.dim[axis], index % x.dim[axis] + 1)
    return _reshape(g, g.slice(x, slices), _shape(node))


def _select_backward(g, node, value):
    """The gradient of a select placed in zeros of the input's dims (its axis one wide first)."""
    grad, sizes, axis, index = node.args[:4]
    axis %= len(sizes)
    start = index % sizes[axis]
    wide = [1 if a == axis else size for a, size in enumerate(sizes)]
    return _placed_in_zeros(g, value, _reshape(g, value(grad), wide), sizes, axis, start, start + 1)


def _slice_backward(g, node, value):
    """The gradient placed in zeros of the input's dims: zeros, grad, zeros joined on the axis."""
    grad, sizes, axis, start, stop, step = node.args[:6]
    axis %= len(sizes)
    start, stop, _ = slice(start, stop, step).indices(sizes[axis])
    return _placed_in_zeros(g, value, value(grad), sizes, axis, start, stop)


def _placed_in_zeros(g, value, grad, sizes, axis: int, start: int, stop: int):
    """`grad` (covering [start, stop) of `axis`) joined with zeros to the dims `sizes`."""
    parts = []
    for width in (start, None, sizes[axis] - stop):
        if width is None:
            parts.append(grad)
        elif width > 0:
            dims = list(sizes)
            dims[axis] = width
            parts.append(g.cast(g.where(value.true(dims), 0.0, 0.0), data_type=grad.data_type))
    return parts[0] if len(parts) == 1 else g.concatenate(parts, axis)


def _native_dropout(g, node, value):
    """Dropout through dnngraph's Philox with a seed drawn from torch's generator per call (the
    masks differ from eager's, as any compiler's do; the backward reads this mask)."""
    y, keep = g.dropout(value(node.args[0]), node.args[1], value.seed(), 0, return_mask=True)
    return y, keep


def _native_dropout_backward(g, node, value):
    grad, keep, scale = value(node.args[0]), value(node.args[1]), node.args[2]
    return g.mul(g.where(keep, grad, 0.0), scale)


def _expand(g, node, value):
    """x broadcast to the result's dims: where(true, x, x) against an all-true broadcast input."""
    x = value(node.args[0])
    everywhere = value.true(_shape(node))
    return g.where(everywhere, x, x)


def _convolution(g, node, value):
    x, w, bias, stride, padding, dilation, _, _, groups = node.args[:9]
    x, w = value(x), value(w)
    y = g.conv_fprop(x, w, padding=list(padding), stride=list(stride), dilation=list(dilation), groups=groups)
    if bias is None:
        return y
    return g.add(y, g.reshape(value(bias), [w.dim[0]] + [1] * (len(x.dim) - 2)))


def _convolution_backward(g, node, value):
    dy, x, w, _, stride, padding, dilation, _, _, groups, mask = node.args[:11]
    dy, x, w = value(dy), value(x), value(w)
    geometry = dict(padding=list(padding), stride=list(stride), dilation=list(dilation), groups=groups)
    dx = g.conv_dgrad(dy, w, list(x.dim), **geometry) if mask[0] else None
    dw = g.conv_wgrad(dy, x, list(w.dim), **geometry) if mask[1] else None
    db = None
    if mask[2]:
        db = _reshaped_result(g, g.reduction(dy, "sum", [0] + list(range(2, len(dy.dim)))), _result(node)[2])
    return dx, dw, db


def _norm_parameter(g, value, tensor, x, count: int):
    """A layer norm's weight or bias [*normalized] with the rank of x."""
    return None if tensor is None else g.reshape(value(tensor), [1] * (len(x.dim) - count) + list(tensor.meta["val"].shape))


def _layer_norm(g, node, value):
    x, shape, weight, bias, eps = node.args[:5]
    x = value(x)
    scale = _norm_parameter(g, value, weight, x, len(shape))
    return tuple(g.layernorm(x, scale, _norm_parameter(g, value, bias, x, len(shape)), epsilon=eps))


def _layer_norm_backward(g, node, value):
    dy, x, shape, mean, rstd, weight, bias, mask = node.args[:8]
    x = value(x)
    scale = _norm_parameter(g, value, weight, x, len(shape))
    dx, dscale, dbias = g.layernorm_backward(value(dy), x, scale, value(mean), value(rstd))
    metas = _result(node)
    return (dx if mask[0] else None, _reshaped_result(g, dscale, metas[1]) if mask[1] else None,
            _reshaped_result(g, dbias, metas[2]) if mask[2] and bias is not None else None)


def _channels(g, value, tensor, x):
    """A per-channel [C] tensor as [1, C, 1, ...] (the norms' parameter dims)."""
    return g.reshape(value(tensor), [1, x.dim[1]] + [1] * (len(x.dim) - 2))


def _batch_norm(g, node, value):
    """Training batch norm: y, the batch statistics [C], the next running statistics [C]."""
    x, weight, bias, running_mean, running_var, _, momentum, eps = node.args[:8]
    x = value(x)
    made = g.batchnorm(x, *(_channels(g, value, t, x) for t in (weight, bias, running_mean, running_var)),
                       epsilon=eps, momentum=momentum)
    return (made[0],) + tuple(_reshaped_result(g, t, meta) for t, meta in zip(made[1:], _result(node)[1:]))


def _batch_norm_inference(g, node, value):
    """Batch norm with the running statistics, as per-channel pointwise ops ((x - mean) * scale +
    bias, scale = weight / sqrt(var + eps)): a convolution's epilogue takes them, so conv, norm
    and activation are one kernel. torch's two empty results are Aux."""
    x, weight, bias, running_mean, running_var, _, eps = node.args[:7]
    x = value(x)
    scale = g.rsqrt(g.add(_channels(g, value, running_var, x), eps))
    if weight is not None:
        scale = g.mul(scale, _channels(g, value, weight, x))
    y = g.mul(g.sub(x, _channels(g, value, running_mean, x)), scale)
    if bias is not None:
        y = g.add(y, _channels(g, value, bias, x))
    return (y,) + tuple(Aux(meta) for meta in _result(node)[1:])


def _batch_norm_backward(g, node, value):
    dy, x, weight, _, _, mean, inv_variance, _, _, mask = node.args[:10]
    x = value(x)
    dx, dscale, dbias = g.batchnorm_backward(value(dy), x, _channels(g, value, weight, x),
                                             _channels(g, value, mean, x), _channels(g, value, inv_variance, x))
    metas = _result(node)
    return (dx if mask[0] else None, _reshaped_result(g, dscale, metas[1]) if mask[1] else None,
            _reshaped_result(g, dbias, metas[2]) if mask[2] else None)


MAX_POOL = (aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
MAX_POOL_BACKWARD = (aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default)


def _pool_geometry(node):
    """(window, stride, padding, dilation, ceil_mode) of a max pool or its backward, per spatial
    axis, with aten's defaults (stride [] is the window; one value serves every axis)."""
    backward = node.target in MAX_POOL_BACKWARD
    args = list(node.args[2 if backward else 1:])
    spatial = SPATIAL_AXES[node.target]
    defaults = [None, [], [0], [1], False]
    for position, key in enumerate(("kernel_size", "stride", "padding", "dilation", "ceil_mode")):
        if len(args) <= position:
            args.append(node.kwargs.get(key, defaults[position]))
    window, stride, padding, dilation, ceil_mode = args[:5]

    def per_axis(values):
        values = [int(v) for v in values]
        return values * spatial if len(values) == 1 else values

    window = per_axis(window)
    return window, per_axis(stride) if len(stride) else window, per_axis(padding), per_axis(dilation), ceil_mode


def _unbatched_pool(node, x) -> Optional[str]:
    """dnngraph pools [N, C, *spatial]; torch's pools also take an input without the batch axis."""
    if x.dim() != SPATIAL_AXES[node.target] + 2:
        return f"pooling of a rank-{x.dim()} input (dnngraph pools [N, C, *spatial])"
    return None


def _max_pool_refused(node) -> Optional[str]:
    """Why a max pool (or its backward) stays in torch: what dnngraph's pooling cannot do exactly."""
    backward = node.target in MAX_POOL_BACKWARD
    x = node.args[1 if backward else 0].meta["val"]
    if not x.is_floating_point():
        return "max pooling of integers"
    why = _unbatched_pool(node, x)
    if why is not None:
        return why
    window, stride, padding, dilation, ceil_mode = _pool_geometry(node)
    if any(d != 1 for d in dilation):
        return f"max pooling with dilation {dilation}"
    if backward and not _indices_of_this_pool(node):
        return "max pooling backward with indices not made by the max pool of its input"
    return None


def _indices_of_this_pool(node) -> bool:
    """Are a max pool backward's indices the argmax of its x (each in its own window, where
    pooling_backward routes by them as torch does; it drops an index outside its window)? Yes
    for indices AOTAutograd saved from the forward (a backward graph's input) and for those of
    the same pool of the same x in this graph."""
    indices, x = node.args[7], node.args[1]
    if indices.op == "placeholder":
        return any(n.op == "placeholder" and n.name.startswith("tangents") for n in node.graph.nodes)
    pool = indices.args[0] if indices.target is operator.getitem and indices.args[1] == 1 else None
    return (pool is not None and pool.target in MAX_POOL and pool.args[0] is x
            and _pool_geometry(pool) == _pool_geometry(node))


def _indices_read(node) -> bool:
    """Does anything read the indices result of a max pool (a backward, torch, the output)?"""
    return any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users)


def _max_pool(g, node, value):
    """Max pooling; torch's indices too where anything reads them (training saves them for the
    backward), exact: the first maximum in window order, a NaN over any number."""
    window, stride, padding, _, ceil_mode = _pool_geometry(node)
    read = _indices_read(node)
    made = g.pooling(value(node.args[0]), "max", window, stride, padding, return_indices=read, ceil_mode=ceil_mode)
    return made if read else (made, None)


def _max_pool_backward(g, node, value):
    """Gradient routed by the forward's saved indices (the argmax of this pool of this x, as
    _indices_of_this_pool made sure): one index load per covering window, no argmax recompute."""
    window, stride, padding, _, ceil_mode = _pool_geometry(node)
    return g.pooling_backward(value(node.args[0]), value(node.args[1]), "max", window, stride, padding,
                              indices=value(node.args[7]), ceil_mode=ceil_mode)


class Aux:
    """A result dnngraph does not compute (an sdpa's random state, its sequence bookkeeping): the
    module hands torch a value of the result's kind (zeros, or the static int) instead. Only the
    matching backward reads it, and its converter ignores it."""

    def __init__(self, meta):
        self.meta = meta


def _attention_bias(g, mask, like):
    """An attention mask as sdpa's additive bias [.., Sq, Skv] of rank 4: a bool mask keeps
    where True (0) and drops where False (-inf); a float mask adds."""
    if mask.data_type.name == "bool":
        mask = g.cast(g.where(mask, 0.0, float("-inf")), data_type=like.data_type)
    return mask if len(mask.dim) == 4 else g.reshape(mask, [1] * (4 - len(mask.dim)) + list(mask.dim))


def _sdpa(g, node, value):
    """torch's flash attention (CPU form, with its mask, or CUDA form) as sdpa; the log-sum-exp
    as [B, H, Sq]."""
    q, k, v = (value(x) for x in node.args[:3])
    mask = node.kwargs.get("attn_mask")
    causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
    bias = None if mask is None else _attention_bias(g, value(mask), q)
    o, stats = g.sdpa(q, k, v, attn_scale=node.kwargs.get("scale"), is_inference=False, use_causal_mask=causal,
                      bias=bias)
    metas = _result(node)
    return (o, _reshaped_result(g, stats, metas[1])) + tuple(Aux(meta) for meta in metas[2:])


def _sdpa_backward(g, node, value):
    d_o, q, k, v, o, lse = (value(x) for x in node.args[:6])
    cpu = node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    mask = node.kwargs.get("attn_mask")
    bias = None if mask is None else _attention_bias(g, value(mask), q)
    stats = g.reshape(lse, list(lse.dim) + [1])
    return tuple(g.sdpa_backward(q, k, v, o, d_o, stats, attn_scale=node.kwargs.get("scale"),
                                 use_causal_mask=node.args[7 if cpu else 11], bias=bias)[:3])


CONVERTERS: dict[object, Callable] = {
    **{target: _unary for target in UNARY}, **{target: _binary for target in BINARY},
    **{target: _reduce for target in REDUCE},
    aten.gelu.default: _gelu, aten.mm.default: _matmul, aten.bmm.default: _matmul, aten.addmm.default: _addmm,
    aten.permute.default: _permute, aten.t.default: _t, aten.transpose.int: _transpose,
    aten.view.default: _view, aten._unsafe_view.default: _view, aten.reshape.default: _view,
    aten.clone.default: _clone, aten._softmax.default: _softmax, aten._log_softmax.default: _softmax,
    aten._safe_softmax.default: _safe_softmax,
    aten.where.self: _where, aten._to_copy.default: _to_copy, aten.cat.default: _cat,
    aten.detach.default: _detach, aten.gelu_backward.default: _gelu_backward,
    aten.silu_backward.default: _silu_backward, aten.threshold_backward.default: _threshold_backward,
    aten.sigmoid_backward.default: _sigmoid_backward, aten.tanh_backward.default: _tanh_backward,
    aten._softmax_backward_data.default: _softmax_backward, aten._log_softmax_backward_data.default: _softmax_backward,
    aten.unsqueeze.default: _reshaped, aten.squeeze.dim: _reshaped, aten.squeeze.dims: _reshaped,
    aten.squeeze.default: _reshaped, aten.slice.Tensor: _slice, aten.expand.default: _expand,
    aten.native_dropout.default: _native_dropout, aten.native_dropout_backward.default: _native_dropout_backward,
    aten.split.Tensor: _split, aten.split_with_sizes.default: _split, aten.slice_backward.default: _slice_backward,
    aten.select.int: _select, aten.select_backward.default: _select_backward,
    aten.convolution.default: _convolution, aten.convolution_backward.default: _convolution_backward,
    aten.native_layer_norm.default: _layer_norm, aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa,
    aten._scaled_dot_product_flash_attention.default: _sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_backward,
    aten._scaled_dot_product_flash_attention_backward.default: _sdpa_backward,
    aten._native_batch_norm_legit_functional.default: _batch_norm,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_inference,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    **{target: _max_pool for target in MAX_POOL}, **{target: _max_pool_backward for target in MAX_POOL_BACKWARD},
}
# The matrix products and convolutions: their kernels take floating operands alone.
PRODUCTS = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.convolution.default,
            aten.convolution_backward.default)
# Results of the sdpa forms that are Aux (random state, bookkeeping) and operands their
# backward converters do not read (and, added below, the tensor a *_like / new_* constant is
# shaped like).
AUX_RESULTS = {aten._scaled_dot_product_flash_attention.default: range(2, 9),
               aten._native_batch_norm_legit_no_training.default: range(1, 3)}
AUX_OPERANDS = {aten._scaled_dot_product_flash_attention_backward.default: range(6, 14),
                **{target: range(7, 8) for target in MAX_POOL_BACKWARD}}
DROPOUT_ARGUMENT = {aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
                    aten._scaled_dot_product_flash_attention.default: 3,
                    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 6,
                    aten._scaled_dot_product_flash_attention_backward.default: 10}



# --- converters of issue 26: hard activations, pooling, layout, gather families ---------------
# Kept in one block with their own refusal table (REFUSALS: target -> why(node) or None), so the
# table above and unsupported() stay as they were.
def _hardtanh(g, node, value):
    low, high = _hardtanh_bounds(node, first=1)
    return g.hardtanh(value(node.args[0]), min_val=low, max_val=high)


def _hardtanh_backward(g, node, value):
    low, high = _hardtanh_bounds(node, first=2)
    return g.hardtanh_backward(value(node.args[0]), value(node.args[1]), min_val=low, max_val=high)


def _hardtanh_bounds(node, first: int) -> tuple:
    """(min_val, max_val) of a hardtanh or its backward, aten's defaults -1 and 1."""
    args = list(node.args[first:first + 2])
    for key, default in (("min_val", -1.0), ("max_val", 1.0))[len(args):]:
        args.append(node.kwargs.get(key, default))
    return float(args[0]), float(args[1])


def _hard_activation_backward(g, node, value):
    op = {aten.hardswish_backward.default: "hardswish_backward",
          aten.hardsigmoid_backward.default: "hardsigmoid_backward"}[node.target]
    return getattr(g, op)(value(node.args[0]), value(node.args[1]))


def _floating_operands(node) -> Optional[str]:
    """The hard activations take floats only (torch refuses integers for most of them)."""
    if any(not arg.meta["val"].is_floating_point() for arg in node.all_input_nodes):
        return f"{node.target} of integers"
    return None


def _hardtanh_refused(node) -> Optional[str]:
    why = _floating_operands(node)
    if why is not None:
        return why
    low, high = _hardtanh_bounds(node, first=2 if node.target is aten.hardtanh_backward.default else 1)
    if not (low <= high):  # NaN bounds too: no clamp dnngraph can state
        return f"hardtanh bounds {low}, {high}"
    return None


AVG_POOL = (aten.avg_pool2d.default, aten.avg_pool3d.default)
AVG_POOL_BACKWARD = (aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
# The spatial axes each pooling op pools over (its input may lack the batch axis: see _unbatched_pool).
SPATIAL_AXES = {**{target: 2 for target in (MAX_POOL[0], MAX_POOL_BACKWARD[0], AVG_POOL[0], AVG_POOL_BACKWARD[0])},
                **{target: 3 for target in (MAX_POOL[1], MAX_POOL_BACKWARD[1], AVG_POOL[1], AVG_POOL_BACKWARD[1])}}


def _avg_pool_geometry(node):
    """(window, stride, padding, ceil_mode, count_include_pad, divisor_override) of an average
    pool or its backward, per spatial axis, with aten's defaults."""
    backward = node.target in AVG_POOL_BACKWARD
    args = list(node.args[2 if backward else 1:])
    defaults = [None, [], [0], False, True, None]
    keys = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    for position, key in enumerate(keys):
        if len(args) <= position:
            args.append(node.kwargs.get(key, defaults[position]))
    window, stride, padding, ceil_mode, include_pad, divisor = args[:6]
    spatial = SPATIAL_AXES[node.target]

    def per_axis(values):
        values = [int(v) for v in values]
        return values * spatial if len(values) == 1 else values

    window = per_axis(window)
    return (window, per_axis(stride) if len(stride) else window, per_axis(padding), bool(ceil_mode),
            bool(include_pad), divisor)


def _avg_pool_attributes(node) -> tuple:
    """(mode, window, stride, padding, keywords) of dnngraph's pooling for an aten average pool."""
    window, stride, padding, ceil_mode, include_pad, divisor = _avg_pool_geometry(node)
    mode = "avg_include_pad" if include_pad else "avg_exclude_pad"
    return mode, window, stride, padding, dict(ceil_mode=ceil_mode, divisor=divisor)


def _avg_pool(g, node, value):
    mode, window, stride, padding, keywords = _avg_pool_attributes(node)
    return g.pooling(value(node.args[0]), mode, window, stride, padding, **keywords)


def _avg_pool_backward(g, node, value):
    mode, window, stride, padding, keywords = _avg_pool_attributes(node)
    return g.pooling_backward(value(node.args[0]), value(node.args[1]), mode, window, stride, padding, **keywords)


def _avg_pool_refused(node) -> Optional[str]:
    """Average pools of floats; torch checks the rest (padding at most half the window, a
    non-zero divisor) before a graph is traced."""
    x = node.args[1 if node.target in AVG_POOL_BACKWARD else 0].meta["val"]
    if not x.is_floating_point():
        return "average pooling of integers"
    return _unbatched_pool(node, x)


def _constant_pad_nd(g, node, value):
    """torch's constant padding from existing ops, axis by axis (pad lists the last axis first):
    a negative pad crops (a slice), a positive one joins blocks of the constant on either side
    (a concatenate, into whose parts the producers write: no copy of x where its producer can
    write it in place)."""
    fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    return _padded(g, value, value(node.args[0]), list(node.args[1]), fill)


def _padded(g, value, x, pads: list, fill):
    """x padded (cropped where negative) by torch's pad list (last axis first) with `fill`."""
    for position in range(0, len(pads), 2):
        axis = len(x.dim) - 1 - position // 2
        before, after = pads[position], pads[position + 1]
        if before < 0 or after < 0:
            slices = [slice(None)] * len(x.dim)
            slices[axis] = slice(max(-before, 0), x.dim[axis] - max(-after, 0))
            x = g.slice(x, slices)
        parts = []
        for width in (max(before, 0), None, max(after, 0)):
            if width is None:
                parts.append(x)
            elif width > 0:
                dims = list(x.dim)
                dims[axis] = width
                parts.append(g.cast(g.where(value.true(dims), fill, fill), data_type=x.data_type))
        x = parts[0] if len(parts) == 1 else g.concatenate(parts, axis)
    return x


def _constant_pad_refused(node) -> Optional[str]:
    x = node.args[0].meta["val"]
    fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if isinstance(fill, bool) or not isinstance(fill, numbers.Real):
        return f"padding with {fill!r}"
    if not x.is_floating_point() and not (math.isfinite(fill) and float(fill) == int(fill)):
        return "padding integers with a fraction"
    if len(node.args[1]) % 2 or len(node.args[1]) > 2 * x.dim():
        return f"pads {list(node.args[1])} for rank {x.dim()}"
    return None


def _ids_along(g, ids, rank: int, axis: int):
    """Ids of any rank as a gather's index: flattened onto `axis` of a rank-`rank` tensor whose
    other axes are 1 (they broadcast over the table)."""
    count = 1
    for size in ids.dim:
        count *= size
    dims = [1] * rank
    dims[axis] = count
    return _reshape(g, ids, dims) if list(ids.dim) != dims else ids


def _gathered(g, x, ids, axis: int, dims):
    """x's rows along `axis` picked by `ids` (any rank), with the result's dims `dims`."""
    picked = g.gather(x, _ids_along(g, ids, len(x.dim), axis), axis)
    return _reshape(g, picked, dims) if list(picked.dim) != list(dims) else picked


def _embedding(g, node, value):
    return _gathered(g, value(node.args[0]), value(node.args[1]), 0, _shape(node))


def _index_select(g, node, value):
    x = value(node.args[0])
    return _gathered(g, x, value(node.args[2]), node.args[1] % len(x.dim), _shape(node))


def _torch_gather(g, node, value):
    """torch.gather: an index smaller than x off the axis reads x's leading part there."""
    x, index = value(node.args[0]), value(node.args[2])
    axis = node.args[1] % len(x.dim)
    if any(i != axis and picks < size for i, (size, picks) in enumerate(zip(x.dim, index.dim))):
        x = g.slice(x, [slice(None) if i == axis else slice(0, picks) for i, picks in enumerate(index.dim)])
    return g.gather(x, index, axis)


def _index_axes(node):
    """(axes, ids nodes) of the index tensors an index.Tensor or index_put holds (a None is a
    full slice of its axis; axes past the list are full slices too)."""
    indices = list(node.args[1])
    axes = [i for i, ids in enumerate(indices) if ids is not None]
    return axes, [indices[axis] for axis in axes]


def _flat_ids(g, ids_list, sizes):
    """One int64 id into the indexed axes (of `sizes`) merged into one, row-major, from one id
    tensor per axis (broadcast together): sum of wrapped_k * stride_k, a negative id counting
    from its axis's end, as torch's indexing has it. An id outside its axis (after the wrap)
    gives a negative flat id (it could otherwise name another element of the merged axis): the
    gather then reads nothing (NaN, or 0 for integers) and the scatter-add adds nothing, as
    `_index` and `_index_put` treat an out-of-range id of one index tensor (torch raises)."""
    total = math.prod(sizes)
    rank = max(len(ids.dim) for ids in ids_list)
    flat, stride = None, total
    for ids, size in zip(ids_list, sizes):
        stride //= size
        if len(ids.dim) < rank:  # broadcast ranks align at the right
            ids = _reshape(g, ids, [1] * (rank - len(ids.dim)) + list(ids.dim))
        if ids.data_type != dtypes.int64:
            ids = g.cast(ids, data_type=dtypes.int64)
        wrapped = g.where(g.cmp_lt(ids, 0), g.add(ids, size).set_data_type(dtypes.int64), ids).set_data_type(
            dtypes.int64)
        term = g.mul(wrapped, stride).set_data_type(dtypes.int64) if stride != 1 else wrapped
        outside = g.where(g.cmp_ge(wrapped, size), -total, term).set_data_type(dtypes.int64)
        term = g.where(g.cmp_lt(wrapped, 0), -total, outside).set_data_type(dtypes.int64)
        flat = term if flat is None else g.add(flat, term).set_data_type(dtypes.int64)
    return flat


def _indexed_first(g, x, axes):
    """(x, first axis of the index group): index tensors on adjacent axes stay where they are;
    separated ones (a full slice between them) are moved to the front in their order, the
    others following in theirs (torch's result puts the broadcast index dims first then)."""
    if axes == list(range(axes[0], axes[-1] + 1)):
        return x, axes[0], None
    order = axes + [axis for axis in range(len(x.dim)) if axis not in axes]
    return g.transpose(x, order), 0, order


def _merged(g, x, first: int, count: int):
    """x with its `count` axes from `first` merged into one (a logical reshape: one of a
    non-contiguous x the view planner copies where no strides express it)."""
    dims = list(x.dim)
    merged = dims[:first] + [math.prod(dims[first:first + count])] + dims[first + count:]
    return _reshape(g, x, merged) if merged != dims else x


def _index(g, node, value):
    """x[..., ids] with one integer index tensor: negative ids count from the end, as torch's
    indexing has them (written as pointwise ops on the ids before the gather). Several index
    tensors (x[rows, cols], a mask's padding[batch, kv]): the indexed axes merged into one and
    gathered by one flat id (`_flat_ids`); separated index tensors index x with those axes
    moved to the front, as torch's result orders them."""
    x = value(node.args[0])
    axes, ids_nodes = _index_axes(node)
    if len(axes) == 1:
        axis, ids = axes[0], value(ids_nodes[0])
        wrapped = g.where(g.cmp_lt(ids, 0), g.add(ids, x.dim[axis]), ids)
        return _gathered(g, x, wrapped.set_data_type(ids.data_type), axis, _shape(node))
    x, first, _ = _indexed_first(g, x, axes)
    sizes = list(x.dim[first:first + len(axes)])
    flat = _flat_ids(g, [value(ids) for ids in ids_nodes], sizes)
    return _gathered(g, _merged(g, x, first, len(axes)), flat, first, _shape(node))


def _integer_ids(node, ids) -> Optional[str]:
    if isinstance(ids, torch.fx.Node) and ids.meta["val"].dtype in (torch.bool, torch.uint8):
        return "a bool or uint8 mask index (its result's shape depends on the mask's values)"
    if not isinstance(ids, torch.fx.Node) or ids.meta["val"].dtype not in (torch.int32, torch.int64):
        return "ids that are not an int32 or int64 tensor"
    return None


def _index_tensors_refused(node, present) -> Optional[str]:
    """Why index tensors of index.Tensor / index_put stay in torch (None: they convert)."""
    if not present:
        return "indexing with no index tensor"
    for ids in present:
        why = _integer_ids(node, ids)
        if why is not None:
            return why
    if len(present) > 1:
        try:
            torch.broadcast_shapes(*(ids.meta["val"].shape for ids in present))
        except RuntimeError:
            return "index tensors whose shapes do not broadcast together"
    return None


def _gather_refused(node) -> Optional[str]:
    if node.target is aten.embedding.default:
        ids = node.args[1]
    elif node.target is aten.index.Tensor:
        return _index_tensors_refused(node, [ids for ids in node.args[1] if ids is not None])
    else:
        ids = node.args[2]
    return _integer_ids(node, ids)


# The scatter-add kernel scans every id for each block of the table's rows: its work is the
# table's rows times the ids. Past this many (a large vocabulary's embedding gradient), torch's
# sort-based kernel is far faster, and the op stays there.
SCATTER_SCAN_LIMIT = 2**24


def _scatter_into(g, base, src, ids, axis: int):
    """base + src added at `ids` along `axis` (ids broadcast to src), in base's type."""
    added = g.scatter_add(src, ids, axis, base.dim[axis])
    return g.add(base, added) if base is not None else added


def _embedding_backward(g, node, value):
    """The table's gradient: each row of dy added at its id; ids equal to padding_idx are moved
    out of range first (they add nothing, as torch skips them)."""
    grad, ids, rows, padding_idx = value(node.args[0]), value(node.args[1]), node.args[2], node.args[3]
    flat = _ids_along(g, ids, 2, 0)
    if padding_idx >= 0:
        flat = g.where(g.cmp_eq(flat, padding_idx), -1, flat).set_data_type(flat.data_type)
    width = grad.dim[-1]
    src = _reshape(g, grad, [flat.dim[0], width])
    return g.scatter_add(src, flat, 0, rows)


def _scatter_add(g, node, value):
    """aten.scatter_add(base, dim, index, src): src's part the index covers, added into base."""
    base, index, src = value(node.args[0]), value(node.args[2]), value(node.args[3])
    axis = node.args[1] % len(base.dim)
    if list(src.dim) != list(index.dim):
        src = g.slice(src, [slice(0, size) for size in index.dim])
    added = g.scatter_add(src, index, axis, base.dim[axis])
    if list(added.dim) != list(base.dim):  # an index smaller than base off the axis: zeros beyond it
        pads = [p for a in reversed(range(len(base.dim))) for p in (0, base.dim[a] - added.dim[a])]
        added = _padded(g, value, added, pads, 0)
    return g.add(base, added)


def _index_add(g, node, value):
    base, index, src = value(node.args[0]), value(node.args[2]), value(node.args[3])
    axis = node.args[1] % len(base.dim)
    alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
    if alpha != 1:
        src = g.mul(src, alpha)
    return _scatter_into(g, base, src, _ids_along(g, index, len(base.dim), axis), axis)


def _index_put(g, node, value):
    """index_put(base, [..., ids], values, accumulate=True): values added at their ids along
    the indexed axis; negative ids count from the end, as in indexing. Several index tensors
    (the gradient of x[rows, cols]): the values added along the indexed axes merged into one, at
    the flat ids `_index` gathers by, then the sum given base's dims back (and its axis order,
    for separated index tensors)."""
    base = value(node.args[0])
    axes, ids_nodes = _index_axes(node)
    if len(axes) == 1:
        axis, ids = axes[0], value(ids_nodes[0])
        wrapped = g.where(g.cmp_lt(ids, 0), g.add(ids, base.dim[axis]), ids).set_data_type(ids.data_type)
        flat = _ids_along(g, wrapped, len(base.dim), axis)
        dims = list(base.dim)
        dims[axis] = flat.dim[axis]
        return _scatter_into(g, base, _reshape(g, value(node.args[2]), dims), flat, axis)
    moved, first, order = _indexed_first(g, base, axes)
    sizes = list(moved.dim[first:first + len(axes)])
    flat = _ids_along(g, _flat_ids(g, [value(ids) for ids in ids_nodes], sizes), len(moved.dim) - len(axes) + 1,
                      first)
    dims = list(moved.dim[:first]) + [flat.dim[first]] + list(moved.dim[first + len(axes):])
    added = g.scatter_add(_reshape(g, value(node.args[2]), dims), flat, first, math.prod(sizes))
    added = _reshape(g, added, list(moved.dim))
    if order is not None:
        added = g.transpose(added, [order.index(axis) for axis in range(len(order))])
    return g.add(base, added)


def _indexed_shape(node) -> torch.Size:
    """The shape base[indices] has, for index_put(base, indices, values): what values must have."""
    base = node.args[0].meta["val"]
    indices = [None if ids is None else ids.meta["val"] for ids in node.args[1]]
    picks = tuple(slice(None) if ids is None else torch.zeros(ids.shape, dtype=torch.int64, device="meta")
                  for ids in indices)
    return torch.empty(base.shape, device="meta")[picks].shape


def _scatter_refused(node) -> Optional[str]:
    """What the scatter converters cannot run exactly (or fast enough)."""
    result = _result(node)
    if not result.is_floating_point():
        return "a scatter-add of integers"
    target = node.target
    if target is aten.embedding_dense_backward.default:
        if node.args[4]:
            return "embedding backward with scale_grad_by_freq"
        ids = node.args[1].meta["val"]
        scans = ids.numel() * int(node.args[2])
        why = _integer_ids(node, node.args[1])
        if why is None and scans > SCATTER_SCAN_LIMIT:
            why = f"embedding backward over {node.args[2]} rows x {ids.numel()} ids (the scatter kernel scans every id)"
        return why
    if target is aten.index_put.default:
        if not (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)):
            return "index_put without accumulate (which of repeated ids wins is unspecified)"
        present = [ids for ids in node.args[1] if ids is not None]
        why = _index_tensors_refused(node, present)
        if why is not None:
            return "index_put with " + why
        if list(node.args[2].meta["val"].shape) != list(_indexed_shape(node)):
            return "index_put with values broadcast to the indexed shape"
        return None
    return _integer_ids(node, node.args[2])


SCATTERS = {aten.embedding_dense_backward.default: _embedding_backward, aten.scatter_add.default: _scatter_add,
            aten.index_add.default: _index_add, aten.index_put.default: _index_put}


GATHERS = {aten.embedding.default: _embedding, aten.index_select.default: _index_select,
           aten.gather.default: _torch_gather, aten.index.Tensor: _index}


def _nll_terms(g, node, value):
    """(targets as [N, 1], ignored [N, 1], the weight of each row's class [N, 1] or None) of an
    nll_loss or its backward (whose arguments start with the gradient)."""
    first = 2 if node.target is aten.nll_loss_backward.default else 1
    targets, weight, _, ignore_index = node.args[first:first + 4]
    ids = _ids_along(g, value(targets), 2, 0)
    ignored = g.cmp_eq(ids, ignore_index)
    class_weight = None
    if weight is not None:
        class_weight = g.gather(_ids_along(g, value(weight), 2, 0), ids, 0)
    return ids, ignored, class_weight


NLL_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # aten's reduction codes


def _sum_all(g, tensor):
    """The sum of every element, as [1] (a 0-d value)."""
    return _reshape(g, g.reduction(tensor, "sum", list(range(len(tensor.dim)))), [1])


def _nll_loss(g, node, value):
    """nll_loss: -weight[t] * x[n, t] per row (0 where t is ignore_index); summed, or divided
    by total_weight (the weights of the rows not ignored: 0 / 0 is NaN when all are, as in
    torch) for the mean. An unreduced loss's total_weight is Aux: its backward reads none."""
    x = value(node.args[0])
    ids, ignored, class_weight = _nll_terms(g, node, value)
    picked = g.gather(x, ids, 1)
    if class_weight is not None:
        picked = g.mul(picked, class_weight)
    per_row = g.where(ignored, 0.0, g.neg(picked))
    reduction = NLL_REDUCTIONS[node.args[3]]
    if reduction == "none":
        return _reshape(g, per_row, [x.dim[0]]), Aux(_result(node)[1])
    total_weight = _sum_all(g, g.where(ignored, 0.0, 1.0 if class_weight is None else class_weight))
    loss = _sum_all(g, per_row)
    return (g.div(loss, total_weight) if reduction == "mean" else loss), total_weight


def _nll_loss_backward(g, node, value):
    """dx[n, t] = -weight[t] * dy[n] (dy / total_weight for the mean; 0 where t is
    ignore_index), every other class 0: one value per row scattered into its class."""
    dy, x = value(node.args[0]), value(node.args[1])
    ids, ignored, class_weight = _nll_terms(g, node, value)
    reduction = NLL_REDUCTIONS[node.args[4]]
    if reduction == "mean":
        dy = g.div(dy, value(node.args[6]))
    per_row = g.neg(_reshape(g, dy, [x.dim[0], 1]) if reduction == "none" else dy)
    if class_weight is not None:
        per_row = g.mul(per_row, class_weight)
    per_row = g.where(ignored, 0.0, per_row)
    if list(per_row.dim) != [x.dim[0], 1]:  # a reduced loss's one gradient for every row
        per_row = g.where(value.true([x.dim[0], 1]), per_row, per_row)
    return g.scatter_add(per_row, ids, 1, x.dim[1])


def _nll_loss_refused(node) -> Optional[str]:
    backward = node.target is aten.nll_loss_backward.default
    x, targets = (node.args[1], node.args[2]) if backward else (node.args[0], node.args[1])
    if x.meta["val"].dim() != 2:
        return "nll_loss of other than [N, C] scores"
    reduction = node.args[4 if backward else 3]
    if reduction not in NLL_REDUCTIONS:
        return f"nll_loss reduction {reduction}"
    return _integer_ids(node, targets)


NLL_LOSS = {aten.nll_loss_forward.default: _nll_loss, aten.nll_loss_backward.default: _nll_loss_backward}


HARD_ACTIVATIONS = {aten.hardswish.default: _unary, aten.hardsigmoid.default: _unary,
                    aten.hardtanh.default: _hardtanh, aten.hardtanh_backward.default: _hardtanh_backward,
                    aten.hardswish_backward.default: _hard_activation_backward,
                    aten.hardsigmoid_backward.default: _hard_activation_backward}
UNARY.update({aten.hardswish.default: "hardswish", aten.hardsigmoid.default: "hardsigmoid"})
CONVERTERS.update(HARD_ACTIVATIONS)
CONVERTERS.update({**{target: _avg_pool for target in AVG_POOL},
                   **{target: _avg_pool_backward for target in AVG_POOL_BACKWARD},
                   aten.constant_pad_nd.default: _constant_pad_nd, **GATHERS, **SCATTERS,
                   **NLL_LOSS})
REFUSALS: dict[object, Callable] = {
    **{target: _floating_operands for target in HARD_ACTIVATIONS},
    aten.hardtanh.default: _hardtanh_refused, aten.hardtanh_backward.default: _hardtanh_refused,
    **{target: _avg_pool_refused for target in AVG_POOL + AVG_POOL_BACKWARD},
    aten.constant_pad_nd.default: _constant_pad_refused,
    **{target: _gather_refused for target in GATHERS},
    **{target: _scatter_refused for target in SCATTERS},
    **{target: _nll_loss_refused for target in NLL_LOSS},
}


# --- constants, alias, logical ops of bool masks (transformers' mask and position building) ------
# An op whose value depends only on its static arguments (arange, scalar_tensor, zeros/ones/full
# and their *_like / new_* forms, which read their tensor argument's dims, type and device, never
# its values) is a constant: the module computes it once in torch, on the first call (on the
# device of the result), and binds it as a graph input at every call (`value.constant(node)`), so
# no op runs for it per call and its readers fuse it. One no converted op reads stays in torch;
# one the graph also returns is copied by the graph (a returned value is memory of its own each
# call: a caller may write into it).
CONSTANTS = (aten.arange.default, aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default,
             aten.zeros.default, aten.ones.default, aten.full.default,
             aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
             aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
# the constant ops whose first argument is a tensor read for its dims, type and device alone
_SHAPED_LIKE = (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)


class _Like:
    """A tensor argument of a constant op, or its result: the dims, strides, type and device of
    an FX value (no values: the op reads none), made as an empty tensor."""

    def __init__(self, meta):
        self.shape, self.stride = tuple(int(d) for d in meta.shape), tuple(int(s) for s in meta.stride())
        self.dtype, self.device = meta.dtype, meta.device

    def make(self):
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


class ConstantSpec:
    """How a constant op's value is made: the aten op itself, run by torch on its static
    arguments (torch's own dtype inference, its arange rounding), copied into the dims, strides and
    type of the traced result; a 0-d value as [1] (as the graph holds it)."""

    def __init__(self, node):
        self.target = node.target
        self.args, self.kwargs = pytree.tree_map_only(torch.fx.Node, lambda arg: _Like(arg.meta["val"]),
                                                      (tuple(node.args), dict(node.kwargs)))
        self.result = _Like(_result(node))
        # a size argument that is a symbol (the tensors' are read as ints above)
        self.symbolic = any(isinstance(leaf, (torch.SymInt, torch.SymFloat))
                            for leaf in pytree.tree_leaves((self.args, self.kwargs)))

    def make(self) -> torch.Tensor:
        args, kwargs = pytree.tree_map_only(_Like, _Like.make, (self.args, self.kwargs))
        with torch.no_grad():
            made = self.target(*args, **kwargs)
            value = self.result.make()
            value.copy_(made)
        return value.view(1) if value.dim() == 0 else value


def _constant(g, node, value):
    return value.constant(node)


def _constant_refused(node) -> Optional[str]:
    """Dense strided constants alone (a pinned or sparse one is torch's to make)."""
    layout = node.kwargs.get("layout")
    if layout not in (None, torch.strided):
        return f"a constant of layout {layout}"
    if node.kwargs.get("pin_memory"):
        return "a constant in pinned memory"
    if not _read_in_dnngraph(node):
        return "a constant only torch reads (made there, as eager makes it: a graph would copy it)"
    return None


def _read_in_dnngraph(node) -> bool:
    """Does an op that converts read `node`'s value (itself, or through views that convert)? A
    value only torch reads is better made by torch than bound and copied into a graph output."""
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target in VIEW_OPS and user.args[0] is node:
            if unsupported(user) is None and _read_in_dnngraph(user):
                return True
        elif unsupported(user) is None:
            return True
    return False


def _alias(g, node, value):
    """alias is a view in torch (the same memory): its value is the argument's, with no kernel."""
    return value(node.args[0])


# bitwise ops of bool tensors are logical ops; of integers they stay in torch (dnngraph has no
# bitwise integer ops)
LOGICAL = {aten.bitwise_and.Tensor: "logical_and", aten.bitwise_or.Tensor: "logical_or",
           aten.bitwise_xor.Tensor: "cmp_ne"}


def _logical(g, node, value):
    return getattr(g, LOGICAL[node.target])(value(node.args[0]), value(node.args[1]))


def _logical_refused(node) -> Optional[str]:
    operands = node.args[:2]
    if not all(isinstance(a, torch.fx.Node) and a.meta["val"].dtype == torch.bool for a in operands):
        return f"{node.target} of other than two bool tensors (dnngraph has no bitwise integer ops)"
    return None


CONVERTERS.update({**{target: _constant for target in CONSTANTS}, aten.alias.default: _alias,
                   **{target: _logical for target in LOGICAL}})
REFUSALS.update({**{target: _constant_refused for target in CONSTANTS},
                 **{target: _logical_refused for target in LOGICAL}})
AUX_OPERANDS.update({target: range(0, 1) for target in _SHAPED_LIKE})

def _tensor_ok(meta) -> Optional[str]:
    if not isinstance(meta, torch.Tensor):
        return "not a tensor"
    if meta.dtype not in TENSOR_TYPES:
        return f"type {meta.dtype}"
    if any(not isinstance(d, int) for d in meta.shape):
        return "a symbolic shape (dnngraph compiles static shapes)"
    if any(not isinstance(d, int) for d in meta.stride()) or not isinstance(meta.storage_offset(), int):
        return "a symbolic stride (dnngraph compiles static shapes)"
    if meta.numel() == 0:
        return "an empty tensor"
    return None


# _to_copy arguments that leave a tensor where and how it is (AOTAutograd spells them out)
_STAYS = {"layout": (None, torch.strided), "memory_format": (None, torch.preserve_format),
          "pin_memory": (None, False), "non_blocking": (None, False)}


def _same_device(wanted, current) -> bool:
    """"cuda" names the current device: the same as "cuda:0" where the tensor is."""
    return wanted.type == current.type and wanted.index in (None, current.index)


def _moves(node) -> bool:
    """Does a _to_copy do more than change the type: another device, layout or memory format?"""
    for key, wanted in node.kwargs.items():
        if key == "device":
            if wanted is not None and not _same_device(torch.device(wanted), node.args[0].meta["val"].device):
                return True
        elif key != "dtype" and wanted not in _STAYS.get(key, ()):
            return True
    return False


def read_as_value(placeholder) -> bool:
    """Does a converted op read this argument's value (not only pass it as an Aux operand)?"""
    for user in placeholder.users:
        ignored = {user.args[i] for i in AUX_OPERANDS.get(user.target, ()) if i < len(user.args)}
        if placeholder not in ignored:
            return True
    return False


_VERDICT = "dnngraph_unsupported"  # node.meta key: unsupported(node)'s answer, found once per node


def unsupported(node) -> Optional[str]:
    """Why `node` (an FX call_function node of an aten graph) stays in torch; None if it converts."""
    if node.op != "call_function":
        return "not an op"
    if node.target is operator.getitem:
        source = node.args[0]
        return None if isinstance(source, torch.fx.Node) and unsupported(source) is None else "a result of an op in torch"
    if _VERDICT not in node.meta:
        why = _checked_form(node)
        node.meta[_VERDICT] = why if why is not None else _trial(node)
    return node.meta[_VERDICT]


def _checked_form(node) -> Optional[str]:
    """_form_refused(node), where a check that raises on a form it did not foresee (a NaN
    argument, say) leaves the op to torch, said as the converter's error it is (tests look for
    them) instead of failing the compile."""
    try:
        return _form_refused(node)
    except Exception as error:  # noqa: BLE001
        return f"converter error in its form check {type(error).__name__}: {error}"


class _TrialValues:
    """The converters' `value` for a node alone: each FX argument a graph input of its meta."""

    def __init__(self, graph):
        self.graph, self.made = graph, {}

    def __call__(self, arg):
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg not in self.made:
            self.made[arg] = graph_input(self.graph, f"input{len(self.made)}", arg.meta["val"])
        return self.made[arg]

    def true(self, dims):
        return self.graph.tensor(dim=list(dims), stride=[0] * len(dims), data_type=dtypes.bool_)

    def seed(self):
        return self.graph.tensor(dim=[1], data_type=dtypes.int64)

    def constant(self, node):
        return graph_input(self.graph, f"constant{len(self.made)}", _result(node))


def _trial(node) -> Optional[str]:
    """Why `node`'s converter cannot make it (None: it can): the converter run on the node alone,
    its arguments inputs of a scratch graph. A GraphError is a form dnngraph refuses; any other
    error a converter that mishandles a form of its op, said as such (tests look for them)."""
    graph = Graph(name="trial", intermediate_data_type=dtypes.float32)
    try:
        convert(graph, node, _TrialValues(graph))
    except GraphError as error:
        return f"dnngraph refuses this form: {error}"
    except Exception as error:  # noqa: BLE001  (a converter's bug leaves the op to torch, named)
        return f"converter error {type(error).__name__}: {error}"
    return None


def graph_input(graph, name: str, meta):
    """A dnngraph graph input with the dims, strides and type of a torch value (`meta`)."""
    return graph.tensor(name=name, dim=scalar_dims(meta), stride=list(meta.stride()) or [1],
                        data_type=dtypes.from_torch(meta.dtype))


def _symbolic_argument(node) -> bool:
    """Does a number argument of `node` depend on a symbolic size (a view to [s0, 8], say)?"""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in leaves)


def _off_the_program_device(node, results) -> Optional[str]:
    """Why an op whose result lies on the CPU in a program that runs on a GPU stays in torch
    (scalar bookkeeping, a step counter: eager keeps it on the CPU, and a graph runs on one
    device)."""
    first = results[0] if isinstance(results, (tuple, list)) and results else results
    if not isinstance(first, torch.Tensor) or first.device.type != "cpu":
        return None
    device = _program_accelerator(node.graph)
    return None if device is None else f"a result on the CPU in a program on {device}"


_ACCELERATORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _program_accelerator(graph) -> Optional[str]:
    """The non-CPU device type any value of `graph` lies on (None: a CPU program); read once per
    graph, not once per node the support predicate asks about."""
    if graph not in _ACCELERATORS:
        values = (node.meta.get("val") for node in graph.nodes)
        _ACCELERATORS[graph] = next((v.device.type for v in values
                                     if isinstance(v, torch.Tensor) and v.device.type != "cpu"), None)
    return _ACCELERATORS[graph]


def _form_refused(node) -> Optional[str]:
    """Why a form of an op stays in torch before its converter is tried (None: try it)."""
    if node.target not in CONVERTERS:
        return f"no converter for {node.target}"
    if _symbolic_argument(node):
        return "a symbolic argument (dnngraph compiles static shapes)"
    results = _result(node)
    why = _off_the_program_device(node, results)
    if why is not None:
        return why
    aux = AUX_RESULTS.get(node.target, ())
    for position, result in enumerate(results if isinstance(results, (tuple, list)) else (results,)):
        why = None if result is None or position in aux else _tensor_ok(result)
        if why is not None:
            return "its result is " + why
    ignored = {node.args[i] for i in AUX_OPERANDS.get(node.target, ()) if i < len(node.args)}
    for arg in node.all_input_nodes:
        why = None if arg in ignored else _tensor_ok(arg.meta.get("val"))
        if why is not None:
            return f"input {arg.name} is {why}"
    if node.target in DROPOUT_ARGUMENT:
        position = DROPOUT_ARGUMENT[node.target]
        if len(node.args) > position and node.args[position]:
            return "attention dropout (torch's generator)"
        mask = node.kwargs.get("attn_mask")
        if mask is not None and (len(mask.meta["val"].shape) > 4 or not mask.meta["val"].is_floating_point()
                                 and mask.meta["val"].dtype != torch.bool):
            return "an attention mask of rank over 4 or of integers"
        if len(_result(node)[0].shape) != 4:
            return "attention operands of rank other than 4"
    if node.target in PRODUCTS:
        integer = next((arg.name for arg in node.all_input_nodes if arg.meta["val"].dtype not in FLOAT_TYPES), None)
        if integer is not None:
            return f"a matrix product or convolution of integers (input {integer}): no kernel takes them"
    if node.target is aten.addmm.default and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        return "addmm with beta or alpha"
    if node.target is aten.native_dropout.default and (not node.args[2] or not 0.0 < node.args[1] < 1.0):
        return "dropout outside training or with p of 0 or 1"
    if node.target is aten.native_dropout_backward.default and node.args[1].meta["val"].dtype != torch.bool:
        return "a dropout mask that is not bool"
    if node.target is aten.slice_backward.default and node.args[5] != 1:
        return "slice_backward with a step"
    if node.target is aten.clone.default and node.kwargs.get("memory_format") not in (None, torch.contiguous_format):
        return "clone to another memory format"
    if node.target is aten._to_copy.default and _moves(node):
        return "_to_copy that moves devices or layouts"
    if node.target is aten.div.Tensor and node.kwargs.get("rounding_mode") is not None:
        return "div with a rounding mode"
    if node.target in BINARY and not all(isinstance(a, (torch.fx.Node, numbers.Number)) for a in node.args[:2]):
        return "an operand that is neither a tensor nor a number"
    if node.target in (aten.convolution.default, aten.convolution_backward.default):
        transposed = node.args[6] if node.target is aten.convolution.default else node.args[7]
        if transposed:
            return "a transposed convolution"
    if node.target in (aten._native_batch_norm_legit_functional.default,
                       aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm_backward.default):
        if any(a is None for a in node.args[1:3 if node.target is aten.native_batch_norm_backward.default else 5]):
            return "a batch norm without weight, bias or running statistics"
        if node.target is aten._native_batch_norm_legit_functional.default and not node.args[5]:
            return "a batch norm in training form without training"
        if node.target is aten.native_batch_norm_backward.default and not node.args[7]:
            return "a batch norm backward of the inference form"
    if node.target in MAX_POOL + MAX_POOL_BACKWARD:
        why = _max_pool_refused(node)
        if why is not None:
            return why
    if node.target in (aten.native_layer_norm.default, aten.native_layer_norm_backward.default):
        weight = node.args[2] if node.target is aten.native_layer_norm.default else node.args[5]
        if weight is None:
            return "a layer norm without a weight"
    if node.target not in INT8_PASSTHROUGH and _int8_made(node):
        return _int8_made(node)
    if node.target in REFUSALS:
        return REFUSALS[node.target](node)
    return None


class ConverterMismatch(RuntimeError):
    """A converter made a value whose dims are not those torch gives the result (a converter bug)."""


def _as_torch_makes(tensor, meta, node):
    """`tensor` in torch's type of the result `meta`, after checking it has torch's dims as
    dnngraph holds them (scalar_dims: a 0-d result is [1], as graph_input binds one)."""
    if list(tensor.dim) != scalar_dims(meta):
        raise ConverterMismatch(f"{node.target} made dims {list(tensor.dim)} where torch's result has "
                                f"{list(meta.shape)} (held as {scalar_dims(meta)})")
    return tensor.set_data_type(dtypes.from_torch(meta.dtype))


def convert(g, node, value):
    """The dnngraph tensor (or tuple of them) computing FX `node` (unsupported(node) is None)."""
    if node.target is operator.getitem:
        return value(node.args[0])[node.args[1]]
    made = CONVERTERS[node.target](g, node, value)
    if not isinstance(made, tuple):
        return _as_torch_makes(made, _result(node), node)
    metas = _result(node)
    for tensor, meta in zip(made, metas):
        if tensor is not None and meta is not None and not isinstance(tensor, Aux):
            _as_torch_makes(tensor, meta, node)
    return made


# --- F.local_response_norm as one LRN kernel (issue 32) ------------------------------------------
# torch decomposes F.local_response_norm into x * x, a view that puts the channels on a pooled
# axis, a zero pad, an average pool over (size, 1[, 1]) with stride 1, a squeeze and view back,
# then * alpha, + k, ** beta and x / that. Every one of those ops converts on its own (several
# kernels); where the chain is exactly that and only the division reads it (inference: a training
# forward saves the pooled values for the backward, so the chain stays and nothing is gained),
# the division becomes g.lrn of x, and the chain, read by nothing, is pruned.
_LRN_POOLS = {aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}


def _only_use(arg, target) -> Optional[torch.fx.Node]:
    """`arg` where it is an FX node of `target` (one target or a tuple) read by one node only."""
    targets = target if isinstance(target, tuple) else (target,)
    if isinstance(arg, torch.fx.Node) and arg.target in targets and len(arg.users) == 1:
        return arg
    return None


def _number(arg) -> Optional[float]:
    return float(arg) if isinstance(arg, numbers.Real) and not isinstance(arg, bool) else None


def _lrn_window(pooled) -> Optional[int]:
    """The LRN size of torch's channel-window average pool `pooled` (an avg_pool2d/3d over
    [N, 1, C, ...] with window (size, 1...), stride 1, zero padding before it), or None."""
    spatial = _LRN_POOLS[pooled.target]
    window, stride = list(pooled.args[1]), list(pooled.args[2]) if len(pooled.args) > 2 else []
    defaults = ([0], False, True, None)  # padding, ceil_mode, count_include_pad, divisor_override
    extra = list(pooled.args[3:]) + [pooled.kwargs.get(k) for k in ("padding", "ceil_mode", "count_include_pad",
                                                                      "divisor_override") if k in pooled.kwargs]
    if any(a not in (d, [0] * spatial) for a, d in zip(extra, defaults)):
        return None
    size = window[0] if len(window) == spatial and window[1:] == [1] * (spatial - 1) else None
    if size is None or stride != [1] * spatial:
        return None
    padded = _only_use(pooled.args[0], aten.constant_pad_nd.default)
    if padded is None or (padded.args[2] if len(padded.args) > 2 else 0) != 0:
        return None
    pads = list(padded.args[1])
    if pads != [0, 0] * (spatial - 1) + [size // 2, (size - 1) // 2]:
        return None
    return size if _only_use(padded.args[0], (aten.unsqueeze.default,) + RESHAPES) else None


def lrn_pattern(node) -> Optional[tuple]:
    """(x, size, alpha, beta, k) where `node` (an aten.div.Tensor) is the end of torch's
    F.local_response_norm of x and only it reads the chain, else None."""
    x, powered = node.args[0], _only_use(node.args[1] if len(node.args) > 1 else None, aten.pow.Tensor_Scalar)
    shifted = powered and _only_use(powered.args[0], aten.add.Tensor)
    scaled = shifted and _only_use(shifted.args[0], aten.mul.Tensor)
    if not scaled or shifted.kwargs.get("alpha", 1) != 1 or len(shifted.args) > 2:
        return None
    beta, k, alpha = _number(powered.args[1]), _number(shifted.args[1]), _number(scaled.args[1])
    averaged = scaled.args[0]
    if _only_use(averaged, RESHAPES):  # rank > 3: viewed back to x's dims after the squeeze
        averaged = averaged.args[0]
    squeezed = _only_use(averaged, aten.squeeze.dim)
    pooled = squeezed and _only_use(squeezed.args[0], tuple(_LRN_POOLS))
    if None in (beta, k, alpha) or not pooled or not isinstance(x, torch.fx.Node):
        return None
    size = _lrn_window(pooled)
    viewed = size and pooled.args[0].args[0]
    squared = viewed and _only_use(viewed.args[0], aten.mul.Tensor)
    if not squared or list(squared.args[:2]) != [x, x] or squeezed.args[1:] != (1,):
        return None
    # the pooled axis is x's channel axis: the view is [N, 1, C, rest of x], the result x's dims
    dims, pooled_dims = _shape(x), _shape(viewed)
    if not 3 <= len(dims) <= 5 or pooled_dims[:3] != [dims[0], 1, dims[1]] or \
            math.prod(pooled_dims[3:]) != math.prod(dims[2:]) or _shape(node) != dims:
        return None
    return x, size, alpha, beta, k


def _div_or_lrn(g, node, value):
    pattern = lrn_pattern(node)
    if pattern is None:
        return _binary(g, node, value)
    x, size, alpha, beta, k = pattern
    return g.lrn(value(x), size, alpha=alpha, beta=beta, k=k)


CONVERTERS[aten.div.Tensor] = _div_or_lrn
# --- recurrent layers (issue 32): dnngraph::rnn, what torch_backend/rnn.py makes of aten.lstm,
# aten.gru, aten.rnn_tanh and aten.rnn_relu while the backend traces ------------------------------
from . import rnn as _rnn_ops  # noqa: E402  (registers the dnngraph::rnn custom ops)


def _recurrent(g, node, value):
    """g.rnn with the layer's flat weights in torch's order; [y, h_n(, c_n)]."""
    x, hx, params, mode, has_biases, num_layers, bidirectional, batch_first = node.args[:8]
    states = [value(h) for h in hx]
    cell = states[1] if mode == "lstm" else None
    proj = int(states[0].dim[-1]) if cell is not None and states[0].dim[-1] != cell.dim[-1] else 0
    y, h_n, c_n = g.rnn(value(x), states[0], cell, [value(p) for p in params], mode=mode, num_layers=num_layers,
                        bidirectional=bidirectional, proj_size=proj, bias=has_biases, batch_first=batch_first)
    return (y, h_n, c_n) if c_n is not None else (y, h_n)


CONVERTERS[torch.ops.dnngraph.rnn.default] = _recurrent


def _inlined(g, source, bound: dict):
    """The nodes of graph `source` added to `g` in order, reading `bound` (source uid -> g
    tensor) for its inputs; `bound` gains every value they make."""
    for node in source.nodes:
        made = g._add_op(node.op, [None if t is None else bound[t.uid] for t in node.inputs], node.attrs)
        for original, twin in zip(node.outputs, made):
            if original is None or twin is None:
                continue
            if original._data_type is not None:
                twin.set_data_type(original._data_type)
            bound[original.uid] = twin
    return bound


def _recurrent_backward(g, node, value):
    """dnngraph::rnn_backward: g.rnn over the same inputs differentiated by dnngraph's autodiff
    (autodiff.derive: the recurrence backward kernels and one GEMM per weight gradient), its
    forward and backward graphs inlined here; [dx] + dhx + dparams."""
    from ..autodiff import derive
    x, hx, params, grads, mode, has_biases, num_layers, bidirectional, batch_first = node.args[:9]
    operands = [value(x)] + [value(h) for h in hx] + [value(p) for p in params]
    standalone = g.blank(f"{g.name}.rnn")
    inputs = [standalone.tensor(name=f"operand{i}", dim=list(t.dim), stride=list(t.stride), data_type=t.data_type)
              for i, t in enumerate(operands)]
    cell = inputs[2] if mode == "lstm" else None
    proj = int(inputs[1].dim[-1]) if cell is not None and inputs[1].dim[-1] != cell.dim[-1] else 0
    weights = inputs[1 + len(hx):]
    outputs = [t for t in standalone.rnn(inputs[0], inputs[1], cell, weights, mode=mode, num_layers=num_layers,
                                         bidirectional=bidirectional, proj_size=proj, bias=has_biases,
                                         batch_first=batch_first) if t is not None]
    for tensor in outputs:
        tensor.set_output(True)
    derivation = derive(standalone, inputs, outputs, [True] * len(inputs))
    by_name = {t.name: operand for t, operand in zip(inputs, operands)}
    bound = {t.uid: by_name[t.name] for t in derivation.forward.inputs()}
    _inlined(g, derivation.forward, bound)
    into_backward = {}
    for seed, grad in zip(derivation.grad_inputs, grads):
        into_backward[seed.uid] = value(grad)
    for saved, twin in zip(derivation.saved, derivation.saved_inputs):
        into_backward[twin.uid] = bound[saved.uid]
    for original, twin in zip(derivation.forward_inputs, derivation.forward_input_twins):
        into_backward[twin.uid] = by_name[original.name]
    _inlined(g, derivation.backward, into_backward)
    return tuple(into_backward[t.uid] for t in derivation.grads)


CONVERTERS[torch.ops.dnngraph.rnn_backward.default] = _recurrent_backward


# --- int8 (issue 33): torch._int_mm, int8 x int8 -> int32 ------------------------------------------
# int8 tensors are taken where their values pass through unchanged (views, copies) or feed
# _int_mm; an op that makes int8 values stays in torch, because torch's int8 arithmetic and
# `.to(torch.int8)` wrap (and truncate) while dnngraph's int8 stores saturate and round to nearest
# even (dtypes.to_int8), as cuDNN's do.
TENSOR_TYPES += (torch.int8,)
INT8_PASSTHROUGH = VIEW_OPS | {aten.clone.default, aten._int_mm.default, aten.alias.default}


def _int_mm(g, node, value):
    """a [M, K] int8 @ b [K, N] int8 -> int32, exact (ops/matmul.py refuses a K that could wrap)."""
    return g.matmul(value(node.args[0]), value(node.args[1]))


def _int8_made(node) -> Optional[str]:
    results = _result(node)
    for result in results if isinstance(results, (tuple, list)) else (results,):
        if isinstance(result, torch.Tensor) and result.dtype == torch.int8:
            return ("an int8 result of an op other than a view: torch's int8 math and conversions wrap, "
                    "dnngraph's int8 stores saturate")
    return None


CONVERTERS[aten._int_mm.default] = _int_mm


# torch compares an integer tensor with a number or a 0-d integer tensor in the tensor's own type,
# converting the other operand to it with wrap-around (an int8 x < 300 compares x with 44, an
# int32 x == tensor(2**32 + 44) with 44); dnngraph compares the values themselves (int8 widened to
# int32), so such a comparison stays in torch. A number in the type's range compares alike.
def _wrapping_comparison(node) -> Optional[str]:
    held, other = _typed_and_converted(node.args[:2])
    if held is None or held.dtype not in (torch.int8, torch.int32):
        return None
    limits = torch.iinfo(held.dtype)
    out_of_range = isinstance(other, int) and not isinstance(other, bool) and not limits.min <= other <= limits.max
    wider = isinstance(other, torch.Tensor) and other.dtype in (torch.int32, torch.int64) and \
        torch.iinfo(other.dtype).bits > limits.bits
    if not (out_of_range or wider):
        return None
    what = repr(other) if out_of_range else f"a 0-d {other.dtype} tensor"
    return (f"torch compares {held.dtype} values with {what} converted to {held.dtype} (it wraps); dnngraph "
            f"would compare the values themselves")


def _typed_and_converted(args) -> tuple:
    """(the tensor whose type torch computes a binary op in, the operand it converts to that
    type) where torch's promotion converts one (a number beside a tensor, a 0-d tensor beside
    one with dims), else (None, None)."""
    values = [arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg for arg in args]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(values) != 2 or not tensors:
        return None, None
    if len(tensors) == 1:
        return tensors[0], next(v for v in values if v is not tensors[0])
    with_dims = [t for t in tensors if t.dim() > 0]
    if len(with_dims) != 1:
        return None, None  # both 0-d or both with dims: promoted as usual
    return with_dims[0], next(t for t in tensors if t is not with_dims[0])


REFUSALS.update({target: _wrapping_comparison for packet in COMPARE for target in (packet.Tensor, packet.Scalar)})
