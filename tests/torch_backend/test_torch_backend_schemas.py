"""Every converter of the torch.compile backend against the forms of its op's schema.

Each aten op the converter table claims is traced alone (make_fx, fake tensors: the FX node and
its metadata are what AOTAutograd hands the backend) in many forms built from its schema:
scalars where tensors go, alpha, empty, negative and several dims, keepdim, dtype arguments,
broadcast, transposed, integer and NaN inputs. The backend's compiler must then either compute
the op as eager torch does or leave it to torch with a reason; it never raises, and no reason
says a converter failed (a form its support check claimed and its converter cannot make).
"""
import itertools
import math

import pytest
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from dnngraph import torch_backend
from dnngraph.torch_backend.convert import CONSTANTS, CONVERTERS

aten = torch.ops.aten
CASES_PER_OP = 24  # forms tried per op (an even spread of its variants where there are more)


def _floats(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    return torch.randn(shape, generator=generator)  # no dims: a 0-d tensor (a loss's gradient)


def _with_specials(x):
    """x with a NaN, an inf and a -inf in it (special values must propagate as torch's do)."""
    x = x.clone()
    flat = x.view(-1)
    flat[0], flat[-1], flat[len(flat) // 2] = float("nan"), float("inf"), float("-inf")
    return x


# What a tensor argument can be, by the argument's name (the first is the plain form).
SELF_FORMS = {
    "float": lambda: _floats(3, 5),
    "transposed": lambda: _floats(5, 3).t(),
    "broadcast": lambda: _floats(1, 5).expand(3, 5),
    "specials": lambda: _with_specials(_floats(3, 5)),
    "int64": lambda: torch.randint(-4, 5, (3, 5)),
    "bool": lambda: torch.rand(3, 5) < 0.5,
    "half": lambda: _floats(3, 5).half(),
}
OTHER_FORMS = {
    "float": lambda: _floats(3, 5, seed=1),
    "row": lambda: _floats(1, 5, seed=1),
    "int number": lambda: 2,
    "float number": lambda: 0.5,
    "negative number": lambda: -3,
    "int64": lambda: torch.randint(1, 5, (3, 5)),
}
# What a non-tensor argument can be, by (schema type, name), then by name.
ARGUMENT_FORMS = {
    ("number", "alpha"): [1, 3, 0.5, -2],
    ("number", "other"): [2, 0.5, -3, 0],
    ("number", "exponent"): [2, 0.5, 3, -1, 0],
    ("number", "threshold"): [0, 0.5, -1],
    ("Optional[List[int]]", "dim"): [None, [], [1], [-1], [0], [0, 1], [-2, -1]],
    ("List[int]", "dim"): [[], [1], [-1], [0, 1], [-2]],
    ("int", "dim"): [0, 1, -1, -2],
    ("bool", "keepdim"): [False, True],
    ("Optional[int]", "dtype"): [None, torch.float32, torch.float64, torch.int64],
    ("str", "approximate"): ["none", "tanh"],
    ("bool", "half_to_float"): [False],
    ("Optional[int]", "memory_format"): [None, torch.contiguous_format, torch.preserve_format],
    ("number", "min_val"): [-1, 0, 0.5, 2.5],  # 2.5 > every max_val but 6: bounds crossed
    ("number", "max_val"): [1, 6, -0.5],
}

# Ops whose required arguments a (3, 5) tensor per tensor argument does not fit: the base call,
# as (positional arguments, keyword arguments, extra variants by argument name), made per case.
def _sdpa_inputs():
    return [_floats(1, 2, 5, 4, seed=s) for s in range(3)]


def _sdpa_backward_args():
    q, k, v = _sdpa_inputs()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    return [_floats(1, 2, 5, 4, seed=9), q, k, v, out, lse, 0.0, False]


def _layer_norm_backward_args():
    x, weight, bias = _floats(3, 5), _floats(5, seed=1), _floats(5, seed=2)
    _, mean, rstd = aten.native_layer_norm.default(x, [5], weight, bias, 1e-5)
    return [_floats(3, 5, seed=3), x, [5], mean, rstd, weight, bias, [True, True, True]]


def _batch_norm_backward_args():
    x = _floats(2, 3, 4, 5)
    weight, mean, var = _floats(3, seed=1), _floats(3, seed=2), _floats(3, seed=3).abs() + 0.5
    _, save_mean, save_invstd = aten.native_batch_norm.default(x, weight, None, mean.clone(), var.clone(),
                                                                True, 0.1, 1e-5)
    return [_floats(2, 3, 4, 5, seed=4), x, weight, mean, var, save_mean, save_invstd, True, 1e-5,
            [True, True, True]]


def _max_pool_backward_args(rank):
    x = _floats(1, 2, *([7] * rank))
    pool = aten.max_pool2d_with_indices.default if rank == 2 else aten.max_pool3d_with_indices.default
    y, indices = pool(x, [3] * rank, [2] * rank, [1] * rank)
    return [torch.randn_like(y), x, [3] * rank, [2] * rank, [1] * rank, [1] * rank, False, indices]


def _conv_args():
    return [_floats(2, 4, 6, 7), _floats(6, 2, 3, 3, seed=1), _floats(6, seed=2), [1, 1], [1, 1], [1, 1], False,
            [0, 0], 2]


def _conv_backward_args():
    return [_floats(2, 6, 6, 7, seed=3), _floats(2, 4, 6, 7), _floats(6, 2, 3, 3, seed=1), [6], [1, 1], [1, 1],
            [1, 1], False, [0, 0], 2, [True, True, True]]


class Fitted:
    """An argument that depends on the others of the call it is placed in (a gradient with the
    dims of the forward's result, a weight total the forward made): `make(args, kwargs)`, run by
    eager torch after every other argument of the form is placed."""

    def __init__(self, make, label: str):
        self.make, self.label = make, label

    def __repr__(self):
        return self.label


def _fitted(args, kwargs):
    """The call with each Fitted argument made (None: torch refuses the form they come from)."""
    try:
        args = [a.make(args, kwargs) if isinstance(a, Fitted) else a for a in args]
        kwargs = {k: v.make(args, kwargs) if isinstance(v, Fitted) else v for k, v in kwargs.items()}
    except Exception:  # noqa: BLE001  (the form is one torch refuses: no case)
        return None
    return args, kwargs


def _gradient_of(forward, first: int, last: int, seed=5):
    """A random gradient with the dims of forward(*args[first:last]) (the forward of a backward op)."""
    return Fitted(lambda args, kwargs: _floats(*forward(*args[first:last]).shape, seed=seed), "grad fitted")


def _ids(high, *shape, low=0, dtype=torch.int64, seed=0):
    """Integer ids in [low, high): in range of the axis they index (negative ones count from the end)."""
    generator = torch.Generator().manual_seed(seed + 11 * len(shape) + sum(shape))
    return torch.randint(low, high, shape, generator=generator, dtype=dtype)


def _pool_forms(rank: int) -> dict:
    """Average pooling geometry forms (the window 3 per axis): strides, pads, ceil mode, divisors."""
    return {"stride": [[], [2] * rank, [1] + [2] * (rank - 1)], "padding": [[0] * rank, [1] * rank, [1]],
            "ceil_mode": [False, True], "count_include_pad": [True, False], "divisor_override": [None, 5]}


def _avg_pool_args(rank: int):
    x = _floats(1, 2, 7, 8) if rank == 2 else _floats(1, 2, 5, 6, 5)
    return [x, [3] * rank]


def _avg_pool_backward_entry(rank: int):
    forward = aten.avg_pool2d.default if rank == 2 else aten.avg_pool3d.default
    x, window = _avg_pool_args(rank)
    forms = _pool_forms(rank)
    args = [_gradient_of(forward, 1, 8), x, window, [2] * rank, [1] * rank, False, True, None]
    return args, {}, {**forms, "stride": forms["stride"][1:], "self": [x, _with_specials(x),
                                                                        x.to(memory_format=torch.channels_last)
                                                                        if rank == 2 else x.transpose(-1, -2)]}


def _nll_loss_entry(backward: bool):
    """nll_loss_forward(x, target, weight, reduction, ignore_index) or its backward, whose gradient
    and total weight are the forward's."""
    x = torch.log_softmax(_floats(6, 5), -1)
    target = _ids(5, 6)
    forms = {"weight": [None, _floats(5, seed=3).abs() + 0.1], "reduction": [1, 0, 2], "ignore_index": [-100, 2],
             "target": [target, torch.full((6,), 2), _ids(5, 6, dtype=torch.int32)],
             "self": [x, _with_specials(x), x.t().contiguous().t(), x.half()]}
    if not backward:
        return [x, target, None, 1, -100], {}, forms
    forward = aten.nll_loss_forward.default
    grad = Fitted(lambda args, kwargs: _floats(*forward(*args[1:6])[0].shape, seed=4), "grad fitted")
    total = Fitted(lambda args, kwargs: forward(*args[1:6])[1], "total_weight fitted")
    return [grad, x, target, None, 1, -100, total], {}, forms


def _index_add_source(args, kwargs):
    """index_add's source: self's dims with the indexed axis as long as the index."""
    base, dim, index = args[:3]
    dims = list(base.shape)
    dims[dim] = index.numel()
    return _floats(*dims, seed=6).to(base.dtype)


def _index_put_values(args, kwargs):
    """index_put's values: the indexed shape (self's dims with the indexed axis replaced by the ids')."""
    base, indices = args[:2]
    axis = next(i for i, ids in enumerate(indices) if ids is not None)
    dims = list(base.shape[:axis]) + list(indices[axis].shape) + list(base.shape[axis + 1:])
    return _floats(*dims, seed=6).to(base.dtype)


def _embedding_gradient(args, kwargs):
    return _floats(*args[1].shape, 4, seed=6)


# The options a constant op (arange, zeros, full_like, ...) takes besides its values.
CONSTANT_FORMS = {"dtype": [None, torch.float32, torch.int64, torch.int32, torch.bool, torch.float16,
                            torch.bfloat16, torch.float64],
                  "layout": [None, torch.strided], "pin_memory": [None, False, True],
                  "device": [None, "cpu"], "requires_grad": [None, False]}


TABLE = {
    aten.mm.default: lambda: ([_floats(3, 5), _floats(5, 4, seed=1)], {}, {}),
    aten.bmm.default: lambda: ([_floats(2, 3, 5), _floats(2, 5, 4, seed=1)], {}, {}),
    aten.addmm.default: lambda: ([_floats(4, seed=2), _floats(3, 5), _floats(5, 4, seed=1)], {},
                                 {"beta": [1, 0.5], "alpha": [1, 2]}),
    aten.permute.default: lambda: ([_floats(3, 5, 2)], {}, {"dims": [[2, 0, 1], [-1, 0, 1], [0, 1, 2]]}),
    aten.transpose.int: lambda: ([_floats(3, 5, 2), 0, 2], {}, {"dim0": [0, -1, 1], "dim1": [2, -3, 1]}),
    aten.view.default: lambda: ([_floats(3, 5, 2)], {}, {"size": [[15, 2], [-1, 10], [30], [3, 1, 10]]}),
    aten._unsafe_view.default: lambda: ([_floats(3, 5, 2)], {}, {"size": [[15, 2], [-1, 10], [30]]}),
    aten.reshape.default: lambda: ([_floats(5, 3).t()], {}, {"shape": [[15], [5, 3], [-1, 1]]}),
    aten.where.self: lambda: ([torch.rand(3, 5) < 0.5, _floats(3, 5), _floats(1, 5, seed=1)], {}, {}),
    aten._to_copy.default: lambda: ([_floats(3, 5)], {}, {
        "dtype": [None, torch.float16, torch.bfloat16, torch.int32, torch.bool, torch.float64],
        "memory_format": [None, torch.preserve_format, torch.contiguous_format], "device": [None, "cpu"]}),
    aten.cat.default: lambda: ([[_floats(3, 5), _floats(3, 5, seed=1)]], {}, {"dim": [0, 1, -1, -2]}),
    aten._softmax_backward_data.default: lambda: ([_floats(3, 5), torch.softmax(_floats(3, 5, seed=1), -1), -1,
                                                   torch.float32], {}, {"dim": [-1, 0, 1]}),
    aten._log_softmax_backward_data.default: lambda: ([_floats(3, 5), torch.log_softmax(_floats(3, 5, seed=1), -1),
                                                       -1, torch.float32], {}, {"dim": [-1, 0]}),
    aten.unsqueeze.default: lambda: ([_floats(3, 5)], {}, {"dim": [0, 1, 2, -1, -3]}),
    aten.squeeze.dim: lambda: ([_floats(3, 1, 5)], {}, {"dim": [1, -2, 0, 2]}),
    aten.squeeze.dims: lambda: ([_floats(3, 1, 5, 1)], {}, {"dim": [[1], [-1, 1], [0], []]}),
    aten.squeeze.default: lambda: ([_floats(3, 1, 5, 1)], {}, {}),
    aten.slice.Tensor: lambda: ([_floats(6, 5)], {}, {
        "dim": [0, 1, -1], "start": [None, 1, -2, -100], "end": [None, 3, -1, 2**63 - 1], "step": [1, 2, 3]}),
    aten.expand.default: lambda: ([_floats(3, 1)], {}, {"size": [[3, 4], [2, 3, 4], [-1, 4], [3, 1]]}),
    aten.native_dropout.default: lambda: ([_floats(40, 50), 0.25, True], {}, {"p": [0.0, 0.25, 1.0],
                                                                            "train": [True, False, None]}),
    aten.native_dropout_backward.default: lambda: ([_floats(3, 5), torch.rand(3, 5) < 0.7, 1.25], {}, {}),
    aten.split.Tensor: lambda: ([_floats(7, 5)], {}, {"split_size": [2, 3, 7, 10], "dim": [0, -2]}),
    aten.split_with_sizes.default: lambda: ([_floats(7, 5)], {}, {"split_sizes": [[2, 5], [7], [1, 2, 4]]}),
    aten.slice_backward.default: lambda: ([_floats(3, 2), [3, 5], 1, 1, 3, 1], {}, {
        "dim": [1, -1], "start": [1, 0, -4], "end": [3, 2**63 - 1, -2], "step": [1, 2]}),
    aten.select.int: lambda: ([_floats(3, 5), 1, 0], {}, {"dim": [0, 1, -1, -2], "index": [0, 2, -1, -3]}),
    aten.select_backward.default: lambda: ([_floats(3), [3, 5], 1, 2], {}, {"dim": [1, -1], "index": [0, 4, -1, -5]}),
    aten.threshold_backward.default: lambda: ([_floats(3, 5), _floats(3, 5, seed=1), 0], {}, {}),
    aten.convolution.default: lambda: (_conv_args(), {}, {"bias": [None]}),
    aten.convolution_backward.default: lambda: (_conv_backward_args(), {}, {
        "output_mask": [[True, True, True], [True, False, False], [False, True, True]]}),
    aten.native_layer_norm.default: lambda: ([_floats(3, 5), [5], _floats(5, seed=1), _floats(5, seed=2), 1e-5],
                                             {}, {"weight": [None], "bias": [None]}),
    aten.native_layer_norm_backward.default: lambda: (_layer_norm_backward_args(), {}, {
        "output_mask": [[True, True, True], [True, False, False]], "bias": [None]}),
    aten._scaled_dot_product_flash_attention_for_cpu.default: lambda: (_sdpa_inputs(), {}, {
        "is_causal": [False, True], "scale": [None, 0.3], "dropout_p": [0.0]}),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: lambda: (_sdpa_backward_args(), {}, {
        "scale": [None]}),
    aten._native_batch_norm_legit_functional.default: lambda: (
        [_floats(2, 3, 4, 5), _floats(3, seed=1), _floats(3, seed=2), _floats(3, seed=3),
         _floats(3, seed=4).abs() + 0.5, True, 0.1, 1e-5], {}, {"weight": [None], "training": [True, False]}),
    aten._native_batch_norm_legit_no_training.default: lambda: (
        [_floats(2, 3, 4, 5), _floats(3, seed=1), _floats(3, seed=2), _floats(3, seed=3),
         _floats(3, seed=4).abs() + 0.5, 0.1, 1e-5], {}, {"weight": [None], "bias": [None]}),
    aten.native_batch_norm_backward.default: lambda: (_batch_norm_backward_args(), {}, {
        "output_mask": [[True, True, True], [True, False, False]], "train": [True, False]}),
    aten.max_pool2d_with_indices.default: lambda: ([_floats(1, 2, 7, 8), [3, 3]], {}, {
        "stride": [[], [2, 2], [1, 2]], "padding": [[0, 0], [1, 1]], "dilation": [[1, 1], [2, 2]],
        "ceil_mode": [False, True], "self": [_floats(1, 2, 7, 8), _floats(2, 7, 8)]}),
    aten.max_pool3d_with_indices.default: lambda: ([_floats(1, 2, 5, 6, 5), [3, 3, 3]], {}, {
        "stride": [[], [2, 2, 2]], "padding": [[0, 0, 0], [1, 1, 1]]}),
    aten.max_pool2d_with_indices_backward.default: lambda: (_max_pool_backward_args(2), {}, {}),
    aten.max_pool3d_with_indices_backward.default: lambda: (_max_pool_backward_args(3), {}, {}),
    aten.hardtanh_backward.default: lambda: ([_floats(3, 5), _with_specials(_floats(3, 5, seed=1)) * 2, -1, 1],
                                             {}, {"self": [_floats(3, 5, seed=1) * 2, _floats(5, 3, seed=1).t(),
                                                           _ids(5, 3, 5, low=-4)]}),
    aten.avg_pool2d.default: lambda: (_avg_pool_args(2), {}, {
        **_pool_forms(2), "kernel_size": [[3, 3], [2, 3], [3]],
        "self": [_floats(1, 2, 7, 8), _floats(1, 2, 7, 8).to(memory_format=torch.channels_last),
                 _with_specials(_floats(1, 2, 7, 8)), _floats(2, 7, 8), _ids(5, 1, 2, 7, 8)]}),
    aten.avg_pool3d.default: lambda: (_avg_pool_args(3), {}, _pool_forms(3)),
    aten.avg_pool2d_backward.default: lambda: _avg_pool_backward_entry(2),
    aten.avg_pool3d_backward.default: lambda: _avg_pool_backward_entry(3),
    aten.constant_pad_nd.default: lambda: ([_floats(3, 5), [1, 1]], {}, {
        "pad": [[1, 2], [0, 2, 1, 0], [-1, 2], [2, -1, -1, 1], [0, 0, 0, 0, 1, 1], [1]],
        "value": [0, 1.5, -2, float("-inf"), float("nan")],
        "self": [_floats(3, 5), _floats(5, 3).t(), _ids(5, 3, 5, low=-4), torch.rand(3, 5) < 0.5,
                 _floats(3, 5).half(), _floats(1, 5).expand(3, 5)]}),
    aten.embedding.default: lambda: ([_floats(7, 4), _ids(7, 3, 5)], {}, {
        "indices": [_ids(7, 3, 5), _ids(7, 6), _ids(7, 2, 3, dtype=torch.int32), torch.tensor(3), _ids(2, 9)],
        "weight": [_floats(7, 4), _floats(4, 7).t(), _floats(7, 4).half(), _ids(9, 7, 4)],
        "padding_idx": [-1, 2]}),
    aten.index_select.default: lambda: ([_floats(6, 5), 0, _ids(5, 4)], {}, {
        "index": [_ids(5, 4), _ids(5, 7, dtype=torch.int32), torch.tensor(2), _ids(2, 3)],
        "self": [_floats(6, 5), _floats(5, 6).t(), _with_specials(_floats(6, 5)), _ids(9, 6, 5), _floats(6, 5).half(),
                 torch.rand(6, 5) < 0.5]}),
    aten.gather.default: lambda: ([_floats(4, 5), 1, _ids(4, 4, 3)], {}, {
        "index": [_ids(4, 4, 3), _ids(4, 2, 3), _ids(4, 4, 5, dtype=torch.int32), _ids(4, 4, 6)],
        "self": [_floats(4, 5), _floats(5, 4).t(), _with_specials(_floats(4, 5)), _ids(9, 4, 5),
                 _floats(1, 5).expand(4, 5)]}),
    aten.index.Tensor: lambda: ([_floats(6, 5), [_ids(6, 3, low=-6)]], {}, {
        "indices": [[_ids(6, 3, low=-6)], [None, _ids(5, 2, 3, low=-5)], [_ids(6, 4, dtype=torch.int32)],
                    [_ids(3, 3), _ids(5, 3)], [torch.rand(6) < 0.5], [torch.tensor(-2)]],
        "self": [_floats(6, 5), _floats(5, 6).t(), _ids(9, 6, 5), _floats(6, 5).half()]}),
    aten.embedding_dense_backward.default: lambda: (
        [Fitted(_embedding_gradient, "grad fitted"), _ids(7, 3, 5), 7, -1, False], {}, {
            "indices": [_ids(7, 3, 5), _ids(7, 6, dtype=torch.int32), _ids(2, 9)],
            "padding_idx": [-1, 2, 0], "scale_grad_by_freq": [False, True], "num_weights": [7, 9]}),
    aten.scatter_add.default: lambda: ([_floats(4, 5), 0, _ids(4, 3, 5), _floats(3, 5, seed=1)], {}, {
        "index": [_ids(4, 3, 5), _ids(4, 2, 3), _ids(4, 3, 5, dtype=torch.int32), _ids(2, 4, 5)],
        "src": [_floats(3, 5, seed=1), _floats(4, 6, seed=1), _floats(5, 3, seed=1).t()],
        "self": [_floats(4, 5), _floats(5, 4).t(), _ids(9, 4, 5), _floats(4, 5).half()]}),
    aten.index_add.default: lambda: ([_floats(4, 5), 0, _ids(4, 6), Fitted(_index_add_source, "source fitted")],
                                     {}, {
        "index": [_ids(4, 6), _ids(4, 3, dtype=torch.int32), _ids(2, 8)], "alpha": [1, 2, 0.5],
        "self": [_floats(4, 5), _floats(5, 4).t(), _ids(9, 4, 5), _floats(4, 5).half()]}),
    aten.index_put.default: lambda: ([_floats(6, 5), [_ids(6, 4, low=-6)], Fitted(_index_put_values, "values fitted")],
                                     {}, {
        "indices": [[_ids(6, 4, low=-6)], [None, _ids(5, 2, 3)], [_ids(3, 4, dtype=torch.int32)], [_ids(2, 8)],
                    [_ids(3, 2), _ids(5, 2)]],
        "values": [Fitted(_index_put_values, "values fitted"), _floats(5, seed=2)],
        "accumulate": [True, False],
        "self": [_floats(6, 5), _floats(5, 6).t(), _ids(9, 6, 5), _floats(6, 5).half()]}),
    aten.new_zeros.default: lambda: ([_floats(3, 5), [2, 3]], {}, {
        "size": [[2, 3], [4], [1, 1, 1], []], "self": [_floats(3, 5), _ids(9, 3, 5), _floats(3, 5).half()]}),
    aten.new_ones.default: lambda: ([_floats(3, 5), [2, 3]], {}, {
        "size": [[2, 3], [4], []], "self": [_floats(3, 5), _ids(9, 3, 5), torch.rand(3, 5) < 0.5],
        "dtype": [None, torch.int32, torch.bool, torch.float16], "pin_memory": [None, True]}),
    aten.new_full.default: lambda: ([_floats(3, 5), [2, 3], 1.5], {}, {
        "size": [[2, 3], [4], []], "fill_value": [1.5, float("-inf"), float("nan"), 3, True],
        "self": [_floats(3, 5), _ids(9, 3, 5), _floats(3, 5).half()]}),
    **{op: (lambda: ([_floats(3, 5)], {}, {**CONSTANT_FORMS, "self": [
        _floats(3, 5), _floats(5, 3).t(), _floats(1, 5).expand(3, 5), _ids(9, 3, 5), torch.rand(3, 5) < 0.5,
        _floats(3, 5).half(), _floats(2, 3, 4, 5).to(memory_format=torch.channels_last)],
        "memory_format": [None, torch.preserve_format, torch.contiguous_format, torch.channels_last]}))
       for op in (aten.zeros_like.default, aten.ones_like.default)},
    aten.full_like.default: lambda: ([_floats(3, 5), 2.5], {}, {
        **CONSTANT_FORMS, "fill_value": [2.5, -7, float("-inf"), True],
        "self": [_floats(3, 5), _floats(5, 3).t(), _ids(9, 3, 5), torch.rand(3, 5) < 0.5],
        "memory_format": [None, torch.preserve_format]}),
    **{op: (lambda: ([[2, 3]], {}, {**CONSTANT_FORMS, "size": [[2, 3], [7], [], [1, 1, 4], [0, 3]]}))
       for op in (aten.zeros.default, aten.ones.default)},
    aten.full.default: lambda: ([[2, 3], 1.5], {}, {
        **CONSTANT_FORMS, "size": [[2, 3], [], [4, 1]], "fill_value": [1.5, -3, float("nan"), True]}),
    aten.scalar_tensor.default: lambda: ([1.5], {}, {
        **CONSTANT_FORMS, "s": [1.5, float("-inf"), -3, True, float("nan")]}),
    aten.arange.default: lambda: ([5], {}, {**CONSTANT_FORMS, "end": [5, 7.5, 1, 0]}),
    aten.arange.start: lambda: ([1, 6], {}, {**CONSTANT_FORMS, "start": [1, -2, 0.5], "end": [6, 3.5]}),
    aten.arange.start_step: lambda: ([0, 5, 2], {}, {
        **CONSTANT_FORMS, "start": [0, 4, -1.5], "end": [5, -3, 2.25], "step": [2, 0.25, -1, 3]}),
    **{op: (lambda: ([torch.rand(3, 5) < 0.5, torch.rand(3, 5) < 0.3], {}, {
        "self": [torch.rand(3, 5) < 0.5, torch.rand(5, 3).t() < 0.5, torch.rand(1, 5) < 0.5, _ids(9, 3, 5)],
        "other": [torch.rand(3, 5) < 0.3, torch.rand(1, 5) < 0.3, torch.rand(3, 1) < 0.3, _ids(9, 3, 5)]}))
       for op in (aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor)},
    aten.nll_loss_forward.default: lambda: _nll_loss_entry(backward=False),
    aten.nll_loss_backward.default: lambda: _nll_loss_entry(backward=True),
}
TABLE.update({
    torch.ops.dnngraph.rnn.default: lambda: _rnn_entry(backward=False),
    torch.ops.dnngraph.rnn_backward.default: lambda: _rnn_entry(backward=True),
})


def _int8(*shape, seed=0):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


# torch._int_mm: int8 [M, K] @ int8 [K, N] -> int32 (on CUDA M > 16, K and N multiples of 8); B
# row-major and K-major (the layout cuBLASLt and wgmma read)
TABLE[aten._int_mm.default] = lambda: ([_int8(17, 32), _int8(32, 8, seed=1)], {},
                                       {"mat2": [_int8(32, 8, seed=1), _int8(8, 32, seed=2).t()]})



def _rnn_entry(backward: bool):
    """dnngraph::rnn (an LSTM of 2 steps, batch 3, input 4, hidden 5) or its backward, with a
    strided x and special values as variants (the other arguments fix the weights' shapes);
    the weights in torch's _flat_weights order."""
    layer = torch.nn.LSTM(4, 5)
    params = [w.detach().clone() for w in layer._flat_weights]
    x, hx = _floats(2, 3, 4), [_floats(1, 3, 5, seed=1), _floats(1, 3, 5, seed=2)]
    flags = ["lstm", True, 1, False, False]
    variants = {"x": [x, _floats(4, 3, 2).transpose(0, 2), _with_specials(x)]}
    if not backward:
        return [x, hx, params] + flags, {}, variants
    grads = [_floats(2, 3, 5, seed=3), _floats(1, 3, 5, seed=4), _floats(1, 3, 5, seed=5)]
    return [x, hx, params, grads] + flags, {}, variants


def _flash_inputs():
    return [_floats(1, 2, 5, 64, seed=s).half() for s in range(3)]


def _flash_backward_args():
    q, k, v = (x.cuda() for x in _flash_inputs())
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention.default(q, k, v)
    return [torch.randn_like(out), q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False, seed, offset]


# Ops eager torch runs only on CUDA tensors: their forms are walked on the GPU alone.
CUDA_ONLY = {
    aten._scaled_dot_product_flash_attention.default: lambda: (_flash_inputs(), {}, {
        "is_causal": [False, True], "scale": [None, 0.3]}),
    aten._scaled_dot_product_flash_attention_backward.default: lambda: (_flash_backward_args(), {}, {
        "is_causal": [False], "scale": [None]}),
}
# Results a converter leaves to torch as placeholders only the op's own backward reads (random
# state, bookkeeping): compared up to this count.
COMPARED_RESULTS = {aten._scaled_dot_product_flash_attention.default: 2}

# Ops whose CUDA eager kernel is wrong in the torch the GPU machine runs: there eager's result is
# taken on the CPU. avg_pool2d's channels-last backward with padding > 0 maps input pixels to the
# wrong windows (pytorch/pytorch#188344, fixed after torch 2.11).
CPU_EAGER_ON_CUDA = {aten.avg_pool2d_backward.default}


def _generic_base(op):
    """Base call from the schema alone: a (3, 5) float per required tensor argument, the first
    form ARGUMENT_FORMS has for each other one (None: the op needs a TABLE entry)."""
    required = [a for a in op._schema.arguments if not a.kwarg_only and not a.has_default_value()]
    others = [ARGUMENT_FORMS.get((str(a.type), a.name)) for a in required if str(a.type) != "Tensor"]
    if any(forms is None for forms in others):
        return None

    def make():
        values, numbers = [], iter(others)
        for seed, argument in enumerate(required):
            values.append(_floats(3, 5, seed=seed) if str(argument.type) == "Tensor" else next(numbers)[0])
        return values, {}, {}

    return make


def _forms(op, argument, given: dict):
    """The values `argument` of `op`'s schema takes across the cases."""
    if argument.name in given:
        return given[argument.name]
    if str(argument.type) == "Tensor":
        return None  # tensors vary one at a time (see _cases)
    forms = ARGUMENT_FORMS.get((str(argument.type), argument.name))
    return forms


def _cases(op):
    """(positional arguments, keyword arguments, label) per form of `op` tried."""
    make = TABLE.get(op) or CUDA_ONLY.get(op) or _generic_base(op)
    assert make is not None, f"{op}: add its base call to TABLE (its required arguments are not all tensors)"
    args, kwargs, given = make()
    schema = op._schema.arguments
    varied = {}
    for position, argument in enumerate(schema):
        forms = _forms(op, argument, given)
        if forms is not None:
            varied[(position, argument)] = forms
    combos = list(itertools.product(*varied.values())) or [()]
    step = max(1, math.ceil(len(combos) / CASES_PER_OP))
    chosen = combos[::step]
    for position, forms in enumerate(varied.values()):  # and each form of each argument once, the others plain
        chosen += [combos[0][:position] + (form,) + combos[0][position + 1:] for form in forms[1:]]
    unique = {repr(combo): combo for combo in chosen}  # the same form once (lists are not hashable)
    cases = []
    for combo in unique.values():
        call = _fitted(*_placed(args, kwargs, dict(zip(varied, combo))))
        if call is not None:
            cases.append((*call, ", ".join(f"{a.name}={_label(v)}" for (_, a), v in zip(varied, combo))))
    cases += _tensor_cases(op, args, kwargs)
    return cases


def _label(form) -> str:
    """A form as a case's name shows it: a tensor by its dims, type and strides."""
    if isinstance(form, torch.Tensor):
        return f"tensor{list(form.shape)} {str(form.dtype)[6:]} stride {list(form.stride())}"
    if isinstance(form, (list, tuple)) and any(isinstance(f, torch.Tensor) for f in form):
        return "[" + ", ".join(_label(f) for f in form) + "]"
    return repr(form)


def _placed(args, kwargs, chosen: dict):
    """The call with each chosen (position, argument) value put where the schema has it."""
    args, kwargs = list(args), dict(kwargs)
    for (position, argument), value in chosen.items():
        if position < len(args) and not argument.kwarg_only:
            args[position] = value
        else:
            kwargs[argument.name] = value
    return args, kwargs


def _tensor_cases(op, args, kwargs):
    """The plain (3, 5) tensor arguments of generic ops in each of their other forms, one at a time."""
    if op in TABLE or op in CUDA_ONLY:
        return []
    cases = []
    for position, argument in enumerate(op._schema.arguments[:len(args)]):
        if str(argument.type) != "Tensor":
            continue
        forms = SELF_FORMS if position == 0 else OTHER_FORMS
        for label, make in list(forms.items())[1:]:
            case_args = list(args)
            case_args[position] = make()
            cases.append((case_args, kwargs, f"{argument.name} {label}"))
    return cases


def _trace(op, args, kwargs):
    """The aten graph of the one call and its tensor inputs."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def call(*tensors):
        filled = list(leaves)
        for position, tensor in zip(positions, tensors):
            filled[position] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
        return op(*call_args, **call_kwargs)

    tensors = [leaves[i] for i in positions]
    return make_fx(call, tracing_mode="fake")(*tensors), tensors


def _eager_in_float64(op, args, kwargs):
    """The op on float64 copies of its float32 tensors (None where torch refuses): the tie-breaker
    where torch's float32 CPU kernel is the odd one out (gelu(inf) is NaN there, inf in float64)."""
    widened = pytree.tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.dtype == torch.float32
                              else x, (args, kwargs))
    try:
        return _eager(op, *widened, device=next((x.device.type for x in pytree.tree_leaves(widened)
                                                 if isinstance(x, torch.Tensor)), "cpu"))
    except Exception:  # noqa: BLE001
        return None


def _matches(got, want, wide) -> bool:
    """Same structure, dims and types as eager's; values close to eager's float32 result or, element
    by element, to its float64 one."""
    got, want = pytree.tree_leaves(got), pytree.tree_leaves(want)
    wide = pytree.tree_leaves(wide) if wide is not None else want
    if len(got) != len(want):
        return False
    for a, b, c in zip(got, want, wide):
        if not isinstance(b, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if b.is_floating_point():
            tolerance = 1e-5 if b.dtype == torch.float32 else 1e-2
            a, b, c = a.double(), b.double(), c.double()
            close = torch.isclose(a, b, rtol=tolerance, atol=tolerance, equal_nan=True)
            if not (close | torch.isclose(a, c, rtol=tolerance, atol=tolerance, equal_nan=True)).all():
                return False
        elif not torch.equal(a, b):
            return False
    return True


def _check_dropout(args, got):
    """dnngraph's dropout draws its own mask: kept values are x / (1 - p), the rest zero."""
    y, keep = got
    x, p = args[0], args[1]
    expected = torch.where(keep, x / (1 - p), torch.zeros_like(x))
    assert torch.allclose(y, expected, rtol=1e-6, atol=1e-6)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.1


def _walk(op, device: str):
    """Every form of `op` on `device`: the backend's result against eager's, or the op left to torch."""
    failures, walked = [], 0
    for args, kwargs, label in _cases(op):
        args, kwargs = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        torch.manual_seed(0)
        try:
            want = _eager(op, args, kwargs, device)
        except Exception:  # noqa: BLE001  (a form torch itself refuses is no case)
            continue
        try:  # torch's own tracing refuses forms some eager kernels let through (hardtanh's
            graph, tensors = _trace(op, args, kwargs)  # crossed bounds on CUDA)
        except Exception:  # noqa: BLE001  (a form torch cannot trace never reaches a backend)
            continue
        walked += 1
        torch_backend.REPORTS.clear()
        compiled = torch_backend._compile(graph, tensors)
        torch.manual_seed(0)  # an op left to torch draws what eager drew (dropout)
        got = compiled(list(tensors))  # as traced: strides are part of what was compiled
        report = torch_backend.REPORTS[-1]
        broken = [why for _, why in report.torch_ops if why.startswith("converter error")]
        if broken:
            failures.append(f"{label}: {broken}")
        elif report.dnngraph_ops and op is aten.native_dropout.default:
            _check_dropout(args, got)
        elif not _matches(*_compared(op, got, want, _eager_in_float64(op, args, kwargs))):
            failures.append(f"{label}: differs from eager (in dnngraph: {report.dnngraph_ops} op(s))")
    assert not failures, f"{op}:\n" + "\n".join(failures)
    assert walked, f"{op}: eager torch refused every form tried: give it a base call in TABLE"


def _eager(op, args, kwargs, device: str):
    """Eager torch's result of the form, on the CPU for an op in CPU_EAGER_ON_CUDA."""
    if device == "cpu" or op not in CPU_EAGER_ON_CUDA:
        return op(*args, **kwargs)
    on_cpu = pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, (args, kwargs))
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, op(*on_cpu[0], **on_cpu[1]))


def _compared(op, *results):
    """The results compared of each of (got, want, wide): all, or the first COMPARED_RESULTS[op]."""
    count = COMPARED_RESULTS.get(op)
    return tuple(r if count is None or r is None else r[:count] for r in results)


@pytest.mark.parametrize("op", [op for op in CONVERTERS if op not in CUDA_ONLY], ids=str)
def test_each_form_of_the_op_matches_eager_or_stays_in_torch(op):
    _walk(op, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", [op for op in CONVERTERS if "_for_cpu" not in str(op)], ids=str)
def test_each_form_of_the_op_matches_eager_or_stays_in_torch_on_the_gpu(op):
    _walk(op, "cuda")


@pytest.mark.parametrize("op", CONSTANTS, ids=str)
def test_each_form_of_a_constant_read_in_a_graph_matches_eager(op):
    """Alone, a constant op stays in torch (no converted op reads it: a graph would only copy it
    out); read by one (a clone here), it is a constant input of the graph: each form then as
    eager makes it (type, dims, strides, values), or left to torch with a reason."""
    failures, converted = [], 0
    for args, kwargs, label in _cases(op):
        try:
            want = op(*args, **kwargs)
            graph, tensors = _trace(lambda *a, **k: op(*a, **k).clone(), args, kwargs)
        except Exception:  # noqa: BLE001  (a form torch refuses is no case)
            continue
        torch_backend.REPORTS.clear()
        got = torch_backend._compile(graph, tensors)(list(tensors))
        report = torch_backend.REPORTS[-1]
        converted += report.dnngraph_ops > 0
        broken = [why for _, why in report.torch_ops if why.startswith("converter error")]
        if broken:
            failures.append(f"{label}: {broken}")
        elif not _matches(got, want, None) or got.stride() != want.stride():
            failures.append(f"{label}: differs from eager (in dnngraph: {report.dnngraph_ops} op(s))")
    assert not failures, f"{op}:\n" + "\n".join(failures)
    assert converted, f"{op}: no form converted"


def test_every_converter_is_walked():
    """A converter added to the table without forms this test can make fails here, by name."""
    missing = [str(op) for op in CONVERTERS if op not in CUDA_ONLY and op not in TABLE and _generic_base(op) is None]
    assert set(CUDA_ONLY) <= set(CONVERTERS)
    assert not missing, f"add base calls to TABLE for {missing}"
