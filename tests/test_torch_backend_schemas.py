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
from dnngraph.torch_backend.convert import CONVERTERS

aten = torch.ops.aten
CASES_PER_OP = 24  # forms tried per op (an even spread of its variants where there are more)


def _floats(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=generator)


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
        "ceil_mode": [False, True]}),
    aten.max_pool3d_with_indices.default: lambda: ([_floats(1, 2, 5, 6, 5), [3, 3, 3]], {}, {
        "stride": [[], [2, 2, 2]], "padding": [[0, 0, 0], [1, 1, 1]]}),
    aten.max_pool2d_with_indices_backward.default: lambda: (_max_pool_backward_args(2), {}, {}),
    aten.max_pool3d_with_indices_backward.default: lambda: (_max_pool_backward_args(3), {}, {}),
}


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
        case_args, case_kwargs = _placed(args, kwargs, dict(zip(varied, combo)))
        cases.append((case_args, case_kwargs, ", ".join(f"{a.name}={v!r}" for (_, a), v in zip(varied, combo))))
    cases += _tensor_cases(op, args, kwargs)
    return cases


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
        return op(*widened[0], **widened[1])
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
            want = op(*args, **kwargs)
        except Exception:  # noqa: BLE001  (a form torch itself refuses is no case)
            continue
        walked += 1
        graph, tensors = _trace(op, args, kwargs)
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


def _compared(op, *results):
    """The results compared of each of (got, want, wide): all, or the first COMPARED_RESULTS[op]."""
    count = COMPARED_RESULTS.get(op)
    return tuple(r if count is None or r is None else r[:count] for r in results)


@pytest.mark.parametrize("op", [op for op in CONVERTERS if op not in CUDA_ONLY], ids=str)
def test_each_form_of_the_op_matches_eager_or_stays_in_torch(op):
    _walk(op, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(CONVERTERS), ids=str)
def test_each_form_of_the_op_matches_eager_or_stays_in_torch_on_the_gpu(op):
    _walk(op, "cuda")


def test_every_converter_is_walked():
    """A converter added to the table without forms this test can make fails here, by name."""
    missing = [str(op) for op in CONVERTERS if op not in CUDA_ONLY and op not in TABLE and _generic_base(op) is None]
    assert set(CUDA_ONLY) <= set(CONVERTERS)
    assert not missing, f"add base calls to TABLE for {missing}"
