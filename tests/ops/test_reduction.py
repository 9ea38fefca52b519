"""Reduction kernels: every mode, inner / outer / several axes, one-pass, looped and split; bf16 on
the GPU (marked gpu), a row of a million split."""
import pytest
import torch

import dnngraph as dg
from helpers import check, run
from rowmodes import modes_used, row_mode, row_options  # noqa: F401 (row_mode: a fixture)

MODES = ("sum", "mean", "max", "min", "amax", "prod", "norm1", "norm2")
DTYPES = {torch.float32: dg.float32, torch.float16: dg.float16}


def sample(shape, mode, dtype=torch.float32):
    if mode == "prod":  # products of values near 1 stay finite and meaningful
        return (1 + 0.05 * torch.randn(*shape)).to(dtype)
    return (torch.randn(*shape) * 2 + 3).to(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("axes", [[2], [0], [1], [0, 2], [0, 1, 2]])
def test_every_mode_and_axes(mode, dtype, axes):
    g = dg.Graph(io_data_type=DTYPES[dtype])
    x = g.tensor(name="x", dim=[5, 37, 3])
    g.reduction(x, mode, axes).set_output(True)
    check(g, {x: sample([5, 37, 3], mode, dtype)}, dtype)


@pytest.mark.parametrize("mode", ["sum", "max", "mean", "prod", "norm2"])
@pytest.mark.parametrize("axes", [[1], [0]])
def test_looped_and_split(row_mode, mode, axes):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[6, 75])
    g.reduction(x, mode, axes).set_output(True)
    check(g, {x: sample([6, 75], mode)}, options=row_options(row_mode))
    if axes == [1]:
        assert row_mode in modes_used(g)


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "sliced"])
def test_layouts(layout, row_mode):
    base = torch.randn(3, 7, 5, 6) * 2 + 3
    x_t = {"transposed": base.transpose(1, 3), "sliced": base[:, 1:6:2],
           "channels_last": base.contiguous(memory_format=torch.channels_last)}[layout]
    g = dg.Graph()
    x = g.tensor_like(x_t, "x")
    g.reduction(x, "sum", [0, 2, 3]).set_output(True)
    g.reduction(x, "max", [1]).set_output(True)
    check(g, {x: x_t}, options=row_options(row_mode))


def test_float32_output_of_half_input():
    g = dg.Graph(io_data_type=dg.float16)
    x = g.tensor(name="x", dim=[9, 301])
    g.reduction(x, "sum", [1]).set_output(True).set_data_type(dg.float32)
    check(g, {x: sample([9, 301], "sum", torch.float16)}, torch.float16)


def test_prologue_and_epilogue_fuse_into_one_kernel():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[11, 29])
    b = g.tensor(name="b", dim=[11, 1])
    total = g.reduction(g.mul(x, x), "sum", [1])
    g.add(g.sqrt(total), b).set_output(True).set_name("norm_plus_b")
    check(g, {x: sample([11, 29], "sum"), b: torch.randn(11, 1)})
    assert len(g.plan.launches) == 1


def test_bad_axes_are_validation_errors():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 5])
    with pytest.raises(dg.ValidationError):
        g.reduction(x, "sum", [2])
    with pytest.raises(dg.ValidationError):
        g.reduction(x, "median", [1])


def test_product_below_the_smallest_normal_half_is_rounded_once(row_mode):
    # 26 values of size ~1: the product (~1e-6) is an fp16 subnormal. The kernel multiplies in
    # fp32 and rounds once at the store, so it holds the reference rounded to fp16 exactly.
    g = dg.Graph(io_data_type=dg.float16)
    x = g.tensor(name="x", dim=[13, 2])
    y = g.reduction(x, "prod", [0, 1]).set_output(True)
    values = torch.tensor([0.5, 0.7] * 13).reshape(13, 2).half()
    outputs = run(g, {x: values}, options=row_options(row_mode))
    ref = g.reference({x: values})[y.name]
    assert 0 < ref.abs().item() < torch.finfo(torch.float16).smallest_normal
    assert outputs[y.name].double().equal(ref.half().double())


def test_product_below_float32_range_stores_about_a_signed_zero(row_mode):
    # 207 values of 0.6 and one of -0.6: the product (-7e-47) is below fp32's smallest subnormal.
    # Its partial products pass through subnormals in an order the mode picks, so the stored value
    # is -0 or one step from it, never a normal number or a positive one
    g = dg.Graph()
    x = g.tensor(name="x", dim=[16, 13])
    y = g.reduction(x, "prod", [0, 1]).set_output(True)
    values = torch.full((16, 13), 0.6)
    values[3, 5] = -0.6
    outputs = run(g, {x: values}, options=row_options(row_mode))
    one_step = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps
    assert abs(outputs[y.name].item()) <= one_step and outputs[y.name].signbit().item()


# --- integer and bool inputs: exact in int64 ------------------------------------------------------
INTEGER_MODES = ("sum", "prod", "max", "min", "amax")
INTEGER_DTYPES = {"int32": dg.int32, "int64": dg.int64, "bool": dg.bool}


def integer_sample(shape, mode, data_type):
    """Values whose sums pass 2**24 (int32) and 2**40 (int64); products of small factors pass
    2**40 without wrapping."""
    if data_type is dg.bool:
        return torch.rand(*shape) < 0.5
    if mode == "prod":
        return torch.randint(-3, 4, shape, dtype=data_type.torch_dtype)
    limit = 2**30 if data_type is dg.int32 else 2**45
    return torch.randint(-limit, limit, shape, dtype=data_type.torch_dtype)


def exact(graph, inputs, options=None):
    """Execute (built with `options` where given) with poisoned outputs; every output equals the
    reference exactly."""
    outputs = run(graph, inputs, options=options)
    refs = graph.reference(inputs)
    for name, out in outputs.items():
        want = refs[name] if refs[name].dtype == out.dtype else refs[name].to(out.dtype)
        assert torch.equal(out, want), f"{name}: {out.flatten()[:4]} != {want.flatten()[:4]}"
    return outputs


@pytest.mark.parametrize("mode", INTEGER_MODES)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
@pytest.mark.parametrize("shape, axes", [([7, 37], [1]), ([37, 5], [0]), ([5, 37, 3], [0, 2])])
def test_integer_reductions_are_exact(row_mode, mode, dtype, shape, axes):
    data_type = INTEGER_DTYPES[dtype]
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=shape, data_type=data_type)
    g.reduction(x, mode, axes).set_output(True).set_name("y")
    x_t = integer_sample(shape, mode, data_type)
    out = exact(g, {x: x_t}, options=row_options(row_mode))
    if dtype != "bool" and mode == "sum":  # beyond what float32 holds exactly
        assert out["y"].abs().max() > 2**24
    if axes == [1]:
        assert row_mode in modes_used(g)


@pytest.mark.parametrize("mode", ["sum", "prod"])
def test_int64_sums_and_products_wrap_like_torch(row_mode, mode):
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=[3, 41])
    g.reduction(x, mode, [1]).set_output(True).set_name("y")
    x_t = torch.randint(2**61, 2**62, (3, 41)) if mode == "sum" else torch.randint(2**20, 2**21, (3, 41))
    out = exact(g, {x: x_t}, options=row_options(row_mode))
    assert torch.equal(out["y"], x_t.sum(1, keepdim=True) if mode == "sum" else x_t.prod(1, keepdim=True))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "broadcast", "size_one_axes"])
def test_integer_layouts(row_mode, layout):
    base = torch.randint(-2**40, 2**40, (3, 7, 5, 6))
    x_t = {"transposed": base.transpose(1, 3), "sliced": base[:, 1:6:2],
           "broadcast": base[:, :1].expand(3, 9, 5, 6), "size_one_axes": base[:1, :, :1]}[layout]
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor_like(x_t, "x")
    for mode in INTEGER_MODES:
        g.reduction(x, mode if mode != "prod" else "max", [0, 2, 3]).set_output(True).set_name(f"{mode}_k")
    g.reduction(x, "sum", [1]).set_output(True).set_name("sum_r")
    g.reduction(x, "min", [0, 1]).set_output(True).set_name("min_outer")
    exact(g, {x: x_t}, options=row_options(row_mode))


def test_integer_results_stored_to_other_types(row_mode):
    """The exact int64 value converts once: narrowed (wrapping) to int32, rounded to float32,
    nonzero to bool."""
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=[4, 23], data_type=dg.int32)
    total = g.reduction(x, "sum", [1])
    total.set_output(True).set_name("wide")
    g.reduction(x, "sum", [1]).set_output(True).set_name("narrow").set_data_type(dg.int32)
    g.reduction(x, "sum", [1]).set_output(True).set_name("real").set_data_type(dg.float32)
    g.reduction(x, "max", [1]).set_output(True).set_name("nonzero").set_data_type(dg.bool)
    x_t = torch.randint(-2**31, 2**31 - 1, (4, 23), dtype=torch.int32)
    x_t[0] = 2**31 - 1  # sums past int32: the narrow store wraps as torch's .to does
    x_t[1] = 0
    out = exact(g, {x: x_t}, options=row_options(row_mode))
    wide = x_t.sum(1, keepdim=True)
    assert torch.equal(out["narrow"], wide.to(torch.int32)) and torch.equal(out["real"], wide.float())


def test_integer_prologue_and_epilogue_stay_exact(row_mode):
    """Integer intermediates keep the prologue, the reduction and the epilogue in integers (an
    intermediate of the float intermediate type would make the reduction a float one, as in the
    reference)."""
    g = dg.Graph(io_data_type=dg.int64)
    x = g.tensor(name="x", dim=[6, 45], data_type=dg.int32)
    flag = g.tensor(name="flag", dim=[6, 45], data_type=dg.bool)
    total = g.reduction(g.mul(x, 3).set_data_type(dg.int64), "sum", [1]).set_data_type(dg.int64)
    g.add(total, 2**40 + 1).set_output(True).set_name("shifted")
    g.mul(total, 0.5).set_output(True).set_name("halved").set_data_type(dg.float32)
    g.reduction(flag, "sum", [1]).set_output(True).set_name("count")
    x_t = torch.randint(-2**29, 2**29, (6, 45), dtype=torch.int32)
    flag_t = torch.rand(6, 45) < 0.3
    out = exact(g, {x: x_t, flag: flag_t}, options=row_options(row_mode))
    assert torch.equal(out["shifted"], (x_t.long() * 3).sum(1, keepdim=True) + 2**40 + 1)
    assert torch.equal(out["count"], flag_t.sum(1, keepdim=True))
    assert len(g.plan.groups) == 2  # prologue and epilogues fused into the two reductions


@pytest.mark.parametrize("mode", ["mean", "norm1", "norm2"])
@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_float_only_modes_over_integers_are_typed_errors(mode, dtype):
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[4, 9], data_type=INTEGER_DTYPES[dtype])
    g.reduction(x, mode, [1]).set_output(True)
    with pytest.raises(dg.UnsupportedError, match=f"reduction {mode}.*{INTEGER_DTYPES[dtype].name}"):
        g.build()


def test_integer_reduction_of_a_matmul_epilogue_is_its_own_exact_kernel():
    """A matmul folds row-reduction exits in float: an integer value is reduced by a row kernel."""
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[4, 8]), g.tensor(name="b", dim=[8, 6])
    product = g.matmul(a, b)
    g.reduction(product, "max", [1]).set_output(True).set_name("float_max")
    whole = g.cast(g.mul(product, 2.0**30), dg.int64).set_output(True).set_name("whole")
    g.reduction(whole, "sum", [1]).set_output(True).set_name("total")
    a_t, b_t = torch.randn(4, 8), torch.randn(8, 6)
    out = run(g, {a: a_t, b: b_t})
    assert [len(group.exits) for group in g.plan.groups if group.kind == "matmul"] == [1]
    assert torch.equal(out["total"], out["whole"].sum(1, keepdim=True))  # past 2**32: float would round


# --- on the GPU: bf16, split reductions of very long rows ----------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sum", "max", "norm2", "mean"])
@pytest.mark.parametrize("shape,axes", [((3, 1000003), [1]), ((8192, 777), [0]), ((16, 4096, 9), [0, 2])])
def test_reductions_gpu(mode, shape, axes):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=list(shape))
    g.reduction(x, mode, axes).set_output(True).set_data_type(dg.float32)
    check(g, {x: (torch.randn(*shape) + 1).to("cuda", torch.bfloat16)}, torch.bfloat16, device="cuda")
    if shape == (3, 1000003):
        assert "split" in modes_used(g)
